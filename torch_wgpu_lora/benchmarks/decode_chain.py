"""Where a decoded token's GPU time goes: each kind of launch's marginal cost in the chain.

A decode step is a chain of a few hundred dependent launches. A per-dispatch profile (stamps
between launches) adds its own cost to each and cannot say what a launch costs *in* the chain,
where it also holds up the next one. So this benchmark records the whole step (the decode plan
and the sampler's launches, as generation records them) ``tokens`` times in one pass and times
it; then the same with one kind of launch left out (``without_us``; ``marginal_us`` is the
difference) and with only that kind (``only_us``); and a chain of as many one-workgroup copies
(``copy_chain_us``: the floor of a dependent launch). A kind is a kernel entry point, GEMVs also
by their shape (rows x features). Steps with launches left out compute on stale inputs: only
their time means anything.

``python -m torch_wgpu_lora.benchmarks.decode_chain --out DIR [--small] [--layers N]`` writes
``decode_chain.json`` (µs per token).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from typing import Any

import numpy as np

from ..engine import BitNetEngine
from ..runtime import Buffer, Launch, Recorder, get_device, kernel, upload, write
from .engine import bitnet_2b_config, packed_model, small_config, with_adapters
from .report import write_json
from .timing import gpu_times


def kind(launch: Launch) -> str:
    """The launch's kernel entry point; a ternary GEMV (each fusion's entry point) also by its rows x features."""
    name = launch.kernel.name
    if name.startswith("bitlinear.wgsl:gemv"):
        c = launch.kernel.constants
        name += f" {launch.grid[0] * c['ROWS']}x{64 * c['ROW_VECS']}"
    return name


def chain_us(launches: list[Launch], tokens: int, repeats: int) -> float:
    """GPU µs per repetition of ``launches`` recorded ``tokens`` times in one pass (median of ``repeats``,
    after two unmeasured passes)."""
    def record(rec: Recorder) -> None:
        for _ in range(tokens):
            for launch in launches:
                rec.launch(launch)

    times = gpu_times(record, repeats)
    if not times:
        raise RuntimeError("this adapter has no timestamp queries")
    return round(statistics.median(times) / tokens * 1e6, 1)


def measure(small: bool, layers: int, tokens: int = 8, repeats: int = 5, cache: int = 144) -> dict[str, Any]:
    """A decode step of a packed BitNet (BitNet-2B's shapes, or the small ones) with r=8 Q/V adapters,
    at position ``cache - 64`` of a ``cache``-position KV cache."""
    config = small_config(layers) if small else bitnet_2b_config(layers)
    engine = BitNetEngine(with_adapters(packed_model(config), 8, seed=0))
    s = engine.decode_session(1, 16, cache - 16)
    s.cache.set_position(cache - 64, [cache - 63])
    write(s.next_token, np.array([5], np.uint32))
    launches = list(s.decode.launches) + list(s.decode_sampling)
    device = engine.device
    src, dst = upload(np.ones(256, np.float32)), Buffer((256,), device=device)
    copy = Launch.build(kernel("copy.wgsl", "copy", device), (1, 1, 1), (src, dst), (64,))
    chain_us(launches, tokens, repeats)  # unmeasured: a GPU that was idle needs longer than two passes to clock up
    result: dict[str, Any] = {"adapter": device.name, "layers": layers, "hidden": config.hidden_size,
                              "dispatches": len(launches), "tokens_per_pass": tokens,
                              "token_us": chain_us(launches, tokens, repeats),
                              "copy_chain_us": chain_us([copy] * len(launches), tokens, repeats), "kinds": {}}
    for name, count in Counter(kind(launch) for launch in launches).most_common():
        without = chain_us([x for x in launches if kind(x) != name], tokens, repeats)
        result["kinds"][name] = {"launches": count, "without_us": without,
                                 "marginal_us": round(result["token_us"] - without, 1),
                                 "only_us": chain_us([x for x in launches if kind(x) == name], tokens, repeats)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_wgpu_lora.benchmarks.decode_chain",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for decode_chain.json")
    parser.add_argument("--small", action="store_true", help="the small shapes (for a CPU adapter)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    get_device()
    result = measure(args.small, args.layers, repeats=args.repeats)
    print(json.dumps(result, indent=1), flush=True)
    write_json(args.out, "decode_chain.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
