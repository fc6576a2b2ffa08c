"""The MLP activation's backward (``ffn_backward.wgsl``): h = relu(gate)²·up into the
interleaved gate/up pairs; the forward is the gate/up epilogue of the projections.

>>> # rec.launch(relu2_backward_launch(dh, pairs, d_pairs, tokens=n, features=F))
"""

from __future__ import annotations

from ...runtime import Buffer, Device, Launch, get_device, kernel


def relu2_backward_launch(dh: Buffer, pairs: Buffer, out: Buffer, *, tokens: int, features: int,
                          device: Device | None = None) -> Launch:
    device = device or get_device()
    kern = kernel("ffn_backward.wgsl", "relu2_backward", device)
    return Launch.build(kern, (-(-features // 256), tokens, 1), (dh, pairs, out),
                        (tokens, features, dh.shape[-1], pairs.shape[-1]))
