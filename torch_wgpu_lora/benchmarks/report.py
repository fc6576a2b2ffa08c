"""The benchmarks' outputs: the op's markdown table, its PNG chart, and the files under ``--out``.

Files: ``lora_op.json`` (meta and a row per case), ``lora_op.md`` (the table),
``lora_op.png`` (the chart, with matplotlib), and with the CLI's extra modes
``training_step.json``, ``breakdown.txt``, ``sweep.json``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..files import write_atomic

if TYPE_CHECKING:
    from .lora_op import Result


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def markdown_row(r: "Result") -> str:
    """One case's line of ``to_markdown``'s table."""
    row = r.row()
    c = r.case
    return (f"| {c.name or f'{c.in_features}->{c.out_features}'} | {c.n} | {c.rank} | {c.mode} | "
            f"{_fmt(r.gpu_us, '.1f')} | {r.wall_us:.1f} | {r.staged_us:.1f} | {r.dispatches} | {_fmt(r.tbps, '.2f')} | "
            f"{_fmt(r.roofline, '.2f')} | {r.torch_device} | {_fmt(r.torch_gpu_us, '.1f')} | {r.torch_wall_us:.1f} | "
            f"{_fmt(row['gpu_ratio'], '.2f')} | {_fmt(row['wall_ratio'], '.2f')} |")


def to_markdown(results: list["Result"]) -> str:
    head = ("| proj | N | r | mode | GPU µs | wall µs | staged µs | disp | TB/s | roofline | torch | "
            "torch GPU µs | torch wall µs | GPU ratio | wall ratio |")
    return "\n".join([head, "|" + "---|" * 15] + [markdown_row(r) for r in results])


def plot(results: list["Result"], path: str | Path) -> None:
    """Bar chart of ours vs torch per case (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.case.name} N={r.case.n} r={r.case.rank} {r.case.mode}" for r in results]
    ours = [r.gpu_us if r.gpu_us is not None else r.wall_us for r in results]
    theirs = [r.torch_gpu_us if r.torch_gpu_us is not None else r.torch_wall_us for r in results]
    pos = np.arange(len(results))
    fig, ax = plt.subplots(figsize=(max(8, len(results) * 0.5), 5))
    ax.bar(pos - 0.2, ours, 0.4, label="WebGPU (GPU time)" if results[0].gpu_us else "WebGPU (wall)")
    ax.bar(pos + 0.2, theirs, 0.4, label=f"torch {results[0].torch_device}")
    ax.set_xticks(pos, labels, rotation=70, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("µs per iteration")
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, png.getvalue())


def write_text(out: str | Path, name: str, text: str) -> Path:
    """Write ``text`` to ``out/name`` atomically (creating ``out``); returns the path."""
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, text.encode())


def write_json(out: str | Path, name: str, data: Any) -> Path:
    return write_text(out, name, json.dumps(data, indent=1))


def write_op_results(out: str | Path, meta: dict[str, Any], results: list["Result"],
                     progress: Callable[[str], None] = print) -> None:
    """``lora_op.json``, ``lora_op.md`` and ``lora_op.png`` (when matplotlib is installed) under ``out``."""
    write_json(out, "lora_op.json", {"meta": meta, "results": [r.row() for r in results]})
    bandwidth = meta["copy_bandwidth_tbps"]
    write_text(out, "lora_op.md", f"Adapter: {meta['adapter']} ({meta['backend']}); copy bandwidth "
                                  f"{bandwidth and round(bandwidth, 3)} TB/s\n\n" + to_markdown(results) + "\n")
    try:
        plot(results, Path(out) / "lora_op.png")
    except ImportError:
        progress("matplotlib not installed: no chart")
