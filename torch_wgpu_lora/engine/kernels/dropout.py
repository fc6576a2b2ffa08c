"""LoRA dropout inside the engine's kernels (``_dropout.wgsl``), and the torch reference of its masks.

The engine never stores a dropout mask: the kernels that read an adapter's input (the norm's
h = A·x, the gradient of A, the adapters' input gradient) each recompute it from four numbers,
a pass's seed, the adapter's key, the token row and the feature, with a counter-based hash.
A pass's seed, threshold and scale live in a small state buffer (``dropout_state``) the plan
writes before each submit, so command buffers encoded ahead never hold them.

>>> mask = dropout_mask_reference(seed=7, key=0, rows=2, k=8, p=0.25)
>>> tuple(mask.shape), sorted({float(v) for v in mask.flatten()}) == [0.0, float(np.float32(1 / 0.75))]
((2, 8), True)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...runtime import Buffer

NO_SPLIT = 2**32 - 1  # a site with fewer adapters: no rank row reaches this split
SITE_KEYS = 4  # keys a layer's site spans (its adapters' indices 0..2)


@dataclass(frozen=True)
class SiteDropout:
    """A norm site's adapters' dropout as its kernels take it: the plan's state buffer, the key
    of the site's first adapter (the others follow it) and the rank rows of the site's stacked A
    where its second and third adapters begin (``NO_SPLIT`` where there is none)."""

    state: Buffer
    key: int
    splits: tuple[int, int]


def site_key(layer: int, site_index: int) -> int:
    """The key of a layer's site's first adapter: adapter i of the site has this + i."""
    return SITE_KEYS * (4 * layer + site_index)


def dropout_params(dropout: SiteDropout | None) -> tuple[int, int, int]:
    """The (drop_key, drop_split1, drop_split2) fields of a kernel's Params."""
    return (0, NO_SPLIT, NO_SPLIT) if dropout is None else (dropout.key, *dropout.splits)


def threshold_and_scale(p: float) -> tuple[int, float]:
    """The kernels' keep test and factor for probability ``p``: keep when the hash is at least
    the threshold (so a feature is kept with probability 1 − threshold / 2³², within 2⁻³³ of
    1 − p), then multiply by 1 / (1 − p) rounded to float32, the factor torch's float32 dropout uses."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
    return min(round(p * 2**32), 2**32 - 1), float(np.float32(1.0 / (1.0 - p)))


def dropout_state(seed: int, p: float) -> np.ndarray:
    """The state buffer's words for a pass: seed, threshold, the scale's float32 bits, 0."""
    threshold, scale = threshold_and_scale(p)
    return np.array([seed & 0xFFFFFFFF, threshold, np.array([scale], np.float32).view(np.uint32)[0], 0], np.uint32)


_M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a·b mod 2³² for int64 tensors of 32-bit values, in halves so no product overflows int64."""
    return (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & _M32


def pcg4d_reference(v: torch.Tensor) -> torch.Tensor:
    """Jarzynski and Olano's pcg4d over the last dimension (4 words, int64 holding u32 values)."""
    x, y, z, w = ((_mul32(c, torch.tensor(1664525)) + 1013904223) & _M32 for c in v.unbind(-1))
    for last in (False, True):
        x = (x + _mul32(y, w)) & _M32
        y = (y + _mul32(z, x)) & _M32
        z = (z + _mul32(x, y)) & _M32
        w = (w + _mul32(y, z)) & _M32
        if not last:
            x, y, z, w = (c ^ (c >> 16) for c in (x, y, z, w))
    return torch.stack((x, y, z, w), -1)


def dropout_mask_reference(seed: int, key: int, rows: int, k: int, p: float) -> torch.Tensor:
    """Adapter ``key``'s mask over ``rows`` token rows × ``k`` features for a pass with ``seed``,
    float32: 0 where a feature is dropped, the scale 1 / (1 − p) where it is kept."""
    threshold, scale = threshold_and_scale(p)
    words = -(-k // 4)
    n, w = torch.meshgrid(torch.arange(rows), torch.arange(words), indexing="ij")
    v = torch.stack((torch.full_like(n, seed & _M32), torch.full_like(n, key), n, w), -1)
    kept = pcg4d_reference(v).reshape(rows, 4 * words)[:, :k] >= threshold
    return kept.float() * scale
