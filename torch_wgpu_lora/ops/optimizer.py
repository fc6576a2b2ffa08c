"""One AdamW step on WebGPU (``adamw.wgsl``), with its torch reference beside it.

The math is torch.optim.AdamW's (decoupled weight decay), step t counted from 1::

    param    *= 1 - lr·weight_decay
    exp_avg   = lerp(exp_avg, grad, 1 - β1)
    exp_avg_sq = β2·exp_avg_sq + (1 - β2)·grad²
    param    -= lr / (1 - β1ᵗ) · exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - β2ᵗ) + eps)

``adamw_launch`` builds that update for one flat float32 tensor whose parameter,
gradient and moments are ``Buffer``s; parameter and moments are updated in place on
the GPU. Its step's values are kept in the launch, or read from an ``adamw_uniform`` that is
written before each submit (for a launch recorded ahead of its step). It reads the gradient's
factor and a skip flag from a small stats buffer on the GPU, which the engine's clip kernels fill (``engine.kernels.optimizer``); without one the
gradient is used as is. ``adamw_step`` records it into a ``Recorder``.
``adamw_reference`` is the same step in torch ops, in place on CPU tensors.
``training.optim.WgpuAdamW`` is the ``torch.optim.Optimizer`` built on ``adamw_step``.

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

__all__ = ["adamw_launch", "adamw_reference", "adamw_scalars", "adamw_step", "adamw_uniform"]

_WG = 256  # threads per workgroup of adamw.wgsl
_UNIT_STATS = np.array([0.0, 1.0, 0.0, 0.0], np.float32)  # [norm, gradient factor, skip flag, loss]


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
