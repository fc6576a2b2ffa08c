"""The metrics log (JSONL, one object a line) and the loss-curve plot drawn from it.

>>> import tempfile, pathlib
>>> log = MetricsLog(pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl")
>>> log.append({"step": 1, "loss": 2.5}); log.append({"step": 1, "eval_loss": 2.7})
>>> log.read()
[{'step': 1, 'loss': 2.5}, {'step': 1, 'eval_loss': 2.7}]

Training lines carry ``step``, ``epoch``, ``loss``, ``lr``, ``grad_norm``, ``tokens``,
``tokens_per_s`` and ``skipped``; evaluation lines ``step`` and ``eval_loss``. Values
that are not finite are written as null (JSON has no NaN).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "plot_loss"]


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsLog:
    """Append-only JSONL file of metrics; ``keep_until(step)`` drops lines after a resumed step."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _finite_or_none(v) for k, v in record.items()}, allow_nan=False)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def keep_until(self, step: int) -> None:
        """Rewrite the log (atomically) without the lines of steps after ``step``."""
        kept = [r for r in self.read() if r["step"] <= step]
        self._replace("".join(json.dumps(r) + "\n" for r in kept))

    def clear(self) -> None:
        self._replace("")

    def _replace(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, self.path)


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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        fig.savefig(f, format="png")
    os.replace(tmp, path)
    return path
