"""LoRALinear: a drop-in nn.Module around a frozen base layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_wgpu_lora import LoRALinear, lora
from torch_wgpu_lora.modules import LoRASum, PerRowLoRA
from torch_wgpu_lora.init import hesper_uniform

TOL = 1e-5  # float32 output of magnitude ~1 from sums of 64 terms; kernel vs torch order


def make(backend="wgpu", **kw):
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(64, 48), r=8, lora_alpha=16, backend=backend, **kw)
    with torch.no_grad():
        layer.lora_B.normal_()
    return layer


def test_output_is_base_plus_scaled_low_rank_update():
    layer = make()
    x = torch.randn(2, 5, 64)
    expected = layer.base_layer(x) + 2.0 * (x @ layer.lora_A.T) @ layer.lora_B.T
    assert torch.allclose(layer(x), expected, atol=TOL)
    assert layer.scaling == 2.0


def test_wgpu_and_torch_backends_agree_in_output_and_gradients():
    out = {}
    for backend in ("wgpu", "torch"):
        layer = make(backend)
        x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        layer(x).square().sum().backward()
        out[backend] = (layer(x).detach(), x.grad, layer.lora_A.grad, layer.lora_B.grad)
    for got, ref in zip(out["wgpu"], out["torch"]):
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_base_layer_is_frozen_and_only_adapters_train():
    layer = make()
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]
    layer(torch.randn(4, 64)).sum().backward()
    assert layer.base_layer.weight.grad is None and layer.lora_A.grad is not None


def test_fresh_adapter_leaves_the_base_output_unchanged():
    layer = LoRALinear(nn.Linear(64, 48), r=4)
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), layer.base_layer(x))


def test_hesper_init_uses_the_seed_and_zero_B():
    layer = LoRALinear(nn.Linear(64, 48), r=4, init="hesper", seed=9)
    assert torch.equal(layer.lora_A, hesper_uniform((4, 64), 64, 9))
    assert torch.count_nonzero(layer.lora_B) == 0


def test_merge_and_unmerge_plain_linear():
    layer = make()
    x = torch.randn(6, 64)
    before = layer(x)
    layer.merge()
    assert layer.merged and torch.allclose(layer(x), before, atol=TOL)
    layer.unmerge()
    assert not layer.merged and torch.allclose(layer(x), before, atol=TOL)
    with pytest.raises(RuntimeError, match="not merged"):
        layer.unmerge()


def test_merge_refuses_quantised_bases():
    from transformers.integrations.bitnet import AutoBitLinear

    layer = LoRALinear(AutoBitLinear(64, 48, bias=False, online_quant=True), r=4)
    with pytest.raises(TypeError, match="need a plain nn.Linear base layer; this one is AutoBitLinear"):
        layer.merge()


def test_merge_refuses_an_adapter_that_would_break_the_weight():
    layer = make(backend="torch")
    with torch.no_grad():
        layer.lora_B[3, 1] = float("nan")
    before = layer.base_layer.weight.detach().clone()
    with pytest.raises(ValueError, match="would put non-finite values into the base weight"):
        layer.merge()
    assert torch.equal(layer.base_layer.weight, before) and not layer.merged


def adapters_of_one_base(backend):
    """Three adapters (ranks 8, 4, 2) on one nn.Linear(64, 48), random A and B."""
    torch.manual_seed(0)
    base = nn.Linear(64, 48)
    adapters = [LoRALinear(base, r=r, lora_alpha=16, backend=backend, init="peft") for r in (8, 4, 2)]
    with torch.no_grad():
        for adapter in adapters:
            adapter.lora_B.normal_()
    return base, adapters


def delta64(adapter, x):
    """The adapter's effect in float64, from its parameters: scaling · x Aᵀ Bᵀ."""
    return adapter.scaling * (x.double() @ adapter.lora_A.double().T) @ adapter.lora_B.double().T


@pytest.mark.parametrize("backend", ["wgpu", "torch"])
def test_per_row_lora_gives_each_row_its_adapter(backend):
    base, (a, b, c) = adapters_of_one_base(backend)
    x = torch.randn(5, 7, 64, generator=torch.Generator().manual_seed(2))
    rows = [b, None, a, b, c]
    with torch.no_grad():
        got = PerRowLoRA(base, rows)(x)
    for i, adapter in enumerate(rows):
        expected = nn.functional.linear(x[i].double(), base.weight.double(), base.bias.double())
        if adapter is not None:
            expected = expected + delta64(adapter, x[i])
        assert torch.allclose(got[i].double(), expected, atol=TOL), f"row {i}"
    with pytest.raises(ValueError, match=r"given for a batch of 5 rows .* input has shape \[4, 7, 64\]"):
        PerRowLoRA(base, rows)(x[:4])
    with pytest.raises(ValueError, match="wrap another base layer"):
        PerRowLoRA(nn.Linear(64, 48), rows)


@pytest.mark.parametrize("backend", ["wgpu", "torch"])
def test_lora_sum_adds_the_adapters_effects(backend):
    base, (a, b, c) = adapters_of_one_base(backend)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    together = LoRASum({"a": a, "c": c})
    expected = nn.functional.linear(x.double(), base.weight.double(), base.bias.double()) + delta64(a, x) + delta64(c, x)
    with torch.no_grad():
        assert torch.allclose(together(x).double(), expected, atol=TOL)
        c.disabled = True  # a disabled adapter adds nothing
        assert torch.allclose(together(x).double(), expected - delta64(c, x), atol=TOL)
    with pytest.raises(ValueError, match="wrap different base layers"):
        LoRASum({"a": a, "other": LoRALinear(nn.Linear(64, 48), r=2)})


def test_dropout_applies_in_training_only():
    layer = make(lora_dropout=0.5)
    x = torch.randn(16, 64)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    torch.manual_seed(1)
    a = layer(x)
    torch.manual_seed(2)
    assert not torch.equal(a, layer(x))


def test_bfloat16_base_layer_gets_bfloat16_output():
    layer = LoRALinear(nn.Linear(64, 48).to(torch.bfloat16), r=4)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and layer.lora_A.grad.dtype == torch.float32


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(r=0), ValueError, "r must be a positive integer, got 0"),
    (dict(lora_dropout=1.0), ValueError, r"lora_dropout must be a number in \[0, 1\), got 1.0"),
    (dict(backend="cuda"), ValueError, r"backend must be one of \('wgpu', 'torch'\), got 'cuda'"),
    (dict(init="zeros"), ValueError, "init must be one of"),
])
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        LoRALinear(nn.Linear(8, 8), **kwargs)


def test_base_without_features_is_refused():
    with pytest.raises(TypeError, match="wraps layers with integer in_features/out_features; ReLU has none"):
        LoRALinear(nn.ReLU())


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), "8", True, None])
def test_a_bad_lora_alpha_is_refused_at_construction(alpha):
    with pytest.raises(ValueError, match="lora_alpha must be a finite number > 0"):
        LoRALinear(torch.nn.Linear(8, 8), r=2, lora_alpha=alpha)


def test_lora_alpha_accepts_numpy_scalars_and_refuses_overflow():
    import numpy as np

    assert LoRALinear(torch.nn.Linear(8, 8), r=2, lora_alpha=np.float32(4.0)).scaling == 2.0
    with pytest.raises(ValueError, match="beyond float32's largest value"):
        LoRALinear(torch.nn.Linear(8, 8), r=1, lora_alpha=1e300)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_the_adapter_to_the_same_gradients(reentrant):
    # The checkpointed backward runs the forward again inside the backward, around the overlapped
    # adapter's two autograd nodes; it must give the plain backward's gradients, bit for bit.
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(17)
    layer = LoRALinear(nn.Linear(48, 40), r=8, lora_alpha=16)
    nn.init.normal_(layer.lora_B)
    x = torch.randn(6, 48, requires_grad=True)
    grads = []
    for run in (lambda: layer(x), lambda: checkpoint(layer, x, use_reentrant=reentrant)):
        layer.zero_grad()
        x.grad = None
        run().square().sum().backward()
        grads.append([x.grad.clone(), layer.lora_A.grad.clone(), layer.lora_B.grad.clone()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _vmap_layer():
    torch.manual_seed(18)
    layer = LoRALinear(nn.Linear(16, 12), r=4, lora_alpha=8)
    nn.init.normal_(layer.lora_B)
    return layer, torch.randn(5, 3, 16)


def _float32_bound(layer, x):
    """How far one float32 computation of ``layer(x)`` may be from the exact value, per output.

    Every output is a chain of dot products: the base's over ``in`` terms plus its bias, and the
    adapter's over ``in`` then ``r`` terms, then their sum. Whatever the order of the additions
    (a GEMM's blocking, the WebGPU kernels' row splits, FMA or not), each element is within
    γ_n·M of the exact value (Higham, Accuracy and Stability, §3.1), where u = 2⁻²⁴, n = in + r + 2
    (here 22: γ₂₂ ≈ 1.3e-6) and M is the same sums over absolute values: a few times 1e-5 for
    these sizes. A wrong row, scaling or weight is off by O(1)."""
    n = layer.in_features + layer.r + 2
    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    xd = x.double().abs()
    W, b = layer.base_layer.weight.double().abs(), layer.base_layer.bias.double().abs()
    A, B = layer.lora_A.detach().double().abs(), layer.lora_B.detach().double().abs()
    return gamma * (xd @ W.T + b + abs(layer.scaling) * (xd @ A.T) @ B.T)


def _float64_layer(layer, x):
    W, b = layer.base_layer.weight.double(), layer.base_layer.bias.double()
    A, B = layer.lora_A.detach().double(), layer.lora_B.detach().double()
    return x.double() @ W.T + b + layer.scaling * (x.double() @ A.T) @ B.T


def test_vmap_over_lora_linear_gives_what_a_loop_gives():
    layer, x = _vmap_layer()
    # The WebGPU part: vmap folds the batch into the op's rows, so it runs the very same kernels
    # on the very same 15 rows as one call on x flattened: bit for bit (the kernels are deterministic).
    folded = torch.func.vmap(lambda row: lora(row, layer.lora_A, layer.lora_B, layer.scaling))(x)
    assert torch.equal(folded, lora(x.reshape(15, 16), layer.lora_A, layer.lora_B, layer.scaling).view(5, 3, 12))
    # The whole layer: torch's batched GEMM and the per-row one may round differently (they do on
    # some AMD CPUs), and the kernels split rows by N; each is within float32's bound of the exact
    # value, so the two are within twice that of each other.
    batched = torch.func.vmap(layer)(x).detach()
    looped = torch.stack([layer(row) for row in x]).detach()
    bound = _float32_bound(layer, x)
    exact = _float64_layer(layer, x)
    assert ((batched.double() - exact).abs() <= bound).all() and ((looped.double() - exact).abs() <= bound).all()
    assert ((batched.double() - looped.double()).abs() <= 2 * bound).all()


def test_vmap_over_lora_linear_takes_the_ops_batching_rule(capfd):
    # torch's per-slice fallback prints "There is a performance drop because we have not yet
    # implemented the batching rule" to stderr; with the fallback turned off it would raise.
    layer, x = _vmap_layer()
    x = x.requires_grad_(True)
    ensemble_A, ensemble_B = torch.randn(5, 4, 16), torch.randn(5, 12, 4)
    fallback = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        out = torch.func.vmap(layer, in_dims=1, out_dims=1)(x.transpose(0, 1))
        out.square().sum().backward()
        ensemble = torch.func.vmap(lambda a, b, row: lora(row, a, b, 0.5))(ensemble_A, ensemble_B, x.detach())
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(fallback)
    assert "performance drop" not in capfd.readouterr().err
    # against float64 autograd: the output within float32's bound, the gradients within 1e-5 of
    # their largest value (sums over the 15 rows of products of the outputs' size: float32 rounding
    # is ~1e-6 of that; a gradient of the wrong row or scale is off by O(1))
    bound = _float32_bound(layer, x.detach())
    assert ((out.transpose(0, 1).detach().double() - _float64_layer(layer, x.detach())).abs() <= bound).all()
    params = [layer.lora_A, layer.lora_B]
    ref = [p.detach().double().requires_grad_(True) for p in (x, *params)]
    W, b = layer.base_layer.weight.double(), layer.base_layer.bias.double()
    (ref[0] @ W.T + b + layer.scaling * (ref[0] @ ref[1].T) @ ref[2].T).square().sum().backward()
    for got, want in zip((x.grad, *(p.grad for p in params)), ref):
        scale = want.grad.abs().max().item()
        assert (got.double() - want.grad).abs().max().item() <= 1e-5 * scale
    each = torch.stack([0.5 * (x[i].detach().double() @ ensemble_A[i].double().T) @ ensemble_B[i].double().T
                        for i in range(5)])
    assert (ensemble.double() - each).abs().max().item() <= 1e-5 * each.abs().max().item()
