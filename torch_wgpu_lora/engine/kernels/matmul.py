"""Float projections (``matmul.wgsl``): the dense flavour's projections and the LM head, with
the epilogues of ``bitlinear`` (store, add, gate/up, LoRA segments); their input gradient
(``matmul_t.wgsl``); and the torch reference of each.

Up to ``projection.gemv_max_tokens`` tokens a projection runs as a GEMV whose workgroups read
each weight word once for a group of tokens (``gemv_group``: all of a decode step's, so that the
LM head, hundreds of MB, is read from memory once a step), each token's sums in the order of a
launch of that token alone; past that, as a GEMM.

>>> # rec.launch(matmul_launch(x, projection, out, tokens=n, out_stride=vocab))
"""

from __future__ import annotations

import torch

from ...runtime import Buffer, Device, Launch, get_device, kernel
from ..weights import Projection
from ..workspace import Workspace
from . import dummy
from .dropout import SiteDropout
from .projection import MODES, check_vec4_rows, gemv_max_tokens, input_grad_launches

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
