"""The engine's GEMMs in one table: each kind of large matrix product a step runs, its variants
(the GEMV, the general cores, the matrix units) with kernel file and entry point, constants, the
check that a device can run them and the work they do; and one rule that picks a variant per shape
and device (``fastest``: measured once per shape on the device, kept in its state).

Kinds (M: tokens; the others as each kind names them):

* ``projection``: a ternary projection's forward, tokens × rows × K (``bitlinear``);
* ``input_grad``: its straight-through input gradient, tokens × K × rows (``bitlinear_t``);
* ``lm_head``: the float weights' forward, tokens × vocabulary × hidden (``matmul``);
* ``lm_head_grad``: its input gradient, tokens × hidden × vocabulary (``matmul_t``);
* ``attention``: scores and their application, over a head's keys (``attention``).

Matrix-unit variants run the same WGSL on every adapter with int8 subgroup matrices
(``runtime.kernels.subgroup_matrix_config``): their tile is counted in the adapter's matrices
(``MmaTile``), so 16 × 16 × 32 matrices on NVIDIA and 8 × 8 × 8 on lavapipe give tiles of the same
form. The input gradient on the matrix units multiplies DIGITS int8 planes of its float32 input
(``bitlinear_t_mma.wgsl`` says why four keep float32 accuracy; the device's ``input_grad_digits``
setting chooses), so it does DIGITS times the integer work of one plane. The LM head's GEMMs on the
matrix units (f16, for bfloat16 weights) multiply two f16 planes of their float32 input
(``matmul_mma.wgsl``), twice the work of one.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

from ...runtime import Device, Launch, Recorder
from ...runtime.kernels import subgroup_matrix_config

@dataclass(frozen=True)
class MmaTile:
    """A matrix-unit GEMM's workgroup (``_mma_tile.wgsl``): ``sub_m`` × ``sub_n`` subgroups,
    each holding ``tm`` × ``tn`` result matrices; ``kstep`` of the sum staged at once, rows padded by
    ``pad`` bytes; ``digits`` planes of A (1, or ``sub_m``); ``result_pad``: words after each row of
    results staged for the epilogue (against bank conflicts: 8 made the sweep's kernels 0-6% faster
    than 0 on the H100, device runs 20 and 22)."""

    sub_m: int = 4
    sub_n: int = 2
    tm: int = 2
    tn: int = 4
    kstep: int = 128
    pad: int = 16
    digits: int = 1
    result_pad: int = 8

    def constants(self) -> dict[str, int]:
        return dict(SUB_M=self.sub_m, SUB_N=self.sub_n, TM=self.tm, TN=self.tn, KSTEP=self.kstep, PAD=self.pad,
                    DIGITS=self.digits, RESULT_PAD=self.result_pad)


@dataclass(frozen=True)
class MmaShape:
    """A tile on one device: its adapter's matrix sizes and what a workgroup covers. ``component``:
    the matrices' type, "i8" (``_ternary_mma_tile.wgsl``'s staging: int8 codes or digits × ternary
    weights) or "f16" (``matmul_mma.wgsl``'s: f16 pairs of float32 rows × bfloat16 weights)."""

    tile: MmaTile
    m: int  # SM_M, SM_N, SM_K and the subgroup size of the adapter's configuration
    n: int
    k: int
    subgroup: int
    component: str = "i8"

    @property
    def threads(self) -> int:
        return self.tile.sub_m * self.tile.sub_n * self.subgroup

    @property
    def block_tokens(self) -> int:  # tokens a workgroup covers
        return self.tile.sub_m * self.tile.tm * self.m // self.tile.digits

    @property
    def block_n(self) -> int:  # columns of the product a workgroup covers
        return self.tile.sub_n * self.tile.tn * self.n

    @property
    def results_bytes(self) -> int:  # every subgroup's row of result matrices staged for the epilogue (put_results)
        return 4 * self.tile.sub_m * self.tile.sub_n * self.m * (self.n * self.tile.tn + self.tile.result_pad)

    @property
    def staged_bytes(self) -> int:
        """Bytes of workgroup memory a step of A and of the weights take (f16: the weights staged
        either way, along the sum or across it, whichever takes more)."""
        t = self.tile
        if self.component == "f16":
            across = self.block_n * (2 * t.kstep + t.pad)
            along = t.kstep * (2 * self.block_n + t.pad)
            return self.block_tokens * t.digits * (2 * t.kstep + t.pad) + max(across, along)
        return (self.block_tokens * t.digits + self.block_n) * (t.kstep + t.pad)

    @property
    def loads(self) -> tuple[int, int]:
        """vec4 loads a thread makes a step: of A, and of the weights."""
        t, threads = self.tile, self.threads
        if self.component == "f16":  # four f16 pairs, eight bfloat16 weights a load
            return -(-self.block_tokens * t.kstep // 4 // threads), -(-self.block_n * t.kstep // 8 // threads)
        return -(-self.block_tokens * t.digits * t.kstep // 16 // threads), -(-self.block_n * t.kstep // 64 // threads)


def f16_matrix_units(device: Device) -> bool:
    """Whether the device multiplies f16 subgroup matrices into f32 (and has f16 in shaders)."""
    return device.has_f16 and subgroup_matrix_config(device, "f16", "f32") is not None


def int8_matrix_units(device: Device) -> bool:
    """Whether the device multiplies int8 subgroup matrices into i32 (in subgroups of one size)."""
    return subgroup_matrix_config(device, "i8", "i32") is not None


def matrix_units_wanted_where_there_are_none(device: Device) -> bool:
    """False, for a device without int8 matrix units, unless its ``gemms`` setting asks for them:
    then a ValueError saying so, rather than a silent run on the general cores."""
    if device.settings.gemms == "matrix_units":
        raise ValueError(f"the gemms setting asks for the matrix units, and this device ({device.name}) has no int8 "
                         f"subgroup matrices ({device.subgroup_matrix_configs or 'none'})")
    return False


def mma_shape(device: Device, tile: MmaTile, component: str = "i8") -> MmaShape:
    """``tile`` on ``device``'s ``component`` configuration ("i8" → i32, "f16" → f32), checked against
    what the kernel and the device allow (ValueError naming what does not fit)."""
    result = {"i8": "i32", "f16": "f32"}[component]
    config = subgroup_matrix_config(device, component, result)
    if config is None or (component == "f16" and not device.has_f16):
        raise ValueError(f"the matrix units need {dict(i8='int8').get(component, component)} subgroup matrices; "
                         f"this device ({device.name}) offers "
                         f"{device.subgroup_matrix_configs or 'none'}")
    shape = MmaShape(tile, config["m"], config["n"], config["k"], config["max_subgroup_size"], component)
    problems = []
    if not (1 <= tile.tm <= 4 and 1 <= tile.tn <= 4):
        problems.append("tm and tn from 1 to 4 (the accumulators' named registers)")
    step = 64 if component == "i8" else 8  # terms a vec4 of weights holds
    if tile.kstep % step or tile.kstep % shape.k:
        problems.append(f"kstep a multiple of {step} and of the matrices' K ({shape.k})")
    if tile.pad % 16:
        problems.append("pad a multiple of 16 bytes")
    if component == "f16" and not tile.digits == tile.sub_m == 2:
        problems.append("two planes (digits = sub_m = 2: hi and lo)")
    elif tile.digits not in (1, tile.sub_m):
        problems.append("digits 1 or sub_m")
    if max(shape.loads) > 8:
        problems.append("at most 8 vec4 loads a thread a step (the staging's Fetched)")
    if shape.threads > int(device.limits["max-compute-invocations-per-workgroup"]):
        problems.append(f"at most {device.limits['max-compute-invocations-per-workgroup']} invocations")
    # the staging's workgroup memory: int8 stages the step, then the results, in all of it; f16 each
    # in a half of it
    room = int(device.limits["max-compute-workgroup-storage-size"]) // (2 if component == "f16" else 1)
    if max(shape.staged_bytes, shape.results_bytes) > room:
        problems.append(f"the staged step ({shape.staged_bytes} bytes) and the results ({shape.results_bytes}) "
                        f"within {room} bytes each")
    if problems:
        raise ValueError(f"matrix-unit tile {tile} on {component} {shape.m}×{shape.n}×{shape.k} matrices: needs "
                         + "; ".join(problems))
    return shape


DECODE_TOKENS = 64  # up to this many tokens a projection takes a decoding tile
# A projection of at least this many outputs (tokens × rows) takes WIDE_TILE: on the H100 it ran
# 1.16-1.32× the default tile from 512 × 13,824 (216 of its workgroups) up, and 0.6-0.7× at
# 512 × 3,840 and below (60 workgroups and fewer; device runs 20 and 22).
WIDE_TILE_OUTPUTS = 4 * 2 ** 20
WIDE_TILE = MmaTile(sub_m=2, sub_n=4, tm=4, tn=4, kstep=64)
# Up to 16 tokens, a projection of this many rows or more (BitNet-2B's fused gate/up, 13,824) takes a
# row of eight subgroups and steps of 128: in the sweep of device run 18 19.9 µs against 31.6 for
# the 16-token tile (matrix_units_decode_split.json); in the engine (device run 38, with q/k/v's
# step also 128) a 16-row step took 3.31 ms against 3.46.
DECODE_WIDE_ROWS = 8192
DECODE_WIDE_TILE = MmaTile(sub_m=1, sub_n=8, tm=1, tn=1, kstep=128)


# From this many tokens the four-digit input gradient takes 2 × 4 result matrices a subgroup on 4 × 2
# subgroups, K steps of 128: at 4,096 tokens it took 0.94-1.00× the time of the default form at each
# of BitNet-2B's projections in two sweeps (device runs 28 and 32, results/h100/matrix_units_none.json);
# at 512 tokens 0.89-1.10× (slower at qkv and o), so fewer tokens keep the default.
INPUT_GRAD_MANY_TOKENS = 4096
INPUT_GRAD_MANY_TOKENS_TILE = MmaTile(digits=4, sub_m=4, sub_n=2, tm=2, tn=4, kstep=128)

# The LM head's GEMMs on f16 matrix units (matmul_mma.wgsl): the hi and lo planes of 64 tokens (a
# subgroup row a plane) against 128 columns, 4 × 2 result matrices a subgroup; a step of 32 terms.
# On the H100 the fastest of the four measured at BitNet-2B's head, 512 and 4,096 tokens, forward and
# input gradient: 4 × 4 matrices on two subgroup columns took 0.99-1.32× its time, 2 × 4 and 2 × 2
# matrices 1.56-1.88× (device runs 30 and 31, results/h100/lm_head_matrix_units.json).
HEAD_TILE = MmaTile(digits=2, sub_m=2, sub_n=4, tm=4, tn=2, kstep=32)


def default_tile(kind: str, tokens: int | None = None, rows: int | None = None, digits: int = 4) -> MmaTile:
    """The tile each matrix-unit kind runs unless told otherwise: the fastest at a training step's
    shapes on an H100 (benchmarks/RESULTS.md, "On the matrix units"). The input gradient's holds 64
    tokens' ``digits`` planes (a subgroup row a plane) against 128 columns: its four planes are four
    times the bytes of the weights' codes they multiply, so it takes more tokens and fewer columns
    than the forward's; with two planes, 4 × 4 result matrices a subgroup against 256 columns (at
    BitNet-2B's shapes, 512 and 4,096 tokens, 0.98-1.43× as fast as the four-plane form with two
    planes; device run 27, ``results/h100/input_grad_transposed.json``); with four planes from
    INPUT_GRAD_MANY_TOKENS tokens, INPUT_GRAD_MANY_TOKENS_TILE. The LM head's: HEAD_TILE, and for up
    to 32 rows (decoding) one or two rows of result matrices a subgroup, so that a workgroup holds
    the step's rows and the head's weights are read about once: each the fastest of the
    benchmarks.matrix_units lm_head sweep on the H100 (device run 36,
    ``results/h100/lm_head_decode_tiles.json``: 16 rows 0.46 ms with steps of 64, against 0.66 with
    steps of 32 and 1.40 on the general cores; 32 rows 0.77 ms; from 33 rows HEAD_TILE, 1.17 ms at 64).
    A projection of ``tokens`` × ``rows`` outputs: WIDE_TILE (4 × 4 result matrices a subgroup) where
    it has enough of them to fill the GPU with its wide workgroups (WIDE_TILE_OUTPUTS); up to
    DECODE_TOKENS tokens (decoding a batch), few tokens and columns a workgroup (many small
    workgroups), each the fastest of the sweep at its token count on the H100
    (``benchmarks/results/h100/matrix_units_decode_split.json``, split in two along K: 89, 113 and
    127 µs for a layer's four projections at 16, 32 and 64 tokens); at up to 16 tokens a projection
    of DECODE_WIDE_ROWS rows or more takes DECODE_WIDE_TILE."""
    if kind == "lm_head" and tokens is not None and tokens <= 16:  # a decoding step's rows: 16 a workgroup
        return MmaTile(digits=2, sub_m=2, sub_n=4, tm=1, tn=2, kstep=64)
    if kind == "lm_head" and tokens is not None and tokens <= 32:
        return MmaTile(digits=2, sub_m=2, sub_n=4, tm=2, tn=2, kstep=32)
    if kind in ("lm_head", "lm_head_grad"):
        return HEAD_TILE
    if kind == "input_grad":
        if digits == 2:
            return MmaTile(digits=2, sub_m=2, sub_n=4, tm=4, tn=4, kstep=64)
        if digits == 4 and tokens is not None and tokens >= INPUT_GRAD_MANY_TOKENS:
            return INPUT_GRAD_MANY_TOKENS_TILE
        return MmaTile(digits=digits, sub_m=digits, sub_n=4, tm=4, tn=2, kstep=64)
    if tokens is not None and tokens <= 16 and rows is not None and rows >= DECODE_WIDE_ROWS:
        return DECODE_WIDE_TILE
    if tokens is not None and tokens <= 16:
        return MmaTile(sub_m=1, sub_n=4, tm=1, tn=1, kstep=256)
    if tokens is not None and tokens <= 32:
        return MmaTile(sub_m=2, sub_n=4, tm=1, tn=1)
    if tokens is not None and tokens <= DECODE_TOKENS:
        return MmaTile(sub_m=4, sub_n=2, tm=1, tn=2)
    if tokens is not None and rows is not None and tokens * rows >= WIDE_TILE_OUTPUTS:
        return WIDE_TILE
    return MmaTile()


@dataclass(frozen=True)
class Variant:
    """One way to compute a kind of GEMM: ``file``:``entry``; ``available`` says whether a device can
    run it; ``work`` counts its integer or float operations at (m, n, k) with ``planes`` planes of
    A (the input gradient's digits on the matrix units; 1 elsewhere)."""

    kind: str
    name: str  # "gemv", "general" (the general cores) or "matrix_units"
    file: str
    entry: str
    available: Callable[[Device], bool]
    work: Callable[[int, int, int, int], int]


def _always(device: Device) -> bool:
    return True


def _macs(m: int, n: int, k: int, planes: int = 1) -> int:
    return 2 * m * n * k * planes


VARIANTS: tuple[Variant, ...] = (
    Variant("projection", "gemv", "bitlinear.wgsl", "gemv", _always, _macs),
    Variant("projection", "general", "bitlinear.wgsl", "gemm", _always, _macs),
    Variant("projection", "matrix_units", "bitlinear_mma.wgsl", "gemm", int8_matrix_units, _macs),
    Variant("input_grad", "general", "bitlinear_t.wgsl", "gemm_tiled", _always, _macs),
    Variant("input_grad", "matrix_units", "bitlinear_t_mma.wgsl", "gemm_tiled", int8_matrix_units, _macs),
    Variant("lm_head", "gemv", "matmul.wgsl", "gemv", _always, _macs),
    Variant("lm_head", "general", "matmul.wgsl", "gemm_tiled", _always, _macs),
    Variant("lm_head", "matrix_units", "matmul_mma.wgsl", "gemm_tiled", f16_matrix_units, _macs),
    Variant("lm_head_grad", "general", "matmul_t.wgsl", "gemm_tiled", _always, _macs),
    Variant("lm_head_grad", "matrix_units", "matmul_mma.wgsl", "gemm_tiled", f16_matrix_units, _macs),
    Variant("attention", "general", "attention.wgsl", "prefill", _always, _macs),
)


def variant(kind: str, name: str) -> Variant:
    for v in VARIANTS:
        if v.kind == kind and v.name == name:
            return v
    raise KeyError(f"no GEMM variant {name!r} of kind {kind!r}; the table has "
                   f"{[(v.kind, v.name) for v in VARIANTS]}")


# Seconds each timing first runs its work: an idle H100 drops to a low clock (345 MHz seen) in the
# moments a new kernel takes to compile, and work timed straight after came out up to 6× slow.
WARM_UP_S = 0.3


def gpu_seconds(device: Device, launches: list[Launch], repeats: int = 5, inner: int = 3) -> float:
    """The median GPU seconds (timestamps) of ``launches``, recorded ``inner`` times a submit and
    divided, ``repeats`` submits, after running them for ``WARM_UP_S``."""
    def submit() -> float:
        rec = Recorder(device, timestamps=True)
        for _ in range(inner):
            for launch in launches:
                rec.launch(launch)
        return rec.submit() / inner

    until = time.perf_counter() + WARM_UP_S
    while time.perf_counter() < until:
        submit()
    return statistics.median(submit() for _ in range(repeats))


def fastest(device: Device, kind: str, shape: tuple[int, ...], candidates: dict[str, Callable[[], list[Launch]]],
            ) -> str:
    """The name of the fastest of ``candidates`` (variant name → a function building its launches at
    ``shape``) on ``device``: each is timed once per (kind, shape) (``gpu_seconds``), and the answer
    kept in the device's state. The variants give the same values, or values
    within the kind's stated accuracy, so the choice changes only the time. With one candidate, or
    without timestamps, the first. The device's ``gemms`` setting, where it names a variant, wins:
    ValueError where that variant is not among the candidates (the device cannot run it)."""
    names = list(candidates)
    wanted = device.settings.gemms
    if wanted != "measured":
        if wanted not in names:
            raise ValueError(f"the gemms setting asks for {wanted!r} {kind} GEMMs, which this device "
                             f"({device.name}) cannot run; it runs {names}")
        return wanted
    if len(names) == 1 or not device.has_timestamps:
        return names[0]
    choices = device.owned("gemm_choices", dict)
    key = (kind, tuple(shape), tuple(names))
    if key not in choices:
        seconds = {name: gpu_seconds(device, build()) for name, build in candidates.items()}
        choices[key] = min(names, key=seconds.__getitem__)
    return choices[key]
