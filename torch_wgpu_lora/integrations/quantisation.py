"""Running a transformers BitNet model with given int8 activation codes: how another
implementation's quantised forward and backward are compared with transformers' own modules.

Why. A quantised model rounds each activation to an int8 code, ``round(x · 127 / max|x|)``.
When two implementations' float sums differ in the last bit, a value sitting within that
distance of a rounding boundary (x·s = k + ½) becomes a different code, and from there the
two compute slightly different functions: no tolerance can tell such a flip from a bug. So
the comparison runs transformers' modules with the other side's codes substituted at every
quantisation point (``feeding_codes``) and checks, at each point, that every substituted
code differs from transformers' own rounding of its own value only at a near-tie
(|x·s − (k + ½)| < ``TIE`` code units) and by one, and (the caller) that flips are rare (at
most ``FLIP_SHARE`` of all codes). With the codes pinned, everything else is float
arithmetic and can be held to float tolerances. The straight-through gradient is kept:
the substituted codes pass gradients as transformers' quantisation does.

**llama.cpp's rule** (``rule="q8_K"``). llama.cpp multiplies its ternary weights (TQ1_0, TQ2_0)
with activations quantised to Q8_K: blocks of 256 consecutive values of a row, each with its own
factor, as ggml's ``quantize_row_q8_K_ref`` (ggml/src/ggml-quants.c): ``iscale = -127 / m`` with m
the block's value of largest magnitude (the first, sign kept), code ``min(127, round(iscale · x))``
(round half to even), value ``code · d`` with ``d = 1 / iscale`` in float32 (a block of zeros: codes
and d 0). ``q8_k_codes`` computes them; fed with llama.cpp's own, transformers' modules compute what
llama.cpp does, to float rounding.

>>> # stats = FeedStats()
>>> # with feeding_codes(model, codes, stats):       # codes[(layer, site)] = (codes [B, T, K], scales)
>>> #     loss = model(input_ids=ids, labels=labels).loss
>>> # assert stats.flips <= FLIP_SHARE * stats.codes
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from .bitnet import PROJECTION_SITES, projection_modules

# A flip is legitimate only where torch's x·s lies this close to a rounding boundary. The two
# sides' x agree to float32 rounding accumulated over a few ops (~1e-6 relative); |x·s| ≤ 127,
# so their x·s differ by ~1e-4 code units: 2e-3 leaves 15× margin while a real error in the
# quantisation (a wrong scale, a wrong element) lands far from a tie almost always.
TIE = 2e-3
FLIP_SHARE = 1e-3
Q8_K_BLOCK = 256  # values per ggml Q8_K block


@dataclass
class FeedStats:
    """What ``feeding_codes`` saw: quantisation calls, codes, flips (substituted codes that differ
    from torch's own rounding), nonzero codes, and the (layer, site) points fed."""

    calls: int = 0
    codes: int = 0
    flips: int = 0
    nonzero: int = 0
    sites: set = field(default_factory=set)


def q8_k_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's Q8_K quantisation of float32 ``x`` [..., K] (K a multiple of 256), as the module
    docstring gives it: (codes [..., K], d [..., K / 256, 1], the values iscale · x before rounding
    [..., K]); codes · d per block is the value llama.cpp multiplies."""
    if x.dtype != torch.float32 or x.shape[-1] % Q8_K_BLOCK:
        raise ValueError(f"Q8_K quantises float32 rows of whole {Q8_K_BLOCK}-value blocks, not {x.dtype} {list(x.shape)}")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // Q8_K_BLOCK, Q8_K_BLOCK)
    largest = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))  # argmax: the first, as ggml's strict >
    # one float32 division each, as ggml's (a Python number over a tensor is a reciprocal and a product)
    iscale = torch.where(largest == 0, 0.0, torch.full_like(largest, -127.0) / largest)
    value = iscale * blocks
    codes = value.round().clamp(max=127)
    d = torch.where(largest == 0, 0.0, torch.ones_like(iscale) / iscale)
    return codes.reshape(x.shape), d, value.reshape(x.shape)


@contextlib.contextmanager
def feeding_codes(model: nn.Module, codes: dict, stats: FeedStats, rule: str = "per-token") -> Iterator[FeedStats]:
    """Inside the block, every activation quantisation of ``model``'s projections uses
    ``codes[(layer, site)]`` instead of its own rounding (sites as in ``PROJECTION_SITES``), after
    checking each difference is a near-tie flip (AssertionError otherwise). ``rule="per-token"``
    (transformers'): [batch, tokens, K] codes and per-token scales (value = code / scale);
    ``rule="q8_K"`` (llama.cpp's, ``q8_k_codes``): [batch, tokens, K] codes and per-block d
    [batch, tokens, K / 256, 1] (value = code · d)."""
    if rule not in ("per-token", "q8_K"):
        raise ValueError(f"rule must be 'per-token' or 'q8_K', got {rule!r}")
    bitnet = sys.modules["transformers.integrations.bitnet"]
    site_of = {module: (layer, PROJECTION_SITES[name]) for layer, name, module in projection_modules(model)}
    current: list = []
    hooks = [m.register_forward_pre_hook(lambda module, args: current.append(site_of[module])) for m in site_of]

    def substitute(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = current.pop()
        ours, _ = codes[key]
        x = x.detach().to(torch.promote_types(x.dtype, torch.float32))  # a float64 reference stays exact
        if rule == "q8_K":
            theirs, _, value = q8_k_codes(x)
            scale = codes[key][1]  # here d, the other side's: value = code · d
        else:
            scale = 127 / x.abs().max(dim=-1, keepdim=True).values.clamp(min=1e-5)
            value = x * scale
            theirs = value.round().clamp(-128, 127)
        flips = ours != theirs
        distance = (value - value.floor() - 0.5).abs()
        if not bool((distance[flips] < TIE).all()):
            raise AssertionError(f"layer {key[0]} {key[1]}: a code differs away from a rounding tie "
                                 f"(distance {distance[flips].min().item():.3g} code units)")
        if not bool(((ours - theirs).abs()[flips] == 1).all()):
            raise AssertionError(f"layer {key[0]} {key[1]}: a code differs by more than one")
        stats.calls += 1
        stats.codes += ours.numel()
        stats.flips += int(flips.sum())
        stats.nonzero += int((ours != 0).sum())
        stats.sites.add(key)
        return ours, scale

    def bitlinear_quant(self: nn.Module, input: torch.Tensor, num_bits: int = 8) -> tuple[torch.Tensor, ...]:
        if rule == "q8_K":
            raise ValueError("transformers' packed BitLinear divides by one scale per token; Q8_K codes are fed to "
                             "AutoBitLinear models (those loaded from GGUF files)")
        q, scale = substitute(input)
        return q.to(torch.int8), scale

    class ActQuant:  # the codes' value, and the identity's gradient (transformers' STE)
        @staticmethod
        def apply(activation: torch.Tensor) -> torch.Tensor:
            q, scale = substitute(activation)
            if rule == "q8_K":  # code · d per block, as llama.cpp's dot products weigh them
                dequantised = (q.reshape(*q.shape[:-1], -1, Q8_K_BLOCK) * scale).reshape(q.shape)
            else:
                dequantised = q / scale
            return activation + (dequantised.to(activation.dtype) - activation).detach()

    saved = bitnet.BitLinear.activation_quant, bitnet.ActQuant
    bitnet.BitLinear.activation_quant = bitlinear_quant
    bitnet.ActQuant = ActQuant
    try:
        yield stats
    finally:
        bitnet.BitLinear.activation_quant, bitnet.ActQuant = saved
        for h in hooks:
            h.remove()
