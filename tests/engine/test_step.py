"""The optimizer step's gradient exchange, in one process with a stand-in for the all-reduce:
the buckets (runs of whole layers, the last layers first) against PyTorch autograd's gradients
of each layer, the all-reduce of a bucket starting while the GPU still runs the backward, the
summed buckets written back (a step whose all-reduce doubles the gradients, as two identical
processes would, against the torch path), and the refusals. Several processes and machines:
``tests/training/test_distributed.py``.

Gradient tolerance: ``GRAD_RTOL`` = 1e-4 of each adapter tensor's largest magnitude, as
``helpers.TWIN_RTOL``: float32 on both sides, sums in other orders, so each gradient agrees to
a few float32 roundings of its scale (measured: at most 9e-6); a layer's gradient in another layer's bucket, or at another offset, is off
by O(1) (or zero where a gradient is expected).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torch_wgpu_lora.engine.step import gradient_buckets
from torch_wgpu_lora.integrations.bitnet import lora_parameters
from torch_wgpu_lora.loss import labelled_tokens
from torch_wgpu_lora.runtime import Recorder, get_device, upload

from .helpers import assert_close, assert_twins_agree, micro_batches, torch_grads, torch_step, twins

LAYERS = 5
GRAD_RTOL = 1e-4


def test_buckets_are_runs_of_whole_layers_from_the_last_closed_at_the_size_given():
    _, _, engine, _, _ = twins(30, num_hidden_layers=LAYERS)
    adapters = engine.adapters
    layer_bytes = 4 * adapters.size // LAYERS  # every layer has the same adapters
    for cap, runs in ((1, [[4], [3], [2], [1], [0]]), (layer_bytes, [[4], [3], [2], [1], [0]]),
                      (layer_bytes + 1, [[4, 3], [2, 1], [0]]), (2 * layer_bytes, [[4, 3], [2, 1], [0]]),
                      (3 * layer_bytes, [[4, 3, 2], [1, 0]]), (1 << 30, [[4, 3, 2, 1, 0]])):
        buckets = gradient_buckets(adapters, cap)
        assert [sorted(b.layers, reverse=True) for b in buckets] == runs, cap
        assert buckets[0].stop == adapters.size and buckets[-1].start == 0
        assert all(a.start == b.stop for a, b in zip(buckets, buckets[1:]))  # contiguous, descending


def test_each_bucket_holds_its_layers_gradients_and_is_all_reduced_while_the_backward_runs():
    # One bucket per layer, two micro-batches: the first whole in the first submit, the second's
    # backward split after each layer.
    model, twin, engine, optimizer, _ = twins(31, num_hidden_layers=LAYERS)
    micro = micro_batches(model, seed=600)
    buckets = gradient_buckets(engine.adapters, 1)
    received = []

    def all_reduce(flat: torch.Tensor) -> None:  # one process: the sum over the processes is its own
        received.append(flat.clone())

    device = get_device()
    before = device.submits
    engine.train_step(micro, optimizer, max_grad_norm=1.0, all_reduce=all_reduce, bucket_bytes=1)
    assert device.submits - before == len(buckets) + 1  # a submit per bucket, then clip and AdamW
    grads, loss_sum = torch_grads(twin, micro)

    layer_of = {p: a.layer for a in engine.adapters.adapters for p in (a.module.lora_A, a.module.lora_B)}
    named = {p: name for name, p in model.named_parameters()}
    assert len(received) == len(buckets)
    for k, (bucket, flat) in enumerate(zip(buckets, received)):
        assert flat.dtype == torch.float32 and flat.numel() == bucket.size + (k == len(buckets) - 1)
        alone = np.zeros(engine.adapters.size, np.float32)  # this bucket's values alone, in place
        alone[bucket.start:bucket.stop] = flat[:bucket.size].numpy()
        rec = Recorder(device)
        values = engine.adapters.read(upload(alone, device), rec)
        rec.submit()
        for param, value in values.items():
            if layer_of[param] in bucket.layers:  # buckets come last layers first: k holds layer LAYERS-1-k
                assert layer_of[param] == LAYERS - 1 - k
                assert_close(value, grads[named[param]], GRAD_RTOL, f"bucket {k}: {named[param]}")
            else:
                assert not value.any(), f"bucket {k} holds values of {named[param]}"
    # the step's loss sum rides with the last bucket (float32 sums in another order)
    assert abs(float(received[-1][-1]) - loss_sum) <= 1e-5 * loss_sum

    # The first bucket's all-reduce started before the GPU's last part of the backward was read
    # back: a step that waited for the whole backward would start it after. (Measured on lavapipe:
    # it starts within 1 ms of its readback; the four later parts take about 20 ms.)
    events = {(what, k): t for what, k, t in engine.optimizer_step.exchange_events}
    last = len(buckets) - 1
    assert events[("reduce", 0)] < events[("read", last)]
    assert [k for what, k, _ in engine.optimizer_step.exchange_events if what == "reduce"] == list(range(len(buckets)))


def test_the_summed_buckets_are_written_back_before_clip_and_adamw():
    # An all-reduce that doubles every bucket is what two processes with the same micro-batches
    # would do, each scaling its loss by the doubled token count: the update is the torch path's
    # over those micro-batches. Were a bucket not written back, its layers would step with half
    # the gradient (eps = 1e-3 makes the update see the gradient's size: helpers.twins).
    model, twin, engine, ours, theirs = twins(32, num_hidden_layers=LAYERS)
    layer_bytes = 4 * engine.adapters.size // LAYERS
    assert len(gradient_buckets(engine.adapters, 2 * layer_bytes)) == 3
    for step in range(3):
        micro = micro_batches(model, seed=700 + step)
        tokens = sum(labelled_tokens(b["labels"]) for b in micro)
        done = engine.train_step(micro, ours, max_grad_norm=1e3, all_reduce=lambda flat: flat.mul_(2),
                                 labelled_total=2 * tokens, bucket_bytes=2 * layer_bytes)
        loss_sum = torch_step(twin, micro, theirs, max_norm=1e3)  # no norm reaches 1e3: no clipping
        assert done["tokens"] == 2 * tokens and abs(done["loss"] - loss_sum / tokens) <= 1e-5 * loss_sum / tokens
    assert_twins_agree(engine, model, twin)


def test_a_non_finite_summed_loss_skips_the_step_on_every_process():
    # The loss sum travels with the last bucket: a process whose loss is not finite makes the
    # sum not finite everywhere, and every process skips the step.
    model, _, engine, optimizer, _ = twins(33, num_hidden_layers=LAYERS)
    before = [p.detach().clone() for p in lora_parameters(model)]
    buckets = gradient_buckets(engine.adapters, 1)

    def all_reduce(flat: torch.Tensor) -> None:
        if flat.numel() == buckets[-1].size + 1:
            flat[-1] = math.nan

    done = engine.train_step(micro_batches(model, seed=800), optimizer, max_grad_norm=1.0, all_reduce=all_reduce,
                             bucket_bytes=1)
    assert done["skipped"] and done["loss"] is None
    engine.adapters.pull()
    assert all(torch.equal(p, b) for p, b in zip(lora_parameters(model), before))


@pytest.mark.parametrize("bucket_bytes", [0, -4, 1.5, True, "1MB", None])
def test_a_bucket_size_that_is_not_a_whole_number_of_bytes_is_refused(bucket_bytes):
    model, _, engine, optimizer, _ = twins(34)
    for exchange in (None, lambda flat: None):
        with pytest.raises(ValueError, match=rf"bucket_bytes must be a whole number of bytes >= 1, got "
                                             rf"{bucket_bytes!r}"):
            engine.train_step(micro_batches(model, seed=900), optimizer, max_grad_norm=1.0, all_reduce=exchange,
                              bucket_bytes=bucket_bytes)
    assert optimizer.state_dict()["state"] == {}  # nothing ran


def test_a_program_recorded_in_parts_is_refused_outside_its_steps():
    model, _, engine, _, _ = twins(35)
    plan = engine.train_plan(1, 8, 1)
    steps = len(plan.slots[0].program)
    assert plan.backward_done(0) == steps and 0 < plan.backward_done(1) < steps
    with pytest.raises(ValueError, match=rf"steps 3 to {steps + 1} of a program of {steps}"):
        plan.record(Recorder(get_device()), 0, start=3, stop=steps + 1)
    with pytest.raises(ValueError, match="steps 5 to 4 of a program"):
        plan.record(Recorder(get_device()), 0, start=5, stop=4)
    with pytest.raises(ValueError, match="layer 2 of a model of 2 layers"):
        plan.backward_done(2)
