"""Ternary BitLinear projections (``bitlinear.wgsl``) and their torch reference.

>>> # launch = bitlinear_launch(codes, meta, projection, out, tokens=n, out_stride=q_size)
>>> # rec.launch(launch)

``gemv`` serves few tokens (decoding), ``gemm`` many (prefill, training); both give the same
exact integer dots. The epilogue modes: ``"store"``, ``"add"`` (into a residual stream),
``"gate_up"`` (interleaved gate/up rows → relu(gate)²·up, optionally saving the raw pair), and
for ``gemv`` ``"rope"`` (the fused q/k/v rows rotated into the query buffer and the KV caches).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...runtime import Buffer, Device, Launch, get_device, kernel
from ..weights import Projection
from . import dummy
from .attention import DecodePartials
from .dropout import SiteDropout, dropout_params
from .rope import RopeTarget

MODES = {"store": 0, "add": 1, "gate_up": 2, "rope": 3}
_ROW_LOADS_MAX = 16  # gemv: vec4 words of a weight row one thread holds (ROW_LOADS_MAX in bitlinear.wgsl)
GEMV_MAX_FEATURES = 16384  # gemv's longest row: its codes staged in workgroup memory (16 KiB)
GEMV_THREADS = 65536  # gemv: threads a launch aims at (measured on the H200 over LANES 4..32)


def gemv_max_tokens(device: Device) -> int:
    """Up to this many tokens a projection runs as ``gemv`` (a weight pass per token: the first from
    memory, the others mostly from L2) rather than ``gemm``, whose few workgroups at so few tokens
    each walk a whole row of weights in a long dependent loop. On the H200, µs a launch gemv / gemm
    at 16 tokens: q/k/v 19.9 / 37.0, o 21.6 / 38.0, gate/up 40.1 / 46.2, down 36.8 / 93.1; at 24
    gate/up's gemv is the slower (58.0 / 46.4). On a CPU adapter it stays 4 tokens, the GEMV path's
    share of the tests (lavapipe's gemm is faster there already: o_proj 402 against 1,111 µs at 4)."""
    return 4 if device.is_cpu else 16


def bitlinear_launch(codes: Buffer, meta: Buffer, proj: Projection, out: Buffer, *, tokens: int, out_stride: int,
                     out_offset: int = 0, mode: str = "store", h: Buffer | None = None, lora_rank: int = 0,
                     lora: Buffer | None = None, lora_b: Buffer | None = None, segments: int = 0,
                     aux: Buffer | None = None, gemv: bool | None = None, lanes: int | None = None,
                     norm: tuple[Buffer, Buffer, float] | None = None, rope: RopeTarget | None = None,
                     attention: DecodePartials | None = None, tile_tokens: int | None = None,
                     device: Device | None = None) -> Launch:
    """One launch computing ``proj`` over ``tokens`` rows of activation codes into ``out``.

    ``codes``: u32 [tokens, k_words · 4] (``norm.rmsnorm_launch`` writes them), ``meta``: f32 [2 · tokens]
    (scales, then code sums). LoRA (``segments`` > 0): ``h`` [tokens, lora_rank] and the
    segment table ``lora`` (``lora_table``) whose B offsets index ``lora_b`` (f32). ``aux`` [tokens, rows]:
    the raw gate/up pairs. ``lanes``: threads a weight row in ``gemv`` (default ``gemv_lanes``);
    ``tile_tokens``: tokens a ``gemm`` workgroup holds, 32 or 64 (default ``gemm_tile_tokens``).

    Decoding's fusions (``gemv`` only): ``norm`` = (x, weight, eps) normalises x's rows (f32 [tokens, ≥ k])
    with RMSNorm and quantises them inside the launch, writing ``codes`` and ``meta`` rather than
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
    k_words = proj.weight.shape[1]
    if codes.shape[-1] != 4 * k_words:
        raise ValueError(f"codes have {codes.shape[-1]} words per token; the weights need {4 * k_words}")
    gemv = tokens <= gemv_max_tokens(device) and proj.k <= GEMV_MAX_FEATURES if gemv is None else gemv
    if gemv and proj.k > GEMV_MAX_FEATURES:
        raise ValueError(f"gemv takes rows of up to {GEMV_MAX_FEATURES} features, not {proj.k}")
    if (norm or rope) and not gemv:
        raise ValueError("norm and mode 'rope' are gemv's fusions (decoding: a few tokens)")
    if norm and not gemv_normalises(proj.k):
        raise ValueError(f"gemv normalises rows of up to {_NORM_FEATURES} features, not {proj.k}")
    if attention and (not norm or attention.heads * attention.head_dim != proj.k or attention.head_dim % 4):
        raise ValueError(f"attention partials of {attention.heads} heads of {attention.head_dim} feed a GEMV that "
                         f"normalises rows of {proj.k} features (norm=...)")
    if attention and rope:
        raise ValueError("attention partials feed o_proj and mode 'rope' is the q/k/v projection's: not one launch")
    pad = dummy(device)
    buffers = {4: proj.scale, 5: out, 6: h or pad, 7: lora or pad, 8: lora_b or pad, 9: aux or dummy(device, "aux")}
    entry = "gemv" if gemv else "gemm"
    constants = dict(MODE=MODES[mode], DIVIDE=proj.divide, SAVE=aux is not None)
    x_stride, cache_len, tokens_per_seq = 0, 0, 1
    if gemv:  # the weights bound as vec4 words (binding 10); K is padded to 64, so rows are whole vec4s
        fewest = -(-k_words // (4 * _ROW_LOADS_MAX))
        lanes = lanes or max(fewest, gemv_lanes(proj.rows, normalises=norm is not None))
        if lanes < fewest:
            raise ValueError(f"gemv: rows of {proj.k} features take at least {fewest} lanes, not {lanes}")
        constants.update(ROWS=128 // lanes, LANES=lanes, ROW_VECS=k_words // 4)
        grid = (-(-proj.rows // (128 // lanes)), tokens, 1)
        buffers[10] = proj.weight  # each gemv entry point binds only what it uses (bitlinear.wgsl)
        if not norm:
            buffers.update({1: codes, 2: meta})
    else:
        tile_tokens = tile_tokens or gemm_tile_tokens(device)
        if tile_tokens not in (32, 64):
            raise ValueError(f"gemm tiles hold 32 or 64 tokens, not {tile_tokens}")
        constants.update(TILE_TOKENS=tile_tokens)
        grid = (-(-proj.rows // 64), -(-tokens // tile_tokens), 1)
        buffers.update({1: codes, 2: meta, 3: proj.weight})
    if norm:
        x, weight, eps = norm
        constants.update(K=proj.k, EPS=eps)
        buffers.update({12: weight, 13: codes, 14: meta})
        x_stride = x.shape[-1]
        if attention:
            entry = "gemv_combine"
            constants.update(SPLITS=attention.splits, HEADS=attention.heads, HEAD_DIM=attention.head_dim)
            buffers.update({20: attention.o, 21: attention.ml})
        else:
            entry = "gemv_norm"
            buffers[11] = x
    if rope:
        if proj.rows != (rope.heads + 2 * rope.kv_heads) * rope.head_dim:
            raise ValueError(f"mode 'rope' takes the fused q/k/v rows: {proj.rows} rows for {rope.heads} + 2 × "
                             f"{rope.kv_heads} heads of {rope.head_dim}")
        constants.update(HEADS=rope.heads, KV_HEADS=rope.kv_heads, HEAD_DIM=rope.head_dim)
        buffers.update({15: rope.cos, 16: rope.sin, 17: rope.step, 18: rope.keys, 19: rope.values})
        del buffers[9]  # its epilogue keeps no gate/up pairs
        cache_len, tokens_per_seq = rope.cache_len, rope.tokens_per_seq
        entry += "_rope"
    kern = kernel("bitlinear.wgsl", entry, device, **constants)
    return Launch.build(kern, grid, buffers, (tokens, proj.rows, k_words, out_stride, out_offset, lora_rank,
                                              segments, proj.rows, x_stride, cache_len, tokens_per_seq))


def gemm_tile_tokens(device: Device) -> int:
    """Tokens a ``gemm`` workgroup holds: 32 on GPUs, 64 on CPU adapters. On the H200, at
    BitNet-2B's four projections over 512 tokens, 32-token tiles took 157 / 108 / 490 / 275 µs
    (q/k/v, o, gate/up, down) against 165 / 132 / 515 / 341 for 64-token tiles: twice the
    workgroups hide more of each one's waits; 16-token tiles were no better at 512 tokens. On
    lavapipe (2 cores; ``benchmarks.launches --small``, 64 tokens) 64-token tiles were as fast or
    faster (gate/up 2.13 against 2.26 ms).

    >>> from types import SimpleNamespace
    >>> gemm_tile_tokens(SimpleNamespace(is_cpu=False)), gemm_tile_tokens(SimpleNamespace(is_cpu=True))
    (32, 64)
    """
    return 64 if device.is_cpu else 32


_NORM_FEATURES = 4 * 8 * 128  # gemv's NORM: NORM_WORDS words of 4 features for each of 128 invocations


def gemv_normalises(k: int) -> bool:
    """Whether ``gemv`` normalises a row of ``k`` features itself: its invocations hold the row in
    registers, and every workgroup re-reads it, so long rows (BitNet-2B's FFN, 6912) keep their own
    norm launch (on the H200 a fused down_proj took longer than the norm launch and the GEMV apart)."""
    return k <= _NORM_FEATURES


def gemv_lanes(rows: int, normalises: bool = False) -> int:
    """Threads a weight row gets in ``gemv`` (workgroups of 128): enough that the launch has about
    GEMV_THREADS, so a projection of few long rows (down_proj) reads each with many threads and
    one of many short rows (gate/up) with few. On the H200, over BitNet-2B's four projections,
    21.3 µs a layer against 24.5 for the best single shape (8 lanes everywhere). A GEMV that
    normalises its input aims at half as many threads: half as many workgroups re-reading the row.

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


def gate_up_reference(y: torch.Tensor) -> torch.Tensor:
    """Interleaved gate/up columns [N, 2F] → relu(gate)²·up [N, F] (BitNet's relu2 MLP)."""
    gate, up = y[:, 0::2], y[:, 1::2]
    return torch.relu(gate).square() * up


def lora_table(segments: list[tuple[int, int, int, int, float, int, int]]) -> np.ndarray:
    """The LORA headers of ``bitlinear.wgsl``/``matmul.wgsl``: for each segment (row_begin,
    row_end, row_step, h_col, scale, b_offset, rank) 8 u32 words; its B [rows, rank] lies at
    ``b_offset`` (floats) in the LB buffer.

    >>> lora_table([(0, 4, 1, 0, 2.0, 64, 2)]).shape
    (8,)
    """
    header = np.zeros((max(len(segments), 1), 8), np.uint32)
    for i, (begin, end, step, h_col, scale, b_offset, rank) in enumerate(segments):
        header[i] = (begin, end, step, h_col, b_offset, rank, np.float32(scale).view(np.uint32), 0)
    return header.reshape(-1)


INPUT_GRAD_WORKGROUPS = 1024  # input-gradient GEMMs: workgroups a launch aims at (split-K below that)


def input_grad_splits(workgroups: int, rows: int, device: Device) -> int:
    """Ranges an input-gradient GEMM of ``workgroups`` tiles splits its ``rows`` (the sum over j)
    into: doubling while the launch has fewer than INPUT_GRAD_WORKGROUPS workgroups, at most 8,
    each range at least 512 rows; 1 on CPU adapters. (A seq-512 step's GEMMs into 2560 features
    are 320 tiles of 64 × 64: two or three a streaming multiprocessor of an H200.) Measured on the
    H200 against counts 1-6, 8, 12 and 16 (the split sum included; ``benchmarks.launches``'
    ``input_grad_*`` times 1, 2, 4, 8): the chosen count was the fastest or within 4% of it for
    each projection at 256 and 512 tokens (o_proj's 512-token sweep aside: the GPU clocked down
    in it), except down_proj at 256 tokens (290 µs at 4 against 273 at 3)."""
    if device.is_cpu:
        return 1
    splits = 1
    while workgroups * splits < INPUT_GRAD_WORKGROUPS and splits < 8 and rows // (2 * splits) >= 512:
        splits *= 2
    return splits


def input_grad_launches(file: str, constants: dict, inputs: dict[int, Buffer], sums: dict[int, Buffer], part: int,
                        params: tuple, tokens: int, k: int, k64: int, rows: int, splits: int | None,
                        dropout: SiteDropout | None, device: Device) -> list[Launch]:
    """The launches of an input-gradient GEMM: ``file``'s gemm_tiled over 64 × 64 tiles of tokens ×
    features (``inputs``: its bindings of A and the weights; ``sums``: OUT, DH, LA; ``part``: the
    PART binding, DROP the next). One launch, or with ``splits`` > 1 ranges of rows one that stores
    each range's sums into device-owned scratch and a split_sum launch that adds them up into OUT."""
    if dropout is not None:
        constants = dict(constants, DROPOUT=True)
    sums = {**sums, part + 1: dropout.state if dropout is not None else dummy(device)}
    params = (*params, *dropout_params(dropout))
    tiles = (k64 // 64, -(-tokens // 64))
    splits = splits or input_grad_splits(tiles[0] * tiles[1], rows, device)
    if splits == 1:
        return [Launch.build(kernel(file, "gemm_tiled", device, **constants), (*tiles, 1),
                             {**inputs, **sums, part: dummy(device, "part")}, params)]
    size = splits * tokens * -(-k // 4) * 4  # rows of whole vec4s
    scratch = device.owned(f"input_grad_partials_{size}", lambda: Buffer((size,), device=device))
    gemm = kernel(file, "gemm_tiled", device, SPLITS=splits, **constants)
    total = kernel(file, "split_sum", device, SPLITS=splits, **constants)
    return [Launch.build(gemm, (*tiles, splits), {**inputs, **sums, part: scratch}, params),
            Launch.build(total, (-(-k // 1024), tokens, 1), {**sums, part: scratch}, params)]


def check_vec4_rows(out: Buffer, lora_a: Buffer | None) -> None:
    """Raises unless the input gradient's output and the adapters' stacked A have rows of whole
    vec4s, as the input-gradient kernels read and write them."""
    for name, buf in (("out", out), ("lora_a", lora_a)):
        if buf is not None and buf.shape[-1] % 4:
            raise ValueError(f"{name}'s rows must be padded to a multiple of 4 floats, got {buf.shape[-1]}")


def bitlinear_t_launch(dy: Buffer, proj: Projection, out: Buffer, *, tokens: int, k: int, accumulate: bool = False,
                       dh: Buffer | None = None, lora_a: Buffer | None = None, lora_rank: int = 0,
                       splits: int | None = None, dropout: SiteDropout | None = None,
                       device: Device | None = None) -> list[Launch]:
    """The straight-through input gradient of ``proj`` (``bitlinear_t.wgsl``): ``out (+)= (dy ∘ c)·T``
    for ``tokens`` rows of ``dy`` (f32 [tokens, ≥ rows]), plus ``dh·A`` for the adapters (``dh``
    [tokens, ≥ lora_rank] already scaled, ``lora_a`` their stacked A [lora_rank, K64]; with
    ``dropout``, each adapter's term masked by its dropout). ``splits``: ranges of the rows summed
    apart (default ``input_grad_splits``)."""
    device = device or get_device()
    check_vec4_rows(out, lora_a)
    k_words = proj.weight.shape[1]
    unused = dummy(device)
    return input_grad_launches("bitlinear_t.wgsl", dict(DIVIDE=proj.divide), {1: dy, 2: proj.weight, 3: proj.scale},
                               {4: out, 5: dh or unused, 6: lora_a or unused}, 7,
                               (tokens, proj.rows, k_words, dy.shape[-1], out.shape[-1], k, lora_rank,
                                dh.shape[-1] if dh is not None else 0, lora_a.shape[-1] if lora_a is not None else 0,
                                int(accumulate)),
                               tokens, k, 16 * k_words, proj.rows, splits, dropout, device)


def bitlinear_t_reference(dy: torch.Tensor, values: torch.Tensor, row_scales: torch.Tensor,
                          divide: bool) -> torch.Tensor:
    """dx = (dy ∘ c)·T in float64: c divides by the row scales (BitLinear, online AutoBitLinear)
    or multiplies (offline AutoBitLinear), the straight-through rule of each flavour."""
    c = 1 / row_scales.double() if divide else row_scales.double()
    return (dy.double() * c[None, :]) @ values.double()
