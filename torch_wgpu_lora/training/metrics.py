"""The metrics log (JSONL, one object a line), the loss-curve plot drawn from it, and the
experiment trackers that hear the same records (``Reporters``: TensorBoard, Weights & Biases).

>>> import tempfile, pathlib
>>> log = MetricsLog(pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl")
>>> log.append({"step": 1, "loss": 2.5}); log.append({"step": 1, "eval_loss": 2.7})
>>> log.read()
[{'step': 1, 'loss': 2.5}, {'step': 1, 'eval_loss': 2.7}]

Training lines carry ``step``, ``epoch``, ``loss``, ``lr``, ``grad_norm``, ``tokens``,
``tokens_per_s`` and ``skipped``; evaluation lines ``step``, ``eval_loss`` and
``eval_perplexity``. Values that are not finite are written as null (JSON has no NaN).

Each line is synced to disk as it is appended. A crash (or a full disk) can still cut the
last line short: ``read`` drops a torn last line with a warning, and ``keep_until`` (on
resume) rewrites the log without it. A damaged line before the last is an error naming
the file and line.
"""

from __future__ import annotations

import importlib
import io
import json
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..files import append_synced, write_atomic

__all__ = ["REPORTERS", "MetricsLog", "Reporters", "perplexity", "plot_loss"]

REPORTERS = ("tensorboard", "wandb")


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsLog:
    """Append-only JSONL file of metrics; ``keep_until(step)`` drops lines after a resumed step."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _finite_or_none(v) for k, v in record.items()}, allow_nan=False)
        append_synced(self.path, line + "\n")

    def read(self) -> list[dict[str, Any]]:
        """Every record; a torn last line (a write cut short) is dropped with a warning."""
        if not self.path.is_file():
            return []
        # Bytes, not text: a write cut short can end inside a UTF-8 sequence or leave NUL bytes.
        lines = [line for line in self.path.read_bytes().split(b"\n") if line.strip()]
        records = []
        for number, line in enumerate(lines, start=1):
            try:
                record = json.loads(line.decode("utf-8"))
                if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                    raise ValueError("not a metrics record (a JSON object with an integer step)")
            except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                if number < len(lines):
                    raise ValueError(f"{self.path}, line {number}: damaged ({err}); only the last line can be "
                                     "torn by a crash, so the log was changed by something else") from None
                warnings.warn(f"{self.path}: the last line is torn (a write cut short by a crash or a full disk) "
                              "and was dropped", RuntimeWarning, stacklevel=2)
                break
            records.append(record)
        return records

    def keep_until(self, step: int) -> None:
        """Rewrite the log (atomically) without the lines of steps after ``step``."""
        kept = [r for r in self.read() if r["step"] <= step]
        self._replace("".join(json.dumps(r) + "\n" for r in kept))

    def clear(self) -> None:
        self._replace("")

    def _replace(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, text.encode("utf-8"))


def perplexity(loss: float) -> float:
    """exp(loss), the perplexity of a mean loss per token (inf where that overflows, as transformers reports it).

    >>> perplexity(0.0)
    1.0
    """
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class Reporters:
    """The experiment trackers ``report_to`` names (``REPORTERS``, one name or several; ``"none"``, as in
    transformers, or an empty list for none), each written
    through its library's own writer: TensorBoard's ``SummaryWriter`` (event files in ``folder``) and
    ``wandb.log`` (a run started in ``folder``'s parent). Each record's numbers are logged at its
    step, under ``train/<name>`` or ``eval/<name>`` (``eval_loss`` → ``eval/loss``). The writers open
    at the first record (on the process that logs), so making one costs nothing elsewhere.

    >>> Reporters((), "runs").names
    ()
    """

    def __init__(self, report_to: str | Sequence[str], folder: str | os.PathLike) -> None:
        names = (report_to,) if isinstance(report_to, str) else tuple(report_to)
        if names == ("none",):  # transformers' value for no tracker
            names = ()
        unknown = [name for name in names if name not in REPORTERS]
        if unknown:
            raise ValueError(f"report_to takes {REPORTERS}, got {unknown[0]!r}")
        for name in names:  # missing packages are said at once, not at the first record
            _writer_module(name)
        self.names, self.folder = names, Path(folder)
        self._writers: dict[str, Any] | None = None

    def log(self, record: dict[str, Any]) -> None:
        if not self.names:
            return
        if self._writers is None:
            self._writers = {name: _open_writer(name, self.folder) for name in self.names}
        step = record["step"]
        values = {_tag(key): float(value) for key, value in record.items()
                  if key not in ("step", "epoch", "skipped") and isinstance(value, (int, float))
                  and not isinstance(value, bool)}
        if "tensorboard" in self._writers:
            for tag, value in values.items():
                self._writers["tensorboard"].add_scalar(tag, value, step)
        if "wandb" in self._writers:
            self._writers["wandb"].log(values, step=step)

    def close(self) -> None:
        for name, writer in (self._writers or {}).items():
            if name == "tensorboard":
                writer.close()
            else:
                writer.finish()
        self._writers = None


def _tag(key: str) -> str:
    return f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"


def _writer_module(name: str) -> Any:
    package = {"tensorboard": "tensorboard", "wandb": "wandb"}[name]
    try:
        return importlib.import_module("torch.utils.tensorboard" if name == "tensorboard" else "wandb")
    except ImportError:
        raise ValueError(f"report_to={name!r} needs the {package} package, which is not installed "
                         f"(pip install {package})") from None


def _open_writer(name: str, folder: Path) -> Any:
    module = _writer_module(name)
    if name == "tensorboard":
        return module.SummaryWriter(log_dir=str(folder))
    return module.init(dir=str(folder.parent))


def plot_loss(records: list[dict[str, Any]], path: str | os.PathLike) -> Path | None:
    """Draw training (and evaluation) loss against step into a PNG at ``path``.

    matplotlib is optional: without it this warns and returns None.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("matplotlib is not installed, so no loss curve was drawn "
                      "(pip install 'torch_wgpu_lora[plot]')", stacklevel=2)
        return None
    path = Path(path)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    fig = Figure(figsize=(6, 4), dpi=100)  # a Figure of its own: no pyplot, no global backend change
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="training loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="evaluation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (per response token)")
    if train or evals:
        ax.legend()
    ax.grid(alpha=0.3)
    png = io.BytesIO()
    fig.savefig(png, format="png")
    return write_atomic(path, png.getvalue())
