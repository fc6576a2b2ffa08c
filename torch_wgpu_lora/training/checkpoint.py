"""Training checkpoints: written atomically, read back without unpickling anything.

A checkpoint is a folder ``step-000123`` holding

* ``adapter/``: the LoRA adapter in PEFT's layout (``integrations.adapter_files.save_adapter``);
* ``optimizer.safetensors``: each parameter's ``exp_avg`` and ``exp_avg_sq`` (keys ``"3.exp_avg"``);
* ``rng.safetensors``: torch's CPU generator state (``"torch"``, uint8);
* ``state.json``: the optimiser's param groups and step counts, the scheduler's state,
  Python's and numpy's RNG states and the trainer's own state (step, data position, ...);
* ``checksums.sha256``: the SHA-256 of every other file, in ``sha256sum``'s format (so
  ``sha256sum -c checksums.sha256`` in the folder checks it by hand too).

A data-parallel run (several processes) is saved by rank 0 alone: the adapter and optimiser
state are every rank's (they are identical), and the random states of ranks 1.. are kept
beside rank 0's (``state.json``'s ``rng.ranks`` and ``"torch.rank1"``, ... in
``rng.safetensors``; ``read_rank_rngs`` reads them back), so each rank resumes its own
random streams (LoRA dropout).

The folder is filled under a temporary name beside it (``.step-000123.XXXXXXXX.tmp``)
and renamed into place, so a checkpoint is complete or absent: a crash while saving
leaves the previous ones as they were. ``latest_checkpoint`` sees only complete ones;
``remove_unfinished`` deletes what a killed run left behind.

A checkpoint damaged after it was written (a truncated file, a state.json missing a key,
a flipped byte anywhere) raises ``DamagedCheckpoint`` naming the file and what is wrong,
before anything is restored.

>>> # save_checkpoint(root / "step-000010", model, optimizer, scheduler, {"step": 10})
>>> # trainer_state = load_checkpoint(latest_checkpoint(root), model, optimizer, scheduler)
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..files import make_temp_dir, sync_dir, write_atomic
from ..integrations.adapter_files import load_adapter_file, save_adapter

__all__ = ["DamagedCheckpoint", "checkpoint_name", "checkpoint_step", "latest_checkpoint", "list_checkpoints",
           "load_checkpoint", "read_checkpoint", "read_rank_rngs", "read_state", "remove_unfinished", "rng_state",
           "save_checkpoint", "set_rng_state"]

FORMAT_VERSION = 2  # 2: checksums.sha256
CHECKSUMS_NAME = "checksums.sha256"
_CHECKED_FILES = ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "optimizer.safetensors",
                  "rng.safetensors", "state.json")
_CHECKSUM_LINE = re.compile(r"^([0-9a-f]{64})  (\S.*)$")  # sha256sum's: digest, two spaces, path
_NAME = re.compile(r"^step-(\d+)$")
_UNFINISHED = re.compile(r"^\.step-\d+\..+\.(tmp|old)$")  # make_temp_dir's names for a new or a replaced one
_MOMENTS = ("exp_avg", "exp_avg_sq")
# state.json's entries (and theirs) that load_checkpoint reads.
_STATE_KEYS = {"trainer": (), "optimizer": ("param_groups", "steps"), "scheduler": (), "rng": ("python", "numpy")}


class DamagedCheckpoint(ValueError):
    """A checkpoint folder that does not read back: a file is missing, truncated or lacks an entry."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_step(folder: str | os.PathLike) -> int:
    """The step a checkpoint folder's name says (``step-000123`` → 123)."""
    match = _NAME.match(Path(folder).name)
    if match is None:
        raise ValueError(f"{folder} is not named like a checkpoint (step-NNNNNN)")
    return int(match.group(1))


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


def remove_unfinished(root: str | os.PathLike) -> list[Path]:
    """Delete the temporary folders a killed ``save_checkpoint`` left under ``root``; returns them.

    A ``.tmp`` folder is a checkpoint being filled. An ``.old`` folder holds a checkpoint that
    was being replaced: it goes back into place if its replacement never arrived.
    Call it only while no other process saves checkpoints under ``root``.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for tmp in sorted(root.iterdir()):
        match = _UNFINISHED.match(tmp.name)
        if match is None or not tmp.is_dir():
            continue
        if match.group(1) == "old":
            for previous in tmp.iterdir():
                if _NAME.match(previous.name) and not (root / previous.name).exists():
                    os.replace(previous, root / previous.name)
        shutil.rmtree(tmp)
        removed.append(tmp)
    if removed:
        sync_dir(root)
    return removed


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


def rng_state() -> dict[str, Any]:
    """This process's Python, numpy (JSON-able) and torch (``"torch"``, a uint8 tensor) RNG states."""
    return {**_rng_states(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` (or ``read_rank_rngs``) returned."""
    _set_rng_states(state, state["torch"])


def save_checkpoint(folder: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, trainer_state: dict[str, Any],
                    rank_rngs: list[dict[str, Any]] | None = None) -> Path:
    """Write a checkpoint to ``folder`` (its name says the step), atomically; returns ``folder``.

    ``trainer_state`` is JSON-able data the trainer needs back (``load_checkpoint`` returns it).
    ``rank_rngs``: in a data-parallel run, the ``rng_state()`` of ranks 1, 2, ... (this
    process, rank 0, saves its own as always). An existing checkpoint of the same name is
    replaced.
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
    rngs = {"torch": torch.get_rng_state()}
    if rank_rngs:
        state["rng"]["ranks"] = [{"python": r["python"], "numpy": r["numpy"]} for r in rank_rngs]
        rngs.update({f"torch.rank{i}": r["torch"].contiguous() for i, r in enumerate(rank_rngs, start=1)})
    text = json.dumps(state, indent=1)  # before anything is written: a state that isn't JSON fails here
    tmp = make_temp_dir(folder)
    try:
        save_adapter(model, tmp / "adapter", format="peft")
        write_atomic(tmp / "optimizer.safetensors", save(moments))
        write_atomic(tmp / "rng.safetensors", save(rngs))
        write_atomic(tmp / "state.json", text.encode("utf-8"))
        write_atomic(tmp / CHECKSUMS_NAME, "".join(f"{_sha256(tmp / name)}  {name}\n"
                                                   for name in _CHECKED_FILES).encode())
        if folder.exists():  # move the old one aside first: a folder cannot be renamed over a full one
            old = make_temp_dir(folder, suffix=".old")
            os.replace(folder, old / folder.name)
            os.replace(tmp, folder)
            shutil.rmtree(old)
        else:
            os.replace(tmp, folder)
        sync_dir(folder.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_checksums(folder: Path) -> None:
    """Every file of the checkpoint against ``checksums.sha256``; DamagedCheckpoint naming the first that differs."""
    listing = folder / CHECKSUMS_NAME
    if not listing.is_file():
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: it has no {CHECKSUMS_NAME}")
    digests = {}
    for number, line in enumerate(listing.read_bytes().decode("utf-8", errors="replace").splitlines(), start=1):
        match = _CHECKSUM_LINE.match(line)
        if match is None or match.group(2) not in _CHECKED_FILES:
            raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {listing}, line {number}, is not "
                                    f"'<SHA-256>  <one of {', '.join(_CHECKED_FILES)}>'")
        digests[match.group(2)] = match.group(1)
    for name in _CHECKED_FILES:
        if name not in digests:
            raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {listing} does not list {name}")
        path = folder / name
        if not path.is_file():
            raise DamagedCheckpoint(f"checkpoint {folder} is damaged: it has no {name}")
        if _sha256(path) != digests[name]:
            raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {path} differs from when it was written "
                                    f"(SHA-256 mismatch with {CHECKSUMS_NAME})")


def read_state(folder: str | os.PathLike) -> dict[str, Any]:
    """The parsed and checked ``state.json`` of the checkpoint ``folder`` (its ``"trainer"``
    entry is the trainer's state); DamagedCheckpoint when it is missing, not JSON or lacks an entry."""
    state_path = Path(folder) / "state.json"
    if not state_path.is_file():
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"no checkpoint at {folder}")
        if not _NAME.match(Path(folder).name):
            raise ValueError(f"{folder} is not a checkpoint: it has no state.json (checkpoints are the "
                             "step-NNNNNN folders under an output folder's checkpoints/)")
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: it has no state.json")
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {state_path} is not valid JSON ({err})") from None
    if not isinstance(state, dict):
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {state_path} holds no JSON object")
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{state_path}: checkpoint format {state.get('format')!r}; this version reads format "
                         f"{FORMAT_VERSION}")
    for key, inner in _STATE_KEYS.items():
        entry = state.get(key)
        if not isinstance(entry, dict):
            raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {state_path} has no {key!r} entry")
        for name in inner:
            if name not in entry:
                raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {state_path} has no {key}.{name} entry")
    return state


def _read_tensors(folder: Path, name: str, keys: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / name
    if not path.is_file():
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: it has no {name}")
    try:
        tensors = load_file(str(path))
    except SafetensorError as err:
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {path} is truncated or corrupt ({err})") from None
    missing = [key for key in keys if key not in tensors]
    if missing:
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {path} has no tensor {missing[0]!r}")
    return tensors


def read_checkpoint(folder: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor], torch.Tensor]:
    """``state.json``, the optimiser's moments and torch's RNG state of ``folder``, read and checked,
    and every file of it (the adapter's too) against its checksum (DamagedCheckpoint names what is
    wrong); the adapter is read by ``load_checkpoint``.

    >>> # state, moments, torch_rng = read_checkpoint(root / "step-000010")
    """
    folder = Path(folder)
    state = read_state(folder)
    steps = state["optimizer"]["steps"]
    moments = _read_tensors(folder, "optimizer.safetensors", [f"{i}.{name}" for i in steps for name in _MOMENTS])
    torch_rng = _read_tensors(folder, "rng.safetensors", ["torch"])["torch"]
    _check_checksums(folder)  # last: a fault the checks above name more precisely is reported by them
    return state, moments, torch_rng


def read_rank_rngs(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The random states of ranks 1, 2, ... saved in ``folder`` by a data-parallel run (``[]`` for a
    one-process run), each as ``rng_state()`` returns them; DamagedCheckpoint when one is missing."""
    folder = Path(folder)
    ranks = read_state(folder)["rng"].get("ranks", [])
    if not isinstance(ranks, list) or not all(isinstance(r, dict) and "python" in r and "numpy" in r for r in ranks):
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {folder / 'state.json'} has a malformed rng.ranks")
    if not ranks:
        return []
    tensors = _read_tensors(folder, "rng.safetensors", [f"torch.rank{i}" for i in range(1, len(ranks) + 1)])
    return [{**r, "torch": tensors[f"torch.rank{i}"]} for i, r in enumerate(ranks, start=1)]


def load_checkpoint(folder: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """Restore adapter, optimiser, scheduler and RNG states from ``folder``; returns the trainer state.

    Every file is read and checked before anything is restored.
    """
    folder = Path(folder)
    state, moments, torch_rng = read_checkpoint(folder)
    optimizer_state = {
        "param_groups": state["optimizer"]["param_groups"],
        "state": {int(i): {"step": torch.tensor(step, dtype=torch.float32),
                           **{name: moments[f"{i}.{name}"] for name in _MOMENTS}}
                  for i, step in state["optimizer"]["steps"].items()},
    }
    load_adapter_file(model, folder / "adapter", format="peft")
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_states(state["rng"], torch_rng)
    return state["trainer"]
