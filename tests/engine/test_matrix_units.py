"""The GEMMs on the matrix units (int8 subgroup matrices; f16 for the LM head; through Dawn) against their
torch references, on shapes whose tiles are cut by every edge and whose sums are not whole steps, with
more than one workgroup shape: the kernels are generic over the adapter's matrix configuration, so
these run on NVIDIA's 16 × 16 × 32 (16 × 16 × 16 f16) matrices and on lavapipe's 8 × 8 × 8
(``scripts/matrix-units-lavapipe.sh``).

Marked ``matrix_units``: they need a device with int8 (and for the LM head's, f16) subgroup matrices,
and fail (never skip) without.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_wgpu_lora.engine.config import pad
from torch_wgpu_lora.engine.kernels.bitlinear import (bitlinear_launch, bitlinear_reference, bitlinear_split_launch,
                                                    bitlinear_t_launch, bitlinear_t_reference)
from torch_wgpu_lora.engine.kernels.gemms import (INPUT_GRAD_MANY_TOKENS_TILE, WIDE_TILE, MmaTile, default_tile,
                                                   f16_matrix_units, int8_matrix_units, mma_shape)
from torch_wgpu_lora.engine.kernels.matmul import (f16_pairs_launch, float32_gemm_bound, matmul_mma_launch,
                                                   matmul_reference, matmul_t_mma_launches, matmul_t_reference)
from torch_wgpu_lora.engine.kernels.norm import rmsnorm_launch
from torch_wgpu_lora.engine.kernels.projection import lora_table
from torch_wgpu_lora.engine.weights import Projection, float_rows, pack_ternary
from torch_wgpu_lora.runtime import get_device, upload

from .helpers import assert_close, assert_codes_round, kernel_workspace, padded, poisoned, run
from .test_kernels import _codes, _projection, rope_epilogue_case

pytestmark = pytest.mark.matrix_units

# The input gradient's tiles: the default (4 digit planes, 4 × 2 matrices a subgroup), one of a
# single row of matrices with a short step and unpadded results, and the one of many tokens (2 × 4
# matrices, steps of 128), so that the staging and the epilogue are checked at three shapes.
INPUT_GRAD_TILES = {"default": None,
                    "narrow": MmaTile(sub_m=4, digits=4, sub_n=2, tm=1, tn=4, kstep=64, result_pad=0),
                    "many-tokens": INPUT_GRAD_MANY_TOKENS_TILE}

U = 2.0 ** -24  # float32's unit roundoff


@pytest.fixture(autouse=True)
def _matrix_units():
    assert int8_matrix_units(get_device()), "run on a device with int8 subgroup matrices"


def _ternary(rows: int, k: int, divide: bool, g: torch.Generator):
    values = torch.randint(-1, 2, (rows, k), generator=g, dtype=torch.int8)
    scales = torch.rand(rows, generator=g) + 0.5
    return values, scales, Projection(upload(pack_ternary(values)), upload(scales.numpy()), rows, k, divide)


def _float32_gemm_error(dy: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, divide: bool,
                        ref: torch.Tensor) -> float:
    """The error against float64 of the same input gradient as a float32 GEMM: torch's, on the same data."""
    c = 1 / scales if divide else scales
    return float(((dy * c[None, :]) @ values.float() - ref).abs().max())


# The forward's tiles: the default for the shape (WIDE_TILE where it has that many outputs), the
# wide one everywhere, and a small one with a short step and unpadded results.
PROJECTION_TILES = {"default": None, "wide": WIDE_TILE,
                    "small": MmaTile(sub_m=2, sub_n=2, tm=1, tn=2, kstep=64, result_pad=0)}
# BitNet-2B's own shapes on GPUs; on a CPU adapter (lavapipe) the small ones alone.
SHAPES = [(1, 64, 8), (37, 100, 130), (40, 1100, 72), (200, 2560, 256), (70, 700, 300),
          (9, 256, 8200)]  # a decoding step's wide projection: DECODE_WIDE_TILE by default
GPU_SHAPES = [(512, 2560, 13824), (300, 6912, 2560)]


@pytest.mark.parametrize("tile", list(PROJECTION_TILES))
@pytest.mark.parametrize("splits", [1, 3], ids=["one-range", "split-k"])
@pytest.mark.parametrize("mode", ["store", "add", "gate_up"])
@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("tokens,k,rows", SHAPES + GPU_SHAPES)
def test_projection_on_the_matrix_units_gives_the_gemms_integers(mode, divide, tokens, k, rows, tile, splits):
    # the same exact integer dots and the same epilogue: equal to the general-core GEMM bit for bit,
    # with LoRA segments and the kept sums or pairs; tokens, rows and K past the tiles included; split
    # along K, the ranges' integer sums added by the epilogue's launch (a range may be empty)
    if (tokens, k, rows) in GPU_SHAPES and get_device().is_cpu:
        return  # minutes on a CPU adapter; the small shapes cut the same edges
    g = torch.Generator().manual_seed(tokens + k + rows)
    codes, scales, xq, xm = _codes(tokens, k, g)
    values = torch.randint(-1, 2, (rows, k), generator=g, dtype=torch.int8)
    row_scales = torch.rand(rows, generator=g) + 0.5
    proj = _projection(values, row_scales, divide)
    rank = 3
    h = torch.randn(tokens, rank, generator=g)
    B = torch.randn(rows, rank, generator=g)
    lb = np.concatenate([np.zeros(4, np.float32), B.numpy().ravel()])
    table = lora_table([(0, rows, 1, 0, 0.5, 4, rank)])
    width = rows // 2 if mode == "gate_up" else rows
    residual = torch.randn(tokens, width, generator=g)
    got = {}
    for mma in (True, False):
        out = upload(residual.numpy().copy()) if mode == "add" else poisoned((tokens, width))
        aux = poisoned((tokens, rows + 4))
        launches = bitlinear_launch(xq, xm, proj, out, tokens=tokens, out_stride=width, mode=mode, h=upload(h.numpy()),
                                    lora_rank=rank, lora=upload(table), lora_b=upload(lb), segments=1, saved=aux,
                                    gemv=False, mma=mma, tile=PROJECTION_TILES[tile] if mma else None,
                                    splits=splits if mma else None)
        names = ["bitlinear_mma.wgsl:gemm", "bitlinear_mma.wgsl:split_epilogue"][:2 if splits > 1 else 1]
        assert [launch.kernel.name for launch in launches] == (names if mma else ["bitlinear.wgsl:gemm"])
        got[mma] = run(launches, out, aux)
    for ours, theirs in zip(got[True], got[False]):
        assert torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))  # NaN: unwritten in both
    if mode == "store":
        ref = bitlinear_reference(codes, scales, values, row_scales, divide) + 0.5 * h.double() @ B.double().T
        # float32 scaling and LoRA sum beside the exact dot: the tolerance of the gemm test with LoRA
        assert_close(got[True][0], ref, 1e-5, "bitlinear on the matrix units")


@pytest.mark.parametrize("tile", list(INPUT_GRAD_TILES))
@pytest.mark.parametrize("splits", [1, 3], ids=["one-range", "split-k"])
@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("tokens,rows,k", [(1, 8, 64), (37, 70, 100), (64, 96, 192), (33, 300, 130),
                                          (130, 2560, 40), (17, 1000, 700)])
def test_input_gradient_on_the_matrix_units_is_as_exact_as_a_float32_gemm(tokens, rows, k, divide, splits, tile):
    # The bound: no larger than torch's float32 GEMM's error on the same data, or one float32 rounding
    # of the result (u · max |ref|) where that GEMM happens to be exact (a short sum). The digits keep
    # each value to 2⁻²⁷ of its row's largest and sum exactly: a float32 GEMM rounds at every step.
    g = torch.Generator().manual_seed(tokens * 7 + rows + k)
    dy = torch.randn(tokens, rows, generator=g) * torch.exp(2 * torch.randn(tokens, 1, generator=g))
    values, scales, proj = _ternary(rows, k, divide, g)
    out = poisoned((tokens, pad(k, 64)))
    launches = bitlinear_t_launch(upload(dy.numpy()), proj, out, tokens=tokens, k=k, splits=splits, mma=True,
                                  tile=INPUT_GRAD_TILES[tile], workspace=kernel_workspace())
    assert launches[1].kernel.name == "bitlinear_t_mma.wgsl:gemm_tiled"
    assert len(launches) == (3 if splits > 1 else 2)  # digits, the GEMM, the ranges' sum
    (got,) = run(launches, out)
    ref = bitlinear_t_reference(dy, values, scales, divide)
    assert torch.isfinite(got[:, :k]).all(), "unwritten outputs"
    err = float((got[:, :k].double() - ref).abs().max())
    bound = max(_float32_gemm_error(dy, values, scales, divide, ref), U * float(ref.abs().max()))
    assert err <= bound, f"error {err:.3g} against float64; a float32 GEMM's bound {bound:.3g}"


@pytest.mark.parametrize("digits", [2, 3])
@pytest.mark.parametrize("tokens,rows,k", [(37, 70, 100), (33, 1000, 130), (70, 300, 700)])
def test_input_gradient_with_fewer_digits_keeps_within_their_bound(tokens, rows, k, digits):
    # The input_grad_digits setting's less exact mode, taken by the launch as its default tile. Its
    # bound, per output: D digits keep each x = dy ∘ c to 2^(1 − 7D) of its row's largest |x| (D − 1
    # digits after the first in [32, 64), each half an ulp of the last), the integer sums are exact,
    # and the epilogue's D − 1 roundings plus x's own add under (2.1·D + 1)·u of the same scale, so
    # |err[n][k]| <= max_j |x[n][j]| · nnz_k · (2^(1 − 7D) + (2.1·D + 1)·u), nnz_k the column's
    # nonzero weights. A digit plane lost or misplaced errs by about 2⁻⁷ of the row's largest value
    # times the square root of nnz_k, several times this bound at these sizes.
    device = get_device()
    g = torch.Generator().manual_seed(tokens + rows + k + digits)
    dy = torch.randn(tokens, rows, generator=g) * torch.exp(2 * torch.randn(tokens, 1, generator=g))
    values, scales, proj = _ternary(rows, k, True, g)
    out = poisoned((tokens, pad(k, 64)))
    previous = device.configure(input_grad_digits=digits)
    try:
        launches = bitlinear_t_launch(upload(dy.numpy()), proj, out, tokens=tokens, k=k, mma=True,
                                      workspace=kernel_workspace())
    finally:
        device.configure(previous)
    assert launches[1].kernel.constants["DIGITS"] == digits
    (got,) = run(launches, out)
    ref = bitlinear_t_reference(dy, values, scales, True)
    x = (dy.double() / scales.double()[None, :]).abs().amax(dim=1, keepdim=True)  # each row's largest |x|
    nnz = (values != 0).double().sum(dim=0, keepdim=True)  # [1, k]
    bound = x * nnz * (2.0 ** (1 - 7 * digits) + (2.1 * digits + 1) * U)
    err = (got[:, :k].double() - ref).abs()
    assert (err <= bound).all(), f"error {float((err / bound).max()):.3g} times the bound with {digits} digits"


@pytest.mark.parametrize("tile", list(INPUT_GRAD_TILES))
@pytest.mark.parametrize("tokens,rows,k", [(37, 70, 100), (130, 40, 2560)])
def test_input_gradient_on_the_matrix_units_adds_with_lora(tokens, rows, k, tile):
    # accumulate into a residual gradient, plus the adapters' dh·A: as the general kernel's test
    g = torch.Generator().manual_seed(tokens + rows + k)
    dy = torch.randn(tokens, rows, generator=g)
    values, scales, proj = _ternary(rows, k, True, g)
    rank = 5
    dh, A = torch.randn(tokens, rank, generator=g), torch.randn(rank, k, generator=g)
    base = torch.randn(tokens, pad(k, 64), generator=g)
    out = upload(base.numpy().copy())
    launches = bitlinear_t_launch(upload(dy.numpy()), proj, out, tokens=tokens, k=k, accumulate=True,
                                  dh=upload(dh.numpy()), lora_a=upload(padded(A, pad(k, 64))), lora_rank=rank,
                                  mma=True, tile=INPUT_GRAD_TILES[tile], workspace=kernel_workspace())
    (got,) = run(launches, out)
    ref = base[:, :k].double() + bitlinear_t_reference(dy, values, scales, True) + dh.double() @ A.double()
    assert_close(got[:, :k], ref, 1e-5, "dx")  # test_backward_kernels.py's float32 tolerance
    assert torch.equal(got[:, k:], base[:, k:])  # padding columns untouched


def test_input_gradient_rows_that_are_not_finite_give_nan_and_leave_the_others_alone():
    g = torch.Generator().manual_seed(3)
    tokens, rows, k = 6, 70, 100
    dy = torch.randn(tokens, rows, generator=g)
    dy[1, 5] = float("inf")
    dy[4, 0] = float("nan")
    dy[2] = 0.0  # an all-zero row: zeros, not NaN
    dy[3] *= 1e-30  # a row of tiny values: scaled by 2^106 into its digits
    values, scales, proj = _ternary(rows, k, True, g)
    out = poisoned((tokens, pad(k, 64)))
    (got,) = run(bitlinear_t_launch(upload(dy.numpy()), proj, out, tokens=tokens, k=k, mma=True,
                                    workspace=kernel_workspace()), out)
    assert torch.isnan(got[[1, 4], :k]).all()
    assert (got[2, :k] == 0).all()
    ok = [0, 2, 3, 5]
    ref = bitlinear_t_reference(dy[ok], values, scales, True)
    for row, r in zip(ok, ref):
        # each row to float32 accuracy of its own scale (row 3's is 1e-30 of the others')
        assert_close(got[row, :k], r, 1e-5, f"row {row}", terms=1.0)


def test_tiles_that_do_not_fit_are_refused_with_what_they_need():
    device = get_device()
    with pytest.raises(ValueError, match="kstep a multiple of 64"):
        mma_shape(device, MmaTile(kstep=96))
    with pytest.raises(ValueError, match="tm and tn from 1 to 4"):
        mma_shape(device, MmaTile(tm=8, tn=4))
    with pytest.raises(ValueError, match="digits 1 or sub_m"):
        mma_shape(device, MmaTile(digits=3))


# ---- the LM head on f16 matrix units (bfloat16 weights; matmul_mma.wgsl) ----------------------------

def _head_weights(rows: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, Projection]:
    """bfloat16 weights of an embedding's scale, a few of them 2⁻³⁰ smaller (exact in f16 only once
    the matrix is scaled by its power of two)."""
    w = torch.randn(rows, k, generator=g) * 0.02
    w[torch.rand(rows, k, generator=g) < 0.05] *= 2.0 ** -30
    w = w.bfloat16()
    return w, Projection(upload(float_rows(w, True)), None, rows, k)


def _rows_scaled(tokens: int, width: int, g: torch.Generator) -> torch.Tensor:
    """Rows whose scales differ by up to e⁶ each way, as the split's per-row powers of two must absorb."""
    return torch.randn(tokens, width, generator=g) * torch.exp(3 * torch.randn(tokens, 1, generator=g))


def _f16_only_error(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    """The error of the same product with each row of a rounded to f16 after its power of two (the hi
    plane alone, summed exactly): what the lo plane is there to remove."""
    m = a.abs().amax(1, keepdim=True).clamp_min(1e-30)
    s = torch.exp2(14 - torch.floor(torch.log2(m)) - 1)
    hi = (a * s).half().double() / s.double()
    return float((hi @ b.double() - ref).abs().max())


HEAD_SHAPES = [(1, 64, 8), (37, 100, 130), (70, 256, 300), (33, 640, 1000)]  # tokens, K, vocabulary rows


def _no_worse_than_torch_on_a_gpu(err: float, float32: torch.Tensor, ref: torch.Tensor, sum_length: int,
                                  added: float = 0.0) -> None:
    """On a GPU, also no larger than torch's float32 GEMM's error on the same data: NVIDIA's matrix
    units lose the low bits of their sums as they accumulate (up to 8.5× torch's error when nothing
    drains them; ``matmul.HEAD_DRAIN_TERMS``). On a CPU adapter, whose units round to nearest, the bounds
    above are the test: how torch's own error compares there turns on the host's MKL. As the input
    gradient's test: or one float32 rounding of the result where torch's sum happens to be exact. Sums
    of fewer than 100 terms are left to the bounds above on a GPU too: at 64, torch's can be exact
    where the units' four additions are not (device run 33). ``added``: the error of a sum the kernel
    adds its result into (not torch's)."""
    if not get_device().is_cpu and sum_length >= 100:
        bound = max(float((float32.double() - ref).abs().max()), U * float(ref.abs().max())) + added
        assert err <= bound, f"error {err:.3g} against float64; torch's float32 GEMM's {bound:.3g}"


@pytest.fixture
def _f16_units():
    assert f16_matrix_units(get_device()), "run on a device with f16 subgroup matrices"


# The forward's tiles: the training head's, and a decoding step's of one and two rows of result
# matrices a subgroup.
HEAD_TILES = {"default": None, "sixteen-rows": default_tile("lm_head", 16), "thirty-two-rows": default_tile("lm_head", 32)}


@pytest.mark.usefixtures("_f16_units")
@pytest.mark.parametrize("tile", list(HEAD_TILES))
@pytest.mark.parametrize("tokens,k,rows", HEAD_SHAPES)
def test_lm_head_on_the_matrix_units_keeps_a_float32_gemms_bound(tokens, k, rows, tile):
    # Per output within a float32 GEMM's error bound on the same data (float32_gemm_bound), and in
    # all at most 1/64 of the error of the hi plane alone (the lo plane carries the next 11 bits)
    g = torch.Generator().manual_seed(tokens * 5 + k + rows)
    x = _rows_scaled(tokens, k, g)
    w, proj = _head_weights(rows, k, g)
    xb = upload(padded(x, pad(k, 64)))
    exps = poisoned((tokens,), "i32")
    out = poisoned((tokens, rows + 3))  # a wider row: out_stride and out_offset
    ws = kernel_workspace()
    (got,) = run([f16_pairs_launch(xb, exps, rows=tokens, width=k),
                  matmul_mma_launch(xb, exps, proj, out, tokens=tokens, out_stride=rows + 3, out_offset=2,
                                    tile=HEAD_TILES[tile], workspace=ws)], out)
    ref = matmul_reference(x, w.float())
    err = (got[:, 2:rows + 2].double() - ref).abs()
    assert (err <= float32_gemm_bound(x, w.float().T)).all(), f"largest error {float(err.max()):.3g}"
    assert float(err.max()) <= _f16_only_error(x, w.float().T, ref) / 64
    _no_worse_than_torch_on_a_gpu(float(err.max()), x @ w.float().T, ref, k)
    assert torch.isnan(got[:, :2]).all() and torch.isnan(got[:, rows + 2:]).all()  # outside the columns: untouched


@pytest.mark.usefixtures("_f16_units")
@pytest.mark.parametrize("splits", [1, 3], ids=["one-range", "split-k"])
@pytest.mark.parametrize("tokens,k,rows", HEAD_SHAPES)
def test_lm_head_input_gradient_on_the_matrix_units_keeps_a_float32_gemms_bound(tokens, k, rows, splits):
    # dx (+)= dy[:, a_col:]·W over a vocabulary chunk in the middle of the logits' rows, added to what
    # the other chunks gave; the bounds of the forward's test
    g = torch.Generator().manual_seed(tokens * 3 + k + rows)
    dy = _rows_scaled(tokens, rows + 12, g)
    w, proj = _head_weights(rows, k, g)
    base = torch.randn(tokens, pad(k, 4), generator=g)
    out = upload(base.numpy().copy())
    dyb = upload(dy.numpy().copy())
    exps = poisoned((tokens,), "i32")
    ws = kernel_workspace()
    launches = [f16_pairs_launch(dyb, exps, rows=tokens, width=rows + 12),
                *matmul_t_mma_launches(dyb, exps, proj, out, tokens=tokens, k=k, a_col=8, accumulate=True,
                                       splits=splits, workspace=ws)]
    assert len(launches) == (3 if splits > 1 else 2)
    (got,) = run(launches, out)
    chunk = dy[:, 8:rows + 8]
    ref = matmul_t_reference(chunk, w.float())
    err = (got[:, :k].double() - base[:, :k].double() - ref).abs()
    # the sum with base rounds once more: u of it
    bound = float32_gemm_bound(chunk, w.float()) + U * (base[:, :k].double().abs() + ref.abs())
    assert (err <= bound).all(), f"largest error {float(err.max()):.3g}"
    assert float(err.max()) <= _f16_only_error(chunk, w.float(), ref) / 64
    _no_worse_than_torch_on_a_gpu(float(err.max()), chunk @ w.float(), ref, rows,
                                  U * float((base[:, :k].double() + ref).abs().max()))
    assert torch.equal(got[:, k:], base[:, k:])  # padding columns untouched


@pytest.mark.usefixtures("_f16_units")
def test_lm_head_rows_that_are_not_finite_give_nan_and_weights_that_are_not_are_refused():
    g = torch.Generator().manual_seed(11)
    tokens, k, rows = 6, 100, 70
    x = torch.randn(tokens, k, generator=g)
    x[1, 5] = float("inf")
    x[4, 0] = float("nan")
    x[2] = 0.0  # an all-zero row: zeros, not NaN
    x[3] *= 1e-30  # a row of tiny values: scaled by 2^113 into its pairs
    w, proj = _head_weights(rows, k, g)
    xb = upload(padded(x, pad(k, 64)))
    exps = poisoned((tokens,), "i32")
    out = poisoned((tokens, rows))
    (got,) = run([f16_pairs_launch(xb, exps, rows=tokens, width=k),
                  matmul_mma_launch(xb, exps, proj, out, tokens=tokens, out_stride=rows, workspace=kernel_workspace())],
                 out)
    assert torch.isnan(got[[1, 4]]).all()
    assert (got[2] == 0).all()
    ok = [0, 3, 5]
    for row, r in zip(ok, matmul_reference(x[ok], w.float())):
        assert_close(got[row], r, 1e-5, f"row {row}")  # each row to float32 accuracy of its own scale
    bad = w.clone()
    bad[3, 7] = float("inf")
    bad_proj = Projection(upload(float_rows(bad, True)), None, rows, k)
    with pytest.raises(ValueError, match="LM head's weights .* hold an infinity or NaN"):
        matmul_mma_launch(xb, exps, bad_proj, out, tokens=tokens, out_stride=rows, workspace=kernel_workspace())


@pytest.mark.usefixtures("_f16_units")
def test_lm_head_tiles_that_do_not_fit_are_refused_with_what_they_need():
    device = get_device()
    with pytest.raises(ValueError, match="two planes"):
        mma_shape(device, MmaTile(digits=1, sub_m=2, kstep=32), "f16")
    with pytest.raises(ValueError, match="kstep a multiple of 8"):
        mma_shape(device, MmaTile(digits=2, sub_m=2, kstep=36), "f16")
    x = upload(np.zeros((4, 64), np.float32))
    with pytest.raises(ValueError, match="kstep must divide the 128 terms summed between drains"):
        f16_pairs_launch(x, upload(np.zeros(4, np.int32)), rows=4, width=64,
                         tile=MmaTile(digits=2, sub_m=2, sub_n=4, tm=1, tn=1, kstep=48))


@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("pairs", [False, True], ids=["add", "gate-up"])
@pytest.mark.parametrize("tokens,k,features", [(1, 64, 68), (9, 300, 2560), (6, 130, 6912)])
def test_a_norm_finishes_a_split_projections_epilogue(tokens, k, features, pairs, divide):
    # o_proj's add or gate/up's products, made from the split GEMM's sums by the next norm's launch,
    # then normalised and quantised: the rows against float64 (the exact dots scaled), the norm
    # against transformers' module on the rows the launch made, the codes BitLinear's rounding
    from transformers.models.bitnet.modeling_bitnet import BitNetRMSNorm

    g = torch.Generator().manual_seed(tokens + k + features)
    codes, scales, xq, xm = _codes(tokens, k, g)
    rows = 2 * features if pairs else features
    values = torch.randint(-1, 2, (rows, k), generator=g, dtype=torch.int8)
    row_scales = torch.rand(rows, generator=g) + 0.5
    proj = _projection(values, row_scales, divide)
    stride = pad(features, 64)
    residual = torch.randn(tokens, stride, generator=g)
    x = upload(residual.numpy().copy()) if not pairs else poisoned((tokens, stride))
    norm = BitNetRMSNorm(features, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(features, generator=g) + 0.5)
    xn, next_codes = poisoned((tokens, stride)), poisoned((tokens, stride // 4), "u32")
    gemm, split = bitlinear_split_launch(xq, xm, proj, x, tokens=tokens, mode="gate_up" if pairs else "add",
                                         workspace=kernel_workspace(), mma=True, splits=3)
    launch = rmsnorm_launch(x, upload(norm.weight.detach().numpy()), xn, tokens=tokens, k=features, eps=1e-5,
                            codes=next_codes, scales_and_sums=xm, split=split)
    got_x, got_xn, got_codes, got_meta = run([gemm, launch], x, xn, next_codes, xm)
    exact = bitlinear_reference(codes, scales, values, row_scales, divide)
    if pairs:
        ref = exact[:, 0::2].clamp(min=0) ** 2 * exact[:, 1::2]
    else:
        ref = residual[:, :features].double() + exact
    # float32 scaling (ws · s, the division) and the add or the products: a few roundings of
    # 2^-24 relative to each value, well under 1e-6 of the rows' largest
    assert_close(got_x[:, :features], ref, 1e-6, "the projection's epilogue")
    with torch.no_grad():
        y = norm(got_x[:, :features])  # transformers' own module, on the rows the launch made
    assert_close(got_xn[:, :features], y, 1e-6, "normalised")
    assert torch.equal(got_xn[:, features:], torch.zeros(tokens, stride - features))
    assert_codes_round(got_codes, got_meta, got_xn, features)


def test_a_norm_finishing_a_split_projection_refuses_what_it_cannot_do():
    g = torch.Generator().manual_seed(1)
    codes, scales, xq, xm = _codes(3, 64, g)
    proj = _projection(torch.randint(-1, 2, (64, 64), generator=g, dtype=torch.int8), torch.rand(64) + 0.5, True)
    x, other, xn, w = poisoned((3, 64)), poisoned((3, 64)), poisoned((3, 64)), upload(np.ones(64, np.float32))
    _, split = bitlinear_split_launch(xq, xm, proj, x, tokens=3, mode="add", workspace=kernel_workspace(), mma=True)
    out_codes = poisoned((3, 16), "u32")
    with pytest.raises(ValueError, match="no LoRA ranks"):
        rmsnorm_launch(x, w, xn, tokens=3, k=64, eps=1e-5, codes=out_codes, scales_and_sums=xm, rank=2,
                       lora_a=poisoned((2, 64)), h=poisoned((3, 2)), split=split)
    with pytest.raises(ValueError, match="split.out"):
        rmsnorm_launch(other, w, xn, tokens=3, k=64, eps=1e-5, codes=out_codes, scales_and_sums=xm, split=split)
    with pytest.raises(ValueError, match="add or gate/up"):
        bitlinear_split_launch(xq, xm, proj, x, tokens=3, mode="store", workspace=kernel_workspace())
    with pytest.raises(ValueError, match="at least two ranges"):
        bitlinear_split_launch(xq, xm, proj, x, tokens=3, mode="add", workspace=kernel_workspace(), splits=1)


def test_a_split_projection_on_the_matrix_units_rotates_q_and_fills_the_caches():
    # decoding a batch's q/k/v on the matrix units: the split epilogue rotates (no rope launch)
    rope_epilogue_case("matrix-units")
    g = torch.Generator().manual_seed(2)
    codes, scales, xq, xm = _codes(2, 64, g)
    proj = _projection(torch.randint(-1, 2, (128, 64), generator=g, dtype=torch.int8), torch.ones(128), True)
    from torch_wgpu_lora.engine.kernels.rope import RopeTarget

    target = RopeTarget(*(poisoned((4,)) for _ in range(5)), heads=4, kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="at least two ranges"):
        bitlinear_launch(xq, xm, proj, poisoned((2, 64)), tokens=2, out_stride=64, mode="rope", rope=target,
                         gemv=False, mma=True, splits=1)
