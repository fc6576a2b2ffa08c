"""LR schedules: warmup length, the multiplier at known steps, JSON state round trip, errors."""

import json
import math

import pytest
import torch

from torch_wgpu_lora.training.schedule import make_scheduler, warmup_steps


def _lrs(schedule, total, steps, **kwargs):
    """The lr of each of the first ``steps`` optimiser steps, base lr 1.0."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(opt, schedule, total_steps=total, **kwargs)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_is_six_percent_rounded_up():
    assert warmup_steps(100, 0.06) == 6
    assert warmup_steps(10, 0.06) == 1
    assert warmup_steps(50, 0.0) == 0


def test_cosine_warms_up_then_decays_to_zero():
    lrs = _lrs("cosine", 100, 101)  # default 6% warmup: 6 steps
    assert lrs[:7] == pytest.approx([0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0])
    assert lrs[53] == pytest.approx(0.5)  # progress (53 - 6) / 94 = 1/2
    assert lrs[30] == pytest.approx(0.5 * (1 + math.cos(math.pi * 24 / 94)))
    assert lrs[100] == pytest.approx(0.0, abs=1e-12)


def test_linear_warms_up_then_decays_linearly():
    lrs = _lrs("linear", 20, 21, warmup_ratio=0.1)  # 2 warmup steps
    assert lrs[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert lrs[11] == pytest.approx(0.5)  # (20 - 11) / 18
    assert lrs[20] == pytest.approx(0.0)


def test_constant_has_no_warmup():
    assert _lrs("constant", 10, 10, warmup_ratio=0.5) == [1.0] * 10


def test_state_round_trips_through_json():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(opt, "cosine", total_steps=50)
    for _ in range(7):
        opt.step()
        sched.step()
    state = json.loads(json.dumps(sched.state_dict()))
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = make_scheduler(opt2, "cosine", total_steps=50)
    sched2.load_state_dict(state)
    opt2.load_state_dict(opt.state_dict())
    for _ in range(5):
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step()
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert opt.param_groups[0]["lr"] not in (0.0, 1.0)  # mid-decay, so equality above means something


def test_bad_arguments_are_named():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=r"schedule must be one of \['constant', 'cosine', 'linear'\], got 'step'"):
        make_scheduler(opt, "step", total_steps=10)
    with pytest.raises(ValueError, match="total_steps must be a positive integer, got 0"):
        make_scheduler(opt, "cosine", total_steps=0)
    with pytest.raises(ValueError, match=r"warmup_ratio must be in \[0, 1\], got 1.5"):
        make_scheduler(opt, "linear", total_steps=10, warmup_ratio=1.5)
