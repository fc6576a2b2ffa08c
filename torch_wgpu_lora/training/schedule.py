"""Learning-rate schedules: every transformers scheduler, by its name.

>>> import torch
>>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
>>> sched = make_scheduler(opt, "cosine", total_steps=100, warmup_steps=warmup_steps(100, 0.06))
>>> sched.get_last_lr(), warmup_steps(100, 0.06)
([0.0], 6)

The schedules are transformers' own (``get_scheduler``, ``SchedulerType``): "linear",
"cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
"inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay",
"reduce_lr_on_plateau", "greedy", ... . Options some of them need (``min_lr_rate``,
``num_decay_steps``, ``num_cycles``, ...) go in ``scheduler_kwargs``. Most multiply the
learning rate by a factor of the optimiser step (warmup: t / warmup from 0 at the first step);
``METRIC_SCHEDULES`` instead follow the evaluation loss (``metric_driven``), and the Trainer
steps them after each evaluation. Their ``state_dict()`` is plain JSON-able data; the schedule
itself is rebuilt from (name, warmup, total, options), which checkpoints record.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["METRIC_SCHEDULES", "make_scheduler", "metric_driven", "schedule_names", "warmup_steps"]

METRIC_SCHEDULES = ("reduce_lr_on_plateau", "greedy")  # stepped with the evaluation loss


def schedule_names() -> tuple[str, ...]:
    """The names ``make_scheduler`` takes: transformers' ``SchedulerType`` values."""
    from transformers import SchedulerType

    return tuple(t.value for t in SchedulerType)


def metric_driven(schedule: str) -> bool:
    """Whether ``schedule`` follows the evaluation loss rather than the step count."""
    return schedule in METRIC_SCHEDULES


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """Warmup length for a fraction of the run, rounded up (as transformers' Trainer does)."""
    if isinstance(warmup_ratio, bool) or not isinstance(warmup_ratio, (int, float)) or not 0.0 <= warmup_ratio <= 1.0:
        raise ValueError(f"warmup_ratio must be a number in [0, 1], got {warmup_ratio!r}")
    return math.ceil(total_steps * warmup_ratio)


def make_scheduler(optimizer: torch.optim.Optimizer, schedule: str = "cosine", total_steps: int = 1,
                   warmup_steps: int = 0, scheduler_kwargs: dict[str, Any] | None = None) -> Any:
    """transformers' scheduler ``schedule`` over ``optimizer`` for a run of ``total_steps`` optimiser
    steps, ``warmup_steps`` of them warming up (schedules without warmup ignore it, as in transformers);
    ``scheduler_kwargs`` are the schedule's own options.
    """
    from transformers import get_scheduler

    names = schedule_names()
    if schedule not in names:
        raise ValueError(f"schedule must be one of transformers' schedulers {list(names)}, got {schedule!r}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be a positive integer, got {total_steps!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be an integer in [0, total_steps={total_steps}], got {warmup_steps!r}")
    if scheduler_kwargs is not None and not isinstance(scheduler_kwargs, dict):
        raise ValueError(f"scheduler_kwargs must be a dict of the schedule's options, got {scheduler_kwargs!r}")
    try:
        return get_scheduler(schedule, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps,
                             scheduler_specific_kwargs=dict(scheduler_kwargs or {}))
    except (TypeError, ValueError) as err:  # a missing or unknown option of that schedule
        raise ValueError(f"schedule {schedule!r}: {err} (its options go in scheduler_kwargs)") from None
