"""WgpuAdamW step for step against torch.optim.AdamW; state_dict round trips; gradient clipping."""

import math

import pytest
import torch

from torch_wgpu_lora import WgpuAdamW
from torch_wgpu_lora.optim import clip_grad_norm

SHAPES = [(8, 64), (64, 8), (4, 100), (3,)]


def _twin_params(seed=0):
    torch.manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, theirs


def _groups(params):
    # Two groups with their own lr and weight decay, as schedulers and users set them.
    return [{"params": params[:2]}, {"params": params[2:], "lr": 5e-3, "weight_decay": 0.0}]


def _assert_close_to_tensor_scale(ours, theirs):
    for p, q in zip(ours, theirs):
        # 1e-6 of the tensor's scale: the kernel and torch differ by float32 ulps per step (torch's
        # CPU sqrt is not correctly rounded); an element passing near zero keeps the absolute
        # error it had when large, so its own relative error says nothing.
        assert (p - q).abs().max().item() <= 1e-6 * q.abs().max().item()


def _step_both(ours, theirs, opt_ours, opt_theirs, gen, skip=None):
    for i, (p, q) in enumerate(zip(ours, theirs)):
        if i == skip:
            p.grad = q.grad = None
            continue
        grad = torch.randn(p.shape, generator=gen)
        p.grad, q.grad = grad.clone(), grad.clone()
    opt_ours.step()
    opt_theirs.step()


def test_matches_torch_adamw_for_20_steps():
    ours, theirs = _twin_params()
    opt_ours = WgpuAdamW(_groups(ours), lr=1e-2)  # the defaults: betas (0.9, 0.999), eps 1e-7, wd 0.01
    opt_theirs = torch.optim.AdamW(_groups(theirs), lr=1e-2, eps=1e-7, weight_decay=0.01, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for step in range(20):
        if step == 10:  # an LR change between steps, as a scheduler makes
            for opt in (opt_ours, opt_theirs):
                opt.param_groups[0]["lr"] = 3e-3
        # Parameter 3 has no gradient on every third step: skipped, its step count lags.
        _step_both(ours, theirs, opt_ours, opt_theirs, gen, skip=3 if step % 3 == 0 else None)
    _assert_close_to_tensor_scale(ours, theirs)
    state = opt_ours.state_dict()["state"]
    assert state[3]["step"].item() == 13 and state[0]["step"].item() == 20
    for i, q in enumerate(theirs):
        for name in ("exp_avg", "exp_avg_sq"):
            want = opt_theirs.state[q][name]
            # Moments follow the same arithmetic; same scale-relative bound as the parameters.
            assert (state[i][name] - want).abs().max().item() <= 1e-6 * want.abs().max().item()


def test_state_dict_round_trip_continues_identically():
    ours, _ = _twin_params()
    opt = WgpuAdamW(_groups(ours), lr=1e-2)
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        for p in ours:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    copies = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    restored = WgpuAdamW(_groups(copies), lr=1.0)  # lr comes back from the state dict
    restored.load_state_dict(opt.state_dict())
    assert restored.param_groups[1]["lr"] == 5e-3
    for _ in range(5):
        for p, c in zip(ours, copies):
            p.grad = torch.randn(p.shape, generator=gen)
            c.grad = p.grad.clone()
        opt.step()
        restored.step()
    for p, c in zip(ours, copies):
        assert torch.equal(p, c)  # same kernel on the same state: bit for bit


def test_loads_torch_adamw_state():
    ours, theirs = _twin_params()
    opt_theirs = torch.optim.AdamW(theirs, lr=1e-2, eps=1e-7, foreach=False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        for q in theirs:
            q.grad = torch.randn(q.shape, generator=gen)
        opt_theirs.step()
    with torch.no_grad():
        for p, q in zip(ours, theirs):
            p.copy_(q)
    opt_ours = WgpuAdamW(ours)
    opt_ours.load_state_dict(opt_theirs.state_dict())
    for _ in range(5):
        _step_both(ours, theirs, opt_ours, opt_theirs, gen)
    _assert_close_to_tensor_scale(ours, theirs)


def test_bad_arguments_and_state_are_named():
    w = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="lr must be a finite number >= 0, got -1"):
        WgpuAdamW([w], lr=-1)
    with pytest.raises(ValueError, match=r"betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"):
        WgpuAdamW([w], betas=(0.9, 1.0))
    d = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    d.grad = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(TypeError, match="a parameter must be a dense float32 CPU tensor, got torch.float64"):
        WgpuAdamW([d]).step()
    w.grad = torch.ones(4)
    opt = WgpuAdamW([w])
    opt.step()
    state = opt.state_dict()
    state["state"][0]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"exp_avg of parameter 0 has shape \(5,\), the parameter \(4,\)"):
        WgpuAdamW([torch.nn.Parameter(torch.zeros(4))]).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved param groups hold \[1\] parameters, this optimizer's \[2\]"):
        WgpuAdamW([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))]).load_state_dict(
            opt.state_dict())
    amsgrad = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], amsgrad=True).state_dict()
    with pytest.raises(ValueError, match=r"the saved optimiser used \['amsgrad'\], which WgpuAdamW does not"):
        WgpuAdamW([torch.nn.Parameter(torch.zeros(4))]).load_state_dict(amsgrad)
    del state["state"][0]["exp_avg_sq"]
    with pytest.raises(ValueError, match=r"state of parameter 0 lacks \['exp_avg_sq'\]"):
        WgpuAdamW([torch.nn.Parameter(torch.zeros(4))]).load_state_dict(state)


def _grads(values):
    params = [torch.nn.Parameter(torch.zeros(len(v))) for v in values]
    for p, v in zip(params, values):
        p.grad = torch.tensor(v)
    return params


def test_clip_grad_norm_matches_torch():
    ours, theirs = _grads([[3.0, 4.0], [12.0]]), _grads([[3.0, 4.0], [12.0]])
    norm = clip_grad_norm(ours, 1.0)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert norm == pytest.approx(13.0) and norm == want.item()
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad, q.grad)


def test_clip_grad_norm_off_and_non_finite_leave_grads():
    params = _grads([[3.0, 4.0]])
    assert clip_grad_norm(params, 0.0) == 5.0 and params[0].grad.tolist() == [3.0, 4.0]
    params = _grads([[math.nan, 4.0]])
    assert math.isnan(clip_grad_norm(params, 1.0)) and params[0].grad[1].item() == 4.0
    with pytest.raises(ValueError, match="max_grad_norm must be a finite number >= 0"):
        clip_grad_norm(params, -1.0)


def test_a_step_bumps_versions_so_a_stale_graph_is_refused_as_with_torch():
    from torch_wgpu_lora import LoRALinear

    for make in (lambda ps: WgpuAdamW(ps, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2)):
        torch.manual_seed(0)
        layer = LoRALinear(torch.nn.Linear(16, 8), r=4)
        torch.nn.init.normal_(layer.lora_B)
        opt = make([layer.lora_A, layer.lora_B])
        y = layer(torch.randn(3, 16)).sum()
        y.backward(retain_graph=True)
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


def test_a_step_updates_the_resident_copy_the_op_reads(monkeypatch):
    from torch_wgpu_lora import LoRALinear
    from torch_wgpu_lora.runtime import tensors

    torch.manual_seed(1)
    layer = LoRALinear(torch.nn.Linear(16, 8), r=4)
    torch.nn.init.normal_(layer.lora_B)
    opt = WgpuAdamW([layer.lora_A, layer.lora_B], lr=1e-2)
    x = torch.randn(3, 16)
    layer(x).sum().backward()
    uploads = []
    real = tensors.upload
    monkeypatch.setattr(tensors, "upload", lambda a, d=None: (uploads.append(a.shape), real(a, d))[1])
    opt.step()
    assert sorted(uploads) == sorted([(4, 16), (4, 8)])  # the two gradients (Bᵀ's layout), no parameter
    uploads.clear()
    y = layer(x)
    assert uploads == [(3, 16)]  # only x: the updated weights are already on the GPU
    ref = layer.base_layer(x) + layer.scaling * (x @ layer.lora_A.T) @ layer.lora_B.T
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_an_empty_parameter_is_stepped_like_torch():
    empty, full = torch.nn.Parameter(torch.zeros(0, 4)), torch.nn.Parameter(torch.ones(3))
    opt = WgpuAdamW([empty, full], lr=0.1, weight_decay=0.0)
    empty.grad, full.grad = torch.zeros(0, 4), torch.ones(3)
    opt.step()
    assert opt.state_dict()["state"][0]["step"].item() == 1
    assert torch.allclose(full, torch.full((3,), 0.9))
