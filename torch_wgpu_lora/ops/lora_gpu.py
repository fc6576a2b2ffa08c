"""The LoRA kernels on GPU buffers: launch plans and the device-resident forward and backward.

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

``forward`` and ``backward`` record into a ``Recorder`` with no CPU round trip; the
torch op (``ops.lora``) and the model engine build on them.

>>> # rec = Recorder(); y, h = forward(rec, x_buf, weights, 2.0); rec.read(y, out); rec.submit()
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime import Buffer, Device, Kernel, Recorder, kernel

__all__ = ["LoRAWeights", "Tuning", "backward", "forward", "max_rank", "max_rows", "set_tuning", "tuning"]


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


def max_rank(device: Device) -> int:
    """The largest rank this adapter runs: lora_up gathers 8 rows of h (8·ceil(r/4) vec4s)
    with one thread each into workgroup memory."""
    threads = min(int(device.limits["max-compute-invocations-per-workgroup"]),
                  int(device.limits["max-compute-workgroup-size-x"]))
    quads = min(threads // 8, int(device.limits["max-compute-workgroup-storage-size"]) // (8 * 16))
    return 4 * quads


def max_rows(device: Device, width4: int, rank: int) -> int:
    """The most rows one forward or backward call takes on this adapter: lora_down and lora_up
    launch a workgroup per 8 rows (one grid dimension), and x, y and h must each fit one
    storage binding. The torch op splits larger inputs into calls of this size."""
    rank4 = 4 * _cdiv(rank, 4)
    return max(1, min(8 * device.max_workgroups, device.max_binding // (4 * width4),
                      device.max_binding // (4 * rank4)))


def _quads(rank: int, most: int) -> int:
    """Rank quads one workgroup covers: all of them up to ``most``; grid.z covers the rest."""
    return min(_cdiv(rank, 4), most)


# Launch plans depend on shapes, the device, the tuning and the shader checks: computed once
# per key (recording runs on every step, and its host time is the op's floor for small inputs).

def _plan(device: Device, key: tuple, make):
    plans = device.owned("lora_plans", dict)
    key = (*key, tuning(device), device.settings.shader_checks)
    plan = plans.get(key)
    if plan is None:
        plan = plans.setdefault(key, make(tuning(device)))
    return plan


def _down(rec: Recorder, X: Buffer, M: Buffer, rank: int) -> Buffer:
    """X·Mᵀ as [splits, rows, rank4] partial blocks whose sum is the product: one block, or
    several when rows are few and each row is split across workgroups (the consumers,
    ``_up`` and ``_outer``, sum them as they read)."""
    rows, width = X.shape
    d4, device = width // 4, rec.device

    def make(tune: Tuning) -> tuple[Kernel, tuple, tuple, int]:
        q = _quads(rank, tune.down_quads)
        rank4 = 4 * _cdiv(rank, 4)
        row_blocks, rank_blocks = _cdiv(rows, 8), _cdiv(rank, 4 * q)
        fit = device.max_binding // (rows * rank4 * 4)  # the partials must fit one binding too
        splits = max(1, min(_cdiv(tune.down_workgroups, row_blocks * rank_blocks), _cdiv(d4, 4 * tune.down_lanes),
                            fit))
        split_d4 = _cdiv(d4, splits)
        splits = _cdiv(d4, split_d4)
        kern = kernel("lora_down.wgsl", "down", device, LANES=tune.down_lanes, Q=q)
        return kern, (row_blocks, splits, rank_blocks), (splits, rows, rank4), split_d4

    kern, grid, shape, split_d4 = _plan(device, ("down", rows, d4, rank), make)
    P = Buffer(shape, device=device)
    rec.dispatch(kern, grid, (X, M, P), (rows, d4, rank, split_d4))
    return P


def _up(rec: Recorder, H: Buffer, rank: int, M: Buffer, Y: Buffer, scale: float, accumulate: bool) -> None:
    """Y (+)= scale·H·M, H given as [splits, rows, rank4] partial blocks."""
    splits, rows = H.shape[:2]
    d4, device = M.shape[1] // 4, rec.device

    def make(tune: Tuning) -> tuple[Kernel, tuple]:
        q = _cdiv(rank, 4)
        wg = max(tune.up_wg, 8 * q)  # the first 8·q threads gather h
        return kernel("lora_up.wgsl", "up", device, WG=wg, Q=q), (_cdiv(d4, wg), _cdiv(rows, 8), 1)

    kern, grid = _plan(device, ("up", rows, d4, rank), make)
    rec.dispatch(kern, grid, (H, M, Y), (rows, d4, rank, splits, int(accumulate), scale))


def _reduce(rec: Recorder, P: Buffer, out: Buffer, splits: int, stride4: int, scale: float,
            accumulate: bool) -> None:
    """out (+)= scale·Σ over splits of P (splits ``stride4`` vec4s apart)."""
    len4 = _cdiv(out.numel, 4)
    kern = kernel("reduce.wgsl", "reduce_partials", rec.device, WG=256)
    rec.dispatch(kern, (_cdiv(len4, 256), 1, 1), (P, out), (len4, stride4, splits, int(accumulate), scale))


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
    d4, device = X.shape[1] // 4, rec.device

    def make(tune: Tuning) -> tuple[Kernel, tuple, int]:
        q = _quads(rank, tune.outer_quads)
        col_blocks = _cdiv(d4, tune.outer_cols) * _cdiv(rank, 4 * q)
        fit = device.max_binding // (rank * d4 * 16)  # the partials must fit one binding too
        splits = max(1, min(_cdiv(tune.outer_workgroups, col_blocks), _cdiv(rows, 16), fit))
        split_rows = _cdiv(rows, splits)
        kern = kernel("lora_outer.wgsl", "outer", device, TD=tune.outer_cols, Q=q)
        return kern, (_cdiv(d4, tune.outer_cols), _cdiv(rows, split_rows), _cdiv(rank, 4 * q)), split_rows

    kern, grid, split_rows = _plan(device, ("outer", rows, d4, rank), make)
    splits = grid[1]
    if splits == 1:
        rec.dispatch(kern, grid, (G, X, grad), (rows, d4, rank, split_rows, int(accumulate), scale))
        return
    P = Buffer((splits, rank, d4 * 4), device=device)
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

    def __post_init__(self) -> None:
        rank = self.A.shape[0]
        if len(self.A.shape) != 2 or len(self.Bt.shape) != 2 or self.Bt.shape[0] != rank:
            raise ValueError(f"LoRAWeights: A must be [r, in4] and Bt [r, out4], got A {self.A.shape}, "
                             f"Bt {self.Bt.shape}")
        for name, buf, n in (("A", self.A, self.in_features), ("Bt", self.Bt, self.out_features)):
            if buf.shape[1] != 4 * _cdiv(n, 4):
                raise ValueError(f"LoRAWeights: {name} {buf.shape} must be {4 * _cdiv(n, 4)} wide for {n} features "
                                 "(padded to a multiple of 4)")

    @property
    def rank(self) -> int:
        return self.A.shape[0]


def _check_rows(what: str, buf: Buffer, width: int, rows: int | None = None) -> None:
    if len(buf.shape) != 2 or buf.shape[1] != width or (rows is not None and buf.shape[0] != rows):
        want = f"[{rows if rows is not None else 'N'}, {width}]"
        raise ValueError(f"{what} is {buf.shape}; expected {want}")


def _check_fits(device: Device, rows: int, width4: int, rank: int) -> None:
    most = max_rows(device, width4, rank)
    if rows > most:
        raise ValueError(f"{rows} rows exceed what one LoRA call takes on this adapter ({most} at width {width4}, "
                         f"rank {rank}); split the rows into calls of at most {most}")


def forward(rec: Recorder, x: Buffer, w: LoRAWeights, scaling: float) -> tuple[Buffer, Buffer]:
    """Record y = s·(x·Aᵀ)·Bᵀ for x [N, in4]; returns (y [N, out4], h).

    h = x·Aᵀ is what ``backward`` needs, kept as lora_down's [splits, N, rank4] partial
    blocks (rank zero-padded to a multiple of 4; one block unless N is small).
    """
    _check_rows("forward: x", x, w.A.shape[1])
    _check_fits(rec.device, x.shape[0], max(w.A.shape[1], w.Bt.shape[1]), w.rank)
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
    rows, rank4 = x.shape[0], 4 * _cdiv(w.rank, 4)
    _check_rows("backward: x", x, w.A.shape[1])
    _check_rows("backward: dy", dy, w.Bt.shape[1], rows)
    if len(h.shape) != 3 or h.shape[1:] != (rows, rank4):
        raise ValueError(f"backward: h is {h.shape}; expected forward's [splits, {rows}, {rank4}]")
    for name, buf, want in (("dA", dA, w.A.shape), ("dBt", dBt, w.Bt.shape), ("dx", dx, x.shape)):
        if buf is not None and buf.shape != want:
            raise ValueError(f"backward: {name} is {buf.shape}; expected {want}")
    if dBt is not None:
        _outer(rec, _summed(rec, h), w.rank, dy, dBt, scaling, accumulate)
    if dx is None and dA is None:
        return
    dh = _down(rec, dy, w.Bt, w.rank)
    if dA is not None:
        _outer(rec, _summed(rec, dh), w.rank, x, dA, scaling, accumulate)
    if dx is not None:
        _up(rec, dh, w.rank, w.A, dx, scaling, accumulate_dx)
