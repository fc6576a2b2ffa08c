"""Rotary position embedding and the KV-cache write (``rope.wgsl``, or the epilogue of a
decoding q/k/v GEMV in ``bitlinear.wgsl``), its backward (``rope_backward.wgsl``), and the torch
references.

A token is stored at its cache row (its sequence's start + its index in the pass) and rotated at
that position, or, in a packed pass (``positions``: several examples in a row, each numbered
from 0), at its own position id.

>>> # target = RopeTarget(weights.rope_cos, weights.rope_sin, starts, k_cache, v_cache, heads=20, kv_heads=5,
>>> #                     head_dim=128)
>>> # rec.launch(rope_launch(qkv, q_rot, target, tokens=n))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ...runtime import Buffer, Device, Launch, get_device, kernel
from . import bound_positions

_WG = 128  # rope.wgsl's invocations per workgroup


@dataclass(frozen=True)
class RopeTarget:
    """Where the fused q/k/v projection's output goes once rotated: transformers' cos/sin tables
    (f32 [positions, head_dim / 2]), the starts buffer (u32 [batch]: each sequence's first position
    in the pass) and the key and value caches (f32 [batch, kv_heads, cache_len, head_dim]); token n
    of a pass is cache row starts[b] + n % tokens_per_seq of sequence b = n // tokens_per_seq,
    rotated at that position, or at ``positions[n]`` where given (u32 [tokens]: a packed pass's
    position ids)."""

    cos: Buffer
    sin: Buffer
    starts: Buffer
    keys: Buffer
    values: Buffer
    heads: int
    kv_heads: int
    head_dim: int
    tokens_per_seq: int = 1
    positions: Buffer | None = None

    @property
    def cache_len(self) -> int:
        return self.keys.shape[2]


def rope_launch(qkv: Buffer, q_rot: Buffer, target: RopeTarget, *, tokens: int, device: Device | None = None) -> Launch:
    """One launch over ``tokens`` rows of the fused q/k/v output (f32 [tokens, qkv_stride]): rotated
    queries into ``q_rot`` [tokens, heads · head_dim], keys and values into ``target``'s caches."""
    device = device or get_device()
    t = target
    kern = kernel("rope.wgsl", "rope", device, WG=_WG, PACKED=t.positions is not None)
    chunks = -(-max((t.heads + t.kv_heads) * t.head_dim // 2, t.kv_heads * t.head_dim) // _WG)
    return Launch.build(kern, (tokens, chunks, 1), (qkv, t.cos, t.sin, t.starts, q_rot, t.keys, t.values,
                                                    bound_positions(t.positions, tokens, device)),
                        (t.tokens_per_seq, t.heads, t.kv_heads, t.head_dim, t.cache_len, qkv.shape[-1]))



def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one tensor [..., positions, D] with cos/sin
    [positions, D] (both halves)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_backward_reference(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, starts: Sequence[int], tokens_per_seq: int, heads: int,
                            kv_heads: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of the fused q/k/v rows [N, (heads + 2·kv_heads)·D] that ``rope_launch`` stored
    at cache rows ``starts[b]``.. of each sequence b, rotated there or at ``positions`` (int
    [B, T]: a packed pass's position ids), from dQ (token-major [N, heads·D]) and the caches' dK,
    dV ([batch, kv_heads, S, D]); ``cos``/``sin`` [positions, D] (both halves). Float64 autograd
    through ``rope_reference``."""
    batch, _, _, d = dk.shape
    t = tokens_per_seq
    rows = torch.tensor([list(range(start, start + t)) for start in starts])  # [B, T]: cache rows
    rotated_at = rows if positions is None else torch.as_tensor(positions, dtype=torch.long).reshape(batch, t)
    c, s = cos[rotated_at].double()[:, None], sin[rotated_at].double()[:, None]  # [B, 1, T, D]
    q = torch.zeros(batch, t, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.zeros(batch, kv_heads, t, d, dtype=torch.float64, requires_grad=True)
    rq, rk = rope_reference(q.transpose(1, 2), c, s), rope_reference(k, c, s)

    def at_rows(cache: torch.Tensor) -> torch.Tensor:  # [B, KVH, S, D] -> [B, KVH, T, D]
        return torch.stack([cache[b, :, rows[b]] for b in range(batch)]).double()

    dq_in, dk_in = torch.autograd.grad((rq, rk), (q, k), (dq.double().reshape(batch, t, heads, d).transpose(1, 2),
                                                          at_rows(dk)))
    dv_in = at_rows(dv)  # values are stored as they are: their gradient passes through

    def per_token(x: torch.Tensor) -> torch.Tensor:  # [B, KVH, T, D] -> [B*T, KVH*D]
        return x.transpose(1, 2).reshape(batch * t, -1)

    return torch.cat((dq_in.reshape(batch * t, -1), per_token(dk_in), per_token(dv_in)), dim=1)


def rope_backward_launch(dq: Buffer, dk: Buffer, dv: Buffer, cos: Buffer, sin: Buffer, starts: Buffer, dqkv: Buffer, *,
                         tokens: int, tokens_per_seq: int, heads: int, kv_heads: int, head_dim: int, cache_len: int,
                         positions: Buffer | None = None, device: Device | None = None) -> Launch:
    """RoPE's transpose (``rope_backward.wgsl``): the q/k/v projection's output gradient from the
    attention's dQ (token-major) and dK, dV (cache layout); ``positions`` as ``RopeTarget``'s."""
    device = device or get_device()
    kern = kernel("rope_backward.wgsl", "rope_backward", device, PACKED=positions is not None)
    return Launch.build(kern, (tokens, 1, 1), (dq, dk, dv, cos, sin, starts, dqkv,
                                               bound_positions(positions, tokens, device)),
                        (tokens_per_seq, heads, kv_heads, head_dim, cache_len, dqkv.shape[-1]))
