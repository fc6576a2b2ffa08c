"""Training checkpoints: written atomically, read back without unpickling anything.

A checkpoint is a folder ``step-000123`` holding

* ``adapter/``: the LoRA adapter in PEFT's layout (``integrations.adapters.save_adapter``);
* ``optimizer.safetensors``: each parameter's ``exp_avg`` and ``exp_avg_sq`` (keys ``"3.exp_avg"``);
* ``rng.safetensors``: torch's CPU generator state (``"torch"``, uint8);
* ``state.json``: the optimiser's param groups and step counts, the scheduler's state,
  Python's and numpy's RNG states and the trainer's own state (step, data position, ...).

The folder is filled under a temporary name beside it and renamed into place, so a
checkpoint is complete or absent: a crash while saving leaves the previous ones as
they were. ``latest_checkpoint`` sees only complete ones.

>>> # save_checkpoint(root / "step-000010", model, optimizer, scheduler, {"step": 10})
>>> # trainer_state = load_checkpoint(latest_checkpoint(root), model, optimizer, scheduler)
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..integrations.adapters import load_adapter, save_adapter

__all__ = ["checkpoint_name", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "read_state",
           "save_checkpoint"]

FORMAT_VERSION = 1
_NAME = re.compile(r"^step-(\d+)$")
_MOMENTS = ("exp_avg", "exp_avg_sq")


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under ``root``, oldest step first (temporary folders are not listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(directory: Path) -> None:
    if os.name == "posix":  # elsewhere folders cannot be opened to sync
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _rng_states() -> dict[str, Any]:
    version, mt_state, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    return {
        "python": [version, list(mt_state), gauss],
        "numpy": {**numpy_state, "state": {"key": numpy_state["state"]["key"].tolist(),
                                           "pos": int(numpy_state["state"]["pos"])}},
    }


def _set_rng_states(states: dict[str, Any], torch_state: torch.Tensor) -> None:
    version, mt_state, gauss = states["python"]
    random.setstate((version, tuple(mt_state), gauss))
    numpy_state = states["numpy"]
    np.random.set_state({**numpy_state, "state": {"key": np.asarray(numpy_state["state"]["key"], dtype=np.uint32),
                                                  "pos": numpy_state["state"]["pos"]}})
    torch.set_rng_state(torch_state)


def save_checkpoint(folder: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, trainer_state: dict[str, Any]) -> Path:
    """Write a checkpoint to ``folder`` (its name says the step), atomically; returns ``folder``.

    ``trainer_state`` is JSON-able data the trainer needs back (``load_checkpoint`` returns it).
    An existing checkpoint of the same name is replaced.
    """
    from safetensors.torch import save

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    optimizer_state = optimizer.state_dict()
    moments = {f"{i}.{name}": entry[name].contiguous()
               for i, entry in optimizer_state["state"].items() for name in _MOMENTS}
    state = {
        "format": FORMAT_VERSION,
        "trainer": trainer_state,
        "optimizer": {"param_groups": optimizer_state["param_groups"],
                      "steps": {str(i): float(entry["step"]) for i, entry in optimizer_state["state"].items()}},
        "scheduler": scheduler.state_dict(),
        "rng": _rng_states(),
    }
    text = json.dumps(state, indent=1)  # before anything is written: a state that isn't JSON fails here
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    try:
        save_adapter(model, tmp / "adapter", format="peft")
        _write_synced(tmp / "optimizer.safetensors", save(moments))
        _write_synced(tmp / "rng.safetensors", save({"torch": torch.get_rng_state()}))
        _write_synced(tmp / "state.json", text.encode("utf-8"))
        _sync_dir(tmp)
        if folder.exists():  # move the old one aside first: a folder cannot be renamed over a full one
            old = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".old"))
            os.replace(folder, old / folder.name)
            os.replace(tmp, folder)
            shutil.rmtree(old)
        else:
            os.replace(tmp, folder)
        _sync_dir(folder.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def read_state(folder: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``state.json`` of the checkpoint ``folder`` (its ``"trainer"`` entry is the trainer's state)."""
    state_path = Path(folder) / "state.json"
    if not state_path.is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint: it has no state.json")
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{state_path} is not valid JSON: {err}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        found = state.get("format") if isinstance(state, dict) else None
        raise ValueError(f"{state_path}: checkpoint format {found!r}; this version reads format {FORMAT_VERSION}")
    return state


def load_checkpoint(folder: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """Restore adapter, optimiser, scheduler and RNG states from ``folder``; returns the trainer state."""
    from safetensors.torch import load_file

    folder = Path(folder)
    state = read_state(folder)
    moments = load_file(str(folder / "optimizer.safetensors"))
    optimizer_state = {
        "param_groups": state["optimizer"]["param_groups"],
        "state": {int(i): {"step": torch.tensor(step, dtype=torch.float32),
                           **{name: moments[f"{i}.{name}"] for name in _MOMENTS}}
                  for i, step in state["optimizer"]["steps"].items()},
    }
    torch_rng = load_file(str(folder / "rng.safetensors"))["torch"]
    load_adapter(model, folder / "adapter", format="peft")
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_states(state["rng"], torch_rng)
    return state["trainer"]
