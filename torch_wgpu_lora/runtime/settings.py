"""What a device's work runs with: its settings, their defaults and how to change them.

Usage::

    from torch_wgpu_lora.runtime import get_device
    dev = get_device()
    previous = dev.configure(shader_checks="full", pool_bytes=256 << 20)
    ...
    dev.configure(previous)         # back to what it was

``Device.configure`` is the one way to change a setting; it checks the value and returns the
settings as they were. Environment variables give the defaults, read once when the device is made:

* ``shader_checks`` (``TORCH_WGPU_LORA_SHADER_CHECKS``, default ``bounds``): the runtime checks
  kernels compile with (``runtime/kernels.py`` says what each mode keeps). Kernels compiled
  after a change use the new mode; compiled ones stay cached under their own.
* ``subgroups`` (``TORCH_WGPU_LORA_SUBGROUPS``, ``1`` or ``0``, default ``1``): kernels use the
  subgroup parts of ``wgsl/`` where the adapter has subgroups; ``0`` keeps the barrier-only
  parts everywhere (for comparisons and tests).
* ``gemms`` (``TORCH_WGPU_LORA_GEMMS``, default ``measured``): which variant of a GEMM kind runs where
  several could (``engine/kernels/gemms.py``): ``measured``, the fastest on this device, timed once
  per shape; ``general`` (the general cores) or ``matrix_units``, that one wherever it runs (for
  tests and comparisons: both give the same values, or values within the kind's stated accuracy).
* ``input_grad_digits`` (``TORCH_WGPU_LORA_INPUT_GRAD_DIGITS``, 2, 3 or 4, default 4): int8 digits
  of each float32 row of dY that the input gradients through the ternary weights take on the matrix
  units (``wgsl/bitlinear_t_mma.wgsl``): each digit is one integer GEMM, and D digits keep each value
  to 2^(1 − 7D) of its row's largest. 4 gives float32 accuracy (the default: gradients as PyTorch's
  float32); 3 and 2 do 3/4 and 1/2 of the integer work, to about 2⁻²⁰ and 2⁻¹³ (bfloat16 keeps 2⁻⁹
  of each value), though not 1/2 of the time (an H100's 1 × 512 training step: 88.2 ms with two,
  91.8 with four); ``docs/backends.md`` has their measured error. The general cores' kernel is
  float32 either way.
* ``pool_bytes`` (``TORCH_WGPU_LORA_POOL_MIB``, in MiB): how many bytes of freed buffers the
  buffer pool keeps for reuse; the rest are destroyed when freed. The default scales with the
  device's memory: 1/64 of it (a 24 GiB CPU adapter keeps 384 MiB, a 141 GiB GPU 2.2 GiB), and
  1 GiB where the implementation does not say how much memory the GPU has. Work that keeps
  reusing the same shapes finds its buffers pooled; work whose shapes keep changing holds no
  more than this bound of buffers it will not reuse.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SHADER_CHECKS = ("full", "bounds", "none")
DEFAULT_SHADER_CHECKS = "bounds"
SHADER_CHECKS_ENV = "TORCH_WGPU_LORA_SHADER_CHECKS"
GEMMS = ("measured", "general", "matrix_units")
GEMMS_ENV = "TORCH_WGPU_LORA_GEMMS"
SUBGROUPS_ENV = "TORCH_WGPU_LORA_SUBGROUPS"
POOL_ENV = "TORCH_WGPU_LORA_POOL_MIB"
INPUT_GRAD_DIGITS = (2, 3, 4)
INPUT_GRAD_DIGITS_ENV = "TORCH_WGPU_LORA_INPUT_GRAD_DIGITS"
POOL_SHARE = 64  # the pool keeps up to 1/POOL_SHARE of the device's memory by default
POOL_BYTES_UNKNOWN_MEMORY = 1 << 30


@dataclass(frozen=True)
class Settings:
    """A device's settings (see the module docstring); ``Device.configure`` changes them."""

    shader_checks: str = DEFAULT_SHADER_CHECKS
    subgroups: bool = True
    pool_bytes: int = POOL_BYTES_UNKNOWN_MEMORY
    gemms: str = "measured"
    input_grad_digits: int = 4

    def __post_init__(self) -> None:
        if self.shader_checks not in SHADER_CHECKS:
            raise ValueError(f"shader_checks must be one of {', '.join(SHADER_CHECKS)}, got {self.shader_checks!r}")
        if self.gemms not in GEMMS:
            raise ValueError(f"gemms must be one of {', '.join(GEMMS)}, got {self.gemms!r}")
        if type(self.input_grad_digits) is not int or self.input_grad_digits not in INPUT_GRAD_DIGITS:
            raise ValueError(f"input_grad_digits must be one of {', '.join(map(str, INPUT_GRAD_DIGITS))}, "
                             f"got {self.input_grad_digits!r}")
        if not isinstance(self.subgroups, bool):
            raise TypeError(f"subgroups must be True or False, got {self.subgroups!r}")
        if isinstance(self.pool_bytes, bool) or not isinstance(self.pool_bytes, int) or self.pool_bytes < 0:
            raise ValueError(f"pool_bytes must be an integer >= 0, got {self.pool_bytes!r}")


def default_pool_bytes(memory_bytes: int | None) -> int:
    """The pool's default bound for a device with ``memory_bytes`` of memory (None: not known).

    >>> default_pool_bytes(24 << 30) >> 20, default_pool_bytes(None) >> 20
    (384, 1024)
    """
    return POOL_BYTES_UNKNOWN_MEMORY if memory_bytes is None else memory_bytes // POOL_SHARE


def settings_from_env(memory_bytes: int | None) -> Settings:
    """The defaults: each setting's environment variable where set, else its built-in default
    (the pool's scaled to ``memory_bytes``). A bad value is a ValueError naming the variable."""
    checks = os.environ.get(SHADER_CHECKS_ENV, DEFAULT_SHADER_CHECKS)
    if checks not in SHADER_CHECKS:
        raise ValueError(f"{SHADER_CHECKS_ENV} must be one of {', '.join(SHADER_CHECKS)}, got {checks!r}")
    subgroups = os.environ.get(SUBGROUPS_ENV, "1")
    if subgroups not in ("0", "1"):
        raise ValueError(f"{SUBGROUPS_ENV} must be 1 (use subgroups where the adapter has them) or 0, "
                         f"got {subgroups!r}")
    pool = os.environ.get(POOL_ENV, "").strip()
    if pool:
        try:
            mib = int(pool)
        except ValueError:
            mib = -1
        if mib < 0:
            raise ValueError(f"{POOL_ENV} must be a whole number of MiB >= 0, got {pool!r}")
        pool_bytes = mib << 20
    else:
        pool_bytes = default_pool_bytes(memory_bytes)
    gemms = os.environ.get(GEMMS_ENV, "measured")
    if gemms not in GEMMS:
        raise ValueError(f"{GEMMS_ENV} must be one of {', '.join(GEMMS)}, got {gemms!r}")
    digits = os.environ.get(INPUT_GRAD_DIGITS_ENV, "4").strip()
    if digits not in tuple(map(str, INPUT_GRAD_DIGITS)):
        raise ValueError(f"{INPUT_GRAD_DIGITS_ENV} must be one of {', '.join(map(str, INPUT_GRAD_DIGITS))}, "
                         f"got {digits!r}")
    return Settings(checks, subgroups == "1", pool_bytes, gemms, int(digits))
