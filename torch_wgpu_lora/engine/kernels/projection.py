"""What the two projection families share (``bitlinear``: ternary weights × int8 codes; ``matmul``:
float weights): the epilogue modes, the LoRA segment table their epilogues read, the token count
up to which a projection runs as a GEMV, and the input-gradient GEMMs' launch shape (a split over
the rows' sum where that fills a GPU).

Measurements behind ``split_k_ranges``: ``benchmarks/results/h200/kernel_tuning.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...runtime import Buffer, Device, Launch, kernel
from ..workspace import Workspace
from . import dummy
from .dropout import SiteDropout, dropout_params
from .gemms import int8_matrix_units

# The epilogues of a forward projection: store the rows, add them into a residual stream, the
# interleaved gate/up pairs → relu(gate)²·up, or (a decoding q/k/v GEMV) rotate them into the
# queries and the KV caches.
MODES = {"store": 0, "add": 1, "gate_up": 2, "rope": 3}


@dataclass(frozen=True)
class SplitSums:
    """A ternary projection's K ranges' i32 sums, [splits, tokens, rows] in ``partials``, left by
    its GEMM on the matrix units (``bitlinear.bitlinear_split_launch``) for the next launch to
    finish: its epilogue without LoRA (the weights' row ``scale``, ``divide`` as
    ``Projection.divide``), an add into ``out`` (the residual stream) or, with ``pairs``, the
    gate/up products relu(gate)² · up into ``out`` (the FFN's activation)."""

    partials: Buffer
    splits: int
    scale: Buffer
    rows: int
    divide: bool
    pairs: bool
    out: Buffer

    @property
    def features(self) -> int:
        """Features of each row the epilogue makes."""
        return self.rows // 2 if self.pairs else self.rows


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


def check_vec4_rows(out: Buffer, lora_a: Buffer | None) -> None:
    """Raises unless the input gradient's output and the adapters' stacked A have rows of whole
    vec4s, as the input-gradient kernels read and write them."""
    for name, buf in (("out", out), ("lora_a", lora_a)):
        if buf is not None and buf.shape[-1] % 4:
            raise ValueError(f"{name}'s rows must be padded to a multiple of 4 floats, got {buf.shape[-1]}")


def gemv_max_tokens(device: Device) -> int:
    """Up to this many tokens a projection, ternary (``bitlinear``) or float (``matmul``: the LM
    head), runs as a GEMV, whose workgroups hold their rows' weights (a float GEMV's serving all
    the tokens from one read of them), rather than as a GEMM: 16 on GPUs, 8 on GPUs whose int8
    matrix units run the ternary GEMMs; 4 on a CPU adapter, the GEMV path's share of the tests
    (past a few tokens the GEMM is the faster there). Both paths of a projection give a token the
    same values but for a float projection's order of sums, so a decoded sequence's tokens are the
    same alone and in a batch of up to this many (``engine.generate``). On the H200 (general cores),
    16 prompts decoded at 2,099 tok/s on GEMVs against 1,510 on GEMMs, and 64 prompts at 4,899 on
    GEMMs against at most 2,207 on GEMVs (``benchmarks/results/h200/kernel_tuning.md``). On the H100
    through Dawn, with the GEMMs on the matrix units, 16 prompts decoded at 3,074 tok/s on GEMMs
    against 2,279 on GEMVs (a step 4.9 against 6.7 ms; ``results/h100/engine_decode_gemv4_dawn.json``
    and ``engine_decode_split_dawn.json``, one run); a GEMM step took 4.7 ms at 8 prompts and a GEMV
    step grows about linearly from 1.7 ms at one, so they cross near 10 (not measured between)."""
    if device.is_cpu:
        return 4
    return 8 if int8_matrix_units(device) else 16


SPLIT_K_WORKGROUPS = 1024  # GEMMs split along their sum below this many workgroups (split-K)


def split_k_ranges(workgroups: int, length: int, device: Device, most: int = 8) -> int:
    """Ranges a GEMM of ``workgroups`` tiles splits its sum of ``length`` terms into (an input
    gradient's rows, a decoding projection's features): doubling while the launch has fewer than
    SPLIT_K_WORKGROUPS workgroups, at most 8, each range at least 512 terms; 1 on CPU adapters,
    whose few cores the unsplit grid fills. (A seq-512 step's GEMMs into 2560 features are 320
    tiles of 64 × 64: two or three a streaming multiprocessor of an H200.)"""
    if device.is_cpu:
        return 1
    splits = 1
    while workgroups * splits < SPLIT_K_WORKGROUPS and splits < most and length // (2 * splits) >= 512:
        splits *= 2
    return splits


def input_grad_launches(file: str, constants: dict, inputs: dict[int, Buffer], sums: dict[int, Buffer], part: int,
                        params: tuple, tokens: int, k: int, k64: int, rows: int, splits: int | None,
                        dropout: SiteDropout | None, workspace: Workspace) -> list[Launch]:
    """The launches of an input-gradient GEMM: ``file``'s gemm_tiled over 64 × 64 tiles of tokens ×
    features (``inputs``: its bindings of A and the weights; ``sums``: OUT, DH, LA; ``part``: the
    PART binding, DROP the next). One launch, or with ``splits`` > 1 ranges of rows one that stores
    each range's sums into the workspace's scratch and a split_sum launch that adds them up into OUT."""
    device = workspace.device
    if dropout is not None:
        constants = dict(constants, DROPOUT=True)
    sums = {**sums, part + 1: dropout.state if dropout is not None else dummy(device)}
    params = (*params, *dropout_params(dropout))
    tiles = (k64 // 64, -(-tokens // 64))
    splits = splits or split_k_ranges(tiles[0] * tiles[1], rows, device)
    if splits == 1:
        return [Launch.build(kernel(file, "gemm_tiled", device, **constants), (*tiles, 1),
                             {**inputs, **sums, part: dummy(device, "part")}, params)]
    partials = workspace.scratch("split-K partial sums", (splits * tokens * -(-k // 4) * 4,))  # rows of whole vec4s
    gemm = kernel(file, "gemm_tiled", device, SPLITS=splits, **constants)
    total = kernel(file, "split_sum", device, SPLITS=splits, **constants)
    return [Launch.build(gemm, (*tiles, splits), {**inputs, **sums, part: partials}, params),
            Launch.build(total, (-(-k // 1024), tokens, 1), {**sums, part: partials}, params)]
