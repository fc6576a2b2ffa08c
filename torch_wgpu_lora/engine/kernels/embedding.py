"""Embedding gather (``embedding.wgsl``) over vocabulary chunks, and its torch reference; the
same kernel gathers float32 rows by index (``gather_rows_launch``).

>>> # launches = embedding_launches(ids, weights.embedding, weights.embedding_rows, out, tokens=n, k=hidden)
"""

from __future__ import annotations

import torch

from ...runtime import Buffer, Device, Launch, get_device, kernel


def embedding_launches(ids: Buffer, chunks: list[Buffer], chunk_rows: list[int], out: Buffer, *, tokens: int,
                       k: int, bf16: bool = False, device: Device | None = None) -> list[Launch]:
    """One launch per vocabulary chunk; each writes the rows of the ids it holds."""
    device = device or get_device()
    kern = kernel("embedding.wgsl", "gather", device, BF16=bf16)
    launches, begin = [], 0
    for chunk, rows in zip(chunks, chunk_rows):
        launches.append(Launch.build(kern, (-(-k // 256), tokens, 1), (ids, chunk, out),
                                     (tokens, k, out.shape[-1], chunk.shape[-1], begin, rows)))
        begin += rows
    return launches


def gather_rows_launch(index: Buffer, table: Buffer, out: Buffer, *, tokens: int, k: int, zero_missing: bool,
                       device: Device | None = None) -> Launch:
    """``out[n] = table[index[n]]`` for ``tokens`` rows of ``k`` features of float32 ``table``;
    an index past the table's rows leaves the row alone, or with ``zero_missing`` zeroes it.

    >>> # rec.launch(gather_rows_launch(labelled, xn, x_labelled, tokens=n, k=hidden, zero_missing=False))
    """
    device = device or get_device()
    kern = kernel("embedding.wgsl", "gather", device, ZERO_MISSING=zero_missing)
    return Launch.build(kern, (-(-k // 256), tokens, 1), (index, table, out),
                        (tokens, k, out.shape[-1], table.shape[-1], 0, table.shape[0]))


def embedding_reference(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The embedding rows of ``ids``, in float32."""
    return weight[ids].float()


def gather_rows_reference(index: torch.Tensor, table: torch.Tensor, out: torch.Tensor,
                          zero_missing: bool) -> torch.Tensor:
    """What ``gather_rows_launch`` leaves in ``out`` (a copy is returned): row n becomes
    ``table[index[n]]`` where the index is a row of ``table``; other rows are zeroed
    (``zero_missing``) or left as they were.

    >>> gather_rows_reference(torch.tensor([1, 9]), torch.eye(2), torch.full((2, 2), 7.0), True).tolist()
    [[0.0, 1.0], [0.0, 0.0]]
    """
    result = out.clone()
    found = index < table.shape[0]
    result[found] = table[index[found]].to(result.dtype)
    if zero_missing:
        result[~found] = 0
    return result
