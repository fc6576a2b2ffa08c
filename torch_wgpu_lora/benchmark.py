"""Benchmark the WebGPU LoRA op against the torch reference, in one process run.

>>> # from torch_wgpu_lora.benchmark import Case, measure
>>> # measure(Case(n=2048, in_features=2560, out_features=2560, rank=16, backward=True))

For each case it reports, for our op:

* ``gpu_us``: GPU time of one iteration on the device-resident path (inputs already in
  GPU buffers), from timestamp queries around its compute pass; median of repeats.
* ``wall_us``: steady-state wall time per iteration over back-to-back iterations on the
  device-resident path (Python encoding + submit; one wait at the end).
* ``staged_us``: wall time of ``lora()`` on CPU tensors: upload, kernels, readback.
* ``dispatches`` per iteration, ``bytes``: the traffic the math cannot avoid (fwd: read
  x, write y; fwd+bwd adds read dY, read x, write dx; plus A and B), ``tbps`` = bytes /
  gpu time, and ``roofline`` = tbps / the adapter's measured buffer-copy bandwidth.

and for torch (CUDA when present, else CPU): ``torch_gpu_us`` (CUDA events) and
``torch_wall_us`` (same loop shape as ours), then the ratios ours/torch.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .ops import lora as lora_ops
from .ops import lora_gpu
from .runtime import Buffer, Recorder, get_device, kernel, synchronize, upload
from .runtime.tensors import resident

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


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float | None:
    """Bytes/s of a GPU buffer-to-buffer copy (read + write counted), from timestamps."""
    device = get_device()
    if not device.has_timestamps:
        return None
    nbytes = min(nbytes, device.max_binding)
    src, dst = Buffer((nbytes // 4,)), Buffer((nbytes // 4,))
    k = kernel("copy.wgsl", "copy", device)
    times = []
    for _ in range(repeats + 1):
        rec = Recorder(timestamps=True)
        rec.dispatch(k, (min(device.max_workgroups, -(-nbytes // (16 * 256 * 4))), 1, 1), (src, dst), (nbytes // 16,))
        times.append(rec.submit())
    return 2 * nbytes / statistics.median(times[1:])


class _Inputs:
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


def _record(rec: Recorder, inp: _Inputs, case: Case, scaling: float) -> None:
    y, h = lora_gpu.forward(rec, inp.xb, inp.w, scaling)
    if case.backward:
        lora_gpu.backward(rec, inp.dyb, inp.xb, h, inp.w, scaling, dA=inp.dA, dBt=inp.dBt, dx=inp.dx)


def _median_wall(fn: Callable[[], None], iters: int, finish: Callable[[], None]) -> float:
    fn()
    finish()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    finish()
    return (time.perf_counter() - start) / iters


def measure(case: Case, iters: int = 50, repeats: int = 20, torch_device: str | None = None,
            bandwidth: float | None = None, scaling: float = 2.0) -> Result:
    """Time one case on our op and on torch (same process, same inputs)."""
    inp = _Inputs(case)
    result = Result(case)
    # GPU time: one timed recording per repeat, after warm-up (compiles, pools, caches).
    gpu_times, dispatches = [], 0
    for i in range(repeats + 2):
        rec = Recorder(timestamps=True)
        _record(rec, inp, case, scaling)
        dispatches = rec.dispatches
        seconds = rec.submit()
        if seconds is not None and i >= 2:
            gpu_times.append(seconds)
    result.dispatches = dispatches
    if gpu_times:
        result.gpu_us = statistics.median(gpu_times) * 1e6
        result.tbps = case.min_bytes() / (result.gpu_us * 1e-6) / 1e12
        if bandwidth:
            result.roofline = result.tbps * 1e12 / bandwidth

    def resident_iteration() -> None:
        rec = Recorder()
        _record(rec, inp, case, scaling)
        rec.submit()

    result.wall_us = _median_wall(resident_iteration, iters, synchronize) * 1e6

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

    result.staged_us = _median_wall(staged_iteration, max(3, iters // 5), lambda: None) * 1e6
    result.extra["max_rel_err"] = _check(inp, case, scaling)
    _measure_torch(result, inp, iters, torch_device, scaling)
    return result


def _check(inp: _Inputs, case: Case, scaling: float) -> float:
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


def _measure_torch(result: Result, inp: _Inputs, iters: int, torch_device: str | None, scaling: float) -> None:
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
    result.torch_wall_us = _median_wall(iteration, iters, sync) * 1e6
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


def to_markdown(results: list[Result]) -> str:
    head = ("| proj | N | r | mode | GPU µs | wall µs | staged µs | disp | TB/s | roofline | torch | "
            "torch GPU µs | torch wall µs | GPU ratio | wall ratio |")
    lines = [head, "|" + "---|" * 15]

    def f(v: float | None, spec: str) -> str:
        return "–" if v is None else format(v, spec)

    for r in results:
        row = r.row()
        c = r.case
        lines.append(
            f"| {c.name or f'{c.in_features}->{c.out_features}'} | {c.n} | {c.rank} | {c.mode} | {f(r.gpu_us, '.1f')} | "
            f"{r.wall_us:.1f} | {r.staged_us:.1f} | {r.dispatches} | {f(r.tbps, '.2f')} | {f(r.roofline, '.2f')} | "
            f"{r.torch_device} | {f(r.torch_gpu_us, '.1f')} | {r.torch_wall_us:.1f} | {f(row['gpu_ratio'], '.2f')} | "
            f"{f(row['wall_ratio'], '.2f')} |")
    return "\n".join(lines)


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
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cases: list[Case] | None = None, out: str | Path | None = None, iters: int = 50, repeats: int = 20,
        progress: Callable[[str], None] = print) -> list[Result]:
    """Measure ``cases`` (default: ``default_cases()``); with ``out``, write JSON, markdown and PNG there."""
    device = get_device()
    bandwidth = copy_bandwidth()
    results = []
    for case in cases or default_cases():
        results.append(measure(case, iters=iters, repeats=repeats, bandwidth=bandwidth))
        progress(to_markdown(results[-1:]).splitlines()[-1])
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"adapter": device.describe()["adapter"], "backend": device.info.get("backend_type"),
                "copy_bandwidth_tbps": bandwidth / 1e12 if bandwidth else None, "torch": torch.__version__,
                "tuning": asdict(lora_gpu.tuning(device))}
        (out / "lora_op.json").write_text(json.dumps({"meta": meta, "results": [r.row() for r in results]}, indent=1))
        (out / "lora_op.md").write_text(
            f"Adapter: {meta['adapter']} ({meta['backend']}); copy bandwidth "
            f"{meta['copy_bandwidth_tbps'] and round(meta['copy_bandwidth_tbps'], 3)} TB/s\n\n" + to_markdown(results) + "\n")
        try:
            plot(results, out / "lora_op.png")
        except ImportError:
            progress("matplotlib not installed: no chart")
    return results


def training_step(steps: int = 10, batch_size: int = 8, rank: int = 8) -> dict[str, Any]:
    """Wall time of one training step of the demo model: LoRA on WebGPU vs LoRA in torch.

    ``wgpu``: adapters through the WGSL kernels and ``WgpuAdamW``. ``torch``: the same
    model with ``backend="torch"`` adapters and ``torch.optim.AdamW``. The frozen base model
    runs in torch on the CPU in both (it is not part of this library's kernels). A step is
    forward, loss, backward, optimiser step, zeroing the gradients; median over ``steps``
    after two warm-up steps.
    """
    from .demo import build_demo_checkpoint, demo_records
    from .integrations.bitnet import load_model_and_tokenizer
    from .integrations.bitnet import apply_lora, lora_parameters, set_backend
    from .training.data import collate, encode_records
    from .training.optim import WgpuAdamW
    from .training.trainer import accumulate_gradients

    with torch.compiler.set_stance("force_eager"):  # as the CLI and the demo run (see cli.py)
        model, tokenizer = load_model_and_tokenizer(build_demo_checkpoint())
        apply_lora(model, r=rank)
        examples = encode_records(tokenizer, demo_records())[:batch_size]
        batch = collate(examples, tokenizer.pad_token_id)
        out: dict[str, Any] = {"tokens": int(batch["attention_mask"].sum()), "batch": list(batch["input_ids"].shape),
                               "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size,
                               "rank": rank}
        for backend in ("wgpu", "torch"):
            set_backend(model, backend)
            params = lora_parameters(model)
            optimizer = WgpuAdamW(params) if backend == "wgpu" else torch.optim.AdamW(params, lr=2e-4, eps=1e-7)
            times = []
            for i in range(steps + 2):
                start = time.perf_counter()
                accumulate_gradients(model, [batch])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if i >= 2:
                    times.append(time.perf_counter() - start)
            out[f"{backend}_ms"] = statistics.median(times) * 1e3
    out["ratio"] = out["wgpu_ms"] / out["torch_ms"]
    return out


def breakdown(case: Case, repeats: int = 10, scaling: float = 2.0) -> list[tuple[str, float]]:
    """Median GPU µs of each kernel launch of one iteration (each timed in its own pass)."""
    inp = _Inputs(case)
    runs = []
    for i in range(repeats + 2):
        rec = Recorder(timestamps=True, per_dispatch=True)
        _record(rec, inp, case, scaling)
        rec.submit()
        if i >= 2:
            runs.append(rec.kernel_times)
    return [(runs[0][k][0], statistics.median(r[k][1] for r in runs) * 1e6) for k in range(len(runs[0]))]


def sweep(case: Case, variants: dict[str, list[Any]], repeats: int = 20) -> list[dict[str, Any]]:
    """GPU time of ``case`` under launch-shape variants, one knob at a time around the default.

    The knob ``shader_checks`` switches the runtime checks of newly compiled kernels.
    """
    from .runtime.kernels import set_shader_checks

    base = lora_gpu.tuning(get_device())
    rows = []
    inp = _Inputs(case)
    for knob, values in variants.items():
        for value in values:
            if knob == "shader_checks":
                set_shader_checks(value)
            else:
                lora_gpu.set_tuning(lora_gpu.Tuning(**{**asdict(base), knob: value}))
            try:
                times = []
                for i in range(repeats + 2):
                    rec = Recorder(timestamps=True)
                    _record(rec, inp, case, 2.0)
                    seconds = rec.submit()
                    if i >= 2 and seconds is not None:
                        times.append(seconds)
                rows.append({"case": case.name, "n": case.n, "rank": case.rank, "mode": case.mode, "knob": knob,
                             "value": value, "gpu_us": statistics.median(times) * 1e6 if times else None})
            finally:
                lora_gpu.set_tuning(None)
                set_shader_checks(None)
    return rows


SWEEP_VARIANTS = {
    "down_workgroups": [256, 512, 1024],
    "outer_workgroups": [256, 512, 1024],
    "down_quads": [1, 2, 4],
    "outer_quads": [1, 2, 4],
    "outer_cols": [32, 64, 128],
}


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m benchmarks.lora_op [--out DIR] [--quick] [--sweep]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="torch-wgpu-lora bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/out", help="folder for lora_op.json/.md/.png")
    parser.add_argument("--iters", type=int, default=50, help="back-to-back iterations for wall times")
    parser.add_argument("--repeats", type=int, default=20, help="timed recordings per case for GPU times")
    parser.add_argument("--quick", action="store_true", help="only q_proj r=16: forward for each N, forward+backward at N=2048")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch shapes on the key cases")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each kernel launch of the key cases on its own (GPU µs per kernel)")
    parser.add_argument("--training-step", action="store_true",
                        help="also time a whole training step of the demo model, LoRA on WebGPU vs in torch")
    args = parser.parse_args(argv)
    cases = default_cases()
    if args.quick:
        cases = [c for c in cases if c.rank == 16 and c.name == "q_proj" and (c.n == 2048 or not c.backward)]
    print(f"adapter: {get_device().name}")
    started = time.perf_counter()
    run(cases, out=args.out, iters=args.iters, repeats=args.repeats,
        progress=lambda line: print(f"[{time.perf_counter() - started:6.1f}s] {line}", flush=True))
    if args.training_step:
        step = training_step()
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "training_step.json").write_text(json.dumps(step, indent=1))
        print(f"[{time.perf_counter() - started:6.1f}s] training step: {step}", flush=True)
    if args.breakdown:
        lines = []
        for case in (Case(2048, 2560, 2560, 16, True, "q_proj"), Case(1, 2560, 2560, 16, True, "q_proj")):
            lines.append(f"{case.name} N={case.n} r={case.rank} {case.mode}: "
                         + ", ".join(f"{name.split(':')[-1]} {us:.1f}" for name, us in breakdown(case)))
            print(f"[{time.perf_counter() - started:6.1f}s] breakdown {lines[-1]}", flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "breakdown.txt").write_text("\n".join(lines) + "\n")
    if args.sweep:
        key = [Case(2048, 2560, 2560, 16, True, "q_proj"), Case(2048, 2560, 2560, 16, False, "q_proj"),
               Case(1, 2560, 2560, 16, False, "q_proj")]
        Path(args.out).mkdir(parents=True, exist_ok=True)
        rows = []
        for case in key:
            rows += sweep(case, SWEEP_VARIANTS)
            (Path(args.out) / "sweep.json").write_text(json.dumps(rows, indent=1))
            print(f"[{time.perf_counter() - started:6.1f}s] swept {case}", flush=True)
        for row in rows:
            print(row)
    return 0
