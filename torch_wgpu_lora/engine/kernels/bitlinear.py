"""Ternary BitLinear projections (``bitlinear.wgsl``) and their torch reference.

>>> # launch = bitlinear_launch(codes, scales_and_sums, projection, out, tokens=n, out_stride=q_size)
>>> # rec.launch(launch)

``gemv`` serves few tokens (decoding), ``gemm`` many (prefill, training); both give the same
exact integer dots. A ``gemv`` workgroup holds its rows' weights in registers and serves one
token (``GEMV_GROUP``) or a group of tokens from that one read, one after another, each token's
values those of a launch of that token alone (the same integer dots, the same float operations per
token). The epilogue modes (``projection.MODES``): ``"store"``, ``"add"`` (into a
residual stream), ``"gate_up"`` (interleaved gate/up rows → relu(gate)²·up, optionally saving the
raw pair), and for ``gemv`` ``"rope"`` (the fused q/k/v rows rotated into the query buffer and the
KV caches). The input gradient through the weights is ``bitlinear_t`` (straight-through).

The launch shapes' rules (``projection.gemv_max_tokens``, ``gemm_tile_tokens``, ``gemv_lanes``,
``GEMV_GROUP``, ``gemv_spread``, ``gemv_normalises``) and what they rest on (a measurement, or
reasoning where none was made): ``benchmarks/results/h200/kernel_tuning.md``.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from ...runtime import Buffer, Device, Launch, Recorder, get_device, kernel
from ..config import pad
from ..weights import K_ALIGN, Projection, pack_ternary
from ..workspace import Workspace
from . import dummy
from .attention.decode import DecodePartials
from .dropout import SiteDropout, dropout_params
from .gemms import (DECODE_TOKENS, MmaTile, default_tile, fastest, int8_matrix_units,
                    matrix_units_wanted_where_there_are_none, mma_shape, variant)
from .projection import MODES, SplitSums, check_vec4_rows, gemv_max_tokens, input_grad_launches, split_k_ranges
from .rope import RopeTarget

_ROW_LOADS_MAX = 16  # gemv: vec4 registers of a weight row one thread holds (ROW_LOADS_MAX in bitlinear.wgsl)
GEMV_MAX_FEATURES = 16384  # gemv's longest row: its codes staged in workgroup memory (16 KiB)
GEMV_THREADS = 65536  # gemv: threads a launch aims at
# gemv: tokens a workgroup serves from one read of its weights. One: on the H200, 16 prompts
# decoded (128 tokens each) at 2,211 tok/s with a workgroup a token, 2,164 in groups of 4, 2,109 of
# 8 and 1,925 of 16 (benchmarks/results/h200/kernel_tuning.md); on lavapipe one was the fastest too.
# Larger groups (``group=``) give each token the same values.
GEMV_GROUP = 1


def gemv_spread(group: int, normalises: bool = False) -> bool:
    """Whether a ``gemv`` thread holds its weights decoded to signed bytes (four vec4 words of the
    row, each decoded once for the group's tokens) rather than as 2-bit words (up to sixteen,
    decoded again for every token): for groups of more than one token, where decoding a word
    (some sixty integer operations) would otherwise cost more than its sixteen dot products with
    each token's codes; never in a GEMV that normalises its input. A row of decoded weights takes
    four times the lanes at the least, so such a launch has more workgroups, and each of them
    normalises every token of its group again: on the H200, 16 tokens in groups of 8, gate/up
    took 393 µs decoded against 190 as 2-bit words (``benchmarks.launches``)."""
    return group > 1 and not normalises


def bitlinear_launch(codes: Buffer, scales_and_sums: Buffer, proj: Projection, out: Buffer, *, tokens: int,
                     out_stride: int, out_offset: int = 0, mode: str = "store", h: Buffer | None = None, lora_rank: int = 0,
                     lora: Buffer | None = None, lora_b: Buffer | None = None, segments: int = 0,
                     saved: Buffer | None = None, gemv: bool | None = None, lanes: int | None = None,
                     norm: tuple[Buffer, Buffer, float] | None = None, rope: RopeTarget | None = None,
                     attention: DecodePartials | None = None, tile_tokens: int | None = None,
                     group: int | None = None, spread: bool | None = None, mma: bool | None = None,
                     tile: MmaTile | None = None, splits: int | None = None, workspace: Workspace | None = None,
                     device: Device | None = None) -> list[Launch]:
    """The launches computing ``proj`` over ``tokens`` rows of activation codes into ``out``: one,
    or on the matrix units split along K (``splits``), two.

    ``codes``: u32 [tokens, k_words · 4] (``norm.rmsnorm_launch`` writes them), ``scales_and_sums``: f32 [2 · tokens]
    (scales, then code sums). LoRA (``segments`` > 0): ``h`` [tokens, lora_rank] and the
    segment table ``lora`` (``lora_table``) whose B offsets index ``lora_b`` (f32). ``saved``: what the
    epilogue also keeps, f32 [tokens, ≥ rows]: the raw gate/up pairs (``"gate_up"``), or the sums of
    an ``"add"`` (the residual stream after it). ``gemv`` (default: up to ``gemv_max_tokens`` tokens and
    rows of up to ``GEMV_MAX_FEATURES``): the GEMV path; its ``lanes``: threads a weight row, a power
    of two up to 64 (default ``gemv_lanes``, at least what the row's length takes), ``group``: tokens a
    workgroup (default ``GEMV_GROUP``), ``spread``: the weights held decoded (default ``gemv_spread``).
    ``tile_tokens``: tokens a ``gemm`` workgroup holds, 32 or 64 (default ``gemm_tile_tokens``).
    ``mma``: run the GEMM on the GPU's matrix units (``bitlinear_mma.wgsl``: the same integers, the same
    epilogue); default ``matrix_units_win``, False where the device has no int8 subgroup matrices;
    ``tile``: its workgroup's shape (default ``gemms.default_tile`` for the tokens and rows); ``splits``:
    ranges of K its workgroups sum apart, their i32 sums added by a second launch that runs the
    epilogue (default: ``projection.split_k_ranges`` up to ``gemms.DECODE_TOKENS`` tokens, whose tiles
    alone leave a GPU idle; one range above), the sums kept in
    ``workspace``'s scratch (or a buffer of their own).

    Decoding's fusions (``gemv``; mode ``"rope"`` also on the matrix units, whose split epilogue then
    rotates, in at least two ranges): ``norm`` = (x, weight, eps) normalises x's rows (f32 [tokens, ≥ k])
    with RMSNorm and quantises them inside the launch, writing ``codes`` and ``scales_and_sums`` rather than
    reading them (``gemv_normalises(k)`` says whether a row fits); with ``attention`` the rows it
    normalises are attention's output, merged from these decode partials as they are read (norm's
    x is then not read); mode ``"rope"`` rotates the fused q/k/v rows: queries into ``out``, keys
    and values into ``rope``'s caches.
    """
    device = device or get_device()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if (mode == "rope") != (rope is not None):
        raise ValueError("mode 'rope' and a RopeTarget go together")
    if rope is not None and rope.positions is not None:
        raise ValueError("the rope epilogue rotates each token at its cache row (decoding); a packed pass's "
                         "position ids are rope_launch's")
    k_words = proj.weight.shape[1]
    if codes.shape[-1] != 4 * k_words:
        raise ValueError(f"codes have {codes.shape[-1]} words per token; the weights need {4 * k_words}")
    gemv = tokens <= gemv_max_tokens(device) and proj.k <= GEMV_MAX_FEATURES if gemv is None else gemv
    if gemv and proj.k > GEMV_MAX_FEATURES:
        raise ValueError(f"gemv takes rows of up to {GEMV_MAX_FEATURES} features, not {proj.k}")
    on_units = not gemv and (matrix_units_win(device, tokens, proj) if mma is None else mma)
    if norm and not gemv:
        raise ValueError("norm is gemv's fusion (decoding: a few tokens)")
    if rope and not (gemv or on_units):
        raise ValueError("mode 'rope' is the epilogue of gemv's and of the matrix units' split GEMM (decoding)")
    if rope and on_units and splits == 1:
        raise ValueError("mode 'rope' on the matrix units rotates in the split epilogue: at least two ranges of K")
    if norm and not gemv_normalises(proj.k):
        raise ValueError(f"gemv normalises rows of up to {_NORM_FEATURES} features, not {proj.k}")
    if attention and (not norm or attention.heads * attention.head_dim != proj.k or attention.head_dim % 4):
        raise ValueError(f"attention partials of {attention.heads} heads of {attention.head_dim} feed a GEMV that "
                         f"normalises rows of {proj.k} features (norm=...)")
    if attention and rope:
        raise ValueError("attention partials feed o_proj and mode 'rope' is the q/k/v projection's: not one launch")
    if rope and proj.rows != (rope.heads + 2 * rope.kv_heads) * rope.head_dim:
        raise ValueError(f"mode 'rope' takes the fused q/k/v rows: {proj.rows} rows for {rope.heads} + 2 × "
                         f"{rope.kv_heads} heads of {rope.head_dim}")
    pad = dummy(device)
    buffers = {4: proj.scale, 5: out, 6: h or pad, 7: lora or pad, 8: lora_b or pad, 9: saved or dummy(device, "saved")}
    entry = "gemv" if gemv else "gemm"
    constants = dict(MODE=MODES[mode], DIVIDE=proj.divide, SAVE=saved is not None)
    if on_units:
        # mode 'rope' rotates in the split epilogue: at least two ranges
        splits = splits or max(2 if rope else 1, _decode_splits(device, tokens, proj, tile))
        params = (tokens, proj.rows, k_words, out_stride, out_offset, lora_rank, segments,
                  saved.shape[-1] if saved is not None else 0, tokens, 4 * k_words, proj.rows, k_words,
                  *((rope.cache_len, rope.tokens_per_seq) if rope else (0, 1)))
        buffers.update({1: codes, 2: scales_and_sums, 3: proj.weight})
        if rope:
            constants.update(HEADS=rope.heads, KV_HEADS=rope.kv_heads, HEAD_DIM=rope.head_dim)
        gemm, partials = _mma_gemm(buffers, constants, params, tokens, proj, tile, splits, workspace, device)
        if splits == 1:
            return [gemm]
        columns = proj.rows // 2 if mode in ("gate_up", "rope") else proj.rows
        sums = {i: b for i, b in buffers.items() if i not in (1, 3)}  # the entry binds what it reads
        if rope:
            del sums[9]  # its epilogue keeps no gate/up pairs
            sums.update({11: rope.cos, 12: rope.sin, 13: rope.starts, 14: rope.keys, 15: rope.values})
        file = variant("projection", "matrix_units").file
        return [gemm, Launch.build(kernel(file, "split_epilogue_rope" if rope else "split_epilogue", device,
                                          **gemm.kernel.constants),
                                   (-(-columns // 64), tokens, 1), {**sums, 10: partials}, params)]
    x_stride, cache_len, tokens_per_seq = 0, 0, 1
    if gemv:  # the weights bound as vec4 words (binding 10); K is padded to 64, so rows are whole vec4s
        group = GEMV_GROUP if group is None else group
        spread = gemv_spread(group, norm is not None) if spread is None else spread
        if group < 1:
            raise ValueError(f"gemv: a workgroup serves at least one token, not group={group}")
        words = _ROW_LOADS_MAX // 4 if spread else _ROW_LOADS_MAX  # vec4 words of the row a thread holds
        fewest = 2 ** math.ceil(math.log2(-(-k_words // (4 * words))))
        lanes = lanes or max(fewest, gemv_lanes(proj.rows, normalises=norm is not None))
        if lanes not in (1, 2, 4, 8, 16, 32, 64):  # 128 / lanes rows a workgroup: an even count
            raise ValueError(f"gemv: lanes must be a power of two from 1 to 64, not {lanes}")
        if lanes < fewest:
            raise ValueError(f"gemv: rows of {proj.k} features take at least {fewest} lanes"
                             f"{' with spread weights' if spread else ''}, not {lanes}")
        constants.update(ROWS=128 // lanes, LANES=lanes, ROW_VECS=k_words // 4, GROUP=group, SPREAD=spread)
        grid = (-(-proj.rows // (128 // lanes)), -(-tokens // group), 1)
        buffers[10] = proj.weight  # each gemv entry point binds only what it uses (bitlinear.wgsl)
        if not norm:
            buffers.update({1: codes, 2: scales_and_sums})
    else:
        tile_tokens = tile_tokens or gemm_tile_tokens(device)
        if tile_tokens not in (32, 64):
            raise ValueError(f"gemm tiles hold 32 or 64 tokens, not {tile_tokens}")
        constants.update(TILE_TOKENS=tile_tokens)
        grid = (-(-proj.rows // 64), -(-tokens // tile_tokens), 1)
        buffers.update({1: codes, 2: scales_and_sums, 3: proj.weight})
    if norm:
        x, weight, eps = norm
        constants.update(K=proj.k, EPS=eps)
        buffers.update({12: weight, 13: codes, 14: scales_and_sums})
        x_stride = x.shape[-1]
        if attention:
            entry = "gemv_combine"
            constants.update(SPANS=attention.splits, HEADS=attention.heads, HEAD_DIM=attention.head_dim)
            buffers.update({20: attention.o, 21: attention.ml})
        else:
            entry = "gemv_norm"
            buffers[11] = x
    if rope:
        constants.update(HEADS=rope.heads, KV_HEADS=rope.kv_heads, HEAD_DIM=rope.head_dim)
        buffers.update({15: rope.cos, 16: rope.sin, 17: rope.starts, 18: rope.keys, 19: rope.values})
        del buffers[9]  # its epilogue keeps no gate/up pairs
        cache_len, tokens_per_seq = rope.cache_len, rope.tokens_per_seq
        entry += "_rope"
    kern = kernel("bitlinear.wgsl", entry, device, **constants)
    return [Launch.build(kern, grid, buffers, (tokens, proj.rows, k_words, out_stride, out_offset, lora_rank,
                                               segments, saved.shape[-1] if saved is not None else 0, x_stride,
                                               cache_len, tokens_per_seq))]


def _decode_splits(device: Device, tokens: int, proj: Projection, tile: MmaTile | None) -> int:
    """The K ranges of a projection on the matrix units: decoding's few tokens in at most two
    ranges, the sweep's best at 16 to 64 tokens (matrix_units_decode_split.json); more tokens in
    one (at 512, the second launch that adds two ranges took longer than they saved: device run 21
    in results/h100/log.txt)."""
    if tokens > DECODE_TOKENS:
        return 1
    shape = mma_shape(device, tile or default_tile("projection", tokens, proj.rows))
    return split_k_ranges(-(-proj.rows // shape.block_n) * -(-tokens // shape.block_tokens), proj.k, device, most=2)


def _mma_gemm(buffers: dict[int, Buffer], constants: dict, params: tuple, tokens: int, proj: Projection,
              tile: MmaTile | None, splits: int, workspace: Workspace | None, device: Device) -> tuple[Launch, Buffer]:
    """bitlinear_mma.wgsl's gemm over ``splits`` ranges of K (``buffers``: its bindings but the
    sums'), and the buffer of the ranges' i32 sums [splits, tokens, rows] (a placeholder for one
    range, whose gemm runs the epilogue itself)."""
    if splits < 1:
        raise ValueError(f"splits: a GEMM sums K in at least one range, not {splits}")
    shape = mma_shape(device, tile or default_tile("projection", tokens, proj.rows))
    grid = (-(-proj.rows // shape.block_n), -(-tokens // shape.block_tokens), splits)
    shown = ((splits, tokens, proj.rows), "i32")
    partials = (workspace.scratch("split-K partial sums", *shown) if workspace is not None
                else Buffer(*shown, device=device)) if splits > 1 else dummy(device, "partials")
    on_units = variant("projection", "matrix_units")
    kern = kernel(on_units.file, on_units.entry, device, **constants, SPLITS=splits, **shape.tile.constants())
    return Launch.build(kern, grid, {**buffers, 10: partials}, params), partials


def bitlinear_split_launch(codes: Buffer, scales_and_sums: Buffer, proj: Projection, out: Buffer, *, tokens: int,
                           mode: str, workspace: Workspace, mma: bool | None = None, tile: MmaTile | None = None,
                           splits: int | None = None) -> tuple[Launch, SplitSums] | None:
    """``bitlinear_launch``'s GEMM on the matrix units without its epilogue: its K ranges' sums
    are left for the next launch to finish (``norm.rmsnorm_launch``'s ``split``: the epilogue and
    the norm that follows it in one launch, a launch fewer a projection). Mode ``"add"`` (into
    ``out``, the residual stream) or ``"gate_up"`` (products into ``out``), without LoRA (the
    finishing launch adds none). At least two ranges (the sweep's choice, ``bitlinear_launch``'s
    default, where that is more): a single range's GEMM would run the epilogue itself. ``mma``,
    ``tile``: ``bitlinear_launch``'s; None where the projection does not run on the matrix units
    (by default where the general cores win), for the caller to run ``bitlinear_launch``."""
    device = workspace.device
    if mode not in ("add", "gate_up"):
        raise ValueError(f"a split projection's sums are finished by a norm after an add or gate/up epilogue, "
                         f"not mode {mode!r}")
    if splits is not None and splits < 2:
        raise ValueError(f"splits: sums left for the next launch come from at least two ranges, not {splits}")
    if not (matrix_units_win(device, tokens, proj) if mma is None else mma):
        return None
    splits = splits or max(2, _decode_splits(device, tokens, proj, tile))
    k_words = proj.weight.shape[1]
    params = (tokens, proj.rows, k_words, out.shape[-1], 0, 0, 0, 0, tokens, 4 * k_words, proj.rows, k_words, 0, 1)
    pad = dummy(device)
    buffers = {1: codes, 2: scales_and_sums, 3: proj.weight, 4: proj.scale, 5: out, 6: pad, 7: pad, 8: pad,
               9: dummy(device, "saved")}
    constants = dict(MODE=MODES[mode], DIVIDE=proj.divide, SAVE=False)
    gemm, partials = _mma_gemm(buffers, constants, params, tokens, proj, tile, splits, workspace, device)
    return gemm, SplitSums(partials, splits, proj.scale, proj.rows, proj.divide, mode == "gate_up", out)


def matrix_units_win(device: Device, tokens: int, proj: Projection) -> bool:
    """Whether ``proj`` over ``tokens`` rows runs faster on the matrix units than as the ``gemm``
    kernel (``gemms.fastest``: measured once per shape on the device), since which wins turns on the
    shape (a grid of few blocks leaves the GPU idle) and on the device. Both give the same values, so
    the choice changes only the time. False without int8 subgroup matrices."""
    if not int8_matrix_units(device):
        return matrix_units_wanted_where_there_are_none(device)
    k_words = proj.weight.shape[1]
    codes = Buffer((tokens, 4 * k_words), "u32", device)
    scales_and_sums, out = Buffer((2 * tokens,), device=device), Buffer((tokens, proj.rows), device=device)

    def build(mma: bool) -> Callable[[], list[Launch]]:
        return lambda: bitlinear_launch(codes, scales_and_sums, proj, out, tokens=tokens, out_stride=proj.rows,
                                        gemv=False, mma=mma, device=device)

    return fastest(device, "projection", (tokens, proj.rows, proj.k),
                   {"matrix_units": build(True), "general": build(False)}) == "matrix_units"


def gemm_tile_tokens(device: Device) -> int:
    """Tokens a ``gemm`` workgroup holds: 32 on GPUs (twice the workgroups of 64-token tiles hide
    more of each one's waits), 64 on CPU adapters.

    >>> from types import SimpleNamespace
    >>> gemm_tile_tokens(SimpleNamespace(is_cpu=False)), gemm_tile_tokens(SimpleNamespace(is_cpu=True))
    (32, 64)
    """
    return 64 if device.is_cpu else 32


_NORM_FEATURES = 4 * 16 * 128  # gemv's NORM: NORM_WORDS words of 4 features for each of 128 invocations


def gemv_normalises(k: int) -> bool:
    """Whether ``gemv`` normalises a row of ``k`` features itself: its invocations hold the row in
    registers (up to 8192 features) and every workgroup re-reads it. BitNet-2B's FFN rows (6912)
    fit: its down_proj GEMV normalising them took a decoded token's GPU time to 1.664 ms against
    1.671 with their own norm launch, 30 launches fewer (H100, device run 21)."""
    return k <= _NORM_FEATURES


def gemv_lanes(rows: int, normalises: bool = False) -> int:
    """Threads a weight row gets in ``gemv`` (workgroups of 128): enough that the launch has about
    GEMV_THREADS, so a projection of few long rows (down_proj) reads each with many threads and
    one of many short rows (gate/up) with few. A GEMV that normalises its input aims at half as
    many threads: half as many workgroups re-reading the row.

    >>> gemv_lanes(2560), gemv_lanes(13824), gemv_lanes(2560, normalises=True)
    (32, 4, 16)
    """
    threads = GEMV_THREADS // 2 if normalises else GEMV_THREADS
    return min(32, max(4, 2 ** round(math.log2(threads / rows))))


def bitlinear_reference(codes: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, row_scales: torch.Tensor,
                        divide: bool) -> torch.Tensor:
    """y[n][j] from int codes [N, K], per-token scales [N], ternary values [rows, K] and per-row
    scales [rows], in float64: the flavour's rule applied to the exact integer dot.

    >>> bitlinear_reference(torch.tensor([[2, -1]]), torch.tensor([2.0]), torch.tensor([[1, 1]]),
    ...                     torch.tensor([0.5]), divide=True)
    tensor([[1.]], dtype=torch.float64)
    """
    dot = codes.double() @ values.double().T
    if divide:
        return dot / (row_scales.double()[None, :] * scales.double()[:, None])
    return dot / scales.double()[:, None] * row_scales.double()[None, :]


def bitlinear_t_launch(dy: Buffer, proj: Projection, out: Buffer, *, tokens: int, k: int, accumulate: bool = False,
                       dh: Buffer | None = None, lora_a: Buffer | None = None, lora_rank: int = 0,
                       splits: int | None = None, dropout: SiteDropout | None = None, mma: bool | None = None,
                       tile: MmaTile | None = None, workspace: Workspace) -> list[Launch]:
    """The straight-through input gradient of ``proj``: ``out (+)= (dy ∘ c)·T`` for ``tokens`` rows of
    ``dy`` (f32 [tokens, ≥ rows]), plus ``dh·A`` for the adapters (``dh`` [tokens, ≥ lora_rank] already
    scaled, ``lora_a`` their stacked A [lora_rank, K64]; with ``dropout``, each adapter's term masked
    by its dropout). ``splits``: ranges of the rows summed apart (default
    ``projection.split_k_ranges``; their partial sums in ``workspace``'s scratch). ``mma``: on the
    matrix units from int8 digits of ``dy ∘ c`` (``bitlinear_t_mma.wgsl``; default
    ``input_grad_on_matrix_units``), else on the general cores (``bitlinear_t.wgsl``); ``tile``: the
    matrix units' workgroup (default ``gemms.default_tile`` with the device's ``input_grad_digits``)."""
    device = workspace.device
    check_vec4_rows(out, lora_a)
    k_words = proj.weight.shape[1]
    unused = dummy(device)
    lora_params = (lora_rank, dh.shape[-1] if dh is not None else 0, lora_a.shape[-1] if lora_a is not None else 0,
                   int(accumulate))
    if mma is None:
        mma = input_grad_on_matrix_units(device, tokens, proj, k, workspace)
    if not mma:
        return input_grad_launches("bitlinear_t.wgsl", dict(DIVIDE=proj.divide), {1: dy, 2: proj.weight, 3: proj.scale},
                                   {4: out, 5: dh or unused, 6: lora_a or unused}, 7,
                                   (tokens, proj.rows, k_words, dy.shape[-1], out.shape[-1], k, *lora_params),
                                   tokens, k, 16 * k_words, proj.rows, splits, dropout, workspace)
    shape = mma_shape(device, tile or default_tile("input_grad", tokens, digits=device.settings.input_grad_digits))
    if shape.tile.digits < 2:
        raise ValueError(f"the input gradient on the matrix units takes its float32 rows in digits (sub_m ≥ 2), "
                         f"not {shape.tile}")
    a_words = -(-proj.rows // 16) * 4  # a digit row: the rows j as int8, padded to whole vec4s
    planes = workspace.scratch("input-gradient digits", (shape.tile.digits * tokens * a_words,), "u32")
    exponents = workspace.scratch("input-gradient digit scales", (tokens,), "i32")
    constants = dict(DIVIDE=proj.divide, **shape.tile.constants())
    if dropout is not None:
        constants["DROPOUT"] = True
    weights_t = transposed_weights(proj, workspace)
    params = (tokens, proj.rows, dy.shape[-1], out.shape[-1], k, *lora_params, *dropout_params(dropout),
              tokens, a_words, *weights_t.shape)
    tiles = (-(-k // shape.block_n), -(-tokens // shape.block_tokens))
    splits = splits or split_k_ranges(tiles[0] * tiles[1], proj.rows, device)
    sums = {4: out, 5: dh or unused, 6: lora_a or unused,
            8: dropout.state if dropout is not None else dummy(device)}
    file = variant("input_grad", "matrix_units").file  # its entry gemm_tiled, after digits; split_sum last
    launches = [Launch.build(kernel(file, "digits", device, **constants), (tokens, 1, 1),
                             {9: dy, 10: proj.scale, 11: planes, 12: exponents}, params)]
    part = dummy(device, "part")
    if splits > 1:
        part = workspace.scratch("split-K partial sums", (splits * tokens * -(-k // 4) * 4,))
        constants["SPLITS"] = splits
    launches.append(Launch.build(kernel(file, "gemm_tiled", device, **constants), (*tiles, splits),
                                 {1: planes, 2: weights_t, 3: exponents, 7: part, **sums}, params))
    if splits > 1:
        launches.append(Launch.build(kernel(file, "split_sum", device, **constants),
                                     (-(-k // 1024), tokens, 1), {7: part, **sums}, params))
    return launches


def transposed_weights(proj: Projection, workspace: Workspace) -> Buffer:
    """``proj``'s packed ternary weights transposed (``ternary_transpose.wgsl``): u32
    [K padded to 64, rows padded to 64 / 16], row k holding column k of the weights, in their
    layout; what the input gradient on the matrix units multiplies by. Made on the GPU at first use
    and kept in ``workspace`` (a plan's reaches the engine's, so a model transposes each projection
    once, for its training plans only: at BitNet-2B, 0.52 GB beside its 1.19 GB of weights)."""
    k_words, t_words = proj.weight.shape[1], -(-proj.rows // 64) * 4
    device = workspace.device

    def fill(out: Buffer) -> None:
        rec = Recorder(device)
        rec.launch(Launch.build(kernel("ternary_transpose.wgsl", "transpose_packed", device),
                                (-(-16 * k_words // 64), t_words, 1), {1: proj.weight, 2: out},
                                (proj.rows, k_words, t_words)))
        rec.submit()

    return workspace.derived("ternary weights transposed (input gradients)", proj.weight, (16 * k_words, t_words),
                             "u32", fill)


def transposed_weights_reference(values: torch.Tensor) -> np.ndarray:
    """What ``transposed_weights`` holds for the ternary ``values`` [rows, K]: torch's transpose,
    its K rows padded to 64 with zeros, packed (``weights.pack_ternary``)."""
    rows, k = values.shape
    out = torch.zeros(pad(k, K_ALIGN), rows, dtype=torch.int8)
    out[:k] = values.T
    return pack_ternary(out)


def input_grad_on_matrix_units(device: Device, tokens: int, proj: Projection, k: int, workspace: Workspace) -> bool:
    """Whether ``proj``'s input gradient over ``tokens`` rows runs faster on the matrix units than on
    the general cores (``gemms.fastest``: measured once per shape); False without int8 subgroup matrices.
    Both are within float32 accuracy of the exact sum (``bitlinear_t_mma.wgsl`` bounds the error)."""
    if not int8_matrix_units(device):
        return matrix_units_wanted_where_there_are_none(device)
    dy = Buffer((tokens, proj.rows), device=device)
    out = Buffer((tokens, -(-k // 4) * 4), device=device)

    def build(mma: bool) -> Callable[[], list[Launch]]:
        return lambda: bitlinear_t_launch(dy, proj, out, tokens=tokens, k=k, mma=mma, workspace=workspace)

    shape = (tokens, k, proj.rows, device.settings.input_grad_digits)  # the digits: the matrix units' work
    return fastest(device, "input_grad", shape,
                   {"matrix_units": build(True), "general": build(False)}) == "matrix_units"


def bitlinear_t_reference(dy: torch.Tensor, values: torch.Tensor, row_scales: torch.Tensor,
                          divide: bool) -> torch.Tensor:
    """dx = (dy ∘ c)·T in float64: c divides by the row scales (BitLinear, online AutoBitLinear)
    or multiplies (offline AutoBitLinear), the straight-through rule of each flavour."""
    c = 1 / row_scales.double() if divide else row_scales.double()
    return (dy.double() * c[None, :]) @ values.double()
