"""LoRA gradients inside the engine's backward (``lora_grad.wgsl``), and the torch reference.

For an adapter whose output rows are a segment of a fused projection (``engine.adapters``):
``dh`` (scaled by the adapter's s), then ``db`` into its B's gradient; for a site, ``da`` into
the stacked A's gradient from every adapter's dh. The adapters' input gradient dh·A is added
by the transposed projection (``bitlinear_t_launch``/``matmul_t_launch``).

>>> # launches = [dh_launch(dy, site_table_b, dh, adapter, ...), db_launch(...), da_launch(...)]
"""

from __future__ import annotations

import torch

from ...runtime import Buffer, Device, Launch, get_device, kernel
from . import dummy
from .dropout import SiteDropout, dropout_params

_FILE = "lora_grad.wgsl"


def _params(tokens: int, rows: tuple[int, int, int], rank: int, h_col: int, b_offset: int, a_offset: int,
            dy_stride: int, h_stride: int, x_stride: int, k: int, accumulate: bool, scale: float,
            dropout: SiteDropout | None = None) -> tuple:
    return (tokens, *rows, rank, h_col, b_offset, a_offset, dy_stride, h_stride, x_stride, k, int(accumulate),
            float(scale), *dropout_params(dropout))


def dh_launch(dy: Buffer, lb: Buffer, dh: Buffer, *, tokens: int, rows: tuple[int, int, int], rank: int, h_col: int,
              b_offset: int, scale: float, per_row: bool | None = None, device: Device | None = None) -> Launch:
    """DH[:, h_col:h_col+rank] = scale · dY[:, rows]·B (B at ``b_offset`` of ``lb``). ``per_row``: one
    invocation a token, no barriers (the default on CPU adapters), or a workgroup for four tokens."""
    device = device or get_device()
    per_row = device.is_cpu if per_row is None else per_row
    grid = (-(-tokens // 64), 1, 1) if per_row else (-(-tokens // 4), 1, 1)
    return Launch.build(kernel(_FILE, "dh_rows" if per_row else "dh", device), grid, {1: dy, 2: lb, 3: dh},
                        _params(tokens, rows, rank, h_col, b_offset, 0, dy.shape[-1], dh.shape[-1], 0, 0, False,
                                scale))


def db_launch(dy: Buffer, h: Buffer, grads: Buffer, *, tokens: int, rows: tuple[int, int, int], rank: int,
              h_col: int, b_offset: int, scale: float, accumulate: bool = True,
              device: Device | None = None) -> Launch:
    """grads[B's place] (+)= scale · dY[:, rows]ᵀ·H[:, h_col:h_col+rank]."""
    device = device or get_device()
    count = -(-(rows[1] - rows[0]) // rows[2])
    return Launch.build(kernel(_FILE, "db", device), (-(-count // 32), -(-rank // 4), 1), {1: dy, 4: h, 5: grads},
                        _params(tokens, rows, rank, h_col, b_offset, 0, dy.shape[-1], h.shape[-1], 0, 0, accumulate,
                                scale))


def da_launch(dh: Buffer, x: Buffer, grads: Buffer, *, tokens: int, rank: int, k: int, a_offset: int,
              accumulate: bool = True, dropout: SiteDropout | None = None, device: Device | None = None) -> Launch:
    """grads[the site's stacked A] (+)= DH[:, :rank]ᵀ·X (X: the site's normalised input, rows of a
    multiple of 4 floats as the norms pad them; with ``dropout``, each adapter's rows of A from its
    own dropout of X)."""
    device = device or get_device()
    if x.shape[-1] % 4:
        raise ValueError(f"da reads x's rows as 4-float words: its rows must hold a multiple of 4 floats, got {x.shape}")
    kern = kernel(_FILE, "da", device, **(dict(DROPOUT=True) if dropout is not None else {}))
    return Launch.build(kern, (-(-k // 32), -(-rank // 4), 1),
                        {5: grads, 6: x, 7: dh, 8: dropout.state if dropout is not None else dummy(device)},
                        _params(tokens, (0, 1, 1), rank, 0, 0, a_offset, 0, dh.shape[-1], x.shape[-1], k, accumulate,
                                1.0, dropout))


def lora_grad_reference(x: torch.Tensor, dy: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float,
                        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dA, dB, dx) of y = scale·((mask ⊙ x)·Aᵀ)·Bᵀ for x [N, K], dy [N, out], in float64 autograd
    (``mask``: a dropout mask of x, scale included; none: no dropout)."""
    x, A, B = (t.double().requires_grad_() for t in (x, A, B))
    y = scale * ((x if mask is None else x * mask.double()) @ A.T) @ B.T
    return torch.autograd.grad(y, (A, B, x), dy.double())
