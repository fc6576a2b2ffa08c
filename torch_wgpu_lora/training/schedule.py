"""Learning-rate schedules: constant, linear warmup + cosine decay (default), linear warmup + linear decay.

>>> import torch
>>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
>>> sched = make_scheduler(opt, "cosine", total_steps=100)   # 6% warmup: 6 steps
>>> sched.get_last_lr(), warmup_steps(100, 0.06)
([0.0], 6)

The schedules are transformers' (``get_scheduler``): a ``LambdaLR`` whose multiplier
at optimiser step t is t / warmup during warmup (0 at the first step, as there),
then 0.5·(1 + cos(π·progress)) or (1 - progress) with progress = (t - warmup) /
(total - warmup). Their ``state_dict()`` is plain JSON-able data; the schedule itself
is rebuilt from (kind, warmup, total), which checkpoints record.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SCHEDULES", "make_scheduler", "warmup_steps"]

# Our names -> transformers' scheduler names.
SCHEDULES = {"constant": "constant", "cosine": "cosine", "linear": "linear"}


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """Warmup length for a fraction of the run, rounded up (as transformers' Trainer does)."""
    if not 0.0 <= warmup_ratio <= 1.0:
        raise ValueError(f"warmup_ratio must be in [0, 1], got {warmup_ratio!r}")
    return math.ceil(total_steps * warmup_ratio)


def make_scheduler(optimizer: torch.optim.Optimizer, schedule: str = "cosine", total_steps: int = 1,
                   warmup_ratio: float = 0.06) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` for a run of ``total_steps`` optimiser steps.

    ``schedule`` is "constant" (no warmup: ``warmup_ratio`` is not used), "cosine" or "linear".
    """
    from transformers import get_scheduler

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be a positive integer, got {total_steps!r}")
    warmup = 0 if schedule == "constant" else warmup_steps(total_steps, warmup_ratio)
    return get_scheduler(SCHEDULES[schedule], optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)
