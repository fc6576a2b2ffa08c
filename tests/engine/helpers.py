"""Shared by the engine's tests: run a pass and read back the int8 codes it chose; compare a
kernel's output with a float64 reference."""

from __future__ import annotations

import numpy as np
import torch

from torch_wgpu_lora.engine.plan import read_codes
from torch_wgpu_lora.runtime import Recorder, write


def forward_with_codes(engine, ids: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, dict]:
    """The engine's logits [batch, tokens, vocab] and the codes of every quantisation point."""
    batch, tokens = ids.shape
    engine.adapters.sync()
    plan = engine.plan(batch, tokens)
    write(plan.ids, ids.numpy().astype(np.uint32).reshape(-1))
    plan.cache.set_position(0, lengths)
    capture, logits = {}, torch.empty(batch * tokens, engine.engine_config.vocab)
    rec = Recorder()
    plan.record(rec, capture=capture)
    plan.read_logits(rec, logits.numpy())
    rec.submit()
    return logits.reshape(batch, tokens, -1), read_codes(capture, batch, tokens, engine.engine_config)


def assert_close(got: np.ndarray, ref: torch.Tensor, what: str, rtol: float, terms: float = 0.0) -> float:
    """Checks max |got - ref| <= rtol · max |ref| (and that every element is finite); returns the
    error relative to that scale (the absolute error when it is zero). ``terms``: the scale used
    instead when the reference is all zeros because its terms cancel exactly (float32 sums of them
    in another order reach zero only to their rounding): the size of those terms."""
    ref = ref.numpy()
    assert got.shape == ref.shape, what
    assert np.isfinite(got).all(), f"{what}: {np.count_nonzero(~np.isfinite(got))} elements not finite (unwritten?)"
    scale = float(np.abs(ref).max()) or terms
    err = np.abs(got.astype(np.float64) - ref).max()
    assert err <= rtol * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"
    return err / scale if scale else err
