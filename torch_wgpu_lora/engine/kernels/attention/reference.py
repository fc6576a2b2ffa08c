"""The torch references of the attention kernels, written as matmul + mask + softmax in the
kernels' layouts, independently of them (the package's docstring gives the math and layouts).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["attention_backward_reference", "attention_reference"]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: int | Sequence[int],
                        lengths: torch.Tensor | Sequence[int], heads: int, kv_heads: int,
                        scale: float, positions: torch.Tensor | Sequence[Sequence[int]] | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch attention in the kernels' layouts and masking, in ``q``'s dtype (float64
    for tests): ``q`` ``[B*T, H*D]``, ``k``/``v`` ``[B, KVH, S, D]`` (S >= the longest length),
    query ``i`` of sequence ``b`` at position ``starts[b] + i`` (``starts`` one int: the same for
    every sequence); returns ``out`` ``[B*T, H*D]`` and ``lse`` ``[B*T, H]``. ``positions``
    (int ``[B, T]``, a packed pass's position ids) keeps each query to the keys of its own
    example: those from ``starts[b] + i - positions[b, i]`` on.

    Written as matmul + mask + softmax, independently of the kernels.

    >>> q, k = torch.randn(2 * 3, 4 * 8), torch.randn(2, 2, 5, 8)
    >>> out, lse = attention_reference(q, k, k, 0, [3, 2], heads=4, kv_heads=2, scale=8 ** -0.5)
    >>> out.shape, lse.shape
    (torch.Size([6, 32]), torch.Size([6, 4]))
    """
    batch, _, keys, dim = k.shape
    tokens = q.shape[0] // batch
    lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(batch)
    first = _starts(starts, batch)
    qh = q.reshape(batch, tokens, heads, dim).transpose(1, 2)  # [B, H, T, D]
    kh = k.repeat_interleave(heads // kv_heads, dim=1)  # [B, H, S, D]
    vh = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * scale  # [B, H, T, S]
    allowed = _allowed(first, lengths, tokens, keys, positions)  # [B, T, S]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, T]
    out = torch.softmax(scores, dim=-1) @ vh  # [B, H, T, D]
    return (out.transpose(1, 2).reshape(batch * tokens, heads * dim),
            lse.transpose(1, 2).reshape(batch * tokens, heads))


def attention_backward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                 lse: torch.Tensor, d_out: torch.Tensor, starts: int | Sequence[int],
                                 lengths: torch.Tensor | Sequence[int], heads: int, kv_heads: int,
                                 scale: float, positions: torch.Tensor | Sequence[Sequence[int]] | None = None,
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention backward from explicit formulas, in the kernels' layouts and ``q``'s dtype:
    ``q``, ``out``, ``d_out`` ``[B*T, H*D]``, ``k``/``v`` ``[B, KVH, S, D]``, ``lse`` ``[B*T, H]``,
    ``positions`` as ``attention_reference``'s; returns ``(d_q, d_k, d_v)``, ``d_k``/``d_v`` over
    all ``S`` key positions (zero where no query attends). P is recomputed from ``lse``, as the
    kernels do::

        P = exp(scale q·k - lse) (masked)   dV = Pᵀ dO   dS = P ∘ (dO vᵀ - rowsum(dO ∘ O))
        dQ = scale dS k                     dK = scale dSᵀ q    (summed over each group's heads)

    >>> q, k = torch.randn(2 * 3, 4 * 8, dtype=torch.float64), torch.randn(2, 2, 5, 8, dtype=torch.float64)
    >>> out, lse = attention_reference(q, k, k, 0, [3, 2], 4, 2, 8 ** -0.5)
    >>> dq, dk, dv = attention_backward_reference(q, k, k, out, lse, torch.ones_like(out), 0, [3, 2], 4, 2, 8 ** -0.5)
    >>> dq.shape, dk.shape, bool(dk[1, :, 2:].abs().max() == 0)
    (torch.Size([6, 32]), torch.Size([2, 2, 5, 8]), True)
    """
    batch, _, keys, dim = k.shape
    tokens, group = q.shape[0] // batch, heads // kv_heads
    lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(batch)
    first = _starts(starts, batch)

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [B*T, H*D] -> [B, H, T, D]
        return x.reshape(batch, tokens, heads, dim).transpose(1, 2)

    qh, oh, doh = heads_first(q), heads_first(out), heads_first(d_out)
    kh = k.repeat_interleave(group, dim=1)  # [B, H, S, D]
    vh = v.repeat_interleave(group, dim=1)
    allowed = _allowed(first, lengths, tokens, keys, positions)[:, None]  # [B, 1, T, S]
    lse_h = lse.reshape(batch, tokens, heads).transpose(1, 2)[..., None]  # [B, H, T, 1]
    probs = torch.where(allowed, torch.exp(qh @ kh.transpose(-1, -2) * scale - lse_h), 0.0)
    d_v = probs.transpose(-1, -2) @ doh  # [B, H, S, D]
    delta = (doh * oh).sum(-1, keepdim=True)
    d_s = probs * (doh @ vh.transpose(-1, -2) - delta)
    d_q = scale * d_s @ kh
    d_k = scale * d_s.transpose(-1, -2) @ qh
    d_k = d_k.reshape(batch, kv_heads, group, keys, dim).sum(2)
    d_v = d_v.reshape(batch, kv_heads, group, keys, dim).sum(2)
    return d_q.transpose(1, 2).reshape(batch * tokens, heads * dim), d_k, d_v


def _allowed(first: torch.Tensor, lengths: torch.Tensor, tokens: int, keys: int,
             positions: torch.Tensor | Sequence[Sequence[int]] | None) -> torch.Tensor:
    """[B, T, S]: whether query ``i`` of sequence ``b`` (at ``first[b] + i``) sees key ``j``: causal,
    within the sequence's length, and (``positions``) within the query's own example."""
    batch = first.shape[0]
    at = first + torch.arange(tokens).view(1, tokens, 1)  # [B, T, 1]
    last = torch.minimum(at, (lengths - 1).view(batch, 1, 1))
    j = torch.arange(keys).view(1, 1, keys)
    allowed = j <= last
    if positions is not None:
        own = torch.as_tensor(positions, dtype=torch.long).reshape(batch, tokens, 1)
        allowed &= j >= at - own
    return allowed


def _starts(starts: int | Sequence[int], batch: int) -> torch.Tensor:
    """Each sequence's first position, [B, 1, 1]."""
    if isinstance(starts, int):
        starts = [starts] * batch
    return torch.as_tensor(list(starts), dtype=torch.long).reshape(batch, 1, 1)
