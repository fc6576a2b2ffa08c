"""The causal language-model loss, defined once: transformers' shift (position t predicts the label
at t + 1) and ``IGNORE_INDEX`` for positions without a label. The torch path, the Trainer, the data
pipeline and the engine's cross-entropy kernel all take it from here.

>>> import torch
>>> shifted_targets(torch.tensor([[IGNORE_INDEX, 5, 6]])).tolist()
[[5, 6, -100]]
>>> round(causal_lm_loss(torch.zeros(1, 3, 4), torch.tensor([[-100, 1, 2]])).item(), 4)  # log 4
1.3863
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "labelled_tokens", "shifted_targets"]

IGNORE_INDEX = -100  # label of positions without loss (cross_entropy's ignore_index)


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Per-position targets of [batch, tokens] labels: position t's target is labels[t + 1]
    (``IGNORE_INDEX`` at the last position)."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of [batch, tokens, vocab] logits against the shifted labels, over positions
    whose target is not ``IGNORE_INDEX``: their mean (``reduction="mean"``, transformers' loss) or
    sum (``"sum"``, for weighting micro-batches by their labelled tokens)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction=reduction)


def labelled_tokens(labels: torch.Tensor) -> int:
    """How many positions of [batch, tokens] labels have a target (the loss's token count)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())
