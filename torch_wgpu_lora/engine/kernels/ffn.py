"""BitNet's MLP activation, relu(gate)²·up over interleaved gate/up pairs: its forward is the
gate/up epilogue of the projections (``bitlinear``, ``matmul``); its backward is
``ffn_backward.wgsl``. The torch reference of each is here.

>>> # rec.launch(relu2_backward_launch(dh, pairs, d_pairs, tokens=n, features=F))
"""

from __future__ import annotations

import torch

from ...runtime import Buffer, Device, Launch, get_device, kernel


def gate_up_reference(y: torch.Tensor) -> torch.Tensor:
    """Interleaved gate/up columns [N, 2F] → relu(gate)²·up [N, F] (BitNet's relu2 MLP).

    >>> gate_up_reference(torch.tensor([[2.0, 3.0, -1.0, 5.0]])).tolist()
    [[12.0, 0.0]]
    """
    gate, up = y[:, 0::2], y[:, 1::2]
    return torch.relu(gate).square() * up


def relu2_backward_launch(dh: Buffer, pairs: Buffer, out: Buffer, *, tokens: int, features: int,
                          device: Device | None = None) -> Launch:
    """The gradient of the interleaved gate/up ``pairs`` (f32 [tokens, ≥ 2·features]) from the
    activation's output gradient ``dh`` (f32 [tokens, ≥ features]), into ``out``."""
    device = device or get_device()
    kern = kernel("ffn_backward.wgsl", "relu2_backward", device)
    return Launch.build(kern, (-(-features // 256), tokens, 1), (dh, pairs, out),
                        (tokens, features, dh.shape[-1], pairs.shape[-1]))


def relu2_backward_reference(dh: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The gradient of ``gate_up_reference`` at ``pairs`` [N, 2F] for output gradient ``dh`` [N, F],
    by float64 autograd."""
    p64 = pairs.double().requires_grad_()
    (grad,) = torch.autograd.grad(gate_up_reference(p64), p64, dh.double())
    return grad
