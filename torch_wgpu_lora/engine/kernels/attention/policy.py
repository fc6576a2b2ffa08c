"""When attention keeps its score matrices whole, and how its long sums are split.

A pass from position 0 (a prompt, a training pass) whose S fits ``SCORES_SCRATCH_BYTES`` keeps S
(then P) whole and runs GEMMs over it (``kept``) rather than the flash kernels (``flash``). A
training step whose layers' P all fit ``KEPT_PROBABILITIES_BYTES`` keeps each layer's P from the
forward to the backward, which then does not compute S again (BitNet-2B: one sequence of up to
640 tokens).

>>> scores_kept_whole(batch=1, heads=20, tokens=512), keeps_probabilities(30, 1, 20, 704)
(True, False)
"""

from __future__ import annotations

from ....runtime import Device

__all__ = ["KEPT_PROBABILITIES_BYTES", "SCORES_SCRATCH_BYTES", "SPLIT_WORKGROUPS", "keeps_probabilities",
           "kept_scores_bytes", "scores_kept_whole", "sum_splits"]

SCORES_SCRATCH_BYTES = 256 << 20  # a pass's largest S or P (and dS) kept whole (BitNet-2B at seq 512: 21 MB)
# The most a training step keeps of its layers' P from the forward to the backward (BitNet-2B at
# seq 512: 30 layers × 21 MB; from 704 tokens, 1.2 GB, the backward computes S again)
KEPT_PROBABILITIES_BYTES = 1 << 30


def kept_scores_bytes(batch: int, heads: int, tokens: int) -> int:
    """Bytes of a pass's S or P (and of its dS) kept whole: a row of ``tokens`` rounded up to 64
    keys for each (sequence, head, query), the queries rounded up alike."""
    padded = -(-tokens // 64) * 64
    return 4 * batch * heads * padded * padded


def scores_kept_whole(batch: int, heads: int, tokens: int) -> bool:
    """Whether a pass from position 0 keeps its S or P whole (GEMMs over them) rather than running
    the flash kernels: where they fit ``SCORES_SCRATCH_BYTES``."""
    return kept_scores_bytes(batch, heads, tokens) <= SCORES_SCRATCH_BYTES


def keeps_probabilities(layers: int, batch: int, heads: int, tokens: int) -> bool:
    """Whether a training pass of ``layers`` layers keeps each layer's P for its backward (the
    ``scores`` buffers of ``attention_launches`` and ``attention_backward_launches``)."""
    return (scores_kept_whole(batch, heads, tokens)
            and layers * kept_scores_bytes(batch, heads, tokens) <= KEPT_PROBABILITIES_BYTES)


SPLIT_WORKGROUPS = 512  # workgroups a split sum aims at on a GPU (see sum_splits)


def sum_splits(workgroups: int, device: Device) -> int:
    """Into how many ranges a launch of ``workgroups`` cuts its long sums (``dkdv``'s query
    tiles, the backward GEMMs' reductions), each range's partial sums added up by another
    launch: on a GPU, the fewest (a power of two, at most 8) that give about SPLIT_WORKGROUPS
    workgroups; 1 on a CPU adapter, whose few cores the unsplit grid already fills.

    >>> # sum_splits(32 * 5, device)  # dkdv of BitNet-2B at seq 512 (32 key blocks × 5 KV heads): 4
    """
    if device.is_cpu:
        return 1
    splits = 1
    while splits < 8 and workgroups * splits < SPLIT_WORKGROUPS:
        splits *= 2
    return splits
