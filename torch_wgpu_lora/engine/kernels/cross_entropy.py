"""Cross-entropy of the LM head's logit rows and its gradient in place (``cross_entropy.wgsl``),
and the torch reference.

The loss of a batch is transformers' (``torch_wgpu_lora.loss``: mean over labels != -100, token t
predicting label t + 1): the host shifts the labels into per-row targets; the kernel writes each row's loss
and overwrites the row with ``(softmax − onehot) · scale``, ready for the head's backward.
Rows without a label (target < 0) get loss 0 and are otherwise left alone.

>>> # rec.launch(cross_entropy_launch(logits, targets, scale, losses, rows=n, vocab=V))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...runtime import Buffer, Device, Launch, get_device, kernel


def cross_entropy_launch(logits: Buffer, targets: Buffer, scale: Buffer, losses: Buffer, *, rows: int, vocab: int,
                         device: Device | None = None) -> Launch:
    device = device or get_device()
    kern = kernel("cross_entropy.wgsl", "rows", device)
    return Launch.build(kern, (rows, 1, 1), (logits, targets, scale, losses), (vocab,))


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """(per-row loss, gradient rows) in float64: what the kernel writes (in the rows it writes:
    the labelled ones; the others' gradient rows here are 0)."""
    x = logits.double().requires_grad_()
    valid = targets >= 0
    losses = torch.zeros(len(targets), dtype=torch.float64)
    losses[valid] = F.cross_entropy(x[valid], targets[valid], reduction="none")
    (grad,) = torch.autograd.grad(losses.sum() * scale, x)
    return losses.detach(), grad
