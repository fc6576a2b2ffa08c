"""Per-launch GPU time of the decode-shaped kernels, each launch recorded many times back to back
in one pass (so each carries the barrier a dependent launch pays): the measurements behind the
engine's kernel choices.

* ``copy``: a one-workgroup copy, the floor of a dependent launch;
* ``norm_*``: RMSNorm of one row at each site of a layer (with the LoRA down-projections of the
  Q/V site, with quantisation, plain; the FFN's wider row), with subgroup and barrier-only
  reductions;
* ``gemv_*``: the ternary GEMV of each projection at each lanes-per-row shape (``gemv_lanes``
  picks one), and with decoding's fusions (``_norm``: normalising its own input; ``qkv_rope``:
  rotating into the cache), against ``rope``, the launch the epilogue replaces;
* ``attention_*``: decode attention over a full cache of each length, per key-split count
  (``decode_splits`` picks one);
* ``attention_backward_*``: a training step's attention backward of one layer, per count of
  ranges dkdv cuts a key block's query tiles into (``sum_splits`` picks one), and per tile
  that fits the adapter (``backward_tile`` picks the first), and as GEMMs over P and dS kept
  whole (``from_start``: what a training step runs), with the split counts ``sum_splits``
  picks and with each count for all of them;
* ``attention_prefill_*``: the same length's attention forward (a prefill or training step) per
  tile that fits (``prefill_tile`` picks the first);
* ``gemm_*``: the forward ternary GEMM of each projection over that many tokens, with 64- and
  32-token tiles (``gemm_tile_tokens`` picks one);
* ``batch_<tokens>_*``: a step of 1, 16 or 64 tokens (a batch's decode step; the small shapes: 1
  or 4), for each projection its GEMV at each count of tokens a workgroup serves up to the
  step's (``_group<G>``; ``GEMV_GROUP`` is the default), in groups of up to 8 its weights held
  decoded (``gemv_spread``) and as 2-bit words (``_packed``), normalising its own input where it
  can (``_norm``, its weights as 2-bit words; ``_spread``: decoded), against its GEMM
  (``gemv_max_tokens`` picks the path: ``_chosen``); and the bf16 LM head's GEMV per group and
  GEMM;
* ``input_grad_*``: the input gradient through each projection's ternary weights over that many
  tokens (a training step's ``bitlinear_t``, its largest kernel), per count of ranges its sum is
  split into, the split-sum launch included (``split_k_ranges`` picks one).

``python -m torch_wgpu_lora.benchmarks.launches --out DIR [--checks bounds,full] [--small]``
writes ``launches.json``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from ..engine.kernels.attention import (attention_backward_launches, attention_launches, backward_tile,
                                       backward_tiles, decode_splits, sum_splits, prefill_tile, prefill_tiles)
from ..engine.kernels.bitlinear import (GEMV_GROUP, bitlinear_launch, bitlinear_t_launch, gemm_tile_tokens,
                                       gemv_normalises)
from ..engine.kernels.matmul import gemv_group as float_gemv_group, matmul_launch
from ..engine.kernels.norm import rmsnorm_launch
from ..engine.kernels.projection import gemv_max_tokens, split_k_ranges
from ..engine.kernels.rope import RopeTarget, rope_launch
from ..engine.weights import Projection
from ..engine.workspace import Workspace
from ..runtime import Buffer, Launch, Recorder, get_device, kernel, upload
from ..runtime.settings import DEFAULT_SHADER_CHECKS
from .report import write_json

# (hidden, ffn, heads, kv heads, head dim, rank of the Q/V site, vocabulary, cache lengths)
SHAPES = {"bitnet-2b": (2560, 6912, 20, 5, 128, 16, 128256, (144, 512, 2048)),
          "small": (256, 512, 4, 1, 64, 16, 4096, (32, 96))}
BATCH_TOKENS = {"bitnet-2b": (1, 16, 64), "small": (1, 4)}  # batch_*: the tokens of a step
BATCH_GROUPS = (1, 2, 4, 8, 16)  # batch_*: tokens a GEMV workgroup serves


def per_launch_us(launches: list[Launch], repeats: int = 100) -> float:
    """GPU µs per repetition of ``launches`` recorded ``repeats`` times in one pass (best of 3)."""
    device = launches[0].kernel.device
    warm = Recorder(device)
    for launch in launches:
        warm.launch(launch)
    warm.submit()
    best = float("inf")
    for _ in range(3):
        rec = Recorder(device, timestamps=True)
        for _ in range(repeats):
            for launch in launches:
                rec.launch(launch)
        seconds = rec.submit()
        if seconds is None:
            raise RuntimeError("this adapter has no timestamp queries")
        best = min(best, seconds / repeats * 1e6)
    return best


def measure(shape: str, repeats: int = 100, seed: int = 0) -> dict[str, float]:
    hidden, ffn, heads, kv_heads, head_dim, rank, vocab, lengths = SHAPES[shape]
    device, rng = get_device(), np.random.default_rng(seed)
    workspace = Workspace(device)

    def floats(*dims: int) -> Buffer:
        return upload(rng.standard_normal(dims).astype(np.float32))

    def words(*dims: int) -> Buffer:
        return upload(rng.integers(0, 2 ** 32, dims, dtype=np.uint32))

    out: dict[str, float] = {}

    def timed(launches: list[Launch], times: int = repeats) -> float:
        return round(per_launch_us(launches, times), 2)

    src, dst = floats(256), Buffer((256,), device=device)
    out["copy"] = timed([Launch.build(kernel("copy.wgsl", "copy", device), (1, 1, 1), (src, dst), (64,))])

    for name, k, quant, lora in (("norm_qv_lora", hidden, True, rank), ("norm_quant", hidden, True, 0),
                                 ("norm_plain", hidden, False, 0), ("norm_ffn_quant", ffn, True, 0)):
        x, g, xn = floats(1, k), floats(k), Buffer((1, k), device=device)
        codes, meta = (Buffer((1, k // 4), "u32", device), Buffer((2,), device=device)) if quant else (None, None)
        a, h = (floats(lora, k), Buffer((1, lora), device=device)) if lora else (None, None)
        for reductions, enabled in (("subgroups", True), ("barriers", False)):
            previous = device.configure(subgroups=enabled)
            try:
                out[f"{name}_{reductions}"] = timed([rmsnorm_launch(x, g, xn, tokens=1, k=k, eps=1e-5, codes=codes,
                                                                    scales_and_sums=meta, lora_a=a, h=h, rank=lora, per_row=False)])
            finally:
                device.configure(previous)

    projections = (("qkv", hidden + 2 * kv_heads * head_dim, hidden, "store"), ("o", hidden, hidden, "add"),
                   ("gate_up", 2 * ffn, hidden, "gate_up"), ("down", hidden, ffn, "add"))
    weights = {name: Projection(words(rows, k // 16), upload(rng.random(rows).astype(np.float32) + 0.5), rows, k)
               for name, rows, k, _ in projections}
    for name, rows, k, mode in projections:
        proj = weights[name]
        codes, meta = words(1, k // 4), upload(np.ones(2, np.float32))
        result = Buffer((1, rows // 2 if mode == "gate_up" else rows), device=device)
        for lanes in [n for n in (4, 8, 16, 32) if 64 * 16 * n >= k]:  # a thread loads at most 16 vec4 words a row
            out[f"gemv_{name}_lanes{lanes}"] = timed(bitlinear_launch(codes, meta, proj, result, tokens=1,
                                                                       out_stride=result.shape[1], mode=mode,
                                                                       gemv=True, lanes=lanes))
        # decoding's fusions at the chosen lanes: the GEMV normalising its own input; q/k/v rotating
        x, g = floats(1, k), upload(rng.random(k).astype(np.float32) + 0.5)
        for lanes in (4, 8, 16, 32) if gemv_normalises(k) else ():
            out[f"gemv_{name}_norm_lanes{lanes}"] = timed(bitlinear_launch(
                codes, meta, proj, result, tokens=1, out_stride=result.shape[1], mode=mode, gemv=True, lanes=lanes,
                norm=(x, g, 1e-5)))
        if name == "qkv":
            cache = lengths[0]
            starts = upload(np.array([cache - 1], np.uint32))
            target = RopeTarget(floats(cache, head_dim // 2), floats(cache, head_dim // 2), starts,
                                floats(1, kv_heads, cache, head_dim), floats(1, kv_heads, cache, head_dim), heads,
                                kv_heads, head_dim)
            q = Buffer((1, heads * head_dim), device=device)
            for norm in (None, (x, g, 1e-5)):
                out["gemv_qkv_rope" + ("_norm" if norm else "")] = timed(bitlinear_launch(
                    codes, meta, proj, q, tokens=1, out_stride=q.shape[1], mode="rope", rope=target, norm=norm))
            out["rope"] = timed([rope_launch(result, q, target, tokens=1)])

    for n in lengths:
        q, kc, vc = floats(1, heads * head_dim), floats(1, kv_heads, n, head_dim), floats(1, kv_heads, n, head_dim)
        attn_out = Buffer((1, heads * head_dim), device=device)
        starts = upload(np.array([n - 1], np.uint32))
        valid = upload(np.array([n], np.uint32))
        chosen = decode_splits(kv_heads, 1, n, device)
        for splits in sorted({1, 2, 4, chosen}):
            launches = attention_launches(q, kc, vc, attn_out, starts, valid, batch=1, tokens=1, heads=heads,
                                          kv_heads=kv_heads, head_dim=head_dim, max_len=n, scale=head_dim ** -0.5,
                                          decode=True, splits=splits, workspace=workspace)
            out[f"attention_{n}_splits{splits}" + ("_chosen" if splits == chosen else "")] = timed(launches)
    # the attention backward of a training step at seq 512 (the heads of a layer), per dkdv split count
    seq = 512 if shape == "bitnet-2b" else 64
    rows, cache = floats(seq, heads * head_dim), (1, kv_heads, seq, head_dim)
    starts = upload(np.zeros(1, np.uint32))
    valid = upload(np.array([seq], np.uint32))
    lse = upload(rng.random((seq, heads)).astype(np.float32) + 5.0)
    keys, values = floats(*cache), floats(*cache)
    attn_out, d_out = floats(seq, heads * head_dim), floats(seq, heads * head_dim)

    def backward(**choice: Any) -> list[Launch]:
        return attention_backward_launches(rows, keys, values, attn_out, lse, d_out, Buffer((seq, heads * head_dim)),
                                           Buffer(cache), Buffer(cache), starts, valid, batch=1, tokens=seq,
                                           heads=heads, kv_heads=kv_heads, head_dim=head_dim, max_len=seq,
                                           scale=head_dim ** -0.5, workspace=workspace, **choice)

    tile = backward_tile(head_dim, device)
    chosen = sum_splits(-(-seq // tile.fixed) * kv_heads, device)
    for splits in sorted({1, 2, 4, 8, chosen}):
        out[f"attention_backward_{seq}_splits{splits}" + ("_chosen" if splits == chosen else "")] = timed(
            backward(splits=splits))
    for t in backward_tiles(head_dim, device):
        name = f"attention_backward_{seq}_tile{t.fixed}x{t.looped}x{t.lanes}"
        out[name + ("_chosen" if t == tile else "")] = timed(backward(tile=t))
    out[f"attention_backward_{seq}_scores_kept"] = timed(backward(from_start=True))  # what training runs
    for splits in (1, 2, 4, 8):  # the GEMMs' split sums, every GEMM cut alike
        out[f"attention_backward_{seq}_scores_kept_splits{splits}"] = timed(backward(from_start=True, splits=splits))
    tile = prefill_tile(head_dim, device)
    for t in prefill_tiles(head_dim, device):
        launches = attention_launches(rows, keys, values, Buffer((seq, heads * head_dim)), starts, valid, batch=1,
                                      tokens=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim, max_len=seq,
                                      scale=head_dim ** -0.5, lse=Buffer((seq, heads)), tile=t, workspace=workspace)
        name = f"attention_prefill_{seq}_tile{t.row_quads}x{t.key_tile}x{t.key_lanes}"
        out[name + ("_chosen" if t == tile else "")] = timed(launches)
    chosen_tile = gemm_tile_tokens(device)
    for name, rows, k, mode in projections:
        proj = weights[name]
        codes, meta = words(seq, k // 4), upload(np.concatenate([np.ones(seq, np.float32), np.zeros(seq, np.float32)]))
        result = Buffer((seq, rows // 2 if mode == "gate_up" else rows), device=device)
        for tile_tokens in (64, 32):
            launches = bitlinear_launch(codes, meta, proj, result, tokens=seq, out_stride=result.shape[1], mode=mode,
                                        gemv=False, tile_tokens=tile_tokens)
            out[f"gemm_{name}_{seq}_tile{tile_tokens}" + ("_chosen" if tile_tokens == chosen_tile else "")] = timed(
                launches, max(1, repeats // 5))
        dy, dx = floats(seq, rows), Buffer((seq, k), device=device)
        chosen_splits = split_k_ranges((k // 64) * -(-seq // 64), rows, device)
        for splits in sorted({1, 2, 4, 8, chosen_splits}):
            launches = bitlinear_t_launch(dy, proj, dx, tokens=seq, k=k, splits=splits, workspace=workspace)
            out[f"input_grad_{name}_{seq}_splits{splits}" + ("_chosen" if splits == chosen_splits else "")] = timed(
                launches, max(1, repeats // 10))
    out.update(measure_batches(weights, projections, hidden, vocab, BATCH_TOKENS[shape], rng, timed, repeats))
    return out


def measure_batches(weights: dict[str, Projection], projections: tuple, hidden: int, vocab: int,
                    steps: tuple[int, ...], rng: np.random.Generator, timed: Any, repeats: int) -> dict[str, float]:
    """The ``batch_*`` entries (the module's docstring) of ``measure``'s projections, timed by its ``timed``."""
    device = get_device()
    out: dict[str, float] = {}

    def floats(*dims: int) -> Buffer:
        return upload(rng.standard_normal(dims).astype(np.float32))

    def words(*dims: int) -> Buffer:
        return upload(rng.integers(0, 2 ** 32, dims, dtype=np.uint32))

    for tokens in steps:
        gemv_path = tokens <= gemv_max_tokens(device)
        chosen, grouped = GEMV_GROUP, min(8, tokens)  # grouped: the group where decoded and 2-bit weights are compared
        groups = sorted({chosen, *(g for g in BATCH_GROUPS if g <= tokens)})
        for name, rows, k, mode in projections:
            proj = weights[name]
            codes, meta = words(tokens, k // 4), upload(np.ones(2 * tokens, np.float32))
            result = Buffer((tokens, rows // 2 if mode == "gate_up" else rows), device=device)
            options = dict(tokens=tokens, out_stride=result.shape[1], mode=mode)
            for group in groups:
                mark = "_chosen" if gemv_path and group == chosen else ""
                out[f"batch_{tokens}_{name}_group{group}{mark}"] = timed(
                    bitlinear_launch(codes, meta, proj, result, gemv=True, group=group, **options))
            if tokens > 1:
                out[f"batch_{tokens}_{name}_group{grouped}_packed"] = timed(
                    bitlinear_launch(codes, meta, proj, result, gemv=True, group=grouped, spread=False, **options))
                out[f"batch_{tokens}_{name}_gemm" + ("" if gemv_path else "_chosen")] = timed(
                    bitlinear_launch(codes, meta, proj, result, gemv=False, **options))
            if gemv_normalises(k):  # the GEMV normalising its input, as a decode step runs it
                norm = (floats(tokens, k), upload(rng.random(k).astype(np.float32) + 0.5), 1e-5)
                for group in sorted({chosen, grouped}):
                    out[f"batch_{tokens}_{name}_norm_group{group}"] = timed(
                        bitlinear_launch(codes, meta, proj, result, gemv=True, group=group, norm=norm, **options))
                if tokens > 1:  # decoded weights take more lanes: more workgroups normalising each token
                    out[f"batch_{tokens}_{name}_norm_group{grouped}_spread"] = timed(bitlinear_launch(
                        codes, meta, proj, result, gemv=True, group=grouped, spread=True, norm=norm, **options))
    # the bf16 LM head (as many rows as one binding holds): a weight word read once for a group of
    # tokens, all of a step's (float_gemv_group), or once a token; and the GEMM
    rows = min(vocab, device.max_binding // (2 * hidden))
    bf16_pairs = rng.integers(0, 2 ** 32, (rows, hidden // 2), dtype=np.uint32) & np.uint32(0xBFFFBFFF)  # |w| < 2
    head = Projection(upload(bf16_pairs), None, rows, hidden)
    for tokens in steps:
        x, logits = floats(tokens, hidden), Buffer((tokens, rows), device=device)
        gemv_path = tokens <= gemv_max_tokens(device)
        chosen = float_gemv_group(tokens)
        for group in sorted({1, chosen}):
            mark = "_chosen" if gemv_path and group == chosen else ""
            out[f"batch_{tokens}_head_group{group}{mark}"] = timed(
                [matmul_launch(x, head, logits, tokens=tokens, out_stride=rows, bf16=True, gemv=True, group=group)],
                max(1, repeats // 10))
        if tokens > 1:
            out[f"batch_{tokens}_head_gemm" + ("" if gemv_path else "_chosen")] = timed(
                [matmul_launch(x, head, logits, tokens=tokens, out_stride=rows, bf16=True, gemv=False)],
                max(1, repeats // 10))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_wgpu_lora.benchmarks.launches",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for launches.json")
    parser.add_argument("--checks", default=DEFAULT_SHADER_CHECKS, help="shader-check modes, e.g. bounds,full")
    parser.add_argument("--small", action="store_true", help="small shapes (for a CPU adapter)")
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"adapter": get_device().name, "shape": "small" if args.small else "bitnet-2b"}
    for checks in args.checks.split(","):
        previous = get_device().configure(shader_checks=checks)
        try:
            result[checks] = measure(result["shape"], args.repeats)
        finally:
            get_device().configure(previous)
        print(checks, json.dumps(result[checks]), flush=True)
    write_json(args.out, "launches.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
