"""Data-parallel training throughput: one process per GPU against one process, BitNet-2B-4T shapes.

Every process builds the same packed model (random weights, same seed) with r=8 adapters on
q_proj and v_proj, runs its own engine on the ``LOCAL_RANK``-th adapter and takes whole
optimizer steps on its own random sequences (batch 1, every token labelled), exactly as the
``Trainer`` does under ``torchrun``: the step's labelled-token count is all-reduced first, then
``BitNetEngine.train_step`` all-reduces the gradients between its two submits. Rank 0 writes
the median step time and the global tok/s (world size × sequence length / step time), with
the time spent in the gradient all-reduce (readback, gloo, write-back included).

>>> # python -m torch_wgpu_lora.benchmarks.distributed --out $OUT/dist1.json
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
from ..files import write_atomic
from ..integrations.bitnet import lora_parameters
from ..optim import WgpuAdamW
from ..runtime import device_info
from ..training.distributed import DataParallel, init_from_env
from .engine import bitnet_2b_config, packed_model, small_config, with_adapters


def measure(layers: int, seq: int, steps: int, small: bool = False) -> dict[str, Any]:
    """Median training step of this process (in a group when torchrun started several)."""
    init_from_env()
    dp = DataParallel.current()
    rank, world = (dp.rank, dp.world_size) if dp else (0, 1)
    config = small_config(layers) if small else bitnet_2b_config(layers)
    model = with_adapters(packed_model(config), 8, seed=0)
    engine = BitNetEngine(model)
    optimizer = WgpuAdamW(lora_parameters(model), lr=1e-4)
    g = torch.Generator().manual_seed(100 + rank)
    reduce_walls: list[float] = []

    def all_reduce(flat: torch.Tensor) -> None:
        t0 = time.perf_counter()
        dp.all_reduce_(flat)
        reduce_walls.append(time.perf_counter() - t0)

    def step() -> dict[str, Any]:
        ids = torch.randint(0, engine.engine_config.vocab, (1, seq), generator=g)
        micro = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}]
        if dp is None:
            return engine.train_step(micro, optimizer, 1.0)
        counts = dp.all_reduce_(torch.tensor([seq - 1], dtype=torch.int64))
        return engine.train_step(micro, optimizer, 1.0, all_reduce=all_reduce, labelled_total=int(counts[0]))

    step()  # warm-up: plans, pipelines
    reduce_walls.clear()
    walls, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step()["loss"])
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    info = device_info()
    return {"rank": rank, "world_size": world, "adapter": info["adapter"], "adapter_index": info["adapter_index"],
            "seq": seq, "layers": layers,
            "steps": steps, "step_s": wall, "tok_per_s": world * seq / wall, "loss": losses[-1],
            "gradient_all_reduce_s": statistics.median(reduce_walls) if reduce_walls else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file rank 0 writes")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="the small model of benchmarks.engine (CPU adapters)")
    args = parser.parse_args(argv)
    result = measure(args.layers, args.seq, args.steps, args.small)
    print(json.dumps(result), flush=True)
    if result["rank"] == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, json.dumps(result, indent=2).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
