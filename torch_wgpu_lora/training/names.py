"""Hugging Face's names for the Trainer's options, and the short names it also takes.

The ``Trainer`` and ``train`` take the names of transformers' ``TrainingArguments`` (and TRL's
``SFTConfig``) for the options they share with it, each meaning what it means there
(``learning_rate``, ``num_train_epochs``, ``per_device_train_batch_size``, ``lr_scheduler_type``,
``lr_scheduler_kwargs``, ``save_steps``, ``adam_beta1``, ...); ``SHORT_NAMES`` are this package's
shorter names for some of them, taken as aliases, and ``betas`` is the pair (``adam_beta1``,
``adam_beta2``), as torch's AdamW takes it. Giving an option under both names is refused, naming both.

>>> @accepts_short_names
... def f(*, learning_rate=1.0, num_train_epochs=None):
...     return learning_rate
>>> f(lr=0.5)
0.5
>>> f(lr=0.5, learning_rate=0.1)
Traceback (most recent call last):
...
TypeError: lr and learning_rate are the same option (transformers' name: learning_rate); give one
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Callable

__all__ = ["BETAS", "SHORT_NAMES", "accepts_short_names", "interval_steps"]

# short name -> transformers' TrainingArguments name
SHORT_NAMES = {"lr": "learning_rate", "epochs": "num_train_epochs", "batch_size": "per_device_train_batch_size",
               "schedule": "lr_scheduler_type", "scheduler_kwargs": "lr_scheduler_kwargs", "save_every": "save_steps",
               "eps": "adam_epsilon"}
BETAS = ("adam_beta1", "adam_beta2")  # what torch's AdamW takes as betas=(beta1, beta2)


def accepts_short_names(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (whose keyword parameters have transformers' names) also taking ``SHORT_NAMES``."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for short, name in SHORT_NAMES.items():
            if short in kwargs:
                if name in kwargs:
                    raise TypeError(f"{short} and {name} are the same option (transformers' name: {name}); "
                                    "give one")
                kwargs[name] = kwargs.pop(short)
        if "betas" in kwargs:
            given = [name for name in BETAS if name in kwargs]
            if given:
                raise TypeError(f"betas and {given[0]} are the same option (transformers' names: adam_beta1, "
                                "adam_beta2); give one")
            betas = kwargs.pop("betas")
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise ValueError(f"betas must be a pair (adam_beta1, adam_beta2), got {betas!r}")
            kwargs.update(zip(BETAS, betas))
        return function(*args, **kwargs)

    return wrapper


def interval_steps(name: str, value: Any, total_steps: int) -> int:
    """A number of steps as transformers' ``warmup_steps`` and ``save_steps`` take it: a whole number of
    steps (0 included), or a fraction in (0, 1) of the run's ``total_steps``, rounded up.

    >>> interval_steps("warmup_steps", 0.1, 25), interval_steps("warmup_steps", 3, 25)
    (3, 3)
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf \
            or (value >= 1 and value != int(value)):
        raise ValueError(f"{name} must be a whole number of steps >= 0 or a fraction in (0, 1) of the run's steps "
                         f"(as in transformers), got {value!r}")
    return math.ceil(total_steps * value) if value < 1 else int(value)
