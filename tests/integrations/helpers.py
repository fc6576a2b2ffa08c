"""Shared by the adapter tests: processes that save into, and load from, one PEFT folder at once."""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from pathlib import Path

import torch
from transformers import BitNetForCausalLM

from torch_wgpu_lora import load_adapter, save_adapter
from torch_wgpu_lora.integrations import adapters
from torch_wgpu_lora.integrations.bitnet import apply_lora, lora_modules

# Each save is one of these: (lora_alpha, the value of every lora_A and lora_B element).
SAVES = ((4.0, 1.0), (16.0, 2.0))


def adapter_of(checkpoint: str | Path, alpha: float, value: float) -> torch.nn.Module:
    """The checkpoint with r=4 Q/V adapters of ``lora_alpha=alpha`` whose every weight is ``value``."""
    model = apply_lora(BitNetForCausalLM.from_pretrained(checkpoint), r=4, lora_alpha=alpha, backend="torch")
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_A.fill_(value)
            m.lora_B.fill_(value)
    return model


def _without_locks() -> None:
    """As where folders cannot be locked: saves and loads take no lock (the readers' pairing check is left)."""
    adapters.locked_dir = lambda *args, **kwargs: contextlib.nullcontext()


def _wait_for_start(ready: multiprocessing.Event, go: multiprocessing.Event, seconds: float) -> float:
    ready.set()
    go.wait(timeout=300)
    return time.monotonic() + seconds


def save_in_turns(checkpoint: str, folder: str, seconds: float, locks: bool, ready, go, results) -> None:
    """Save SAVES[0], SAVES[1], SAVES[0], ... into ``folder`` for ``seconds``; put the number of saves."""
    if not locks:
        _without_locks()
    models = [adapter_of(checkpoint, alpha, value) for alpha, value in SAVES]
    until, saves = _wait_for_start(ready, go, seconds), 0
    while time.monotonic() < until:
        save_adapter(models[saves % 2], folder)
        saves += 1
    results.put(("saves", saves))


def load_in_turns(checkpoint: str, folder: str, seconds: float, locks: bool, ready, go, results) -> None:
    """Load ``folder`` again and again for ``seconds``; put what each load gave: a whole save, a
    mixed one, the refusal that says the folder was being written, or any other error."""
    if not locks:
        _without_locks()
    model = adapter_of(checkpoint, *SAVES[0])
    outcomes: dict[str, int] = {"whole": 0, "being written": 0}
    others: list[str] = []
    until = _wait_for_start(ready, go, seconds)
    while time.monotonic() < until:
        try:
            load_adapter(model, folder)
        except ValueError as err:
            if "was being written while it was read" not in str(err):
                others.append(f"ValueError: {err}")
            else:
                outcomes["being written"] += 1
            continue
        except Exception as err:  # reported to the test, which fails naming it
            others.append(f"{type(err).__name__}: {err}")
            continue
        modules = lora_modules(model).values()
        got = {(m.lora_alpha, m.scaling, *torch.unique(torch.cat([m.lora_A.flatten(), m.lora_B.flatten()])).tolist())
               for m in modules}
        whole = [{(alpha, alpha / 4, value)} for alpha, value in SAVES]
        if got in whole:
            outcomes["whole"] += 1
        else:
            others.append(f"mixed: {sorted(got)}")
    results.put(("loads", outcomes, others))
