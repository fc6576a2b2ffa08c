"""Rotary position embedding and the KV-cache write (``rope.wgsl``), and the torch reference.

>>> # rec.launch(rope_launch(qkv, weights.rope_cos, weights.rope_sin, step, q_rot, k_cache, v_cache, ...))
"""

from __future__ import annotations

import torch

from ...runtime import Buffer, Device, Launch, get_device, kernel

_WG = 128  # rope.wgsl's invocations per workgroup


def rope_launch(qkv: Buffer, cos: Buffer, sin: Buffer, step: Buffer, q_rot: Buffer, k_cache: Buffer,
                v_cache: Buffer, *, tokens: int, tokens_per_seq: int, heads: int, kv_heads: int, head_dim: int,
                cache_len: int, device: Device | None = None) -> Launch:
    """One launch over ``tokens`` rows of the fused q/k/v output (f32 [tokens, qkv_stride])."""
    device = device or get_device()
    kern = kernel("rope.wgsl", "rope", device, WG=_WG)
    chunks = -(-max((heads + kv_heads) * head_dim // 2, kv_heads * head_dim) // _WG)
    return Launch.build(kern, (tokens, chunks, 1), (qkv, cos, sin, step, q_rot, k_cache, v_cache),
                        (tokens_per_seq, heads, kv_heads, head_dim, cache_len, qkv.shape[-1]))


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one tensor [..., positions, D] with cos/sin
    [positions, D] (both halves)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_backward_launch(dq: Buffer, dk: Buffer, dv: Buffer, cos: Buffer, sin: Buffer, step: Buffer, dqkv: Buffer, *,
                         tokens: int, tokens_per_seq: int, heads: int, kv_heads: int, head_dim: int, cache_len: int,
                         device: Device | None = None) -> Launch:
    """RoPE's transpose (``rope_backward.wgsl``): the q/k/v projection's output gradient from the
    attention's dQ (token-major) and dK, dV (cache layout)."""
    device = device or get_device()
    kern = kernel("rope_backward.wgsl", "rope_backward", device)
    return Launch.build(kern, (tokens, 1, 1), (dq, dk, dv, cos, sin, step, dqkv),
                        (tokens_per_seq, heads, kv_heads, head_dim, cache_len, dqkv.shape[-1]))
