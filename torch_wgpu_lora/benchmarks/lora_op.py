"""The LoRA op benchmark: our WebGPU op against the torch reference, in one process run.

>>> # from torch_wgpu_lora.benchmarks.lora_op import Case, measure
>>> # measure(Case(n=2048, in_features=2560, out_features=2560, rank=16, backward=True))

For each case it reports, for our op:

* ``gpu_us``: GPU time of one iteration on the device-resident path (inputs already in
  GPU buffers), from timestamp queries around its compute pass; median of repeats.
* ``wall_us``: steady-state wall time per iteration over back-to-back iterations on the
  device-resident path (Python encoding + submit; one wait at the end).
* ``staged_us``: wall time of ``lora()`` on CPU tensors: upload, kernels, readback;
  median of individually timed calls.
* ``dispatches`` per iteration, ``bytes``: the traffic the math cannot avoid (fwd: read
  x, write y; fwd+bwd adds read dY, read x, write dx; plus A and B), ``tbps`` = bytes /
  gpu time, and ``roofline`` = tbps / the adapter's measured buffer-copy bandwidth.

and for torch (CUDA when present, else CPU): ``torch_gpu_us`` (the sum of its CUDA
kernels' durations) and ``torch_wall_us`` (same loop shape as ours), then the ratios
ours/torch.

``run`` writes them under ``--out``: ``lora_op.json`` (the run's adapter, backend and copy
bandwidth, and a row per case), ``lora_op.md`` (``to_markdown``'s table) and ``lora_op.png``
(``plot``'s chart, with matplotlib). The command line is ``benchmarks.cli``'s.
"""

from __future__ import annotations

import io
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..files import write_atomic
from ..ops import lora as lora_ops
from ..ops import lora_gpu
from ..runtime import Buffer, Recorder, get_device, synchronize, upload
from ..runtime.tensors import resident
from . import report
from .timing import copy_bandwidth, gpu_times, kernel_times, median_wall, steady_wall

BITNET_2B_SHAPES = {"q_proj": (2560, 2560), "v_proj": (2560, 640)}


@dataclass(frozen=True)
class Case:
    n: int
    in_features: int
    out_features: int
    rank: int
    backward: bool
    name: str = ""

    @property
    def mode(self) -> str:
        return "fwd+bwd" if self.backward else "fwd"

    def min_bytes(self) -> int:
        act_in, act_out = self.n * self.in_features * 4, self.n * self.out_features * 4
        weights = self.rank * (self.in_features + self.out_features) * 4
        if not self.backward:
            return act_in + act_out + weights
        return 2 * act_in + act_in + 2 * act_out + 2 * weights  # x twice, dx; y, dY; A, B and grads


@dataclass
class Result:
    case: Case
    gpu_us: float | None = None
    wall_us: float = 0.0
    staged_us: float = 0.0
    dispatches: int = 0
    tbps: float | None = None
    roofline: float | None = None
    torch_device: str = "cpu"
    torch_gpu_us: float | None = None
    torch_wall_us: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        out = {**asdict(self.case), "mode": self.case.mode, **{k: v for k, v in asdict(self).items() if k != "case"}}
        out["wall_ratio"] = self.wall_us / self.torch_wall_us if self.torch_wall_us else None
        out["gpu_ratio"] = (self.gpu_us / self.torch_gpu_us) if (self.gpu_us and self.torch_gpu_us) else None
        return out


def default_cases() -> list[Case]:
    """BitNet-2B's q_proj and v_proj, r in {8, 16}, N in {1, 128, 2048}, forward and forward+backward."""
    return [Case(n, i, o, r, bwd, name) for name, (i, o) in BITNET_2B_SHAPES.items()
            for r in (8, 16) for n in (1, 128, 2048) for bwd in (False, True)]


def quick_cases() -> list[Case]:
    """``--quick``: only q_proj r=16, forward for each N and forward+backward at N=2048."""
    return [c for c in default_cases() if c.rank == 16 and c.name == "q_proj" and (c.n == 2048 or not c.backward)]


# The key cases, timed launch by launch with ``--breakdown``.
BREAKDOWN_CASES = (Case(2048, 2560, 2560, 16, True, "q_proj"), Case(1, 2560, 2560, 16, True, "q_proj"))


class Inputs:
    """One case's tensors, on the CPU for torch-side staging and as GPU buffers."""

    def __init__(self, case: Case, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(case.n, case.in_features, generator=g)
        self.A = torch.randn(case.rank, case.in_features, generator=g) / case.in_features ** 0.5
        self.B = torch.randn(case.out_features, case.rank, generator=g)
        self.dy = torch.randn(case.n, case.out_features, generator=g)
        self.w = lora_gpu.LoRAWeights(resident(self.A, "rows4"), resident(self.B, "cols4"), case.in_features,
                                      case.out_features)
        self.xb = upload(self.x.numpy())
        self.dyb = upload(self.dy.numpy())
        self.dA = Buffer(self.w.A.shape)
        self.dBt = Buffer(self.w.Bt.shape)
        self.dx = Buffer(self.xb.shape)


def record(rec: Recorder, inp: Inputs, case: Case, scaling: float) -> None:
    """Record one iteration of the op on the device-resident path (forward, and backward for fwd+bwd)."""
    y, h = lora_gpu.forward(rec, inp.xb, inp.w, scaling)
    if case.backward:
        lora_gpu.backward(rec, inp.dyb, inp.xb, h, inp.w, scaling, dA=inp.dA, dBt=inp.dBt, dx=inp.dx)


def measure(case: Case, iters: int = 50, repeats: int = 20, torch_device: str | None = None,
            bandwidth: float | None = None, scaling: float = 2.0) -> Result:
    """Time one case on our op and on torch (same process, same inputs)."""
    inp = Inputs(case)
    result = Result(case)

    def timed(rec: Recorder) -> None:
        record(rec, inp, case, scaling)
        result.dispatches = rec.dispatches

    times = gpu_times(timed, repeats)
    if times:
        result.gpu_us = statistics.median(times) * 1e6
        result.tbps = case.min_bytes() / (result.gpu_us * 1e-6) / 1e12
        if bandwidth:
            result.roofline = result.tbps * 1e12 / bandwidth

    def resident_iteration() -> None:
        rec = Recorder()
        record(rec, inp, case, scaling)
        rec.submit()

    result.wall_us = steady_wall(resident_iteration, iters, synchronize) * 1e6

    x = inp.x.clone().requires_grad_(case.backward)
    A = inp.A.clone().requires_grad_(case.backward)
    B = inp.B.clone().requires_grad_(case.backward)

    def staged_iteration() -> None:
        if case.backward:
            A.grad = B.grad = x.grad = None
            lora_ops.lora(x, A, B, scaling).backward(inp.dy)
        else:
            with torch.no_grad():
                lora_ops.lora(x, A, B, scaling)

    result.staged_us = median_wall(staged_iteration, max(3, iters // 5)) * 1e6
    result.extra["max_rel_err"] = _check(inp, case, scaling)
    _measure_torch(result, inp, iters, torch_device, scaling)
    return result


def _check(inp: Inputs, case: Case, scaling: float) -> float:
    """Largest error of the op's outputs (and gradients) against float64, relative to each one's scale."""
    x, A, B = (t.clone().requires_grad_(case.backward) for t in (inp.x, inp.A, inp.B))
    x64, A64, B64 = (t.double().requires_grad_(case.backward) for t in (inp.x, inp.A, inp.B))
    y, y64 = lora_ops.lora(x, A, B, scaling), lora_ops.lora_reference(x64, A64, B64, scaling)
    pairs = [(y, y64)]
    if case.backward:
        y.backward(inp.dy)
        y64.backward(inp.dy.double())
        pairs += [(x.grad, x64.grad), (A.grad, A64.grad), (B.grad, B64.grad)]
    return max(((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in pairs)


def _measure_torch(result: Result, inp: Inputs, iters: int, torch_device: str | None, scaling: float) -> None:
    case = result.case
    dev = torch.device(torch_device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result.torch_device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    x = inp.x.to(dev).requires_grad_(case.backward)
    A = inp.A.to(dev).requires_grad_(case.backward)
    B = inp.B.to(dev).requires_grad_(case.backward)
    dy = inp.dy.to(dev)

    def iteration() -> None:
        if case.backward:
            A.grad = B.grad = x.grad = None
            lora_ops.lora_reference(x, A, B, scaling).backward(dy)
        else:
            with torch.no_grad():
                lora_ops.lora_reference(x, A, B, scaling)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    result.torch_wall_us = steady_wall(iteration, iters, sync) * 1e6  # the same loop shape as ours
    if dev.type == "cuda":
        # GPU time = the sum of its kernels' durations (CUDA events around an iteration
        # would also count the gaps while the CPU launches kernels).
        from torch.profiler import ProfilerActivity, profile

        reps = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                iteration()
            torch.cuda.synchronize()
        result.torch_gpu_us = sum(e.self_device_time_total for e in prof.key_averages()) / reps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        iteration()
        end.record()
        torch.cuda.synchronize()
        result.extra["torch_event_us"] = start.elapsed_time(end) * 1e3


def run(cases: list[Case] | None = None, out: str | Path | None = None, iters: int = 50, repeats: int = 20,
        progress: Callable[[str], None] = print) -> list[Result]:
    """Measure ``cases`` (default: ``default_cases()``); with ``out``, write JSON, markdown and PNG there."""
    device = get_device()
    bandwidth = copy_bandwidth()
    results = []
    for case in cases or default_cases():
        results.append(measure(case, iters=iters, repeats=repeats, bandwidth=bandwidth))
        progress(markdown_row(results[-1]))
    if out is not None:
        meta = {"adapter": device.describe()["adapter"], "backend": device.info.get("backend_type"),
                "copy_bandwidth_tbps": bandwidth / 1e12 if bandwidth else None, "torch": torch.__version__,
                "tuning": asdict(lora_gpu.tuning(device))}
        write_op_results(out, meta, results, progress)
    return results


def breakdown(case: Case, repeats: int = 10, scaling: float = 2.0) -> list[tuple[str, float]]:
    """Median GPU µs of each kernel launch of one iteration (each timed in its own pass)."""
    inp = Inputs(case)
    runs = kernel_times(lambda rec: record(rec, inp, case, scaling), repeats)
    return [(runs[0][k][0], statistics.median(r[k][1] for r in runs) * 1e6) for k in range(len(runs[0]))]


# -- the op's table and chart ---------------------------------------------------------------------

def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def markdown_row(r: Result) -> str:
    """One case's line of ``to_markdown``'s table."""
    row = r.row()
    c = r.case
    return (f"| {c.name or f'{c.in_features}->{c.out_features}'} | {c.n} | {c.rank} | {c.mode} | "
            f"{_fmt(r.gpu_us, '.1f')} | {r.wall_us:.1f} | {r.staged_us:.1f} | {r.dispatches} | {_fmt(r.tbps, '.2f')} | "
            f"{_fmt(r.roofline, '.2f')} | {r.torch_device} | {_fmt(r.torch_gpu_us, '.1f')} | {r.torch_wall_us:.1f} | "
            f"{_fmt(row['gpu_ratio'], '.2f')} | {_fmt(row['wall_ratio'], '.2f')} |")


def to_markdown(results: list[Result]) -> str:
    head = ("| proj | N | r | mode | GPU µs | wall µs | staged µs | disp | TB/s | roofline | torch | "
            "torch GPU µs | torch wall µs | GPU ratio | wall ratio |")
    return "\n".join([head, "|" + "---|" * 15] + [markdown_row(r) for r in results])


def plot(results: list[Result], path: str | Path) -> None:
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


def write_op_results(out: str | Path, meta: dict[str, Any], results: list[Result],
                     progress: Callable[[str], None] = print) -> None:
    """``lora_op.json``, ``lora_op.md`` and ``lora_op.png`` (when matplotlib is installed) under ``out``."""
    report.write_json(out, "lora_op.json", {"meta": meta, "results": [r.row() for r in results]})
    bandwidth = meta["copy_bandwidth_tbps"]
    report.write_text(out, "lora_op.md", f"Adapter: {meta['adapter']} ({meta['backend']}); copy bandwidth "
                                         f"{bandwidth and round(bandwidth, 3)} TB/s\n\n" + to_markdown(results) + "\n")
    try:
        plot(results, Path(out) / "lora_op.png")
    except ImportError:
        progress("matplotlib not installed: no chart")
