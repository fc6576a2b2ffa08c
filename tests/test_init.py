"""Hesper's initialisation, bit for bit, and PEFT's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torch_wgpu_lora.init import (GOLDEN_GAMMA, Xoroshiro128Plus, float64_to_float32_truncate, hesper_uniform,
                                  init_lora_A, peft_uniform, splitmix64_mix)


def test_splitmix64_matches_the_published_reference_output():
    # SplitMix64 (Steele, Lea, Flood 2014) seeded with 1234567 first outputs 6457827717110365317;
    # Hesper's first state word is exactly that first output.
    assert splitmix64_mix((1234567 + GOLDEN_GAMMA) % 2**64) == 6457827717110365317
    assert Xoroshiro128Plus(1234567).s0 == 6457827717110365317


def independent_xoroshiro(seed: int, count: int) -> list[int]:
    """The same generator written with numpy uint64 wrap-around arithmetic (a second implementation)."""
    with np.errstate(over="ignore"):
        def mix(z):
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            return z ^ (z >> np.uint64(31))

        def rotl(v, k):
            return (v << np.uint64(k)) | (v >> np.uint64(64 - k))

        s0 = mix(np.uint64(seed) + np.uint64(GOLDEN_GAMMA))
        s1 = mix(s0 + np.uint64(GOLDEN_GAMMA))
        out = []
        for _ in range(count):
            out.append(int(s0 + s1))
            t = s0 ^ s1
            s0, s1 = rotl(s0, 24) ^ t ^ (t << np.uint64(16)), rotl(t, 37)
        return out


@pytest.mark.parametrize("seed", [0, 42, 43, 2**63 + 5])
def test_xoroshiro_agrees_with_an_independent_implementation(seed):
    rng = Xoroshiro128Plus(seed)
    scalar = [rng.next_u64() for _ in range(64)]
    assert scalar == independent_xoroshiro(seed, 64)
    assert Xoroshiro128Plus(seed).next_u64_array(64).tolist() == scalar


def test_known_answers_for_seed_42():
    rng = Xoroshiro128Plus(42)
    assert (rng.s0, rng.s1) == (13679457532755275413, 6332618229526065668)
    assert [rng.next_u64() for _ in range(4)] == [1565331688571789465, 7199280286892351276,
                                                  5398882731901830099, 13075507151040594378]
    A = hesper_uniform((1, 3), fan_in=2560, seed=42)
    assert [float(v).hex() for v in A[0].tolist()] == ['-0x1.d1ae540000000p-6', '-0x1.ec55da0000000p-8',
                                                       '-0x1.d121440000000p-7']


def test_values_follow_the_recipe_draw_by_draw():
    fan_in, seed = 640, 7
    bits = Xoroshiro128Plus(seed).next_u64_array(12)
    bound = math.sqrt(3.0 / fan_in)
    expected = [float(np.float32(0.0)) for _ in bits]
    for i, b in enumerate(bits.tolist()):
        v = (b >> 11) / 2.0**53 * 2.0 * bound - bound
        f32 = np.float32(v)  # round to nearest; truncation is that or one step toward zero
        if abs(float(f32)) > abs(v):
            f32 = np.nextafter(f32, np.float32(0.0))
        expected[i] = float(f32)
    assert hesper_uniform((3, 4), fan_in, seed).flatten().tolist() == expected


def test_truncation_rounds_toward_zero_and_flushes_float32_underflow():
    values = np.array([1.0 + 2**-30, -(1.0 + 2**-30), 1e-39, -1e-40, 3.0], dtype=np.float64)
    out = float64_to_float32_truncate(values)
    assert out.tolist() == [1.0, -1.0, 0.0, 0.0, 3.0]
    assert np.float32(1.0 + 2**-24 + 2**-25) != float64_to_float32_truncate(np.array([1.0 + 2**-24 + 2**-25]))[0]


def test_statistics_of_a_large_draw():
    fan_in = 2560
    A = hesper_uniform((16, fan_in), fan_in, seed=123).double()
    bound = math.sqrt(3.0 / fan_in)
    assert A.min() >= -bound and A.max() < bound
    n = A.numel()
    # Uniform(-b, b): mean 0 (std b/sqrt(3n)), variance b²/3; allow 5 standard errors.
    assert abs(A.mean().item()) < 5 * bound / math.sqrt(3 * n)
    assert abs(A.var().item() / (bound**2 / 3) - 1) < 5 * math.sqrt(0.8 / n)
    counts = torch.histc(A, bins=10, min=-bound, max=bound)
    expected = n / 10
    assert ((counts - expected) ** 2 / expected).sum() < 30  # chi² with 9 dof: p < 1e-3 above ~27.9


def test_different_seeds_give_different_draws():
    assert not torch.equal(hesper_uniform((2, 8), 8, 1), hesper_uniform((2, 8), 8, 2))


def test_peft_init_is_kaiming_uniform_with_a_sqrt5():
    A = peft_uniform((8, 400), seed=0)
    assert A.abs().max() <= 1 / math.sqrt(400)  # gain sqrt(2/(1+5)) · sqrt(3/fan_in) = 1/sqrt(fan_in)
    assert torch.equal(A, peft_uniform((8, 400), seed=0))


def test_unknown_init_is_refused():
    with pytest.raises(ValueError, match="init must be one of \\('hesper', 'peft', 'gaussian'\\), got 'xavier'"):
        init_lora_A((2, 2), "xavier", 0)
