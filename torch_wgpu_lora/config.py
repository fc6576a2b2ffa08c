"""``LoraConfig``: what an adapter is, checked once, shared by ``apply_lora``, the CLI and the adapter files.

>>> config = LoraConfig(r=8, lora_alpha=16)
>>> config.scaling, config.target_modules
(2.0, ('q_proj', 'v_proj'))
>>> LoraConfig(lora_alpha=float("nan"))
Traceback (most recent call last):
...
ValueError: lora_alpha must be a finite number > 0, got nan

Modelled on PEFT's ``LoraConfig`` (``peft/tuners/lora/config.py``), restricted to what this
package implements: plain LoRA, output = base(x) + (lora_alpha / r) · B·A·dropout(x), on
every linear module whose last name component is in ``target_modules``. ``init``, ``seed``
and ``backend`` say how adapters start and run here; adapter files do not store them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from .init import INITS

__all__ = ["BACKENDS", "LoraConfig"]

BACKENDS = ("wgpu", "torch")  # where LoRALinear computes its adapter: WebGPU kernels, or torch ops

_FLOAT32_MAX = float(np.finfo(np.float32).max)  # the kernels compute in float32
_SEED_LIMIT = 2 ** 64  # torch.Generator.manual_seed (PEFT's init) and Hesper's u64 seeds


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapter settings, validated on construction (a ValueError names the bad field).

    * ``r``: rank, a positive integer;
    * ``lora_alpha``: a finite number > 0 (ints, floats, numpy scalars); scaling = lora_alpha / r,
      which must fit in float32;
    * ``target_modules``: names of the linear modules to adapt (the last component of their
      qualified names, e.g. ``"q_proj"``); a single name may be given as a string;
    * ``lora_dropout``: dropout probability on the adapter's input, in [0, 1);
    * ``init``: ``"hesper"`` (Hesper's seeded Kaiming-uniform, bit for bit) or ``"peft"``;
    * ``seed``: base seed of lora_A's initialisation, an integer in [0, 2**64);
    * ``backend``: ``"wgpu"`` (the WebGPU kernels) or ``"torch"`` (plain torch ops).

    >>> dataclasses.replace(LoraConfig(), r=16).r
    16
    """

    r: int = 8
    lora_alpha: float = 8.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    lora_dropout: float = 0.0
    init: str = "hesper"
    seed: int = 42
    backend: str = "wgpu"

    def __post_init__(self) -> None:
        def set_field(name: str, value: Any) -> None:  # frozen: normalised values go in this way
            object.__setattr__(self, name, value)

        set_field("r", _positive_integer("r", self.r))
        set_field("lora_alpha", _positive_real("lora_alpha", self.lora_alpha))
        if self.lora_alpha / self.r > _FLOAT32_MAX:
            raise ValueError(f"lora_alpha={self.lora_alpha!r} gives scaling lora_alpha / r = "
                             f"{self.lora_alpha / self.r:.3g}, beyond float32's largest value "
                             f"({_FLOAT32_MAX:.3g}) that the kernels compute in")
        set_field("target_modules", _targets(self.target_modules))
        dropout = self.lora_dropout
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"lora_dropout must be a number in [0, 1), got {dropout!r}")
        set_field("lora_dropout", float(dropout))
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        set_field("seed", _seed(self.seed))
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    @property
    def scaling(self) -> float:
        """lora_alpha / r, the factor on every adapter's output."""
        return self.lora_alpha / self.r

    def updated(self, **fields: Any) -> LoraConfig:
        """A copy with ``fields`` replaced (and checked); an unknown field name raises TypeError.

        >>> LoraConfig().updated(r=4, lora_alpha=8).scaling
        2.0
        """
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise TypeError(f"unknown LoraConfig field(s) {unknown}; the fields are {sorted(known)}")
        return dataclasses.replace(self, **fields)


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _positive_integer(name: str, value: Any) -> int:
    if not _is_integer(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _seed(value: Any) -> int:
    if not _is_integer(value) or not 0 <= value < _SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {value!r}")
    return int(value)


def _positive_real(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) \
            or not math.isfinite(float(value)) or not float(value) > 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _targets(value: Any) -> tuple[str, ...]:
    targets = (value,) if isinstance(value, str) else value
    try:
        targets = tuple(targets)
    except TypeError:
        raise ValueError(f"target_modules must be module names such as ('q_proj', 'v_proj'), got {value!r}") from None
    if not targets or not all(isinstance(t, str) and t.strip() == t and t and "." not in t for t in targets):
        raise ValueError("target_modules must be one or more module names (the last part of a qualified name, "
                         f"such as 'q_proj'), got {value!r}")
    if len(set(targets)) != len(targets):
        raise ValueError(f"target_modules names a module twice: {value!r}")
    return targets
