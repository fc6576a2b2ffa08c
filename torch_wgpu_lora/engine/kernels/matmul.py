"""Float projections (``matmul.wgsl``): the dense flavour's projections and the LM head, with
the epilogues of ``bitlinear`` (store, add, gate/up, LoRA segments); their input gradient
(``matmul_t.wgsl``); the LM head's two GEMMs on f16 matrix units for bfloat16 weights
(``matmul_mma.wgsl``: float32 rows split in place into f16 pairs, then the GEMM); and the torch
reference of each.

Up to ``projection.gemv_max_tokens`` tokens a projection runs as a GEMV whose workgroups read
each weight word once for a group of tokens (``gemv_group``: all of a decode step's, so that the
LM head, hundreds of MB, is read from memory once a step), each token's sums in the order of a
launch of that token alone; past that, as a GEMM.

>>> # rec.launch(matmul_launch(x, projection, out, tokens=n, out_stride=vocab))
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ...runtime import Buffer, Device, Kernel, Launch, Recorder, get_device, kernel, write
from ..weights import Projection
from ..workspace import Workspace
from . import dummy
from .dropout import SiteDropout, dropout_params
from .gemms import MmaShape, MmaTile, default_tile, f16_matrix_units, fastest, mma_shape, variant
from .projection import MODES, check_vec4_rows, gemv_max_tokens, input_grad_launches, split_k_ranges

GEMV_GROUP_MAX = 64  # gemv: the most tokens a workgroup serves (GROUP_MAX in matmul.wgsl: a sum a token a thread)


def gemv_group(tokens: int) -> int:
    """Tokens a float ``gemv`` workgroup serves: all of the launch's, up to ``GEMV_GROUP_MAX``. Each
    thread keeps a sum a token in registers, and the group's size is a pipeline constant (the
    sums' loop unrolled): one pipeline per token count, a decode plan's one.

    >>> gemv_group(1), gemv_group(16), gemv_group(67)
    (1, 16, 64)
    """
    return min(tokens, GEMV_GROUP_MAX)


def matmul_launch(x: Buffer, proj: Projection, out: Buffer, *, tokens: int, out_stride: int, out_offset: int = 0,
                  mode: str = "store", bf16: bool = False, h: Buffer | None = None, lora_rank: int = 0,
                  lora: Buffer | None = None, lora_b: Buffer | None = None, segments: int = 0,
                  saved: Buffer | None = None, gemv: bool | None = None, group: int | None = None,
                  device: Device | None = None) -> Launch:
    """One launch computing ``out (+)= x·Wᵀ`` for ``tokens`` rows of ``x`` (f32 [tokens, K64]); ``saved``
    as ``bitlinear_launch``'s (the raw gate/up pairs, or the sums of an ``"add"``). ``gemv``: the GEMV
    path (default: up to ``gemv_max_tokens`` tokens), ``group``: its tokens a workgroup, 1 to
    ``GEMV_GROUP_MAX`` (default ``gemv_group``)."""
    device = device or get_device()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    x_words = x.shape[-1] // 4
    w_words = proj.weight.shape[1] // 4
    if w_words * (8 if bf16 else 4) != 4 * x_words:
        raise ValueError(f"x rows hold {4 * x_words} floats; the weight rows {w_words * (8 if bf16 else 4)}")
    gemv = tokens <= gemv_max_tokens(device) if gemv is None else gemv
    constants = dict(MODE=MODES[mode], BF16=bf16, SAVE=saved is not None)
    if gemv:
        group = gemv_group(tokens) if group is None else group
        if not 1 <= group <= GEMV_GROUP_MAX:
            raise ValueError(f"gemv: a workgroup serves 1 to {GEMV_GROUP_MAX} tokens, not group={group}")
        constants.update(GROUP=group)
        grid = (-(-proj.rows // 8), -(-tokens // group), 1)
    else:
        grid = (-(-proj.rows // 64), -(-tokens // 64), 1)
    kern = kernel("matmul.wgsl", "gemv" if gemv else "gemm_tiled", device, **constants)
    pad = dummy(device)
    return Launch.build(kern, grid, (x, proj.weight, out, h or pad, lora or pad, lora_b or pad,
                                     saved or dummy(device, "saved")),
                        (tokens, 4 * x_words, proj.rows, w_words, x_words, x.shape[-1], out_stride, out_offset,
                         lora_rank, segments, saved.shape[-1] if saved is not None else 0))


def matmul_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, K] · weight [rows, K]ᵀ in float64."""
    return x.double() @ weight.double().T


def float32_gemm_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per output of a [N, K] · b [K, M], a float32 GEMM's error bound on the same data: |a|·|b|
    times γ for K + 2 roundings of at most 2u each (round to nearest or toward zero), plus the f16
    split's 2⁻²¹ a term and the lo plane's own sums (2⁻¹¹ of the hi plane's): what the LM head on
    the matrix units (``matmul_mma.wgsl``) keeps to, and a float32 kernel a fortiori."""
    n = a.shape[1] + 2
    u = 2.0 ** -24  # float32's unit roundoff
    gamma = 2 * n * u / (1 - 2 * n * u)
    return a.double().abs() @ b.double().abs() * (gamma * (1 + 2.0 ** -11) + 2.0 ** -21)


def matmul_t_launch(dy: Buffer, proj: Projection, out: Buffer, *, tokens: int, k: int, bf16: bool = False,
                    accumulate: bool = False, dy_col: int = 0, dh: Buffer | None = None, lora_a: Buffer | None = None,
                    lora_rank: int = 0, splits: int | None = None, dropout: SiteDropout | None = None,
                    workspace: Workspace) -> list[Launch]:
    """The input gradient of a float projection (``matmul_t.wgsl``): ``out (+)= dy·W`` (+ ``dh·A``,
    with ``dropout`` each adapter's term masked by its dropout), reading ``dy``'s columns from
    ``dy_col`` (a vocabulary chunk of the logits' gradient). ``splits``: ranges of the rows summed
    apart (default ``projection.split_k_ranges``; their partial sums in ``workspace``'s scratch)."""
    device = workspace.device
    check_vec4_rows(out, lora_a)
    w_words = proj.weight.shape[1]
    unused = dummy(device)
    return input_grad_launches("matmul_t.wgsl", dict(BF16=bf16),
                               {1: dy, 2: proj.weight}, {3: out, 4: dh or unused, 5: lora_a or unused}, 6,
                               (tokens, proj.rows, w_words, dy.shape[-1], dy_col, out.shape[-1], k, lora_rank,
                                dh.shape[-1] if dh is not None else 0, lora_a.shape[-1] if lora_a is not None else 0,
                                int(accumulate)),
                               tokens, k, w_words * (2 if bf16 else 1), proj.rows, splits, dropout, workspace)


def matmul_t_reference(dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dx = dy [N, rows] · weight [rows, K] in float64: the input gradient of ``matmul_reference``."""
    return dy.double() @ weight.double()


# Terms of the sum the f16 matrix units accumulate before each lane adds their sums into its own in
# round-to-nearest float32 (matmul_mma.wgsl's DRAIN counts staged steps: this over the tile's kstep;
# NVIDIA's units truncate as they accumulate). On the H100, at three shapes (device run 31,
# results/h100/lm_head_matrix_units.json, steps of 32 terms): never draining, 1.45-8.5× torch's float32
# error on the same data; every 128 terms, 0.36-0.68× it and below the general cores' float32 kernel's
# (every 256: up to 1.24× torch's); a 4,096-token head 1.15× as fast as on the general cores (every
# 256: 1.30×; never: 1.62×).
HEAD_DRAIN_TERMS = 128


def _head_shape(kind: str, device: Device, tile: MmaTile | None) -> MmaShape:
    shape = mma_shape(device, tile or default_tile(kind), "f16")
    if HEAD_DRAIN_TERMS % shape.tile.kstep:
        raise ValueError(f"the LM head's tile {shape.tile}: kstep must divide the {HEAD_DRAIN_TERMS} terms "
                         "summed between drains (HEAD_DRAIN_TERMS)")
    return shape


def _drain_steps(shape: MmaShape) -> int:
    """matmul_mma.wgsl's DRAIN: staged steps between drains, HEAD_DRAIN_TERMS terms."""
    return HEAD_DRAIN_TERMS // shape.tile.kstep


def f16_pairs_launch(a: Buffer, exponents: Buffer, *, rows: int, width: int, tile: MmaTile | None = None,
                     device: Device | None = None) -> Launch:
    """Rewrites the first ``width`` floats of each of ``rows`` rows of ``a`` (f32, as u32 bits or
    floats) in place as f16 pairs (hi, lo), and each row's power of two into ``exponents`` (i32
    [rows]): what the LM head's GEMMs on the matrix units read (``matmul_mma.wgsl``, ``split``).
    A workgroup a row, the rows along the grid's y (an indirect grid covers the labelled rows)."""
    device = device or get_device()
    shape = _head_shape("lm_head", device, tile)
    if width > a.shape[-1]:
        raise ValueError(f"f16 pairs: a row of {a.shape[-1]} floats has no {width} to split")
    kern = kernel("matmul_mma.wgsl", "split", device, **shape.tile.constants())
    return Launch.build(kern, (1, rows, 1), {11: a, 12: exponents}, _head_params(kern, a_stride=a.shape[-1], width=width))


def _head_params(kern: Kernel, **fields: int) -> dict[str, int]:
    """A ``matmul_mma.wgsl`` launch's Params: ``fields`` by name, every other field 0."""
    unknown = set(fields) - set(kern.params)
    if unknown:
        raise ValueError(f"{kern.name}: no params {sorted(unknown)}; fields are {list(kern.params)}")
    return {name: fields.get(name, 0) for name in kern.params}


def head_weights_largest(proj: Projection, workspace: Workspace) -> Buffer:
    """The largest magnitude of ``proj``'s bfloat16 weights (u32 [1], float32 bits): the power of two
    the matrix units scale them by (``matmul_mma.wgsl``, ``largest``). Found on the GPU at first use
    and kept in ``workspace``; ValueError where the weights hold an infinity or NaN."""
    device = workspace.device

    def fill(out: Buffer) -> None:
        write(out, np.zeros(1, np.uint32))
        words = proj.weight.numel
        kern = kernel("matmul_mma.wgsl", "largest", device)
        rec = Recorder(device)
        rec.launch(Launch.build(kern, (min(1024, -(-words // 256)), 1, 1), {13: proj.weight, 14: out},
                                _head_params(kern, width=words)))
        got = np.empty(1, np.uint32)
        rec.read(out, got)
        rec.submit()
        if got[0] >= 0x7F800000:
            raise ValueError(f"the LM head's weights ({proj.rows} × {proj.k}) hold an infinity or NaN")

    return workspace.derived("LM-head weights' largest magnitude (matrix units)", proj.weight, (1,), "u32", fill)


def matmul_mma_launch(pairs: Buffer, exponents: Buffer, proj: Projection, out: Buffer, *, tokens: int,
                      out_stride: int, out_offset: int = 0, tile: MmaTile | None = None,
                      workspace: Workspace) -> Launch:
    """``out[:, out_offset:] = x·Wᵀ`` on f16 matrix units for the bfloat16 weights of ``proj`` (rows of
    its vocabulary chunk), from ``tokens`` rows of ``x`` split into ``pairs`` and ``exponents`` by
    ``f16_pairs_launch``: float32 accuracy (``matmul_mma.wgsl`` bounds the error)."""
    device = workspace.device
    shape = _head_shape("lm_head", device, tile)
    if pairs.shape[-1] < proj.k:
        raise ValueError(f"the LM head on the matrix units: rows of {pairs.shape[-1]} pairs, weights of K = {proj.k}")
    grid = (-(-proj.rows // shape.block_n), -(-tokens // shape.block_tokens), 1)
    kern = kernel(variant("lm_head", "matrix_units").file, "gemm_tiled", device, DRAIN=_drain_steps(shape),
                  **shape.tile.constants())
    return Launch.build(kern, grid,
                        {1: pairs, 2: proj.weight, 3: exponents, 4: dummy(device, "out"), 5: dummy(device),
                         6: dummy(device), 7: dummy(device, "part"), 8: dummy(device), 9: out,
                         10: head_weights_largest(proj, workspace)},
                        _head_params(kern, tokens=tokens, rows=proj.k, columns=proj.rows,
                                     w_words=proj.weight.shape[1], a_stride=pairs.shape[-1], out_stride=out_stride,
                                     out_offset=out_offset))


def matmul_t_mma_launches(pairs: Buffer, exponents: Buffer, proj: Projection, out: Buffer, *, tokens: int, k: int,
                          a_col: int = 0, accumulate: bool = False, splits: int | None = None,
                          tile: MmaTile | None = None, workspace: Workspace) -> list[Launch]:
    """The input gradient of the LM head on f16 matrix units: ``out (+)= dy·W`` for the bfloat16
    weights of ``proj`` (a vocabulary chunk), ``dy``'s columns from ``a_col`` split into ``pairs`` and
    ``exponents`` by ``f16_pairs_launch``. ``splits``: ranges of the chunk's rows summed apart
    (default ``projection.split_k_ranges``; their partial sums in ``workspace``'s scratch)."""
    device = workspace.device
    check_vec4_rows(out, None)
    shape = _head_shape("lm_head_grad", device, tile)
    constants = dict(W_ALONG_SUM=True, DRAIN=_drain_steps(shape), **shape.tile.constants())
    tiles = (-(-k // shape.block_n), -(-tokens // shape.block_tokens))
    splits = splits or split_k_ranges(tiles[0] * tiles[1], proj.rows, device)
    sums = {4: out, 5: dummy(device), 6: dummy(device), 8: dummy(device)}
    file = variant("lm_head_grad", "matrix_units").file
    part = dummy(device, "part")
    if splits > 1:
        part = workspace.scratch("split-K partial sums", (splits * tokens * -(-k // 4) * 4,))
        constants["SPLITS"] = splits
    gemm = kernel(file, "gemm_tiled", device, **constants)
    params = _head_params(gemm, tokens=tokens, rows=proj.rows, columns=k, w_words=proj.weight.shape[1],
                          a_stride=pairs.shape[-1], a_col=a_col, out_stride=out.shape[-1], k=k,
                          accumulate=int(accumulate),
                          **dict(zip(("drop_key", "drop_split1", "drop_split2"), dropout_params(None))))
    launches = [Launch.build(gemm, (*tiles, splits),
                             {1: pairs, 2: proj.weight, 3: exponents, 7: part, 9: dummy(device, "outf"),
                              10: head_weights_largest(proj, workspace), **sums}, params)]
    if splits > 1:
        launches.append(Launch.build(kernel(file, "split_sum", device, **constants), (-(-k // 1024), tokens, 1),
                                     {7: part, **sums}, params))
    return launches


def head_forward_launches(x: Buffer, exponents: Buffer, chunks: list[tuple[Projection, int]], logits: Buffer, *,
                          tokens: int, workspace: Workspace) -> list[Launch]:
    """The LM head's forward on the f16 matrix units: ``x`` split in place into f16 pairs (its rows'
    powers of two into ``exponents``), then a GEMM per vocabulary chunk (``chunks``: each chunk's
    weights and its first column in ``logits``), with the tile for ``tokens`` rows."""
    device = workspace.device
    tile = default_tile("lm_head", tokens)
    return [f16_pairs_launch(x, exponents, rows=tokens, width=chunks[0][0].k, tile=tile, device=device),
            *(matmul_mma_launch(x, exponents, proj, logits, tokens=tokens, out_stride=logits.shape[-1],
                                out_offset=begin, tile=tile, workspace=workspace) for proj, begin in chunks)]


def head_on_matrix_units(x: Buffer, logits: Buffer, dx: Buffer | None, exponents: Buffer, proj: Projection, *,
                         tokens: int, bf16: bool, workspace: Workspace) -> bool:
    """Whether the LM head over ``tokens`` rows (``x`` → ``logits``, and with ``dx`` its input gradient
    too, from the logits' gradient; ``proj`` a vocabulary chunk) runs faster on the f16 matrix units,
    splitting its float32 inputs into f16 pairs (``exponents``: a row's power of two), than on the
    general cores (``gemms.fastest``: measured once per shape, on these buffers, whose values it
    overwrites); False for float32 weights (f16 holds bfloat16 weights exactly, not float32 ones) or
    without f16 matrix units. Both are within float32 accuracy of the exact sums
    (``matmul_mma.wgsl`` bounds the error)."""
    device = workspace.device
    if not (bf16 and f16_matrix_units(device)):
        return False
    k, vocab = proj.k, logits.shape[-1]

    def build(mma: bool) -> Callable[[], list[Launch]]:
        def launches() -> list[Launch]:
            if mma:
                out = head_forward_launches(x, exponents, [(proj, 0)], logits, tokens=tokens, workspace=workspace)
                if dx is not None:
                    out += [f16_pairs_launch(logits, exponents, rows=tokens, width=vocab, device=device),
                            *matmul_t_mma_launches(logits, exponents, proj, dx, tokens=tokens, k=k,
                                                   workspace=workspace)]
                return out
            out = [matmul_launch(x, proj, logits, tokens=tokens, out_stride=vocab, bf16=True, gemv=False,
                                 device=device)]
            if dx is not None:
                out += matmul_t_launch(logits, proj, dx, tokens=tokens, k=k, bf16=True, workspace=workspace)
            return out
        return launches

    # the forward alone and the forward with the input gradient are kept apart (the last number)
    return fastest(device, "lm_head", (tokens, proj.rows, k, int(dx is not None)),
                   {"matrix_units": build(True), "general": build(False)}) == "matrix_units"
