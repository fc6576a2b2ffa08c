"""clip.wgsl and adamw.wgsl against their torch references, and the AdamW reference against
torch.optim.AdamW."""

import numpy as np
import pytest
import torch

from torch_wgpu_lora.ops.optimizer import (CLIP_PARTIALS, adamw_launch, adamw_reference, adamw_scalars, adamw_step,
                                           clip_launches, clip_reference)
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
