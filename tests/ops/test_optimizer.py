"""adamw.wgsl against its torch reference, and the reference against torch.optim.AdamW."""

import numpy as np
import pytest
import torch

from torch_wgpu_lora.ops.adamw import adamw_reference, adamw_step
from torch_wgpu_lora.runtime import Recorder, get_device, upload


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
