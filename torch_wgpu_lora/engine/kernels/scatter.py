"""Rows of one buffer into chosen rows of another (``scatter_rows.wgsl``), and rows moved within
one buffer (``move_rows.wgsl``), with their torch references: how a prompt prefilled on its own
joins a running generation (``engine.generate``), its keys and values, decode state and first
token written into the rows it takes over; and how a generation whose last rows run narrows to its
first rows, the running rows moved into the first ones.

A row is ``blocks`` blocks of ``width`` 32-bit words: contiguous in the source, ``dst_block``
words apart in the destination, whose rows are ``dst_row`` words apart. A KV cache of fewer
positions goes into a longer one's heads that way (``kv_rows_launch``).

>>> # rec.launch(scatter_rows_launch(src, rows, dst, count=2, blocks=1, width=4, dst_block=4, dst_row=4))
"""

from __future__ import annotations

import torch

from ...runtime import Buffer, Device, Launch, get_device, kernel

_WG = 256  # scatter_rows.wgsl's invocations per workgroup
_CHUNKS = 64  # most workgroups along a block (each then loops over the rest)


def scatter_rows_launch(src: Buffer, rows: Buffer, dst: Buffer, *, count: int, blocks: int, width: int,
                        dst_block: int, dst_row: int, device: Device | None = None) -> Launch:
    """``dst`` row ``rows[i]`` takes ``src`` row i, for i < ``count`` (the module docstring's layout;
    32-bit words of any dtype, copied as bits). ``rows``: u32 [count], written before each submit."""
    device = device or get_device()
    if "f16" in (src.dtype, dst.dtype) or rows.dtype != "u32" or rows.numel < count:
        raise ValueError(f"scatter_rows copies 32-bit words to rows given as u32 (at least {count}), got "
                         f"{src.dtype} to {dst.dtype} at {rows.dtype} {rows.shape}")
    if not 0 < width <= dst_block or (blocks - 1) * dst_block + width > dst_row or dst.numel < dst_row:
        raise ValueError(f"rows of {blocks} blocks of {width} words do not fit {dst.shape} with blocks {dst_block} "
                         f"and rows {dst_row} words apart")
    if src.numel < count * blocks * width:
        raise ValueError(f"{src.shape} holds fewer than {count} rows of {blocks} × {width} words")
    k = kernel("scatter_rows.wgsl", "scatter", device, WG=_WG)
    grid = (min(-(-width // _WG), _CHUNKS), blocks, count)
    return Launch.build(k, grid, (src, rows, dst), (width, dst_block, dst_row, blocks))


def kv_rows_launch(src: Buffer, rows: Buffer, dst: Buffer, count: int, device: Device | None = None) -> Launch:
    """Sequences i < ``count`` of the KV cache layer ``src`` (f32 [batch, kv_heads, positions,
    head_dim]) into sequences ``rows[i]`` of ``dst`` (the same but for more positions, or as many):
    the first positions of each of their heads."""
    _, heads, positions, head_dim = src.shape
    if len(dst.shape) != 4 or dst.shape[1] != heads or dst.shape[3] != head_dim or dst.shape[2] < positions:
        raise ValueError(f"KV rows of {src.shape} do not fit a cache of {dst.shape}")
    return scatter_rows_launch(src, rows, dst, count=count, blocks=heads, width=positions * head_dim,
                               dst_block=dst.shape[2] * head_dim, dst_row=heads * dst.shape[2] * head_dim,
                               device=device)


def move_rows_launch(buf: Buffer, moves: Buffer, count: int, device: Device | None = None) -> Launch:
    """Row ``moves[count + i]`` of ``buf`` ([rows, ...], 32-bit words of any dtype, copied as bits)
    takes row ``moves[i]``, for i < ``count``. ``moves``: u32 [at least 2 · count], the rows moved
    then the rows they go to, written before each submit; no moved row is also a row moved to."""
    device = device or get_device()
    if buf.dtype == "f16" or moves.dtype != "u32" or moves.numel < 2 * count or count > buf.shape[0]:
        raise ValueError(f"move_rows moves rows of 32-bit words, given as u32 pairs (at least {2 * count}): got "
                         f"{count} rows of {buf.dtype} {buf.shape} at {moves.dtype} {moves.shape}")
    width = buf.numel // buf.shape[0]
    k = kernel("move_rows.wgsl", "move_rows", device, WG=_WG)
    return Launch.build(k, (min(-(-width // _WG), _CHUNKS), 1, count), (moves, buf), (width, count))


def move_rows_reference(buf: torch.Tensor, moved: list[int], to: list[int]) -> torch.Tensor:
    """What ``move_rows_launch`` leaves in ``buf`` (a copy is returned) for the rows ``moved``
    going to the rows ``to``.

    >>> move_rows_reference(torch.tensor([[1, 2], [3, 4], [5, 6]]), [2], [0]).tolist()
    [[5, 6], [3, 4], [5, 6]]
    """
    out = buf.clone()
    out[to] = buf[moved]
    return out


def scatter_rows_reference(src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """What ``scatter_rows_launch`` leaves in ``dst`` (a copy is returned), for ``src`` [count, blocks,
    width] and ``dst`` [rows, blocks, dst_block] (its blocks' first ``width`` words taken).

    >>> scatter_rows_reference(torch.tensor([[[5, 6]]]), torch.tensor([1]), torch.zeros(2, 1, 3)).tolist()
    [[[0.0, 0.0, 0.0]], [[5.0, 6.0, 0.0]]]
    """
    out = dst.clone()
    out[rows, :, :src.shape[-1]] = src.to(out.dtype)
    return out
