"""Adapter initialisation: Hesper's seeded Kaiming-uniform, bit for bit, and PEFT's two.

Hesper's recipe (``init="hesper"``): B is zero; A is uniform in [-bound, bound) with
bound = sqrt(3 / in_features), drawn row-major from xoroshiro128+ (Hesper's docs call
it xoshiro128+) seeded through SplitMix64, each draw turned into float32 by
truncating the float64 mantissa (round toward zero), with underflow to zero.

>>> A = hesper_uniform((2, 4), fan_in=4, seed=42)
>>> A.dtype, A.shape, bool((A.abs() <= (3 / 4) ** 0.5).all())
(torch.float32, torch.Size([2, 4]), True)
"""

from __future__ import annotations

import math

import numpy as np
import torch

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def splitmix64_mix(z: int) -> int:
    """SplitMix64's finaliser (multipliers 0xbf58476d1ce4e5b9, 0x94d049bb133111eb; shifts 30, 27, 31)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


class Xoroshiro128Plus:
    """xoroshiro128+ (rotations 24 and 37, shift 16) seeded as Hesper does.

    The second state word is mixed from the first, not from the next SplitMix64 state:
    s0 = mix(seed + γ), s1 = mix(s0 + γ).

    >>> rng = Xoroshiro128Plus(42)
    >>> 0 <= rng.next_u64() < 2 ** 64
    True
    """

    def __init__(self, seed: int) -> None:
        self.s0 = splitmix64_mix((seed + GOLDEN_GAMMA) & MASK64)
        self.s1 = splitmix64_mix((self.s0 + GOLDEN_GAMMA) & MASK64)

    def next_u64(self) -> int:
        s0, s1 = self.s0, self.s1
        result = (s0 + s1) & MASK64
        t = s0 ^ s1
        self.s0 = (((s0 << 24) | (s0 >> 40)) & MASK64) ^ t ^ ((t << 16) & MASK64)
        self.s1 = ((t << 37) | (t >> 27)) & MASK64
        return result

    def next_u64_array(self, count: int) -> np.ndarray:
        """``count`` successive draws (the state advances by ``count``)."""
        out = np.empty(count, dtype=np.uint64)
        s0, s1 = self.s0, self.s1
        for i in range(count):  # inherently sequential: each draw advances the state
            out[i] = (s0 + s1) & MASK64
            t = s0 ^ s1
            s0 = (((s0 << 24) | (s0 >> 40)) & MASK64) ^ t ^ ((t << 16) & MASK64)
            s1 = ((t << 37) | (t >> 27)) & MASK64
        self.s0, self.s1 = s0, s1
        return out


def float64_to_float32_truncate(values: np.ndarray) -> np.ndarray:
    """float64 → float32 rounding toward zero; magnitudes below float32's smallest normal become 0."""
    bits = np.ascontiguousarray(values, dtype=np.float64).view(np.uint64) & np.uint64(~((1 << 29) - 1) & MASK64)
    truncated = bits.view(np.float64)
    truncated = np.where(np.abs(truncated) < np.finfo(np.float32).tiny, 0.0, truncated)
    return truncated.astype(np.float32)  # exact: at most 24 significant bits remain


def hesper_uniform(shape: tuple[int, int], fan_in: int, seed: int) -> torch.Tensor:
    """A float32 tensor of ``shape`` drawn as Hesper draws its A matrices."""
    count = math.prod(shape)
    bits = Xoroshiro128Plus(seed & MASK64).next_u64_array(count)
    unit = (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    bound = math.sqrt(3.0 / fan_in)
    values = unit * 2.0 * bound - bound
    return torch.from_numpy(float64_to_float32_truncate(values).reshape(shape))


def peft_uniform(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """PEFT's default for lora_A: ``kaiming_uniform_(a=sqrt(5))``, from a seeded generator."""
    out = torch.empty(shape)
    torch.nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
    return out


def gaussian(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """PEFT's ``init_lora_weights="gaussian"`` for lora_A: N(0, (1/r)²), from a seeded generator."""
    out = torch.empty(shape)
    torch.nn.init.normal_(out, std=1.0 / shape[0], generator=torch.Generator().manual_seed(seed))
    return out


INITS = ("hesper", "peft", "gaussian")


def init_lora_A(shape: tuple[int, int], init: str, seed: int) -> torch.Tensor:
    """lora_A's initial values [r, in_features] for ``init`` in ``INITS``."""
    if init == "hesper":
        return hesper_uniform(shape, fan_in=shape[1], seed=seed)
    if init == "peft":
        return peft_uniform(shape, seed)
    if init == "gaussian":
        return gaussian(shape, seed)
    raise ValueError(f"init must be one of {INITS}, got {init!r}")
