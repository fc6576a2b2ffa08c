"""The optimizer's kernels on WebGPU, each with its torch reference beside it: the global-norm
clip (``clip.wgsl``) and AdamW (``adamw.wgsl``).

**The clip** (``clip_launches``, ``clip_reference``) reads a flat gradient and a step's per-token
losses and writes a 4-float stats buffer: [‖G‖, clip coefficient, non-finite flag, Σ losses], the
rule of ``torch.nn.utils.clip_grad_norm_`` (coef = min(1, max_norm / (‖G‖ + 1e-6)); max_norm 0:
off), the flag set when the norm or the loss is not finite. AdamW then reads the coefficient and
the flag from it: a whole optimizer step stays on the GPU and only the stats come back.

**AdamW**:

The math is torch.optim.AdamW's (decoupled weight decay), step t counted from 1::

    param    *= 1 - lr·weight_decay
    exp_avg   = lerp(exp_avg, grad, 1 - β1)
    exp_avg_sq = β2·exp_avg_sq + (1 - β2)·grad²
    param    -= lr / (1 - β1ᵗ) · exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - β2ᵗ) + eps)

``adamw_launch`` builds that update for one flat float32 tensor whose parameter,
gradient and moments are ``Buffer``s; parameter and moments are updated in place on
the GPU. Its step's values are kept in the launch, or read from an ``adamw_uniform`` that is
written before each submit (for a launch recorded ahead of its step). It reads the gradient's
factor and a skip flag from the clip's stats buffer; without one the gradient is used as is.
``adamw_step`` records it into a ``Recorder``. ``adamw_reference`` is the same step in torch ops,
in place on CPU tensors. ``optim.WgpuAdamW`` is the ``torch.optim.Optimizer`` built on them.

>>> import numpy as np
>>> from torch_wgpu_lora.runtime import Buffer, Recorder, upload
>>> p, g = upload(np.ones(8, np.float32)), upload(np.ones(8, np.float32))
>>> m, v = upload(np.zeros(8, np.float32)), upload(np.zeros(8, np.float32))
>>> rec = Recorder(); adamw_step(rec, p, g, m, v, step=1, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
>>> out = np.empty(8, np.float32); rec.read(p, out); rec.submit(); round(float(out[0]), 4)
0.9
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

import numpy as np

from ..runtime import Buffer, Device, Kernel, Launch, Recorder, Uniform, get_device, kernel, upload

__all__ = ["CLIP_PARTIALS", "adamw_launch", "adamw_reference", "adamw_scalars", "adamw_step", "adamw_uniform",
           "clip_launches", "clip_reference"]

_WG = 256  # threads per workgroup of adamw.wgsl
_UNIT_STATS = np.array([0.0, 1.0, 0.0, 0.0], np.float32)  # [norm, gradient factor, skip flag, loss]
CLIP_PARTIALS = 256  # workgroups of the clip's sum of squares: floats of its ``partials`` buffer


def clip_launches(grads: Buffer, losses: Buffer, stats: Buffer, partials: Buffer, *, n: int, rows: int,
                  max_norm: float, device: Device | None = None) -> list[Launch]:
    """stats ← [‖grads[:n]‖, clip coefficient, non-finite flag, Σ losses[:rows]]; ``partials``
    (f32, at least ``CLIP_PARTIALS``) holds the workgroups' sums of squares in between.

    >>> # launches = clip_launches(grads, losses, stats, partials, n=size, rows=r, max_norm=1.0)
    """
    device = device or get_device()
    if partials.numel < CLIP_PARTIALS or stats.numel < 4:
        raise ValueError(f"clip: partials need {CLIP_PARTIALS} floats and stats 4, got {partials.shape} and "
                         f"{stats.shape}")
    params = (n, rows, float(max_norm))
    return [Launch.build(kernel("clip.wgsl", "sumsq", device, PARTIALS=CLIP_PARTIALS), (CLIP_PARTIALS, 1, 1),
                         {1: grads, 2: partials}, params),
            Launch.build(kernel("clip.wgsl", "stats", device, PARTIALS=CLIP_PARTIALS), (1, 1, 1),
                         {3: partials, 4: losses, 5: stats}, params)]


def clip_reference(grads: torch.Tensor, losses: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What ``clip_launches`` writes, in float64: [‖grads‖, coefficient, non-finite flag, Σ losses].

    >>> clip_reference(torch.tensor([3.0, 4.0]), torch.tensor([1.0, 2.0]), 1.0).tolist()
    [5.0, 0.199999960000008, 0.0, 3.0]
    """
    norm = torch.linalg.vector_norm(grads.double())
    loss = losses.double().sum()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0 else torch.ones((), dtype=torch.float64)
    finite = bool(torch.isfinite(norm)) and bool(torch.isfinite(loss))
    return torch.stack((norm, coef, torch.tensor(0.0 if finite else 1.0, dtype=torch.float64), loss))


def adamw_scalars(step: int, lr: float, betas: tuple[float, float], eps: float,
                  weight_decay: float) -> tuple[float, ...]:
    """The kernel's uniform values for step ``step`` (from 1), worked out in float64 as torch does.

    Returns (decay, w1, beta2, w2, neg_step_size, bc2_sqrt, eps).
    """
    if step < 1:
        raise ValueError(f"adamw: step counts from 1, got {step}")
    beta1, beta2 = betas
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, -(lr / bias_correction1),
            bias_correction2**0.5, eps)


def _kernel(device: Device) -> Kernel:
    return kernel("adamw.wgsl", "adamw_step", device, WG=_WG)


def adamw_uniform(device: Device | None = None) -> Uniform:
    """A uniform for ``adamw_launch`` that takes each step's values when written:
    ``u.write((n, *adamw_scalars(step, lr, betas, eps, weight_decay)))`` before each submit."""
    return Uniform(_kernel(device or get_device()))


def adamw_launch(param: Buffer, grad: Buffer, exp_avg: Buffer, exp_avg_sq: Buffer,
                 scalars: Sequence[float] | Uniform, *, stats: Buffer | None = None, n: int | None = None,
                 device: Device | None = None) -> Launch:
    """One AdamW update of the first ``n`` (default: all) elements of ``param``, ``exp_avg`` and
    ``exp_avg_sq`` (in place) from ``stats[1]`` · ``grad``, skipped when ``stats[2]`` is not 0.

    All four buffers hold float32. ``scalars``: ``adamw_scalars(step, ...)`` (the values kept in
    the launch), or an ``adamw_uniform`` written before each submit (a launch recorded ahead of
    its step). Without ``stats`` the gradient is used as is.
    """
    device = device or param.device
    n = param.numel if n is None else n
    for name, buf in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if buf.numel < n or buf.dtype != "f32":
            raise ValueError(f"adamw: {name} is {buf.shape} {buf.dtype}; expected at least {n} f32 elements")
    if stats is None:
        stats = device.owned("adamw_unit_stats", lambda: upload(_UNIT_STATS, device))
    groups = max(1, math.ceil(n / _WG))
    grid_x = min(groups, device.max_workgroups)
    return Launch.build(_kernel(device), (grid_x, math.ceil(groups / grid_x), 1),
                        (param, grad, exp_avg, exp_avg_sq, stats),
                        scalars if isinstance(scalars, Uniform) else (n, *scalars))


def adamw_step(rec: Recorder, param: Buffer, grad: Buffer, exp_avg: Buffer, exp_avg_sq: Buffer, *, step: int,
               lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Record one AdamW update of ``param``, ``exp_avg`` and ``exp_avg_sq`` (in place) from ``grad``,
    four buffers of the same number of float32 elements."""
    for name, buf in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if buf.numel != param.numel:
            raise ValueError(f"adamw_step: {name} is {buf.shape}; expected {param.numel} elements like param "
                             f"{param.shape}")
    if param.numel:
        rec.launch(adamw_launch(param, grad, exp_avg, exp_avg_sq,
                                adamw_scalars(step, lr, betas, eps, weight_decay), device=rec.device))


@torch.no_grad()
def adamw_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                    step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """The same step in torch ops, in place (torch.optim.AdamW's single-tensor path, op for op).

    >>> p, g = torch.ones(3), torch.ones(3)
    >>> adamw_reference(p, g, torch.zeros(3), torch.zeros(3), step=1, lr=0.1, betas=(0.9, 0.999),
    ...                 eps=1e-8, weight_decay=0.0)
    >>> round(p[0].item(), 4)
    0.9
    """
    decay, w1, beta2, w2, neg_step_size, bc2_sqrt, eps = adamw_scalars(step, lr, betas, eps, weight_decay)
    param.mul_(decay)
    exp_avg.lerp_(grad, w1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=w2)
    param.addcdiv_(exp_avg, (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps), value=neg_step_size)
