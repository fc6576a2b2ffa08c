"""Data-parallel training throughput: one process per GPU against one process, BitNet-2B-4T shapes.

Every process builds the same packed model (random weights, same seed) with r=8 adapters on
q_proj and v_proj, runs its own engine on the ``LOCAL_RANK``-th adapter and takes whole
optimizer steps on its own random sequences (batch 1, every token labelled), exactly as the
``Trainer`` does under ``torchrun``: the step's labelled-token count is all-reduced first, then
``BitNetEngine.train_step`` exchanges the gradients in buckets of ``--bucket-mb`` while the
backward runs (``engine.step``). Rank 0 writes the median step time and the global tok/s (world
size × sequence length / step time), and how the exchange overlapped the step (medians over the
steps, from ``OptimizerStep.exchange_events``):

* ``gradient_all_reduce_s``: the buckets' all-reduces added up (the exchange's own time);
* ``exchange_exposed_s``: from the last bucket's readback to its sum written back, the time the
  exchange adds after the backward (the last bucket's all-reduce and the write-back);
* ``exchange_share``, ``exposed_share``: those two over the step time.

``--fake-exchange`` runs one process on the exchange's path with an all-reduce that leaves the
gradients as they are: against a run without it, the cost of splitting the step into a submit per
bucket, and the exchange's timeline on one GPU. ``--bucket-mb`` larger than the gradients makes
one bucket (the step is then two submits: the whole backward, then clip and AdamW).

>>> # python -m torch_wgpu_lora.benchmarks.distributed --out $OUT/dist1.json
>>> # python -m torch_wgpu_lora.benchmarks.distributed --fake-exchange --out $OUT/dist1_split.json
>>> # torchrun --nproc-per-node 2 -m torch_wgpu_lora.benchmarks.distributed --out $OUT/dist2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..engine import BitNetEngine
from ..engine.step import DEFAULT_BUCKET_BYTES, gradient_buckets
from ..files import write_atomic
from ..integrations.bitnet import lora_parameters
from ..ops.optimizer import WgpuAdamW
from ..runtime import device_info
from ..training.distributed import DataParallel, init_from_env
from .engine import bitnet_2b_config, packed_model, small_config, with_adapters


def exchange_times(events: list[tuple[str, int, float]]) -> tuple[float, float]:
    """(the buckets' all-reduces added up, the time from the last bucket's readback to the sums
    written back) of one step's ``OptimizerStep.exchange_events``, in seconds."""
    at = {(what, k): t for what, k, t in events}
    buckets = 1 + max(k for what, k, _ in events if what == "read")
    reduced = sum(at[("reduced", k)] - at[("reduce", k)] for k in range(buckets))
    return reduced, at[("written", -1)] - at[("read", buckets - 1)]


def measure(layers: int, seq: int, steps: int, small: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            fake_exchange: bool = False) -> dict[str, Any]:
    """Median training step of this process (in a group when torchrun started several)."""
    init_from_env()
    dp = DataParallel.current()
    if dp is not None and fake_exchange:
        raise ValueError("--fake-exchange measures one process; it runs without torchrun")
    rank, world = (dp.rank, dp.world_size) if dp else (0, 1)
    config = small_config(layers) if small else bitnet_2b_config(layers)
    model = with_adapters(packed_model(config), 8, seed=0)
    engine = BitNetEngine(model)
    optimizer = WgpuAdamW(lora_parameters(model), lr=1e-4)
    g = torch.Generator().manual_seed(100 + rank)
    exchange = dp is not None or fake_exchange

    def all_reduce(flat: torch.Tensor) -> None:
        if dp is not None:
            dp.all_reduce_(flat)

    def step() -> dict[str, Any]:
        ids = torch.randint(0, engine.engine_config.vocab, (1, seq), generator=g)
        micro = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}]
        if not exchange:
            return engine.train_step(micro, optimizer, 1.0)
        counts = dp.all_reduce_(torch.tensor([seq - 1], dtype=torch.int64)) if dp else torch.tensor([seq - 1])
        return engine.train_step(micro, optimizer, 1.0, all_reduce=all_reduce, labelled_total=int(counts[0]),
                                 bucket_bytes=bucket_bytes)

    step()  # warm-up: plans, pipelines
    walls, losses, reduced, exposed = [], [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step()["loss"])
        walls.append(time.perf_counter() - t0)
        if exchange:
            times = exchange_times(engine.optimizer_step.exchange_events)
            reduced.append(times[0])
            exposed.append(times[1])
    wall = statistics.median(walls)
    info = device_info()
    result = {"rank": rank, "world_size": world, "adapter": info["adapter"], "adapter_index": info["adapter_index"],
              "seq": seq, "layers": layers, "steps": steps, "step_s": wall, "step_walls_s": walls,
              "tok_per_s": world * seq / wall, "loss": losses[-1], "fake_exchange": fake_exchange}
    if exchange:
        buckets = gradient_buckets(engine.adapters, bucket_bytes)
        result.update({"bucket_bytes": bucket_bytes, "buckets": len(buckets),
                       "gradient_bytes": 4 * engine.adapters.size,
                       "gradient_all_reduce_s": statistics.median(reduced),
                       "exchange_exposed_s": statistics.median(exposed),
                       "exchange_share": statistics.median(reduced) / wall,
                       "exposed_share": statistics.median(exposed) / wall})
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file rank 0 writes")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="the small model of benchmarks.engine (CPU adapters)")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20,
                        help="MiB of gradients per bucket of the exchange (default: %(default)s)")
    parser.add_argument("--fake-exchange", action="store_true", help="one process on the exchange's path, with an "
                        "all-reduce that changes nothing: what splitting the step costs")
    args = parser.parse_args(argv)
    if not args.bucket_mb > 0:
        parser.error(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    result = measure(args.layers, args.seq, args.steps, args.small, max(1, round(args.bucket_mb * 2**20)),
                     args.fake_exchange)
    print(json.dumps(result), flush=True)
    if result["rank"] == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, json.dumps(result, indent=2).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
