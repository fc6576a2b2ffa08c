"""The matrix units through WebGPU: their ceiling, and each GEMM kind of the engine's table
(``engine/kernels/gemms.py``) at a training step's shapes, each variant and tile, as a share of
that ceiling measured in the same run, beside torch's own GEMMs of the same shapes (CUDA, when
torch has it). Also the kernels whose speed differs between WebGPU implementations (RMSNorm,
the decode GEMV), timed on the backend this process runs, so that two runs compare Dawn with
wgpu-native.

* ``ceiling``: ``subgroup_matrix_ceiling_<type>.wgsl``, every subgroup multiplying operands it
  holds into 8 accumulators, no memory traffic: the rate no GEMM on this path can pass.
* ``gemms``: projection (forward, exact int8) and input_grad (int8 digit planes: four, and the
  settings' fewer) at BitNet-2B's shapes over ``tokens`` rows, general cores and matrix units, each
  tile of ``TILES``. A rate is the kind's useful work (2·M·N·K) over GPU time; ``share`` compares the
  integer work the matrix units do (the input gradient's is its digits times its useful work) with
  the int8 ceiling.
* ``layouts``: where the int8 GEMM's time goes: its main loop (``int8_gemm_layouts.wgsl``) with the
  weights already unpacked to int8, staged through workgroup memory with A or read by the matrix
  loads straight from storage, through one staging buffer or two, and with both operands straight
  from storage, each tile of ``LAYOUT_TILES``, beside the engine's kernel (which unpacks the
  ternary codes as it stages them, and runs the projection's epilogue) on the same shapes; each
  result checked against the exact product.
* ``backend_kernels``: RMSNorm of a 512-token prefill (quantised, LoRA ranks) and of one token, and
  the q/k/v GEMV of one token.
* ``lm_head``: the LM head's forward at BitNet-2B's shape (bfloat16 weights) over ``tokens`` rows:
  the general cores, the GEMV (up to 64 rows: decoding), and the f16 matrix units (the rows split into
  f16 pairs first, untimed) at each tile of ``HEAD_TILES``. ``share`` compares the units' work (two
  planes: twice the useful work) with the f16 ceiling. Each case's error against float64 on the
  first ``HEAD_CHECKED`` rows of the vocabulary is kept beside torch float32's on the same data, and
  whether every output is within a float32 GEMM's bound (``matmul.float32_gemm_bound``).

``python -m torch_wgpu_lora.benchmarks.matrix_units --out DIR [--tokens 512,4096] [--sections ...]``
writes ``matrix_units.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any, Callable

import numpy as np
import torch

from ..engine.kernels.bitlinear import bitlinear_launch, bitlinear_t_launch
from ..engine.kernels.gemms import (HEAD_TILE, WIDE_TILE, MmaTile, default_tile, f16_matrix_units, gpu_seconds,
                                    int8_matrix_units, mma_shape, variant)
from ..engine.kernels.matmul import f16_pairs_launch, float32_gemm_bound, matmul_launch, matmul_mma_launch
from ..engine.kernels.norm import rmsnorm_launch
from ..engine.weights import Projection, float_rows, pack_ternary
from ..engine.workspace import Workspace
from ..runtime import Buffer, Device, Launch, Recorder, get_device, kernel, upload, write
from ..runtime.buffers import DTYPES
from ..runtime.kernels import subgroup_matrix_config
from .report import write_json

HIDDEN, FFN, KV = 2560, 6912, 640  # BitNet-2B-4T: hidden, FFN, key/value width (5 heads of 128)
DECODE_SPLITS = (1, 2, 4, 8)  # K ranges of decoding's tiles (split-K)
# A layer's ternary projections as (rows, K): fused q/k/v, o, fused gate/up, down.
PROJECTIONS = {"qkv": (HIDDEN + 2 * KV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * FFN, HIDDEN),
               "down": (HIDDEN, FFN)}
TILES = {
    "projection": [MmaTile(), MmaTile(result_pad=0), MmaTile(kstep=64),
                   MmaTile(sub_m=4, sub_n=4, tm=4, tn=2, kstep=64), WIDE_TILE,
                   MmaTile(sub_m=2, sub_n=4, tm=4, tn=4, kstep=64, result_pad=0),
                   # 4 × 4 matrices a subgroup in workgroups of 4 subgroups (room for more workgroups an SM)
                   MmaTile(sub_m=2, sub_n=2, tm=4, tn=4, kstep=64), MmaTile(sub_m=2, sub_n=2, tm=4, tn=4)],
    # decoding's projections: 16 to 64 rows, tiles of few tokens and columns (more workgroups), each
    # also split along K (DECODE_SPLITS)
    "decode": [MmaTile(sub_m=1, sub_n=4, tm=1, tn=1, kstep=256), MmaTile(sub_m=1, sub_n=4, tm=1, tn=1, kstep=512),
               MmaTile(sub_m=1, sub_n=4, tm=1, tn=1), MmaTile(sub_m=1, sub_n=8, tm=1, tn=1),
               MmaTile(sub_m=1, sub_n=2, tm=1, tn=1, kstep=256), MmaTile(sub_m=2, sub_n=4, tm=1, tn=1),
               MmaTile(sub_m=4, sub_n=2, tm=1, tn=2), MmaTile(sub_m=2, sub_n=4, tm=2, tn=1)],
    "input_grad": [default_tile("input_grad"),
                   MmaTile(sub_m=4, digits=4, sub_n=4, tm=4, tn=2, kstep=64, result_pad=0),
                   MmaTile(sub_m=4, digits=4), MmaTile(sub_m=4, digits=4, sub_n=2, tm=4, tn=4, kstep=64),
                   MmaTile(sub_m=4, digits=4, sub_n=2, tm=2, tn=4, kstep=64),
                   MmaTile(sub_m=4, digits=4, sub_n=4, tm=2, tn=2, kstep=64),
                   # fewer digits (the input_grad_digits setting): less work, less accuracy
                   default_tile("input_grad", digits=3), default_tile("input_grad", digits=2)],
}


def ceiling(log: Callable[[str], None]) -> dict[str, Any]:
    """The register-only loop's rate for each matrix type the device offers."""
    device = get_device()
    rows = {}
    for ty, (component, result) in {"i8": ("i8", "i32"), "f16": ("f16", "f32")}.items():
        config = subgroup_matrix_config(device, component, result)
        if config is None or (ty == "f16" and not device.has_f16):
            continue
        iters, subgroups = 4096, 4
        workgroups = 8 * 132 if not device.is_cpu else 8
        out = Buffer((workgroups * subgroups * 8 * config["m"] * config["n"],), "i32" if ty == "i8" else "f32")
        k = kernel(f"subgroup_matrix_ceiling_{ty}.wgsl", "ceiling", device, SUBGROUPS=subgroups)
        launch = Launch.build(k, (workgroups, 1, 1), [out], (iters if not device.is_cpu else 16,))
        seconds = gpu_seconds(device, [launch], repeats=3, inner=1)
        runs = iters if not device.is_cpu else 16
        ops = 2 * config["m"] * config["n"] * config["k"] * 8 * runs * subgroups * workgroups
        rows[ty] = dict(config=config, seconds=seconds, rate=ops / seconds)
        log(f"ceiling {ty} {config['m']}x{config['n']}x{config['k']}: {ops / seconds / 1e12:.1f} T op/s")
    return rows


def _ternary(rows: int, k: int, g: np.random.Generator) -> Projection:
    values = torch.from_numpy(g.integers(-1, 2, (rows, k), dtype=np.int8))
    scales = (g.random(rows, dtype=np.float32) + 0.5)
    return Projection(upload(pack_ternary(values)), upload(scales), rows, k, True)


VOCAB = 128256  # BitNet-2B-4T's vocabulary: the LM head's rows
HEAD_CHECKED = 2048  # rows of the head's output checked against float64 (the first of the vocabulary)


def _head_tile(sub_n: int, tm: int, tn: int, kstep: int) -> MmaTile:
    return MmaTile(digits=2, sub_m=2, sub_n=sub_n, tm=tm, tn=tn, kstep=kstep)


# The LM head's tiles on f16 matrix units (hi and lo planes a subgroup row each): for decoding's rows
# (up to 64), one to four rows of result matrices a subgroup, steps of 32 or 64 terms; for a training
# step's, the engine's HEAD_TILE and its neighbours.
HEAD_TILES = {
    "decode": [default_tile("lm_head", 16), default_tile("lm_head", 32), _head_tile(4, 1, 1, 32),
               _head_tile(4, 1, 1, 64), _head_tile(4, 1, 2, 32), _head_tile(8, 1, 1, 64), _head_tile(2, 1, 2, 64),
               _head_tile(4, 2, 1, 64), _head_tile(4, 2, 1, 32), HEAD_TILE, _head_tile(4, 4, 1, 32),
               _head_tile(2, 4, 2, 32)],
    "training": [HEAD_TILE, _head_tile(2, 4, 4, 32), _head_tile(4, 4, 1, 32), _head_tile(4, 2, 2, 32)],
}


def lm_head(tokens_list: list[int], ceilings: dict[str, Any], log: Callable[[str], None],
            rows_out: list[dict[str, Any]], save: Callable[[], None]) -> None:
    """The lm_head section (module docstring): appends each case's row to ``rows_out``, and calls
    ``save`` after each token count."""
    device = get_device()
    g = torch.Generator().manual_seed(3)
    weights = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.02).bfloat16()
    head = Projection(upload(float_rows(weights, True)), None, VOCAB, HIDDEN)
    checked = min(HEAD_CHECKED, VOCAB)
    first = Projection(head.weight.rows(0, checked), None, checked, HIDDEN)  # the rows whose error is kept
    w_checked = weights[:checked].double()
    del weights
    f16_ceiling = ceilings.get("f16", {}).get("rate")
    workspace = Workspace(device)
    k64 = -(-HIDDEN // 64) * 64
    for tokens in tokens_list:
        x = torch.randn(tokens, HIDDEN, generator=g) * torch.exp(2 * torch.randn(tokens, 1, generator=g))
        padded = np.zeros((tokens, k64), np.float32)
        padded[:, :HIDDEN] = x.numpy()
        rows32, pairs, exponents = upload(padded), Buffer((tokens, k64)), Buffer((tokens,), "i32")
        logits, check = Buffer((tokens, VOCAB)), Buffer((tokens, checked))
        exact = x.double() @ w_checked.T
        bound = float32_gemm_bound(x, w_checked.T)
        torch_error = float(((x @ w_checked.float().T).double() - exact).abs().max())
        useful = 2 * tokens * VOCAB * HIDDEN

        def build(variant_name: str, tile: MmaTile | None, proj: Projection, out: Buffer) -> list[Launch]:
            if tile is not None:
                return [matmul_mma_launch(pairs, exponents, proj, out, tokens=tokens, out_stride=proj.rows, tile=tile,
                                          workspace=workspace)]
            return [matmul_launch(rows32, proj, out, tokens=tokens, out_stride=proj.rows, bf16=True,
                                  gemv=variant_name == "gemv", device=device)]

        cases: list[tuple[str, MmaTile | None]] = [("general", None)] + ([("gemv", None)] if tokens <= 64 else [])
        if f16_matrix_units(device):
            cases += [("matrix_units", tile) for tile in HEAD_TILES["decode" if tokens <= 64 else "training"]]
        for name_v, tile in cases:
            label = "" if tile is None else f"{tile.sub_m}x{tile.sub_n} sg, {tile.tm}x{tile.tn} m, k{tile.kstep}"
            try:
                rec = Recorder(device)
                if tile is not None:  # the rows as f16 pairs, split in place afresh (the tile's shape checked)
                    write(pairs, padded)
                    rec.launch(f16_pairs_launch(pairs, exponents, rows=tokens, width=k64, tile=tile, device=device))
                for launch in build(name_v, tile, first, check):
                    rec.launch(launch)
                rec.submit()
                seconds = gpu_seconds(device, build(name_v, tile, head, logits))
            except (ValueError, RuntimeError) as e:
                log(f"  lm_head {tokens} {name_v} {label}: {str(e)[:160]}")
                continue
            errors = (torch.from_numpy(_read(device, check)).double() - exact).abs()
            error = float(errors.max())
            work = useful * (2 if tile is not None else 1)
            row = dict(kind="lm_head", tokens=tokens, rows=VOCAB, k=HIDDEN, variant=name_v,
                       tile=None if tile is None else tile.__dict__, seconds=seconds, rate=useful / seconds,
                       share=work / seconds / f16_ceiling if (f16_ceiling and tile is not None) else None,
                       error=error, torch_float32_error=torch_error, within_bound=bool((errors <= bound).all()))
            rows_out.append(row)
            log(f"lm_head {tokens:5} {name_v:12} {label:28} {seconds * 1e3:8.3f} ms {useful / seconds / 1e12:7.1f} "
                f"TFLOP/s, error {error:.2e} (torch float32 {torch_error:.2e})"
                + (f"  {row['share'] * 100:5.1f}% of ceiling" if row["share"] else "")
                + ("" if row["within_bound"] else "  PAST A FLOAT32 GEMM'S BOUND"))
        save()


def gemms(tokens_list: list[int], ceilings: dict[str, Any], log: Callable[[str], None],
          rows_out: list[dict[str, Any]], save: Callable[[], None]) -> None:
    """Appends each case's row to ``rows_out``, and calls ``save`` after each shape."""
    device = get_device()
    g = np.random.default_rng(0)
    mma = int8_matrix_units(device)
    int8_ceiling = ceilings.get("i8", {}).get("rate")
    workspace = Workspace(device)
    for name, (rows, k) in PROJECTIONS.items():
        proj = _ternary(rows, k, g)
        for tokens in tokens_list:
            codes = upload(g.integers(-127, 128, (tokens, 4 * proj.weight.shape[1]), dtype=np.int32).astype(np.uint32))
            meta = upload(np.concatenate([g.random(tokens, dtype=np.float32) + 0.1, np.zeros(tokens, np.float32)]))
            out = Buffer((tokens, rows))
            dy = upload(g.standard_normal((tokens, rows), dtype=np.float32))
            dx = Buffer((tokens, -(-k // 64) * 64))
            useful = 2 * tokens * rows * k
            # (kind, variant, its tile (a GEMV: tokens a workgroup), its launches)
            cases: list[tuple[str, str, Any, Callable[[], list[Launch]]]] = [
                ("projection", "general", None, lambda: bitlinear_launch(codes, meta, proj, out, tokens=tokens,
                                                                          out_stride=rows, gemv=False, mma=False)),
            ]
            if tokens > 64:  # a training step's sizes: the input gradient too
                cases.append(("input_grad", "general", None, lambda: bitlinear_t_launch(dy, proj, dx, tokens=tokens, k=k,
                                                                                        mma=False, workspace=workspace)))
            if tokens <= 64:  # decoding's sizes: the GEMV too, a workgroup a token and the whole batch a workgroup
                for group in (1, tokens):
                    cases.append(("projection", "gemv", group,
                                  lambda group=group: bitlinear_launch(codes, meta, proj, out, tokens=tokens,
                                                                        out_stride=rows, gemv=True, group=group)))
            if mma:
                for tile in TILES["decode" if tokens <= 64 else "projection"]:
                    for splits in DECODE_SPLITS if tokens <= 64 else (1,):
                        cases.append(("projection", "matrix_units", (tile, splits),
                                      lambda tile=tile, splits=splits: bitlinear_launch(
                                          codes, meta, proj, out, tokens=tokens, out_stride=rows, gemv=False, mma=True,
                                          tile=tile, splits=splits, workspace=workspace)))
                for tile in TILES["input_grad"] if tokens > 64 else ():
                    cases.append(("input_grad", "matrix_units", (tile, 1),
                                  lambda tile=tile: bitlinear_t_launch(dy, proj, dx, tokens=tokens, k=k, mma=True,
                                                                       tile=tile, workspace=workspace)))
            for kind, name_v, shape, build in cases:
                tile, splits = shape if isinstance(shape, tuple) else (None, None)
                try:
                    if tile is not None:
                        mma_shape(device, tile)
                    seconds = gpu_seconds(device, build())
                except (ValueError, RuntimeError) as e:
                    log(f"  {kind} {name} {tokens} {_case_name(shape)}: {str(e)[:160]}")
                    continue
                work = variant(kind, name_v).work(tokens, rows, k, tile.digits if tile is not None else 1)
                row = dict(kind=kind, projection=name, tokens=tokens, rows=rows, k=k, variant=name_v,
                           tile=None if tile is None else tile.__dict__, splits=splits,
                           group=shape if name_v == "gemv" else None, seconds=seconds, rate=useful / seconds,
                           integer_rate=work / seconds,
                           share=(work / seconds / int8_ceiling) if (int8_ceiling and name_v == "matrix_units") else None)
                rows_out.append(row)
                log(f"{kind:10} {name:8} {tokens:5} {name_v:12} {_case_name(shape):34} "
                    f"{seconds * 1e3:8.3f} ms {useful / seconds / 1e12:7.1f} T/s"
                    + (f"  {row['share'] * 100:5.1f}% of ceiling" if row["share"] else ""))
            save()


def _case_name(shape: tuple[MmaTile, int] | int | None) -> str:
    """A case's launch shape: a matrix-unit tile and its K ranges, or a GEMV's tokens a workgroup."""
    if isinstance(shape, tuple):
        tile, splits = shape
        return (f"{tile.sub_m}x{tile.sub_n} sg, {tile.tm}x{tile.tn} m, k{tile.kstep}, {splits} ranges"
                + f", results +{tile.result_pad}")
    return "" if shape is None else f"gemv group {shape}"


# The layouts section's variants of int8_gemm_layouts.wgsl: its entry and constants.
LAYOUTS = {
    "A staged, W from storage": ("staged", dict(STAGE_W=False)),
    "A staged, W from storage, two buffers": ("staged", dict(STAGE_W=False, DOUBLE=True)),
    "A and W staged": ("staged", dict(STAGE_W=True)),
    "A and W staged, two buffers": ("staged", dict(STAGE_W=True, DOUBLE=True)),
    "both from storage": ("direct", {}),
}
LAYOUT_TILES = [(2, 2, 4, 4), (2, 4, 4, 4), (4, 2, 2, 4), (4, 4, 2, 2)]  # subgroups and matrices: sub_m, sub_n, tm, tn
LAYOUT_KSTEPS = (64, 128)  # the staged layouts' steps along K
LAYOUT_SHAPES = [("gate_up", 4096), ("down", 512)]  # (PROJECTIONS' name, tokens): the best and worst-fed


def layout_launch(device: Device, layout: str, tile: tuple[int, int, int, int], kstep: int, a: Buffer, w: Buffer,
                  c: Buffer, tokens: int, n: int, k: int) -> Launch:
    """``int8_gemm_layouts.wgsl``'s ``layout`` (a key of LAYOUTS) at ``tile`` (sub_m, sub_n, tm, tn):
    c (i32 [tokens, n]) = a (int8 [tokens, k]) · w (int8 [n, k])ᵀ. ValueError where the shape is not
    a multiple of the tile or the tile does not fit the device."""
    entry, constants = LAYOUTS[layout]
    config = subgroup_matrix_config(device, "i8", "i32")
    sub_m, sub_n, tm, tn = tile
    bm, bn, threads = sub_m * tm * config["m"], sub_n * tn * config["n"], sub_m * sub_n * config["max_subgroup_size"]
    if tokens % bm or n % bn or k % kstep or kstep % config["k"]:
        raise ValueError(f"{tokens}×{n}×{k} is not a multiple of the tile ({bm}×{bn}, K step {kstep})")
    if entry == "staged":
        staged = (2 if constants.get("DOUBLE") else 1) * (bm + (bn if constants["STAGE_W"] else 0)) * (kstep + 16)
        loads = max(bm, bn if constants["STAGE_W"] else 0) * kstep // 16
        if staged > int(device.limits["max-compute-workgroup-storage-size"]) or loads > 8 * threads:
            raise ValueError(f"the tile stages {staged} bytes, {-(-loads // threads)} vec4 loads a thread (at most 8)")
        constants = dict(constants, KSTEP=kstep)
    program = kernel("int8_gemm_layouts.wgsl", entry, device, SUB_M=sub_m, SUB_N=sub_n, TM=tm, TN=tn, **constants)
    buffers = {2: a, 4: w, 5: c} if entry == "direct" else {1: a, 3: w, 4: w, 5: c}
    return Launch.build(program, (n // bn, tokens // bm, 1), buffers, (tokens, n, k))


def layouts(shapes: list[tuple[str, int]], ceilings: dict[str, Any], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The layouts section (module docstring) at ``shapes``: (name in PROJECTIONS, tokens)."""
    device = get_device()
    g = np.random.default_rng(2)
    int8_ceiling = ceilings.get("i8", {}).get("rate")
    workspace = Workspace(device)
    rows_out = []
    for name, tokens in shapes:
        n, k = PROJECTIONS[name]
        a8 = g.integers(-127, 128, (tokens, k), dtype=np.int8)
        w8 = g.integers(-1, 2, (n, k), dtype=np.int8)
        a, w, c = upload(a8.view(np.uint32)), upload(w8.view(np.uint32)), Buffer((tokens, n), "i32")
        exact = torch.from_numpy(a8).double() @ torch.from_numpy(w8).double().T  # |sums| < 2^53
        proj = Projection(upload(pack_ternary(torch.from_numpy(w8))), upload(np.ones(n, np.float32)), n, k, True)
        meta = upload(np.concatenate([np.ones(tokens, np.float32), np.zeros(tokens, np.float32)]))
        out = Buffer((tokens, n))
        # (label, its launches, the buffer they write)
        cases: list[tuple[str, Callable[[], list[Launch]], Buffer]] = [
            (f"engine's kernel, {_case_name((tile, 1))}",
             lambda tile=tile: bitlinear_launch(a, meta, proj, out, tokens=tokens, out_stride=n, gemv=False, mma=True,
                                                tile=tile, splits=1, workspace=workspace), out)
            for tile in (default_tile("projection", tokens, n), WIDE_TILE)]
        for layout, (entry, _) in LAYOUTS.items():
            for tile in LAYOUT_TILES:
                for kstep in LAYOUT_KSTEPS if entry == "staged" else LAYOUT_KSTEPS[:1]:
                    label = f"{layout}, {tile[0]}x{tile[1]} sg, {tile[2]}x{tile[3]} m" + (
                        f", k{kstep}" if entry == "staged" else "")
                    cases.append((label, lambda layout=layout, tile=tile, kstep=kstep: [
                        layout_launch(device, layout, tile, kstep, a, w, c, tokens, n, k)], c))
        for label, build, written in cases:
            try:
                launches = build()
                seconds = gpu_seconds(device, launches)
            except (ValueError, RuntimeError) as e:
                log(f"  layouts {name} {tokens} {label}: {str(e)[:160]}")
                continue
            result = torch.from_numpy(_read(device, written))
            right = bool(torch.equal(result.double(), exact))  # the engine's: scales of 1, exact in float32
            rate = 2 * tokens * n * k / seconds
            rows_out.append(dict(projection=name, tokens=tokens, rows=n, k=k, variant=label, seconds=seconds,
                                 rate=rate, share=rate / int8_ceiling if int8_ceiling else None, exact=right))
            log(f"layouts {name:8} {tokens:5} {label:62} {seconds * 1e3:8.3f} ms {rate / 1e12:7.1f} T/s"
                + (f"  {rate / int8_ceiling * 100:5.1f}% of ceiling" if int8_ceiling else "")
                + ("" if right else "  NOT EXACT"))
    return rows_out


def _read(device: Device, buf: Buffer) -> np.ndarray:
    rec = Recorder(device)
    out = np.empty(buf.shape, DTYPES[buf.dtype])
    rec.read(buf, out)
    rec.submit()
    return out


def torch_gemms(tokens_list: list[int], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """torch's bf16 matmul and int8 ``_int_mm`` at the same shapes (CUDA only)."""
    if not torch.cuda.is_available():
        return []
    rows_out = []
    for name, (rows, k) in PROJECTIONS.items():
        for tokens in tokens_list:
            for what, make in (("bf16", lambda: (torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16),
                                                 torch.randn(k, rows, device="cuda", dtype=torch.bfloat16))),
                               ("int8", lambda: (torch.randint(-127, 128, (tokens, k), device="cuda", dtype=torch.int8),
                                                 torch.randint(-1, 2, (k, rows), device="cuda", dtype=torch.int8)))):
                a, b = make()
                op = torch.matmul if what == "bf16" else torch._int_mm
                for _ in range(3):
                    op(a, b)
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    op(a, b)
                end.record()
                torch.cuda.synchronize()
                seconds = start.elapsed_time(end) / 1e3 / 20
                rate = 2 * tokens * rows * k / seconds
                rows_out.append(dict(projection=name, tokens=tokens, rows=rows, k=k, dtype=what, seconds=seconds,
                                     rate=rate))
                log(f"torch {what:5} {name:8} {tokens:5} {seconds * 1e3:8.3f} ms {rate / 1e12:7.1f} T/s")
    return rows_out


def backend_kernels(log: Callable[[str], None]) -> dict[str, float]:
    """GPU µs of the kernels whose code the two WebGPU implementations compile differently."""
    device = get_device()
    g = np.random.default_rng(1)
    rank = 16
    out = {}
    for tokens in (512, 1):
        x = upload(g.standard_normal((tokens, HIDDEN), dtype=np.float32))
        w = upload(np.ones(HIDDEN, np.float32))
        xn = Buffer((tokens, HIDDEN))
        codes, meta = Buffer((tokens, HIDDEN // 4), "u32"), Buffer((2 * tokens,))
        a = upload(g.standard_normal((rank, HIDDEN), dtype=np.float32))
        h = Buffer((tokens, rank))
        launch = rmsnorm_launch(x, w, xn, tokens=tokens, k=HIDDEN, eps=1e-5, codes=codes, scales_and_sums=meta,
                                lora_a=a, h=h,
                                rank=rank, per_row=False)
        out[f"rmsnorm_{tokens}_lora"] = gpu_seconds(device, [launch]) * 1e6
        plain = rmsnorm_launch(x, w, xn, tokens=tokens, k=HIDDEN, eps=1e-5, codes=codes, scales_and_sums=meta,
                               per_row=False)
        out[f"rmsnorm_{tokens}"] = gpu_seconds(device, [plain]) * 1e6
    proj = _ternary(HIDDEN + 2 * KV, HIDDEN, g)
    codes = upload(g.integers(-127, 128, (1, 4 * proj.weight.shape[1]), dtype=np.int32).astype(np.uint32))
    meta = upload(np.array([1.0, 0.0], np.float32))
    y = Buffer((1, proj.rows))
    out["gemv_qkv_1"] = gpu_seconds(device, bitlinear_launch(codes, meta, proj, y, tokens=1, out_stride=proj.rows,
                                                      gemv=True)) * 1e6
    for name, us in out.items():
        log(f"{device.backend.name} {name}: {us:.1f} us")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/out/matrix_units")
    parser.add_argument("--tokens", default="512,4096", help="rows of each GEMM (a step's tokens)")
    parser.add_argument("--sections", default="ceiling,gemms,torch,backend_kernels",
                        help="comma-separated: ceiling, gemms, layouts, lm_head, torch, backend_kernels")
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    tokens = [int(t) for t in args.tokens.split(",")]
    device = get_device()
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    started = time.time()
    result: dict[str, Any] = dict(adapter=device.name, device=device.describe(), host=platform.node())

    def save() -> None:  # after every section and shape: a run stopped by a time limit keeps what it measured
        result["seconds"] = time.time() - started
        write_json(args.out, f"matrix_units_{device.backend.name}.json", result)

    result["ceiling"] = ceiling(log) if sections & {"ceiling", "gemms", "layouts", "lm_head"} else {}
    if "torch" in sections:  # short: before the sweeps
        result["torch"] = torch_gemms(tokens, log)
        save()
    if "gemms" in sections:
        result["gemms"] = []
        gemms(tokens, result["ceiling"], log, result["gemms"], save)
    if "layouts" in sections:
        result["layouts"] = layouts(LAYOUT_SHAPES, result["ceiling"], log)
        save()
    if "lm_head" in sections:
        result["lm_head"] = []
        lm_head(tokens, result["ceiling"], log, result["lm_head"], save)
    if "backend_kernels" in sections:
        result["backend_kernels"] = backend_kernels(log)
    save()


if __name__ == "__main__":
    main()
