"""Benchmark the WebGPU LoRA op against the torch reference, in one process run.

The command line of ``torch-wgpu-lora bench``, also ``python -m torch_wgpu_lora.benchmarks.cli``: the op
benchmark always runs; each ``MODES`` entry adds one more, when its flag is given. A mode
is a function ``(args, log)`` that measures and writes its files under ``args.out``.

>>> # main(["--out", "benchmarks/out", "--quick", "--breakdown"])  # -> 0
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

from ..runtime import get_device
from . import report

Log = Callable[[str], None]


def build_parser() -> argparse.ArgumentParser:
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
    return parser


def run_lora_op(args: argparse.Namespace, log: Log) -> None:
    from .lora_op import default_cases, quick_cases, run

    run(quick_cases() if args.quick else default_cases(), out=args.out, iters=args.iters, repeats=args.repeats,
        progress=log)


def run_training_step(args: argparse.Namespace, log: Log) -> None:
    from .training_step import training_step

    step = training_step()
    report.write_json(args.out, "training_step.json", step)
    log(f"training step: {step}")


def run_breakdown(args: argparse.Namespace, log: Log) -> None:
    from .lora_op import BREAKDOWN_CASES, breakdown

    lines = []
    for case in BREAKDOWN_CASES:
        lines.append(f"{case.name} N={case.n} r={case.rank} {case.mode}: "
                     + ", ".join(f"{name.split(':')[-1]} {us:.1f}" for name, us in breakdown(case)))
        log(f"breakdown {lines[-1]}")
    report.write_text(args.out, "breakdown.txt", "\n".join(lines) + "\n")


def run_sweep(args: argparse.Namespace, log: Log) -> None:
    from .sweep import SWEEP_CASES, SWEEP_VARIANTS, sweep

    rows = []
    for case in SWEEP_CASES:
        rows += sweep(case, SWEEP_VARIANTS)
        report.write_json(args.out, "sweep.json", rows)  # after each case: a long sweep keeps what it has
        log(f"swept {case}")
    for row in rows:
        print(row)


# Run in this order: the op benchmark always (flag None), then each mode whose flag is set.
MODES: tuple[tuple[str | None, Callable[[argparse.Namespace, Log], None]], ...] = (
    (None, run_lora_op),
    ("training_step", run_training_step),
    ("breakdown", run_breakdown),
    ("sweep", run_sweep),
)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m torch_wgpu_lora.benchmarks.cli [--out DIR] [--quick] [--sweep] ...``; returns 0."""
    args = build_parser().parse_args(argv)
    print(f"adapter: {get_device().name}")
    started = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {line}", flush=True)

    for flag, mode in MODES:
        if flag is None or getattr(args, flag):
            mode(args, log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
