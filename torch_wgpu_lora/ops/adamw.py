"""One AdamW step on WebGPU (``adamw.wgsl``), with its torch reference beside it.

The math is torch.optim.AdamW's (decoupled weight decay), step t counted from 1::

    param    *= 1 - lr·weight_decay
    exp_avg   = lerp(exp_avg, grad, 1 - β1)
    exp_avg_sq = β2·exp_avg_sq + (1 - β2)·grad²
    param    -= lr / (1 - β1ᵗ) · exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - β2ᵗ) + eps)

``adamw_step`` records that update for one flat float32 tensor whose parameter,
gradient and moments are ``Buffer``s; parameter and moments are updated in place on
the GPU. ``adamw_reference`` is the same step in torch ops, in place on CPU tensors.
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

import torch

from ..runtime import Buffer, Recorder, kernel

__all__ = ["adamw_reference", "adamw_scalars", "adamw_step"]

_WG = 256  # threads per workgroup of adamw.wgsl


def adamw_scalars(step: int, lr: float, betas: tuple[float, float], eps: float,
                  weight_decay: float) -> tuple[float, ...]:
    """The kernel's uniform values for step ``step`` (from 1), worked out in float64 as torch does.

    Returns (decay, w1, beta2, w2, neg_step_size, bc2_sqrt, eps).
    """
    beta1, beta2 = betas
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, -(lr / bias_correction1),
            bias_correction2**0.5, eps)


def adamw_step(rec: Recorder, param: Buffer, grad: Buffer, exp_avg: Buffer, exp_avg_sq: Buffer, *, step: int,
               lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Record one AdamW update of ``param``, ``exp_avg`` and ``exp_avg_sq`` (in place) from ``grad``.

    All four buffers hold the same number of float32 elements; ``step`` is this update's
    count, from 1 (it sets the bias corrections).
    """
    n = param.numel
    for name, buf in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if buf.numel != n or buf.dtype != "f32":
            raise ValueError(f"adamw_step: {name} is {buf.shape} {buf.dtype}; expected {n} f32 elements "
                             f"like param {param.shape}")
    if step < 1:
        raise ValueError(f"adamw_step: step counts from 1, got {step}")
    if n == 0:
        return
    k = kernel("adamw.wgsl", "adamw_step", rec.device, WG=_WG)
    groups = math.ceil(n / _WG)
    grid_x = min(groups, rec.device.max_workgroups)
    rec.dispatch(k, (grid_x, math.ceil(groups / grid_x), 1), (param, grad, exp_avg, exp_avg_sq),
                 (n, *adamw_scalars(step, lr, betas, eps, weight_decay)))


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
