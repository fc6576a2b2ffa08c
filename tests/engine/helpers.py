"""Shared by the engine's model tests: run a pass and read back the int8 codes it chose."""

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
