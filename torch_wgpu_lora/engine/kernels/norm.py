"""RMSNorm with BitLinear's activation quantisation and the LoRA down-projections fused
(``norm.wgsl``), and the torch reference of each step.

>>> # rec.launch(rmsnorm_launch(x, weight, xn, tokens=n, k=hidden, eps=1e-5, codes=c, scales_and_sums=m))
"""

from __future__ import annotations

import math

import torch

from ...runtime import Buffer, Device, Launch, get_device, kernel
from . import dummy
from .dropout import SiteDropout, dropout_params
from .attention.decode import DecodePartials
from .projection import SplitSums


# rmsnorm_rows: the most features, and LoRA rank × feature steps, one invocation takes (norm.wgsl says why)
ROWS_MAX_STEPS = 16384


def rmsnorm_launch(x: Buffer, weight: Buffer, out: Buffer, *, tokens: int, k: int, eps: float,
                   codes: Buffer | None = None, scales_and_sums: Buffer | None = None, lora_a: Buffer | None = None,
                   h: Buffer | None = None, rank: int = 0, rstd: Buffer | None = None, per_row: bool | None = None,
                   dropout: SiteDropout | None = None, row_adapters: tuple[Buffer, Buffer] | None = None,
                   split: SplitSums | None = None, attention: DecodePartials | None = None,
                   device: Device | None = None) -> Launch:
    """One launch normalising ``tokens`` rows of ``x`` (f32 [tokens, ≥ k]) into ``out`` (f32 [tokens,
    stride], stride = k padded to a multiple of 64); with ``codes`` and ``scales_and_sums`` it also quantises
    them (u32 [tokens, stride / 4], f32 [2 · tokens]);
    with ``rank`` > 0 it writes ``h = y·Aᵀ`` into the first ``rank`` columns of ``h`` ([tokens, ≥ rank])
    from ``lora_a`` [rank, stride] (with ``dropout``, each adapter's h from its own dropout of y); with
    ``rstd`` it keeps 1/rms per token. ``row_adapters`` = (rows, columns), u32 [tokens] and u32 [rank]:
    each token runs one of the adapters stacked in ``lora_a``, its h 0 in the columns of the others
    (rows[n] names token n's adapter, columns[r] rank r's; a batch of mixed adapters). ``per_row``: one
    invocation a row (no barriers; the default on CPU adapters, for rows of up to ``ROWS_MAX_STEPS``
    features) rather than a workgroup a row (the default on GPUs).

    ``split``: the rows are made first, by the epilogue of the projection whose K ranges' sums it
    holds (``SplitSums``; ``norm.wgsl``'s rmsnorm_split): added into ``x`` (``split.out``, the
    residual stream) or, for gate/up pairs, written to it. The projection's token scales are
    ``scales_and_sums``' first, which the launch then overwrites with the new codes'. A workgroup a
    row, quantised, without LoRA ranks or 1/rms kept (a decoding step's norm).

    ``attention``: the rows are a decoding step's attention output, read as its key spans' partials
    merged (``norm.wgsl``'s rmsnorm_partials; ``x`` is not read): the launch replaces
    decode_combine's. A workgroup a row."""
    device = device or get_device()
    stride = out.shape[-1]
    if split is not None and attention is not None:
        raise ValueError("a norm reads a split projection's sums or attention's partials, not both")
    if split is not None:
        return _rmsnorm_split_launch(split, x, weight, out, tokens, k, eps, codes, scales_and_sums, rank, rstd,
                                     device)
    if attention is not None and (attention.heads * attention.head_dim != k or attention.head_dim % 4
                                  or per_row):
        raise ValueError(f"attention partials of {attention.heads} heads of {attention.head_dim} (whole vec4s) feed a "
                         f"norm of rows of {k} features, a workgroup a row")
    if stride % 64 or stride < k or x.shape[-1] < k:
        raise ValueError(f"out rows must hold k={k} padded to a multiple of 64, x rows at least k: x {x.shape}, "
                         f"out {out.shape}")
    quant = codes is not None
    dropout = dropout if rank else None
    row_adapters = row_adapters if rank else None
    if row_adapters is not None and (math.prod(row_adapters[0].shape) < tokens
                                     or math.prod(row_adapters[1].shape) < rank):
        raise ValueError(f"row_adapters name the adapters of {row_adapters[0].shape} tokens and "
                         f"{row_adapters[1].shape} ranks; the launch has {tokens} tokens and {rank} ranks")
    options = dict(DROPOUT=dropout is not None, PER_ROW=row_adapters is not None)
    rows = device.is_cpu and k <= ROWS_MAX_STEPS and attention is None if per_row is None else per_row
    if rows and k > ROWS_MAX_STEPS:
        raise ValueError(f"rows of {k} features are too long for the invocation-a-row kernel (at most "
                         f"{ROWS_MAX_STEPS}); use per_row=False")
    if rows:
        kern = kernel("norm.wgsl", "rmsnorm_rows", device, QUANT=quant, SAVE=rstd is not None, **options)
    else:  # an invocation holds up to 8 words of 4 features: 256 invocations up to 8192 features
        group = max(256, -(-stride // (32 * 32)) * 32)
        if group > int(device.limits["max-compute-invocations-per-workgroup"]):
            raise ValueError(f"rows of {k} features are too long for one workgroup of this adapter")
        if attention is not None:
            options.update(SPANS=attention.splits, HEADS=attention.heads, HEAD_DIM=attention.head_dim)
        kern = kernel("norm.wgsl", "rmsnorm" if attention is None else "rmsnorm_partials", device, QUANT=quant,
                      SAVE=rstd is not None, K=k, STRIDE=stride, WG=group, **options)
    buffers = {1: x, 2: weight, 3: out, 4: codes or dummy(device, "codes"),
               5: scales_and_sums or dummy(device, "scales_and_sums"),
               6 if rows else 9: lora_a or dummy(device), 7: h or dummy(device, "h"), 8: rstd or dummy(device, "rstd"),
               10: dropout.state if dropout is not None else dummy(device),
               11: row_adapters[0] if row_adapters is not None else dummy(device),
               12: row_adapters[1] if row_adapters is not None else dummy(device)}
    if attention is not None:  # the entry reads the partials instead of x
        del buffers[1]
        buffers.update({16: attention.o, 17: attention.ml})
    h_stride = h.shape[-1] if h is not None else 0
    chunk = max(1, ROWS_MAX_STEPS // k)  # rmsnorm_rows: LoRA ranks an invocation computes
    grid = (-(-tokens // 64), max(1, -(-rank // chunk)), 1) if rows else (tokens, 1 + -(-rank // 4), 1)
    return Launch.build(kern, grid, buffers, (tokens, k, x.shape[-1], stride, stride // 4, rank, h_stride, eps,
                                              chunk, *dropout_params(dropout), 0))


def _rmsnorm_split_launch(split: SplitSums, x: Buffer, weight: Buffer, out: Buffer, tokens: int, k: int, eps: float,
                          codes: Buffer | None, scales_and_sums: Buffer | None, rank: int, rstd: Buffer | None,
                          device: Device) -> Launch:
    stride = out.shape[-1]
    problems = []
    if codes is None or scales_and_sums is None or rank or rstd is not None:
        problems.append("codes and their scales, no LoRA ranks, no 1/rms kept")
    if x is not split.out:
        problems.append("x is the buffer the projection's epilogue writes (split.out)")
    if split.features != k or k % 4 or split.rows % 4 or x.shape[-1] % 4 or x.shape[-1] < k:
        problems.append(f"rows of k={k} features (a multiple of 4) from the projection's {split.rows} rows, "
                        f"x's rows of whole vec4s ({x.shape})")
    if stride % 64 or stride < k or stride > 32 * 256:
        problems.append(f"out rows of k padded to a multiple of 64, at most 8192 ({out.shape})")
    if problems:
        raise ValueError("a norm after a split projection's epilogue needs " + "; ".join(problems))
    kern = kernel("norm.wgsl", "rmsnorm_split", device, K=k, STRIDE=stride, WG=256, SPLITS=split.splits,
                  PAIRS=split.pairs, DIVIDE=split.divide)
    none = dummy(device)
    buffers = {2: weight, 3: out, 4: codes, 5: scales_and_sums, 7: dummy(device, "h"), 8: dummy(device, "rstd"),
               9: none, 10: none, 11: none, 12: none, 13: split.partials, 14: split.scale, 15: x}
    return Launch.build(kern, (tokens, 1, 1), buffers, (tokens, k, x.shape[-1], stride, stride // 4, 0, 0, eps, 1,
                                                      *dropout_params(None), split.rows))


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' BitNetRMSNorm / LlamaRMSNorm in float32, op for op."""
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rmsnorm_backward_reference(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The input gradient of RMSNorm at ``x`` for output gradient ``dy``: float64 autograd through
    ``w · x / sqrt(mean(x²) + eps)`` (the kernel computes it from the forward's saved 1/rms)."""
    x64 = x.double().requires_grad_()
    y = weight.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps))
    (dx,) = torch.autograd.grad(y, x64, dy.double())
    return dx


def quantise_reference(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BitLinear's per-token absmax int8 quantisation, op for op: (codes, scales)."""
    scale = 127 / y.abs().max(dim=-1, keepdim=True).values.clamp(min=1e-5)
    return (y * scale).round().clamp(-128, 127), scale[..., 0]


def rmsnorm_backward_launch(dy: Buffer, x: Buffer, rstd: Buffer, weight: Buffer, out: Buffer, *, tokens: int, k: int,
                            accumulate: bool = False, per_row: bool | None = None,
                            device: Device | None = None) -> Launch:
    """The input gradient of ``rmsnorm`` from its saved 1/rms (``norm_backward.wgsl``), stored or
    added into ``out`` (a residual stream's gradient). ``per_row`` as ``rmsnorm_launch``'s (its default too:
    rows of up to ``ROWS_MAX_STEPS`` features on CPU adapters)."""
    device = device or get_device()
    rows = device.is_cpu and k <= ROWS_MAX_STEPS if per_row is None else per_row
    strides = (dy.shape[-1], x.shape[-1], out.shape[-1])
    buffers = {1: dy, 2: x, 3: rstd, 4: weight, 5: out}
    if rows:
        entry = "rmsnorm_backward_rows"
    elif all(n % 4 == 0 for n in (k, *strides)):  # every row starts on a vec4: DY4, X4, G4, OUT4
        entry, buffers = "rmsnorm_backward4", {3: rstd, 6: dy, 7: x, 8: weight, 9: out}
    else:
        entry = "rmsnorm_backward"
    return Launch.build(kernel("norm_backward.wgsl", entry, device), (-(-tokens // 64) if rows else tokens, 1, 1),
                        buffers, (tokens, k, *strides, int(accumulate)))
