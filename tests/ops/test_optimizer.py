"""clip.wgsl and adamw.wgsl against their torch references, and the AdamW reference against
torch.optim.AdamW; WgpuAdamW step for step against torch.optim.AdamW, state_dict round trips;
gradient clipping."""

import math

import numpy as np
import pytest
import torch

from torch_wgpu_lora import WgpuAdamW
from torch_wgpu_lora.ops.optimizer import (CLIP_PARTIALS, adamw_launch, adamw_reference, adamw_scalars, adamw_step,
                                           clip_grad_norm, clip_launches, clip_reference)
from torch_wgpu_lora.runtime import Buffer, Recorder, get_device, upload, write


def _kernel_step(param, grad, exp_avg, exp_avg_sq, **hyper):
    """One kernel step on copies of the tensors; returns the updated (param, exp_avg, exp_avg_sq)."""
    bufs = [upload(t.numpy().copy()) for t in (param, grad, exp_avg, exp_avg_sq)]
    rec = Recorder()
    adamw_step(rec, *bufs, **hyper)
    outs = [np.empty(param.shape, np.float32) for _ in range(3)]
    for buf, out in zip((bufs[0], bufs[2], bufs[3]), outs):
        rec.read(buf, out)
    rec.submit()
    return [torch.from_numpy(o) for o in outs]


def _state(n, seed):
    g = torch.Generator().manual_seed(seed)
    param, grad, exp_avg = (torch.randn(n, generator=g) for _ in range(3))
    exp_avg_sq = torch.rand(n, generator=g) * 0.1
    return param, grad, exp_avg, exp_avg_sq


# beta1 = 0.3 takes lerp's second branch (weight 1 - beta1 >= 0.5); step 7 has real bias corrections.
@pytest.mark.parametrize("betas,weight_decay,step", [((0.9, 0.999), 0.01, 1), ((0.9, 0.999), 0.0, 7),
                                                     ((0.3, 0.9), 0.1, 7)])
def test_kernel_matches_reference(betas, weight_decay, step):
    param, grad, exp_avg, exp_avg_sq = _state(1000, seed=step)  # 1000: not a multiple of the workgroup
    hyper = dict(step=step, lr=1e-2, betas=betas, eps=1e-7, weight_decay=weight_decay)
    got = _kernel_step(param, grad, exp_avg, exp_avg_sq, **hyper)
    adamw_reference(param, grad, exp_avg, exp_avg_sq, **hyper)
    for name, g, want in zip(("param", "exp_avg", "exp_avg_sq"), got, (param, exp_avg, exp_avg_sq)):
        # Same operations and FMAs; torch's CPU sqrt is not correctly rounded: a few float32 ulps.
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7, msg=name)


def test_kernel_two_dimensional_grid(monkeypatch):
    # Tensors of more than max_workgroups * 256 elements spread over a 2-D grid; shrink the
    # limit so a small tensor takes that path: every element must still be updated once.
    monkeypatch.setattr(get_device(), "max_workgroups", 2)
    param, grad, exp_avg, exp_avg_sq = _state(1000, seed=3)  # 4 workgroups: grid (2, 2)
    hyper = dict(step=1, lr=1e-2, betas=(0.9, 0.999), eps=1e-7, weight_decay=0.01)
    got = _kernel_step(param, grad, exp_avg, exp_avg_sq, **hyper)
    adamw_reference(param, grad, exp_avg, exp_avg_sq, **hyper)
    torch.testing.assert_close(got[0], param, rtol=1e-6, atol=1e-7)  # as above: a few ulps


def test_reference_is_torch_adamw():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50))
    param, exp_avg, exp_avg_sq = p.detach().clone(), torch.zeros(50), torch.zeros(50)
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-7, weight_decay=0.1, foreach=False)
    for step in range(1, 21):
        grad = torch.randn(50)
        p.grad = grad.clone()
        opt.step()
        adamw_reference(param, grad, exp_avg, exp_avg_sq, step=step, lr=1e-2, betas=(0.9, 0.99), eps=1e-7,
                        weight_decay=0.1)
    assert torch.equal(param, p.detach())  # the very same ops: bit for bit
    assert torch.equal(exp_avg, opt.state[p]["exp_avg"]) and torch.equal(exp_avg_sq, opt.state[p]["exp_avg_sq"])


def test_kernel_rejects_mismatched_buffers_and_step_zero():
    p, g = upload(np.zeros(8, np.float32)), upload(np.zeros(4, np.float32))
    m, v = upload(np.zeros(8, np.float32)), upload(np.zeros(8, np.float32))
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-7, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"grad is \(4,\); expected 8 elements like param"):
        adamw_step(Recorder(), p, g, m, v, step=1, **hyper)
    with pytest.raises(ValueError, match="step counts from 1, got 0"):
        adamw_step(Recorder(), p, upload(np.zeros(8, np.float32)), m, v, step=0, **hyper)


def _run(launches, *reads):
    rec = Recorder()
    for launch in launches:
        rec.launch(launch)
    outs = [np.empty(buf.shape, np.float32) for buf in reads]
    for buf, out in zip(reads, outs):
        rec.read(buf, out)
    rec.submit()
    return [torch.from_numpy(o) for o in outs]


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
def test_clip_then_adamw_match_their_references(max_norm, reductions):
    g = torch.Generator().manual_seed(6)
    n = 3000  # not a multiple of a workgroup's share
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    m, v = torch.randn(n, generator=g) * 0.01, torch.rand(n, generator=g) * 1e-3
    losses = torch.rand(10, generator=g)
    P, G, M, V = (upload(t.numpy().copy()) for t in (p, grad, m, v))
    stats, partials = Buffer((4,)), Buffer((CLIP_PARTIALS,))
    write(stats, np.full(4, np.nan, np.float32))
    options = dict(step=3, lr=1e-2, betas=(0.9, 0.999), eps=1e-7, weight_decay=0.01)
    launches = clip_launches(G, upload(losses.numpy()), stats, partials, n=n, rows=10, max_norm=max_norm)
    launches.append(adamw_launch(P, G, M, V, adamw_scalars(**options), stats=stats, n=n))
    got_p, got_m, got_v, got_stats = _run(launches, P, M, V, stats)
    norm, coef, flag, loss = clip_reference(grad, losses, max_norm).tolist()
    # the norm and the loss sum: float32 sums of 3,000 and 10 terms in another order against float64;
    # the coefficient follows the norm's rounding
    assert abs(got_stats[0].item() - norm) <= 1e-5 * norm and abs(got_stats[1].item() - coef) <= 1e-5
    assert got_stats[2].item() == flag == 0.0 and abs(got_stats[3].item() - loss) <= 1e-5
    p_ref, m_ref, v_ref = p.clone(), m.clone(), v.clone()
    adamw_reference(p_ref, grad * got_stats[1], m_ref, v_ref, **options)
    for got, ref, name in ((got_p, p_ref, "param"), (got_m, m_ref, "exp_avg"), (got_v, v_ref, "exp_avg_sq")):
        # same operations and FMAs on the same clipped gradient: a few float32 ulps (torch's CPU sqrt)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("bad", ["loss", "grad"])
def test_a_non_finite_loss_or_gradient_skips_the_update(bad):
    n = 100
    p, grad, losses = torch.ones(n), torch.full((n,), 0.1), torch.ones(3)
    if bad == "loss":
        losses[1] = float("nan")
    else:
        grad[7] = float("inf")
    assert clip_reference(grad, losses, 1.0)[2] == 1.0
    P, G = upload(p.numpy().copy()), upload(grad.numpy())
    M, V = upload(np.zeros(n, np.float32)), upload(np.zeros(n, np.float32))
    stats = Buffer((4,))
    launches = clip_launches(G, upload(losses.numpy()), stats, Buffer((CLIP_PARTIALS,)), n=n, rows=3, max_norm=1.0)
    launches.append(adamw_launch(P, G, M, V, adamw_scalars(1, 0.1, (0.9, 0.999), 1e-8, 0.0), stats=stats, n=n))
    got_p, got_stats = _run(launches, P, stats)
    assert got_stats[2].item() == 1.0 and torch.equal(got_p, p)


def test_clip_refuses_buffers_too_small():
    with pytest.raises(ValueError, match=f"partials need {CLIP_PARTIALS} floats"):
        clip_launches(Buffer((8,)), Buffer((2,)), Buffer((4,)), Buffer((CLIP_PARTIALS - 1,)), n=8, rows=2,
                      max_norm=1.0)


# -- WgpuAdamW -----------------------------------------------------------------------------------------

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
