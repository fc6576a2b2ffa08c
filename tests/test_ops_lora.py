"""LoRAFunction / lora against a float64 torch reference.

Tolerance: float32 kernels against float64 torch, max |ours - ref| <= 1e-4 * max |ref|
per output (relative to the reference's scale). Reason: float32 keeps 24 bits
(eps 6e-8); sums of up to 2560 terms (or 2048 rows) in a different order than torch
grow the error by about sqrt(K)·eps ~ 3e-6 of the scale, so 1e-4 leaves 30x margin
while still catching any indexing or accumulation bug (those give O(1) errors).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_wgpu_lora import LoRAFunction, lora, lora_reference
from torch_wgpu_lora.ops import lora as lora_ops
from torch_wgpu_lora.runtime import Buffer, Recorder, get_device, upload

RTOL = 1e-4  # of the reference's max magnitude; see module docstring
SHAPES = [(2560, 2560), (2560, 640), (13, 7), (64, 48)]  # BitNet-2B q_proj and v_proj, odd, small
RANKS = [1, 8, 16, 64]
ROWS = [0, 1, 7, 333, 2048]


def assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.shape == ref.shape, what
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (got.double() - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= RTOL * max(scale, 1e-30), f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def reference(x, A, B, s, dy):
    x64, A64, B64 = (t.detach().double().requires_grad_() for t in (x, A, B))
    y = lora_reference(x64, A64, B64, s)
    y.backward(dy.double())
    return y.detach(), x64.grad, A64.grad, B64.grad


def run_case(rows: int, in_f: int, out_f: int, rank: int, scaling: float = 0.75, lead=()):
    g = torch.Generator().manual_seed(rows * 7919 + in_f * 31 + out_f * 7 + rank)
    x = torch.randn(*lead, rows, in_f, generator=g, requires_grad=True)
    A = (torch.randn(rank, in_f, generator=g) / in_f**0.5).requires_grad_()
    B = torch.randn(out_f, rank, generator=g).requires_grad_()
    dy = torch.randn(*lead, rows, out_f, generator=g)
    y = lora(x, A, B, scaling)
    y.backward(dy)
    y_ref, dx_ref, dA_ref, dB_ref = reference(x, A, B, scaling, dy)
    tag = f"N={rows} {in_f}->{out_f} r={rank}"
    assert_close(y, y_ref, f"y {tag}")
    assert_close(x.grad, dx_ref, f"dx {tag}")
    assert_close(A.grad, dA_ref, f"dA {tag}")
    assert_close(B.grad, dB_ref, f"dB {tag}")


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("in_f,out_f", SHAPES)
def test_forward_and_every_gradient_match_float64(in_f, out_f, rank, rows):
    run_case(rows, in_f, out_f, rank)


@pytest.mark.parametrize("tuning", [lora_ops.GPU_TUNING, lora_ops.CPU_TUNING,
                                    lora_ops.Tuning(512, 512, down_quads=1, outer_quads=2, outer_cols=32)],
                         ids=["gpu-tuning", "cpu-tuning", "narrow-workgroups"])
@pytest.mark.parametrize("rows,in_f,out_f,rank", [(1, 2560, 640, 16), (7, 13, 7, 8), (333, 2560, 2560, 64), (40, 300, 20, 3)])
def test_both_launch_tunings_give_the_same_math(tuning, rows, in_f, out_f, rank):
    lora_ops.set_tuning(tuning)  # the adapter here picks one; both must be right on any adapter
    try:
        run_case(rows, in_f, out_f, rank)
    finally:
        lora_ops.set_tuning(None)


def test_three_dimensional_input():
    run_case(5, 48, 40, 8, lead=(3,))


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(64, 30, generator=g)
    x = base.T.requires_grad_()          # [30, 64], transposed storage
    A_big = torch.randn(8, 128, generator=g)
    A = A_big[:, ::2].requires_grad_()   # [8, 64], strided
    B = torch.randn(8, 40, generator=g).T.requires_grad_()  # [40, 8], transposed
    dy = torch.randn(40, 30, generator=g).T  # non-contiguous upstream gradient
    y = lora(x, A, B, 2.0)
    y.backward(dy)
    y_ref, dx_ref, dA_ref, dB_ref = reference(x, A, B, 2.0, dy)
    assert_close(y, y_ref, "y")
    assert_close(x.grad, dx_ref, "dx")
    assert_close(A.grad, dA_ref, "dA")
    assert_close(B.grad, dB_ref, "dB")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_compute_in_float32_and_return_their_dtype(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 32, generator=g).to(dtype).requires_grad_()
    A = torch.randn(4, 32, generator=g).to(dtype).requires_grad_()
    B = torch.randn(24, 4, generator=g).to(dtype).requires_grad_()
    y = lora(x, A, B, 0.5)
    y.sum().backward()
    assert y.dtype == dtype and x.grad.dtype == dtype and A.grad.dtype == dtype and B.grad.dtype == dtype
    y32 = lora_reference(x.float(), A.float(), B.float(), 0.5)
    # The only error is the final rounding to dtype: half an ulp of the output's magnitude.
    eps = torch.finfo(dtype).eps
    assert (y.float() - y32).abs().max() <= eps * y32.abs().max()


def test_gradients_accumulate_over_two_backward_calls():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 20, generator=g)
    A = torch.randn(4, 20, generator=g, requires_grad=True)
    B = torch.randn(12, 4, generator=g, requires_grad=True)
    dy1, dy2 = torch.randn(11, 12, generator=g), torch.randn(11, 12, generator=g)
    lora(x, A, B, 1.5).backward(dy1)
    lora(x, A, B, 1.5).backward(dy2)
    _, _, dA1, dB1 = reference(x, A, B, 1.5, dy1)
    _, _, dA2, dB2 = reference(x, A, B, 1.5, dy2)
    assert_close(A.grad, dA1 + dA2, "accumulated dA")
    assert_close(B.grad, dB1 + dB2, "accumulated dB")


def test_kernels_keep_plus_equals_semantics_on_the_device():
    """backward(accumulate=True) adds into dA, dBᵀ and dx: micro-batch accumulation without a round trip."""
    g = torch.Generator().manual_seed(4)
    rows, in_f, out_f, rank, s = 50, 32, 24, 4, 0.5
    x, dy = torch.randn(rows, in_f, generator=g), torch.randn(rows, out_f, generator=g)
    A, B = torch.randn(rank, in_f, generator=g), torch.randn(out_f, rank, generator=g)
    w = lora_ops.resident_weights(A, B)
    xb, dyb = upload(x.numpy()), upload(dy.numpy())
    dA, dBt, dx = Buffer((rank, in_f)), Buffer((rank, out_f)), Buffer((rows, in_f))
    rec = Recorder()
    _, h = lora_ops.forward(rec, xb, w, s)
    lora_ops.backward(rec, dyb, xb, h, w, s, dA=dA, dBt=dBt, dx=dx, accumulate=False)
    lora_ops.backward(rec, dyb, xb, h, w, s, dA=dA, dBt=dBt, dx=dx, accumulate=True, accumulate_dx=True)
    out = {k: np.zeros(b.shape, np.float32) for k, b in (("dA", dA), ("dBt", dBt), ("dx", dx))}
    for k, b in (("dA", dA), ("dBt", dBt), ("dx", dx)):
        rec.read(b, out[k])
    rec.submit()
    _, dx_ref, dA_ref, dB_ref = reference(x, A, B, s, dy)
    assert_close(torch.from_numpy(out["dA"]), 2 * dA_ref, "2·dA")
    assert_close(torch.from_numpy(out["dBt"]).T, 2 * dB_ref, "2·dB")
    assert_close(torch.from_numpy(out["dx"]), 2 * dx_ref, "2·dx")


def test_only_requested_gradients_are_computed(monkeypatch):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 16, generator=g)  # no grad wanted for x
    A = torch.randn(2, 16, generator=g)  # frozen
    B = torch.randn(8, 2, generator=g, requires_grad=True)
    calls = []
    real_dispatch = Recorder.dispatch
    monkeypatch.setattr(Recorder, "dispatch", lambda self, k, *a, **kw: (calls.append(k.name), real_dispatch(self, k, *a, **kw)))
    y = lora(x, A, B, 1.0)
    calls.clear()
    y.sum().backward()
    assert x.grad is None and A.grad is None and B.grad is not None
    assert "lora_outer.wgsl:outer" in calls  # gradB only: no dh (lora_down) or dx (lora_up) pass
    assert not any(name.startswith(("lora_down", "lora_up")) for name in calls)
    _, _, _, dB_ref = reference(x, A, B, 1.0, torch.ones(6, 8))
    assert_close(B.grad, dB_ref, "dB")


def test_weights_stay_resident_until_their_values_change():
    A = torch.randn(4, 16)
    B = torch.randn(8, 4)
    first = lora_ops.resident_weights(A, B)
    assert lora_ops.resident_weights(A, B).A is first.A  # unchanged: no upload
    with torch.no_grad():
        A.data.add_(1.0)  # bypasses the version counter; the value check still sees it
    second = lora_ops.resident_weights(A, B)
    assert second.A is not first.A and second.Bt is first.Bt
    x = torch.randn(3, 16)
    assert_close(lora(x, A, B, 1.0), lora_reference(x.double(), A.double(), B.double(), 1.0), "after update")


def test_inputs_larger_than_one_binding_are_split_into_row_chunks(monkeypatch):
    device = get_device()
    monkeypatch.setattr(device, "max_binding", 64 * 4 * 10)  # 10 rows of 64 floats per binding
    run_case(37, 64, 40, 4)


def test_zero_rows():
    x = torch.zeros(0, 16, requires_grad=True)
    A = torch.randn(4, 16, requires_grad=True)
    B = torch.randn(8, 4, requires_grad=True)
    y = lora(x, A, B, 1.0)
    y.sum().backward()
    assert y.shape == (0, 8) and torch.count_nonzero(A.grad) == 0 and torch.count_nonzero(B.grad) == 0


def test_integer_inputs_raise_type_error():
    with pytest.raises(TypeError, match=r"lora: x has dtype torch.int64; expected a floating dtype"):
        lora(torch.ones(2, 4, dtype=torch.int64), torch.ones(1, 4), torch.ones(3, 1), 1.0)
    with pytest.raises(TypeError, match=r"lora: A has dtype torch.int32"):
        lora(torch.ones(2, 4), torch.ones(1, 4, dtype=torch.int32), torch.ones(3, 1), 1.0)


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"x \(2, 5\) does not match A \(1, 4\)"):
        lora(torch.ones(2, 5), torch.ones(1, 4), torch.ones(3, 1), 1.0)
    with pytest.raises(ValueError, match=r"B \(3, 2\) does not match A \(1, 4\)"):
        lora(torch.ones(2, 4), torch.ones(1, 4), torch.ones(3, 2), 1.0)
    with pytest.raises(ValueError, match=r"A and B must be 2-D, got A \(4,\)"):
        lora(torch.ones(2, 4), torch.ones(4), torch.ones(3, 1), 1.0)


def test_rank_outside_the_supported_range_is_refused():
    with pytest.raises(ValueError, match=r"rank must be between 1 and 512, got A \(513, 4\)"):
        lora(torch.ones(2, 4), torch.ones(513, 4), torch.ones(3, 513), 1.0)


def test_tensors_off_the_cpu_are_refused_clearly():
    with pytest.raises(ValueError, match=r"lora: x is on meta; the WebGPU op takes CPU tensors \(move them with .cpu\(\)"):
        lora(torch.ones(2, 4, device="meta"), torch.ones(1, 4), torch.ones(3, 1), 1.0)


def test_scaling_must_be_a_finite_number():
    with pytest.raises(TypeError, match="scaling must be a finite Python number, got nan"):
        lora(torch.ones(2, 4), torch.ones(1, 4), torch.ones(3, 1), float("nan"))


def test_function_apply_is_the_same_op():
    x, A, B = torch.randn(4, 8), torch.randn(2, 8), torch.randn(6, 2)
    assert torch.equal(LoRAFunction.apply(x, A, B, 0.5), lora(x, A, B, 0.5))
