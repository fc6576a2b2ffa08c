"""Flash attention in tiles, forward (``attention.wgsl`` ``prefill``) and backward
(``attention_backward.wgsl``): memory bounded for any length, the online softmax of
flash-attention-2.

**Forward.** One workgroup per (block of ``4*RG`` rows, KV head, sequence), where a row is one
(query, head of the KV group) pair: the block's queries *and* the ``heads // kv_heads`` heads that
share the KV head read every K/V tile once from workgroup memory. A loop over key tiles of ``BK``
keys keeps an online softmax; causality bounds the loop per block (a block stops at its last row's
key), and the heaviest blocks launch first. Thread (kl, rg, ct) holds 4 rows × 4 vec4 columns of
the output in named registers (16 vec4 accumulators, no arrays); scores are computed in 4-row ×
4-key register blocks from q and k in workgroup memory. ``KL`` key lanes split the head dim for
the scores and the tile's keys for P·V, summed once at the end. Tile loads keep four vec4 loads in
flight per thread. The tile (``PrefillTile``) is the first of ``PREFILL_TILES`` whose workgroup
memory fits ``max-compute-workgroup-storage-size`` (48 KiB on NVIDIA: 32 rows × 32 keys in 2 key
lanes, 128 threads; 32 KiB on lavapipe; WebGPU's default 16 KiB gets 16 rows × 8 keys).

**Backward.** ``row_dot`` (D = rowsum(dO ∘ O), also the kept-scores backward's first launch),
``dq`` (a workgroup per block of ``tile.fixed`` (query, head) rows of a KV head, looping over key
tiles) and ``dkdv`` (a workgroup per block of ``tile.fixed`` keys of a KV head, looping over every
query tile of the group's heads that sees it: no atomics), cut into ranges of query tiles
(``policy.sum_splits``) whose partial sums ``dkdv_sum`` adds up. P is recomputed from the
forward's lse.

**Packed passes** (``positions``: several examples in a row) mask each query to the keys of its
own example, in the forward and in ``dq`` and ``dkdv``; the forward's and ``dq``'s loops over
key tiles start at the tile of their block's first key.

The order of preference of the tiles was measured: ``benchmarks/results/h200/kernel_tuning.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ....runtime import Buffer, Device, Launch, get_device, kernel
from ...workspace import Workspace
from .. import bound_positions, dummy
from .policy import sum_splits

__all__ = ["BACKWARD_TILES", "PREFILL_TILES", "BackwardTile", "PrefillTile", "backward_launches", "backward_tile",
           "backward_tiles", "prefill_launch", "prefill_tile", "prefill_tiles", "row_dot_launch"]

FILE = "attention.wgsl"
BACKWARD_FILE = "attention_backward.wgsl"


@dataclass(frozen=True)
class PrefillTile:
    """A prefill workgroup's shape: ``row_quads`` (RG: 4*RG rows of (query, head) pairs),
    ``key_tile`` (BK: keys per tile, a multiple of 4 and of 2*KL) and ``key_lanes`` (KL: threads
    sharing a (row quad, column) cell, splitting the head dim for scores and the keys for PV)."""

    row_quads: int
    key_tile: int
    key_lanes: int = 1

    def columns(self, head_dim: int) -> int:
        """Column threads (CT): each owns 4 of the head's ``head_dim // 4`` vec4 columns."""
        return -(-(head_dim // 4) // 4)

    def threads(self, head_dim: int) -> int:
        return self.row_quads * self.columns(head_dim) * self.key_lanes

    def workgroup_bytes(self, head_dim: int) -> int:
        """Workgroup memory of the prefill kernel with this tile (Qs, KVs, Ps, As, Mrun, Lrun)."""
        d4, rg, bk = head_dim // 4, self.row_quads, self.key_tile
        return 16 * (4 * rg * (d4 + 1) + bk * (d4 + 1) + bk * rg * self.key_lanes + 3 * rg)

    def valid(self) -> bool:
        return self.key_tile % 4 == 0 and self.key_tile % (2 * self.key_lanes) == 0 and self.row_quads > 0


# In order of preference: the first whose workgroup memory and threads fit the adapter is used.
PREFILL_TILES = (PrefillTile(8, 32, 2), PrefillTile(16, 16), PrefillTile(8, 16, 2), PrefillTile(8, 16),
                 PrefillTile(4, 16, 2), PrefillTile(4, 8, 2), PrefillTile(4, 8), PrefillTile(2, 8),
                 PrefillTile(1, 8), PrefillTile(1, 4))


@dataclass(frozen=True)
class BackwardTile:
    """The tile of the backward kernels: ``fixed`` rows (``dq``) or keys (``dkdv``) a workgroup
    owns, ``looped`` keys (``dq``) or rows (``dkdv``) per tile of its loop, and ``lanes`` (KL)
    splitting the head dim in the score phase. Both kernels use ``(fixed / 4) * ceil(head_dim / 8)``
    threads and the same workgroup memory: q and dO of the rows, k and v of the keys, the lanes'
    partial scores, P and dS."""

    fixed: int
    looped: int
    lanes: int

    def column_threads(self, head_dim: int) -> int:
        return (head_dim // 4 + 1) // 2

    def threads(self, head_dim: int) -> int:
        return self.fixed // 4 * self.column_threads(head_dim)

    def workgroup_bytes(self, head_dim: int) -> int:
        """Workgroup memory of ``dkdv`` (``dq``'s is a little less: no Pm)."""
        rows, keys = self.fixed, self.looped  # symmetric in rows and keys
        qst = head_dim // 4 + 1
        return 16 * qst * 2 * (rows + keys) + 4 * rows * keys * (2 * self.lanes + 2) + 16 * max(rows, keys)

    def valid(self) -> bool:
        return self.fixed % 4 == 0 and self.looped % 4 == 0 and self.fixed > 0 and self.looped > 0 and self.lanes > 0


# In order of preference. Sizes at head_dim 128: 43.3 KiB (NVIDIA's 48 KiB), 30.0 KiB (lavapipe's
# 32 KiB), 14.8 KiB (WebGPU's default 16 KiB). At head_dim 128 both kernels have 64 threads; the
# score phase has 4×4 blocks × lanes units: 64, 32 and 16 of them.
BACKWARD_TILES = (BackwardTile(16, 16, 4), BackwardTile(16, 8, 4), BackwardTile(8, 4, 8), BackwardTile(4, 4, 8),
                  BackwardTile(4, 4, 4))


def _fitting(tiles: tuple, head_dim: int, device: Device | None) -> list:
    """``tiles`` (in order) whose workgroup memory and thread count fit ``device``."""
    device = device or get_device()
    limit = int(device.limits["max-compute-workgroup-storage-size"])
    threads = min(int(device.limits["max-compute-invocations-per-workgroup"]),
                  int(device.limits["max-compute-workgroup-size-x"]))
    return [t for t in tiles if t.workgroup_bytes(head_dim) <= limit and t.threads(head_dim) <= threads]


def _first(tiles: list, what: str, head_dim: int) -> Any:
    if not tiles:
        raise ValueError(f"head_dim={head_dim}: no {what} tile fits this adapter's workgroup memory")
    return tiles[0]


def prefill_tiles(head_dim: int, device: Device | None = None) -> list[PrefillTile]:
    """Every prefill tile that fits ``device``, in order of preference (``benchmarks.launches`` times them)."""
    return _fitting(PREFILL_TILES, head_dim, device)


def prefill_tile(head_dim: int, device: Device | None = None) -> PrefillTile:
    """The first prefill tile (in order of preference) whose workgroup memory and thread count fit ``device``."""
    return _first(prefill_tiles(head_dim, device), "prefill", head_dim)


def backward_tiles(head_dim: int, device: Device | None = None) -> list[BackwardTile]:
    """Every backward tile that fits ``device``, in order of preference."""
    return _fitting(BACKWARD_TILES, head_dim, device)


def backward_tile(head_dim: int, device: Device | None = None) -> BackwardTile:
    """The first backward tile whose workgroup memory and thread count fit ``device``."""
    return _first(backward_tiles(head_dim, device), "attention backward", head_dim)


def prefill_launch(q: Buffer, k_cache: Buffer, v_cache: Buffer, out: Buffer, starts: Buffer, lengths: Buffer,
                   lse: Buffer | None, *, batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int,
                   max_len: int, scale: float, tile: PrefillTile | None, device: Device,
                   positions: Buffer | None = None) -> Launch:
    """The flash forward over ``tokens`` queries of each sequence (any position, any length;
    ``positions``: a packed pass's position ids)."""
    tile = tile or prefill_tile(head_dim, device)
    if not tile.valid() or tile.workgroup_bytes(head_dim) > device.limits["max-compute-workgroup-storage-size"]:
        raise ValueError(f"attention: prefill tile {tile} does not fit head_dim={head_dim} on this adapter")
    group, d4 = heads // kv_heads, head_dim // 4
    kern = kernel(FILE, "prefill", device, D4=d4, R=group, RG=tile.row_quads, CT=tile.columns(head_dim),
                  KL=tile.key_lanes, BK=tile.key_tile, PACKED=positions is not None)
    params = (batch, tokens, kv_heads, max_len, 1, int(lse is not None), float(scale))
    grid = (-(-tokens * group // (4 * tile.row_quads)), kv_heads, batch)
    return Launch.build(kern, grid, (starts, lengths, q, k_cache, v_cache, out, lse or dummy(device, "lse"),
                                     bound_positions(positions, batch * tokens, device)), params)


def _grid(workgroups: int, device: Device) -> tuple[int, int, int]:
    """A 1-D count of workgroups as a 2-D grid within the adapter's limit per dimension."""
    limit = device.max_workgroups
    return min(workgroups, limit), -(-workgroups // limit), 1


def row_dot_launch(out: Buffer, d_out: Buffer, *, batch: int, tokens: int, heads: int, kv_heads: int,
                   head_dim: int, max_len: int, scale: float, workspace: Workspace) -> tuple[Launch, Buffer]:
    """D = rowsum(dO ∘ O) of every (query, head) row, into the workspace's scratch (returned)."""
    device = workspace.device
    rows_total = batch * tokens * heads
    rd = workspace.scratch("attention row dots", (rows_total,))
    lanes_per_row, row_threads = 8, 256
    row_dot = kernel(BACKWARD_FILE, "row_dot", device, D4=head_dim // 4, R=heads // kv_heads, RL=lanes_per_row,
                     RW=row_threads)
    params = (batch, tokens, kv_heads, max_len, float(scale))
    return Launch.build(row_dot, _grid(-(-rows_total // (row_threads // lanes_per_row)), device),
                        {6: d_out, 12: out, 13: rd}, params), rd


def backward_launches(q: Buffer, k_cache: Buffer, v_cache: Buffer, lse: Buffer, d_out: Buffer, d_q: Buffer,
                      d_k: Buffer, d_v: Buffer, starts: Buffer, lengths: Buffer, rd: Buffer, *, batch: int, tokens: int,
                      heads: int, kv_heads: int, head_dim: int, max_len: int, scale: float,
                      tile: BackwardTile | None, splits: int | None, workspace: Workspace,
                      positions: Buffer | None = None) -> list[Launch]:
    """``dq`` and ``dkdv`` after ``row_dot`` (``rd``), and ``dkdv_sum`` where the sums are split (their
    partials in the workspace's scratch: the layers of a step run one after another); ``positions``:
    a packed pass's position ids."""
    device = workspace.device
    tile = tile or backward_tile(head_dim, device)
    if not tile.valid() or tile.workgroup_bytes(head_dim) > device.limits["max-compute-workgroup-storage-size"]:
        raise ValueError(f"attention backward: tile {tile} does not fit head_dim={head_dim} on this adapter")
    group, d4 = heads // kv_heads, head_dim // 4
    params = (batch, tokens, kv_heads, max_len, float(scale))
    key_blocks = -(-tokens // tile.fixed)
    splits = splits or sum_splits(key_blocks * kv_heads * batch, device)
    shape = dict(D4=d4, R=group, KL=tile.lanes, CT=tile.column_threads(head_dim), NT=tile.threads(head_dim),
                 PACKED=positions is not None)
    dq = kernel(BACKWARD_FILE, "dq", device, BQ=tile.fixed, BK=tile.looped, **shape)
    dkdv = kernel(BACKWARD_FILE, "dkdv", device, BQ=tile.looped, BK=tile.fixed, SPLITS=splits, **shape)
    common = {1: starts, 2: lengths, 3: q, 4: k_cache, 5: v_cache, 6: d_out, 7: lse, 8: rd,
              16: bound_positions(positions, batch * tokens, device)}
    launches = [Launch.build(dq, (-(-tokens * group // tile.fixed), kv_heads, batch), {**common, 9: d_q}, params)]
    if splits == 1:
        return launches + [Launch.build(dkdv, (key_blocks, kv_heads, batch), {**common, 10: d_k, 11: d_v}, params)]
    size = batch * kv_heads * max_len * head_dim
    parts = (workspace.scratch("attention dK partial sums", (splits * size,)),
             workspace.scratch("attention dV partial sums", (splits * size,)))
    total = kernel(BACKWARD_FILE, "dkdv_sum", device, D4=d4, SPLITS=splits)
    return launches + [
        Launch.build(dkdv, (key_blocks, kv_heads, batch * splits), {**common, 10: parts[0], 11: parts[1]}, params),
        Launch.build(total, _grid(-(-size // (4 * 256)), device),
                     {1: starts, 10: d_k, 11: d_v, 14: parts[0], 15: parts[1]}, params),
    ]
