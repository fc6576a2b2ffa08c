"""LR schedules: warmup length, the multiplier at known steps, every transformers scheduler by name,
JSON state round trip, errors."""

import json
import math

import pytest
import torch

from torch_wgpu_lora.training.schedule import make_scheduler, metric_driven, schedule_names, warmup_steps


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
    lrs = _lrs("cosine", 100, 101, warmup_steps=warmup_steps(100, 0.06))  # 6% warmup: 6 steps
    assert lrs[:7] == pytest.approx([0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0])
    assert lrs[53] == pytest.approx(0.5)  # progress (53 - 6) / 94 = 1/2
    assert lrs[30] == pytest.approx(0.5 * (1 + math.cos(math.pi * 24 / 94)))
    assert lrs[100] == pytest.approx(0.0, abs=1e-12)


def test_linear_warms_up_then_decays_linearly():
    lrs = _lrs("linear", 20, 21, warmup_steps=2)
    assert lrs[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert lrs[11] == pytest.approx(0.5)  # (20 - 11) / 18
    assert lrs[20] == pytest.approx(0.0)


def test_constant_has_no_warmup():
    assert _lrs("constant", 10, 10, warmup_steps=5) == [1.0] * 10


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
    with pytest.raises(ValueError, match=r"schedule must be one of transformers' schedulers \['linear', 'cosine', "
                                         r".*\], got 'step'"):
        make_scheduler(opt, "step", total_steps=10)
    with pytest.raises(ValueError, match="total_steps must be a positive integer, got 0"):
        make_scheduler(opt, "cosine", total_steps=0)
    with pytest.raises(ValueError, match=r"warmup_steps must be an integer in \[0, total_steps=10\], got 11"):
        make_scheduler(opt, "linear", total_steps=10, warmup_steps=11)
    with pytest.raises(ValueError, match=r"warmup_ratio must be a number in \[0, 1\], got 1.5"):
        warmup_steps(10, 1.5)
    with pytest.raises(ValueError, match=r"schedule 'cosine_with_min_lr': One of min_lr or min_lr_rate should be set"
                                         r".*\(its options go in scheduler_kwargs\)"):
        make_scheduler(opt, "cosine_with_min_lr", total_steps=10)


def test_every_transformers_scheduler_is_taken_by_name():
    from transformers import SchedulerType, get_scheduler

    options = {"cosine_with_min_lr": {"min_lr_rate": 0.1}, "cosine_warmup_with_min_lr": {"min_lr_rate": 0.1},
               "warmup_stable_decay": {"num_decay_steps": 4}}
    assert set(schedule_names()) == {t.value for t in SchedulerType} and len(schedule_names()) >= 12
    for name in schedule_names():
        if metric_driven(name):  # stepped with a metric, by the Trainer's evaluations
            sched = make_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), name, 10)
            sched.step(1.0)
            continue
        ours = _lrs(name, 12, 12, warmup_steps=3, scheduler_kwargs=options.get(name))
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        reference = get_scheduler(name, opt, num_warmup_steps=3, num_training_steps=12,
                                  scheduler_specific_kwargs=options.get(name))
        theirs = []
        for _ in range(12):
            theirs.append(opt.param_groups[0]["lr"])
            opt.step()
            reference.step()
        assert ours == theirs, name
        if name != "constant":  # the others warm up over warmup_steps
            assert ours[0] < ours[1] < ours[2], name
