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


@dataclass
class FeedStats:
    """What ``feeding_codes`` saw: quantisation calls, codes, flips (substituted codes that differ
    from torch's own rounding), nonzero codes, and the (layer, site) points fed."""

    calls: int = 0
    codes: int = 0
    flips: int = 0
    nonzero: int = 0
    sites: set = field(default_factory=set)


@contextlib.contextmanager
def feeding_codes(model: nn.Module, codes: dict, stats: FeedStats) -> Iterator[FeedStats]:
    """Inside the block, every activation quantisation of ``model``'s projections uses
    ``codes[(layer, site)]`` ([batch, tokens, K] codes and per-token scales; sites as in
    ``PROJECTION_SITES``) instead of its own rounding, after checking each difference is a
    near-tie flip (AssertionError otherwise)."""
    bitnet = sys.modules["transformers.integrations.bitnet"]
    site_of = {module: (layer, PROJECTION_SITES[name]) for layer, name, module in projection_modules(model)}
    current: list = []
    hooks = [m.register_forward_pre_hook(lambda module, args: current.append(site_of[module])) for m in site_of]

    def substitute(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = current.pop()
        ours, _ = codes[key]
        x = x.detach().to(torch.promote_types(x.dtype, torch.float32))  # a float64 reference stays exact
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
        q, scale = substitute(input)
        return q.to(torch.int8), scale

    class ActQuant:  # the codes' value, and the identity's gradient (transformers' STE)
        @staticmethod
        def apply(activation: torch.Tensor) -> torch.Tensor:
            q, scale = substitute(activation)
            return activation + ((q / scale).to(activation.dtype) - activation).detach()

    saved = bitnet.BitLinear.activation_quant, bitnet.ActQuant
    bitnet.BitLinear.activation_quant = bitlinear_quant
    bitnet.ActQuant = ActQuant
    try:
        yield stats
    finally:
        bitnet.BitLinear.activation_quant, bitnet.ActQuant = saved
        for h in hooks:
            h.remove()
