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

from torch_wgpu_lora import lora, lora_reference
from torch_wgpu_lora.ops.lora import base_plus_lora
from torch_wgpu_lora.ops import lora_gpu
from torch_wgpu_lora.runtime import Buffer, Recorder, get_device, upload
from torch_wgpu_lora.runtime import tensors as lora_ops_tensors
from torch_wgpu_lora.runtime.tensors import resident

from ..concurrency import in_threads

RTOL = 1e-4  # of the reference's max magnitude; see module docstring
SHAPES = [(2560, 2560), (2560, 640), (13, 7), (64, 48)]  # BitNet-2B q_proj and v_proj, odd, small
RANKS = [1, 8, 16, 64, 100]  # 100: lora_up's large-rank branch (more than 16 quads)
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


@pytest.mark.parametrize("tuning", [lora_gpu.GPU_TUNING, lora_gpu.CPU_TUNING,
                                    lora_gpu.Tuning(512, 512, down_quads=1, outer_quads=2, outer_cols=32)],
                         ids=["gpu-tuning", "cpu-tuning", "narrow-workgroups"])
@pytest.mark.parametrize("rows,in_f,out_f,rank", [(1, 2560, 640, 16), (7, 13, 7, 8), (333, 2560, 2560, 64), (40, 300, 20, 3)])
def test_both_launch_tunings_give_the_same_math(tuning, rows, in_f, out_f, rank):
    lora_gpu.set_tuning(tuning)  # the adapter here picks one; both must be right on any adapter
    try:
        run_case(rows, in_f, out_f, rank)
    finally:
        lora_gpu.set_tuning(None)


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
    w = lora_gpu.LoRAWeights(resident(A, "rows4"), resident(B, "cols4"), in_f, out_f)
    xb, dyb = upload(x.numpy()), upload(dy.numpy())
    dA, dBt, dx = Buffer((rank, in_f)), Buffer((rank, out_f)), Buffer((rows, in_f))
    rec = Recorder()
    _, h = lora_gpu.forward(rec, xb, w, s)
    lora_gpu.backward(rec, dyb, xb, h, w, s, dA=dA, dBt=dBt, dx=dx, accumulate=False)
    lora_gpu.backward(rec, dyb, xb, h, w, s, dA=dA, dBt=dBt, dx=dx, accumulate=True, accumulate_dx=True)
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


def test_weights_stay_resident_until_their_values_change(monkeypatch):
    A = torch.randn(4, 16)
    B = torch.randn(8, 4)
    x = torch.randn(3, 16)
    uploads = []
    real_upload = lora_ops_tensors.upload
    monkeypatch.setattr(lora_ops_tensors, "upload", lambda a, d=None: (uploads.append(a.shape), real_upload(a, d))[1])
    lora(x, A, B, 1.0)
    assert sorted(uploads) == sorted([(3, 16), (4, 16), (4, 8)])  # x, A and Bᵀ
    uploads.clear()
    lora(x, A, B, 1.0)
    assert uploads == [(3, 16)]  # only x: the weights are resident
    with torch.no_grad():
        A.data.add_(1.0)  # bypasses the version counter; the value check still sees it
    uploads.clear()
    assert_close(lora(x, A, B, 1.0), lora_reference(x.double(), A.double(), B.double(), 1.0), "after update")
    assert sorted(uploads) == sorted([(3, 16), (4, 16)])


def test_forward_change_weights_forward_then_the_first_backward():
    # Each forward keeps the weights it used: the first graph's backward is refused by autograd
    # (A changed in place), and a graph built after the change is right.
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, 24, generator=g)
    A = torch.randn(4, 24, generator=g, requires_grad=True)
    B = torch.randn(12, 4, generator=g, requires_grad=True)
    dy = torch.randn(7, 12, generator=g)
    y1 = lora(x, A, B, 2.0)
    with torch.no_grad():
        A.add_(0.5)
    y2 = lora(x, A, B, 2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y1.backward(dy)
    y2.backward(dy)
    _, _, dA_ref, dB_ref = reference(x, A, B, 2.0, dy)
    assert_close(A.grad, dA_ref, "dA after the change")
    assert_close(B.grad, dB_ref, "dB after the change")


def test_weights_changed_through_data_between_forward_and_backward_act_as_in_torch():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 24, generator=g)
    A = torch.randn(4, 24, generator=g, requires_grad=True)
    B = torch.randn(12, 4, generator=g, requires_grad=True)
    dy = torch.randn(7, 12, generator=g)
    A0, B0 = A.detach().clone(), B.detach().clone()
    y1 = lora(x, A, B, 2.0)
    A.data.add_(0.5)  # autograd cannot see this: torch's backward then reads the new values
    B.data.mul_(3.0)
    lora(x, A, B, 2.0)
    y1.backward(dy)
    dh = dy @ B.detach()  # torch's own rule uses the tensors' current values for dA
    assert_close(A.grad, 2.0 * (dh.T @ x).double(), "dA from current B (as torch would)")
    assert_close(B.grad, 2.0 * (dy.T @ (x @ A0.T)).double(), "dB from the forward's h")
    A64, B64 = (t.detach().double().requires_grad_() for t in (A0, B0))  # torch itself, same sequence
    y64 = lora_reference(x.double(), A64, B64, 2.0)
    A64.data.add_(0.5)
    B64.data.mul_(3.0)
    y64.backward(dy.double())
    assert_close(A.grad, A64.grad, "dA as torch's")
    assert_close(B.grad, B64.grad, "dB as torch's")


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


def test_rank_limit_comes_from_the_adapter_and_the_largest_rank_runs():
    most = lora_gpu.max_rank(get_device())
    assert most >= 512  # 1024 invocations and 16 KiB of workgroup memory, WebGPU's defaults
    with pytest.raises(ValueError, match=rf"rank must be between 1 and {most} \(this adapter's limit\), "
                                         rf"got A \({most + 1}, 4\)"):
        lora(torch.ones(2, 4), torch.ones(most + 1, 4), torch.ones(3, most + 1), 1.0)


@pytest.mark.parametrize("rank", [130, 512])
def test_large_ranks(rank):
    run_case(19, 40, 36, rank)


def test_tensors_off_the_cpu_are_refused_clearly():
    with pytest.raises(ValueError, match=r"lora: x is on meta; the WebGPU op takes CPU tensors \(move them with .cpu\(\)"):
        lora(torch.ones(2, 4, device="meta"), torch.ones(1, 4), torch.ones(3, 1), 1.0)


def test_scaling_must_be_a_finite_real_number():
    x, A, B = torch.ones(2, 4), torch.ones(1, 4), torch.ones(3, 1)
    with pytest.raises(ValueError, match="scaling must be finite in float32 .*got nan"):
        lora(x, A, B, float("nan"))
    with pytest.raises(ValueError, match="scaling must be finite in float32 .*got 1e\\+300"):
        lora(x, A, B, 1e300)
    with pytest.raises(TypeError, match="scaling must be a real number, got '2'"):
        lora(x, A, B, "2")
    with pytest.raises(TypeError, match="scaling must be a real number, got True"):
        lora(x, A, B, True)
    expect = lora_reference(x, A, B, 0.5)
    assert torch.equal(lora(x, A, B, np.float32(0.5)), expect) and torch.equal(lora(x, A, B, np.float64(0.5)), expect)


def test_zero_features_are_refused_clearly():
    with pytest.raises(ValueError, match="in_features and out_features must be at least 1"):
        lora(torch.ones(2, 0), torch.ones(1, 0), torch.ones(3, 1), 1.0)
    with pytest.raises(ValueError, match="in_features and out_features must be at least 1"):
        lora(torch.ones(2, 4), torch.ones(1, 4), torch.ones(0, 1), 1.0)


def test_tensors_with_the_negative_bit_are_read_by_value():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 12, generator=g)
    A, B = torch.randn(3, 12, generator=g), torch.randn(6, 3, generator=g)
    neg_x = torch._neg_view(x)
    assert neg_x.is_neg()
    assert_close(lora(neg_x, A, B, 1.0), lora_reference(-x.double(), A.double(), B.double(), 1.0), "neg view")


def test_rows_past_the_grid_limit_are_split_into_calls(monkeypatch):
    # x of shape (600000, 16) needs 75000 workgroups of 8 rows: past 65535. Shrink the limit so
    # a small input exercises the same split.
    device = get_device()
    monkeypatch.setattr(device, "max_workgroups", 4)  # 32 rows per call
    assert lora_gpu.max_rows(device, 16, 4) == 32
    run_case(100, 16, 12, 4)


def test_device_resident_calls_check_their_shapes():
    A, B = torch.randn(4, 16), torch.randn(8, 4)
    w = lora_gpu.LoRAWeights(resident(A, "rows4"), resident(B, "cols4"), 16, 8)
    rec = Recorder()
    with pytest.raises(ValueError, match=r"forward: x is \(3, 20\); expected \[N, 16\]"):
        lora_gpu.forward(rec, Buffer((3, 20)), w, 1.0)
    x = Buffer((3, 16))
    _, h = lora_gpu.forward(rec, x, w, 1.0)
    with pytest.raises(ValueError, match=r"backward: dy is \(3, 12\); expected \[3, 8\]"):
        lora_gpu.backward(rec, Buffer((3, 12)), x, h, w, 1.0, dA=Buffer((4, 16)))
    with pytest.raises(ValueError, match=r"backward: dA is \(4, 12\); expected \(4, 16\)"):
        lora_gpu.backward(rec, Buffer((3, 8)), x, h, w, 1.0, dA=Buffer((4, 12)))
    with pytest.raises(ValueError, match=r"backward: h is \(1, 5, 4\); expected forward's \[splits, 3, 4\]"):
        lora_gpu.backward(rec, Buffer((3, 8)), x, Buffer((1, 5, 4)), w, 1.0, dA=Buffer((4, 16)))
    with pytest.raises(ValueError, match=r"LoRAWeights: A must be \[r, in4\] and Bt \[r, out4\]"):
        lora_gpu.LoRAWeights(resident(A, "rows4"), Buffer((5, 8)), 16, 8)
    with pytest.raises(ValueError, match=r"Bt \(4, 8\) must be 12 wide for 9 features"):
        lora_gpu.LoRAWeights(resident(A, "rows4"), resident(B, "cols4"), 16, 9)


def test_double_backward_matches_torch_for_a_gradient_penalty():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 10, generator=g, dtype=torch.float64, requires_grad=True)
    A = torch.randn(3, 10, generator=g, dtype=torch.float64, requires_grad=True)
    B = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)

    def penalised(fn):
        y = fn(x, A, B, 0.7)
        (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return torch.autograd.grad(y.sum() + (gx ** 2).sum(), (x, A, B))

    ours, theirs = penalised(lora), penalised(lora_reference)
    for name, a, b in zip(("x", "A", "B"), ours, theirs):
        assert_close(a, b.detach(), f"penalised d{name}")
    # float64 in, float32 kernels inside: gradgradcheck at float32's precision
    assert torch.autograd.gradgradcheck(lambda x, A, B: lora(x, A, B, 0.7), (x, A, B), eps=1e-3, atol=1e-2,
                                        rtol=1e-2)


def test_several_threads_share_one_lora_linear_and_every_result_is_right():
    from torch_wgpu_lora import LoRALinear

    torch.manual_seed(10)
    layer = LoRALinear(torch.nn.Linear(48, 40), r=8, lora_alpha=16)
    torch.nn.init.normal_(layer.lora_B)

    def check(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(25):
            x = torch.randn(int(torch.randint(1, 40, (1,), generator=g)), 48, generator=g, requires_grad=True)
            y = layer(x)
            ref = layer.base_layer(x) + lora_reference(x, layer.lora_A, layer.lora_B, layer.scaling)
            assert (y - ref).abs().max() <= 1e-4 * ref.abs().max()
            (gx,) = torch.autograd.grad(y.sum(), x)
            (gx_ref,) = torch.autograd.grad(ref.sum(), x)
            assert (gx - gx_ref).abs().max() <= 1e-4 * gx_ref.abs().max()

    in_threads(check, 3)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_torch_compile_treats_the_op_as_one_opaque_op(fullgraph):
    from torch_wgpu_lora import LoRALinear

    torch.manual_seed(11)
    torch._dynamo.reset()
    model = torch.nn.Sequential(LoRALinear(torch.nn.Linear(32, 24), r=4, lora_alpha=8), torch.nn.ReLU(),
                                LoRALinear(torch.nn.Linear(24, 16), r=4, lora_alpha=8))
    for m in model:
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_B)
    compiled = torch.compile(model, fullgraph=fullgraph)
    x = torch.randn(5, 32)
    y_eager = model(x)
    y_eager.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    y = compiled(x)
    y.square().sum().backward()
    assert (y - y_eager).abs().max() <= 1e-6 * y_eager.abs().max()
    for p, ref in zip([p for p in model.parameters() if p.requires_grad], eager_grads):
        assert (p.grad - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_torch_library_opcheck():
    # Schema and fake implementation. (test_aot_dispatch_* compares two runs' outputs, and the
    # forward's second output is a fresh token per call by design; the compile tests above
    # check compiled against eager instead.)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(5, 12, generator=g, requires_grad=True)
    A = torch.randn(3, 12, generator=g, requires_grad=True)
    B = torch.randn(6, 3, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.torch_wgpu_lora.lora_forward.default, (x, A, B, 0.5, True),
                          test_utils=("test_schema", "test_faketensor"))


# -- base_plus_lora: the adapter's GPU work in flight while the CPU computes the base ---------------

class _LoggedLinear(torch.autograd.Function):
    """x @ W.T that writes its forward and backward into ``log``."""

    @staticmethod
    def forward(ctx, x, W, log):
        log.append("base forward")
        ctx.save_for_backward(x, W)
        ctx.log = log
        return x @ W.T

    @staticmethod
    def backward(ctx, dy):
        x, W = ctx.saved_tensors
        ctx.log.append("base backward")
        return dy @ W, dy.T @ x, None


@pytest.mark.parametrize("in_f, out_f, rows", [(2560, 640, 333), (13, 7, 5), (64, 48, 1), (64, 48, 0)])
def test_base_plus_lora_matches_float64_in_output_and_every_gradient(in_f, out_f, rows):
    g = torch.Generator().manual_seed(13)
    x = torch.randn(rows, in_f, generator=g, requires_grad=True)
    W = torch.randn(out_f, in_f, generator=g, requires_grad=True)
    A = torch.randn(8, in_f, generator=g, requires_grad=True)
    B = torch.randn(out_f, 8, generator=g, requires_grad=True)
    dy = torch.randn(rows, out_f, generator=g)
    y = base_plus_lora(lambda: x @ W.T, x, A, B, 0.5)
    y.backward(dy)
    x64, W64, A64, B64 = (t.detach().double().requires_grad_() for t in (x, W, A, B))
    ref = x64 @ W64.T + lora_reference(x64, A64, B64, 0.5)
    ref.backward(dy.double())
    assert_close(y, ref.detach(), "y")
    for name, ours, theirs in (("x", x, x64), ("W", W, W64), ("A", A, A64), ("B", B, B64)):
        assert_close(ours.grad, theirs.grad, f"d{name}")


def test_base_plus_lora_runs_the_base_while_the_adapter_is_on_the_gpu(monkeypatch):
    from torch_wgpu_lora.runtime import recorder

    log = []
    submit, wait = recorder.Recorder.submit_async, recorder.Pending.wait
    monkeypatch.setattr(recorder.Recorder, "submit_async", lambda self: (log.append("gpu submit"), submit(self))[1])
    monkeypatch.setattr(recorder.Pending, "wait", lambda self: (log.append("gpu wait"), wait(self))[1])
    g = torch.Generator().manual_seed(14)
    x = torch.randn(9, 16, generator=g, requires_grad=True)
    W, A, B = torch.randn(12, 16, generator=g), torch.randn(4, 16, generator=g, requires_grad=True), \
        torch.randn(12, 4, generator=g, requires_grad=True)
    y = base_plus_lora(lambda: _LoggedLinear.apply(x, W, log), x, A, B, 2.0)
    assert log == ["gpu submit", "base forward", "gpu wait"]
    log.clear()
    y.sum().backward()
    assert log == ["gpu submit", "base backward", "gpu wait"]


def test_base_plus_lora_double_backward_matches_float64_for_a_gradient_penalty():
    g = torch.Generator().manual_seed(15)
    x = torch.randn(6, 10, generator=g, requires_grad=True)
    W = torch.randn(7, 10, generator=g)
    A = torch.randn(3, 10, generator=g, requires_grad=True)
    B = torch.randn(7, 3, generator=g, requires_grad=True)

    def penalised(fn, x, A, B):
        y = fn(lambda: x @ W.to(x.dtype).T, x, A, B, 0.7)
        (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        return torch.autograd.grad(y.sum() + (gx ** 2).sum(), (x, A, B))

    ours = penalised(base_plus_lora, x, A, B)
    theirs = penalised(lambda base, *args: base() + lora_reference(*args),
                       *(t.detach().double().requires_grad_() for t in (x, A, B)))
    for name, a, b in zip(("x", "A", "B"), ours, theirs):
        assert_close(a, b.detach(), f"penalised d{name}")


def test_base_plus_lora_with_a_frozen_adapter_still_trains_the_base():
    g = torch.Generator().manual_seed(16)
    x, A, B = torch.randn(5, 16, generator=g), torch.randn(4, 16, generator=g), torch.randn(8, 4, generator=g)
    W = torch.randn(8, 16, generator=g, requires_grad=True)
    base_plus_lora(lambda: x @ W.T, x, A, B, 1.0).square().sum().backward()
    W64 = W.detach().double().requires_grad_()
    (x.double() @ W64.T + lora_reference(x.double(), A.double(), B.double(), 1.0)).square().sum().backward()
    assert_close(W.grad, W64.grad, "dW")


def test_base_plus_lora_names_a_base_output_of_the_wrong_shape_and_passes_on_a_base_error():
    x, A, B = torch.randn(5, 16), torch.randn(4, 16), torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"the base layer returned \(5, 9\); expected \(5, 8\)"):
        base_plus_lora(lambda: torch.zeros(5, 9), x, A, B, 1.0)

    def broken():
        raise KeyError("base")

    with pytest.raises(KeyError, match="base"):
        base_plus_lora(broken, x, A, B, 1.0)
    assert_close(base_plus_lora(lambda: torch.zeros(5, 8), x, A, B, 1.0),
                 lora_reference(x.double(), A.double(), B.double(), 1.0), "after the errors")
