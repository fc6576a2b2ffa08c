"""LoRALinear: a drop-in nn.Module around a frozen base layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_wgpu_lora import LoRALinear
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


def test_vmap_over_lora_linear_gives_what_a_loop_gives():
    torch.manual_seed(18)
    layer = LoRALinear(nn.Linear(16, 12), r=4, lora_alpha=8)
    nn.init.normal_(layer.lora_B)
    x = torch.randn(5, 3, 16)
    batched = torch.func.vmap(layer)(x)
    looped = torch.stack([layer(row) for row in x])
    assert torch.equal(batched, looped)
