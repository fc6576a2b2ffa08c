"""LoRA on WebGPU as a ``torch.autograd.Function``, with its torch reference beside it.

The math, with x [N, in], A [r, in], B [out, r] and s = scaling::

    forward   h  = x·Aᵀ          lora_down.wgsl   (each row split across workgroups when N is small)
              y  = s·h·Bᵀ        lora_up.wgsl     (B projection and scale fused; sums h's splits)
    backward  dh = dY·B          lora_down.wgsl   gradDh
              dB += s·dYᵀ·h      lora_outer.wgsl  gradB, as dBᵀ
              dA += s·dhᵀ·x      lora_outer.wgsl  gradA
              dx += s·dh·A       lora_up.wgsl     inputGrad
    reduce.wgsl sums split partial results: lora_outer's row splits, and h's or dh's
    splits before lora_outer reads them.

GPU layout: a matrix's long side (``in`` or ``out``) is contiguous and padded to a
multiple of 4 floats so kernels load vec4s: x, dx [N, in4]; dY, y [N, out4]; A [r, in4];
B is kept transposed, Bᵀ [r, out4], so gradDh and gradB read it like the forward.
Padding costs a host copy only when ``in`` or ``out`` is not a multiple of 4.

Two levels of API:

* ``lora(x, A, B, scaling)`` / ``LoRAFunction``: torch CPU tensors in and out.
  Forward keeps x and h on the GPU for backward; backward uploads only dY and
  computes only the gradients autograd asks for. A and B stay on the GPU between
  calls and are uploaded again only when their values change.
* ``forward`` / ``backward`` on ``Buffer``s recorded into a ``Recorder``: the
  device-resident path, for chains of ops with no CPU round trip.

dtypes: float32 inside. float16, bfloat16 and float64 inputs are computed in float32
and returned in the input's dtype. Integer inputs raise TypeError; tensors on any
device other than the CPU raise ValueError (move them with ``.cpu()``).
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..runtime import Buffer, Device, Kernel, Recorder, get_device, kernel, upload

__all__ = ["LoRAFunction", "LoRAWeights", "backward", "forward", "lora", "lora_reference", "resident_weights"]


def lora_reference(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """The same math in plain torch: ``scaling * (x @ A.T) @ B.T``.

    >>> lora_reference(torch.ones(2, 3), torch.ones(1, 3), torch.ones(4, 1), 0.5).shape
    torch.Size([2, 4])
    """
    return scaling * (x @ A.T) @ B.T


# -- launch plans ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tuning:
    """Launch shapes. ``down_workgroups``: below this many row blocks, lora_down splits each
    row across workgroups (summed afterwards); ``outer_workgroups``: how many workgroups
    lora_outer's reduction over rows is spread across. A CPU adapter wants few, a GPU many.
    ``down_lanes``: threads sharing 4 ranks in lora_down. ``up_wg``: threads per workgroup
    in lora_up. ``outer_cols``: vec4 columns per workgroup in lora_outer. ``down_quads``,
    ``outer_quads``: at most this many rank quads per workgroup (fewer: more workgroups,
    each reading its rows again from cache)."""

    down_workgroups: int
    outer_workgroups: int
    down_lanes: int = 16
    up_wg: int = 128
    outer_cols: int = 64
    down_quads: int = 4
    outer_quads: int = 4


GPU_TUNING = Tuning(down_workgroups=512, outer_workgroups=512)
CPU_TUNING = Tuning(down_workgroups=8, outer_workgroups=8)
_tuning_override: Tuning | None = None


def tuning(device: Device) -> Tuning:
    if _tuning_override is not None:
        return _tuning_override
    return CPU_TUNING if device.is_cpu else GPU_TUNING


def set_tuning(value: Tuning | None) -> None:
    """Override launch shapes (benchmarks and tests); ``None`` restores the defaults."""
    global _tuning_override
    _tuning_override = value


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _quads(rank: int, most: int) -> int:
    """Rank quads one workgroup covers: all of them up to ``most``; grid.z covers the rest."""
    return min(_cdiv(rank, 4), most)


# Launch plans depend only on shapes, the device and the tuning: computed once per shape
# (recording runs on every step, and its host time is the op's floor for small inputs).

@functools.lru_cache(maxsize=1024)
def _down_plan(device: Device, tune: Tuning, rows: int, d4: int, rank: int) -> tuple[Kernel, tuple, tuple, int]:
    q = _quads(rank, tune.down_quads)
    rank4 = 4 * _cdiv(rank, 4)
    row_blocks, rank_blocks = _cdiv(rows, 8), _cdiv(rank, 4 * q)
    fit = device.max_binding // (rows * rank4 * 4)  # the partials must fit one binding too
    splits = max(1, min(_cdiv(tune.down_workgroups, row_blocks * rank_blocks), _cdiv(d4, 4 * tune.down_lanes), fit))
    split_d4 = _cdiv(d4, splits)
    splits = _cdiv(d4, split_d4)
    kern = kernel("lora_down.wgsl", "down", "IIII", device, LANES=tune.down_lanes, Q=q)
    return kern, (row_blocks, splits, rank_blocks), (splits, rows, rank4), split_d4


def _down(rec: Recorder, X: Buffer, M: Buffer, rank: int) -> Buffer:
    """X·Mᵀ as [splits, rows, rank4] partial blocks whose sum is the product: one block, or
    several when rows are few and each row is split across workgroups (the consumers,
    ``_up`` and ``_outer``, sum them as they read)."""
    rows, width = X.shape
    kern, grid, shape, split_d4 = _down_plan(rec.device, tuning(rec.device), rows, width // 4, rank)
    P = Buffer(shape, device=rec.device)
    rec.dispatch(kern, grid, (X, M, P), (rows, width // 4, rank, split_d4))
    return P


@functools.lru_cache(maxsize=1024)
def _up_plan(device: Device, tune: Tuning, rows: int, d4: int, rank: int) -> tuple[Kernel, tuple]:
    q = _cdiv(rank, 4)
    wg = max(tune.up_wg, 8 * q)  # the first 8·q threads gather h
    return kernel("lora_up.wgsl", "up", "IIIIIf", device, WG=wg, Q=q), (_cdiv(d4, wg), _cdiv(rows, 8), 1)


def _up(rec: Recorder, H: Buffer, rank: int, M: Buffer, Y: Buffer, scale: float, accumulate: bool) -> None:
    """Y (+)= scale·H·M, H given as [splits, rows, rank4] partial blocks."""
    splits, rows = H.shape[:2]
    d4 = M.shape[1] // 4
    kern, grid = _up_plan(rec.device, tuning(rec.device), rows, d4, rank)
    rec.dispatch(kern, grid, (H, M, Y), (rows, d4, rank, splits, int(accumulate), scale))


def _reduce(rec: Recorder, P: Buffer, out: Buffer, splits: int, stride4: int, scale: float,
            accumulate: bool) -> None:
    """out (+)= scale·Σ over splits of P (splits ``stride4`` vec4s apart)."""
    len4 = _cdiv(out.numel, 4)
    kern = kernel("reduce.wgsl", "reduce_partials", "IIIIf", rec.device, WG=256)
    rec.dispatch(kern, (_cdiv(len4, 256), 1, 1), (P, out), (len4, stride4, splits, int(accumulate), scale))


@functools.lru_cache(maxsize=1024)
def _outer_plan(device: Device, tune: Tuning, rows: int, d4: int, rank: int) -> tuple[Kernel, tuple, int]:
    q = _quads(rank, tune.outer_quads)
    col_blocks = _cdiv(d4, tune.outer_cols) * _cdiv(rank, 4 * q)
    fit = device.max_binding // (rank * d4 * 16)  # the partials must fit one binding too
    splits = max(1, min(_cdiv(tune.outer_workgroups, col_blocks), _cdiv(rows, 16), fit))
    split_rows = _cdiv(rows, splits)
    kern = kernel("lora_outer.wgsl", "outer", "IIIIIf", device, TD=tune.outer_cols, Q=q)
    return kern, (_cdiv(d4, tune.outer_cols), _cdiv(rows, split_rows), _cdiv(rank, 4 * q)), split_rows


def _summed(rec: Recorder, P: Buffer) -> Buffer:
    """``_down``'s [splits, rows, rank4] blocks summed into one block, [1, rows, rank4]."""
    if P.shape[0] == 1:
        return P
    out = Buffer((1, *P.shape[1:]), device=rec.device)
    _reduce(rec, P, out, P.shape[0], out.numel // 4, 1.0, accumulate=False)
    return out


def _outer(rec: Recorder, G: Buffer, rank: int, X: Buffer, grad: Buffer, scale: float, accumulate: bool) -> None:
    """grad (+)= scale·Gᵀ·X (G one [1, rows, rank4] block), over row splits summed by reduce.wgsl
    when there are several."""
    rows = G.shape[1]
    d4 = X.shape[1] // 4
    kern, grid, split_rows = _outer_plan(rec.device, tuning(rec.device), rows, d4, rank)
    splits = grid[1]
    if splits == 1:
        rec.dispatch(kern, grid, (G, X, grad), (rows, d4, rank, split_rows, int(accumulate), scale))
        return
    P = Buffer((splits, rank, d4 * 4), device=rec.device)
    rec.dispatch(kern, grid, (G, X, P), (rows, d4, rank, split_rows, 0, 1.0))
    _reduce(rec, P, grad, splits, rank * d4, scale, accumulate)


# -- the device-resident path ------------------------------------------------------------------

@dataclass(frozen=True)
class LoRAWeights:
    """A [r, in4] and Bᵀ [r, out4] on the GPU, with the logical sizes."""

    A: Buffer
    Bt: Buffer
    in_features: int
    out_features: int

    @property
    def rank(self) -> int:
        return self.A.shape[0]


def forward(rec: Recorder, x: Buffer, w: LoRAWeights, scaling: float) -> tuple[Buffer, Buffer]:
    """Record y = s·(x·Aᵀ)·Bᵀ for x [N, in4]; returns (y [N, out4], h).

    h = x·Aᵀ is what ``backward`` needs, kept as lora_down's [splits, N, rank4] partial
    blocks (rank zero-padded to a multiple of 4; one block unless N is small).

    >>> # rec = Recorder(); y, h = forward(rec, x_buf, weights, 2.0); rec.read(y, out); rec.submit()
    """
    h = _down(rec, x, w.A, w.rank)
    y = Buffer((x.shape[0], w.Bt.shape[1]), device=rec.device)
    _up(rec, h, w.rank, w.Bt, y, scaling, accumulate=False)
    return y, h


def backward(rec: Recorder, dy: Buffer, x: Buffer, h: Buffer, w: LoRAWeights, scaling: float, *,
             dA: Buffer | None = None, dBt: Buffer | None = None, dx: Buffer | None = None,
             accumulate: bool = False, accumulate_dx: bool = False) -> None:
    """Record the LoRA gradients that have a destination buffer.

    dA [r, in4] and dBt [r, out4] get ``+=`` when ``accumulate`` (gradient accumulation
    across micro-batches), else are overwritten. dx [N, in4] gets ``+=`` when
    ``accumulate_dx`` (adding into a residual stream's gradient), else is overwritten.
    """
    if dBt is not None:
        _outer(rec, _summed(rec, h), w.rank, dy, dBt, scaling, accumulate)
    if dx is None and dA is None:
        return
    dh = _down(rec, dy, w.Bt, w.rank)
    if dA is not None:
        _outer(rec, _summed(rec, dh), w.rank, x, dA, scaling, accumulate)
    if dx is not None:
        _up(rec, dh, w.rank, w.A, dx, scaling, accumulate_dx)


# -- torch staging -----------------------------------------------------------------------------

def _width4(n: int) -> int:
    return _cdiv(n, 4) * 4


def _as_gpu_matrix(t: torch.Tensor, device: Device) -> Buffer:
    """Upload a 2-D tensor as float32 rows padded to a multiple of 4 (no copy when already so)."""
    rows, cols = t.shape
    if t.dtype == torch.float32 and t.is_contiguous() and cols % 4 == 0:
        return upload(t.numpy(), device)
    padded = np.zeros((rows, _width4(cols)), np.float32)
    padded[:, :cols] = t.detach().numpy() if t.dtype in (torch.float32, torch.float64) else t.float().numpy()
    return upload(padded, device)


def _into(dst: torch.Tensor, transpose: bool = False) -> Callable[[np.ndarray], None]:
    """A readback sink: copy the mapped [rows, width4] view (trimmed) into ``dst``."""
    target = dst.numpy()
    if transpose:
        target = target.T

    def sink(view: np.ndarray) -> None:
        np.copyto(target, view[:, : target.shape[1]])

    return sink


class _Resident:
    """A weight's GPU copy and the values it was made from."""

    __slots__ = ("ref", "shadow", "buffer")

    def __init__(self, ref: weakref.ref, shadow: torch.Tensor, buffer: Buffer) -> None:
        self.ref, self.shadow, self.buffer = ref, shadow, buffer


_resident: dict[tuple[int, bool], _Resident] = {}


def _resident_matrix(t: torch.Tensor, transpose: bool, device: Device) -> Buffer:
    key = (id(t), transpose)
    entry = _resident.get(key)
    values = t.detach()
    if entry is not None and entry.ref() is t and torch.equal(entry.shadow, values):
        return entry.buffer
    # A new buffer each time: a forward still waiting for its backward keeps the old one.
    buffer = _as_gpu_matrix(values.T if transpose else values, device)
    if entry is None or entry.ref() is not t:
        weakref.finalize(t, _resident.pop, key, None)
    _resident[key] = _Resident(weakref.ref(t), values.clone(), buffer)
    return buffer


def resident_weights(A: torch.Tensor, B: torch.Tensor, device: Device | None = None) -> LoRAWeights:
    """GPU copies of A and Bᵀ, uploaded again only when the tensors' values change.

    >>> A, B = torch.randn(8, 64), torch.zeros(32, 8)
    >>> resident_weights(A, B).Bt.shape
    (8, 32)
    """
    device = device or get_device()
    return LoRAWeights(_resident_matrix(A, False, device), _resident_matrix(B, True, device),
                       A.shape[1], B.shape[0])


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MAX_RANK = 512  # lora_up.wgsl gathers h with 2·rank threads of one workgroup (at most 1024)


def _check(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: Any) -> None:
    for name, t in (("x", x), ("A", A), ("B", B)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lora: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"lora: {name} has dtype {t.dtype}; expected a floating dtype "
                            "(float32, float16, bfloat16 or float64)")
        if t.device.type != "cpu":
            raise ValueError(f"lora: {name} is on {t.device}; the WebGPU op takes CPU tensors "
                             "(move them with .cpu(), or use backend='torch')")
    if A.dim() != 2 or B.dim() != 2:
        raise ValueError(f"lora: A and B must be 2-D, got A {tuple(A.shape)} and B {tuple(B.shape)}")
    if not 1 <= A.shape[0] <= MAX_RANK:
        raise ValueError(f"lora: rank must be between 1 and {MAX_RANK}, got A {tuple(A.shape)}")
    if x.dim() == 0 or x.shape[-1] != A.shape[1]:
        raise ValueError(f"lora: x {tuple(x.shape)} does not match A {tuple(A.shape)}: "
                         f"x's last dimension must equal A's in_features ({A.shape[1]})")
    if B.shape[1] != A.shape[0]:
        raise ValueError(f"lora: B {tuple(B.shape)} does not match A {tuple(A.shape)}: "
                         f"B must be [out_features, rank={A.shape[0]}]")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        raise TypeError(f"lora: scaling must be a finite Python number, got {scaling!r}")


def _row_chunks(rows: int, width4: int, device: Device) -> list[slice]:
    """Row ranges whose [rows, width4] float32 slabs fit one storage binding."""
    per_chunk = max(1, device.max_binding // (4 * width4))
    return [slice(i, min(i + per_chunk, rows)) for i in range(0, rows, per_chunk)]


class LoRAFunction(torch.autograd.Function):
    """y = scaling · (x·Aᵀ)·Bᵀ computed by WGSL kernels; gradients for x, A and B.

    >>> x = torch.randn(5, 16, requires_grad=True)
    >>> A = torch.randn(4, 16, requires_grad=True); B = torch.randn(8, 4, requires_grad=True)
    >>> y = LoRAFunction.apply(x, A, B, 2.0); y.sum().backward()
    >>> x.grad.shape, A.grad.shape, B.grad.shape
    (torch.Size([5, 16]), torch.Size([4, 16]), torch.Size([8, 4]))
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
        _check(x, A, B, scaling)
        device = get_device()
        in_f, out_f = A.shape[1], B.shape[0]
        x2 = x.detach().reshape(-1, in_f)
        rows = x2.shape[0]
        y = torch.empty((rows, out_f), dtype=torch.float32)
        saved = []
        if rows:
            w = resident_weights(A, B, device)
            rec = Recorder(device)
            for chunk in _row_chunks(rows, max(_width4(in_f), _width4(out_f)), device):
                xb = _as_gpu_matrix(x2[chunk], device)
                yb, hb = forward(rec, xb, w, float(scaling))
                rec.read(yb, _into(y[chunk]))
                saved.append((chunk, xb, hb))
            rec.submit()
            ctx.weights = w
        ctx.saved_gpu = saved
        ctx.scaling = float(scaling)
        ctx.x_meta = (x.shape, x.dtype)
        ctx.save_for_backward(A, B)  # autograd then refuses a backward after A or B changed in place
        return y.to(x.dtype).reshape(*x.shape[:-1], out_f)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        A, B = ctx.saved_tensors
        x_shape, x_dtype = ctx.x_meta
        need_x, need_A, need_B = ctx.needs_input_grad[:3]
        rank, in_f, out_f = A.shape[0], A.shape[1], B.shape[0]
        dy2 = dy.reshape(-1, out_f)
        rows = dy2.shape[0]
        alloc = torch.empty if rows else torch.zeros  # readbacks overwrite all; no rows means zero gradients
        dx = alloc((rows, in_f), dtype=torch.float32) if need_x else None
        dA = alloc((rank, in_f), dtype=torch.float32) if need_A else None
        dB = alloc((out_f, rank), dtype=torch.float32) if need_B else None
        if rows and (need_x or need_A or need_B):
            device = get_device()
            w = ctx.weights
            rec = Recorder(device)
            dA_buf = Buffer((rank, w.A.shape[1]), device=device) if need_A else None
            dBt_buf = Buffer((rank, w.Bt.shape[1]), device=device) if need_B else None
            for i, (chunk, xb, hb) in enumerate(ctx.saved_gpu):
                dyb = _as_gpu_matrix(dy2[chunk], device)
                dxb = Buffer(xb.shape, device=device) if need_x else None
                backward(rec, dyb, xb, hb, w, ctx.scaling, dA=dA_buf, dBt=dBt_buf, dx=dxb, accumulate=i > 0)
                if need_x:
                    rec.read(dxb, _into(dx[chunk]))
            if need_A:
                rec.read(dA_buf, _into(dA))
            if need_B:
                rec.read(dBt_buf, _into(dB, transpose=True))
            rec.submit()
        return (
            dx.to(x_dtype).reshape(x_shape) if need_x else None,
            dA.to(A.dtype) if need_A else None,
            dB.to(B.dtype) if need_B else None,
            None,
        )


def lora(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * (x @ A.T) @ B.T`` on WebGPU, differentiable, for x of shape [..., in].

    >>> x, A, B = torch.randn(2, 3, 16), torch.randn(4, 16), torch.randn(8, 4)
    >>> torch.allclose(lora(x, A, B, 0.5), lora_reference(x, A, B, 0.5), atol=1e-5)
    True
    """
    return LoRAFunction.apply(x, A, B, scaling)
