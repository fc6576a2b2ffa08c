"""The engine's training: every adapter gradient of every layer against PyTorch autograd on
transformers' modules (with the straight-through backward), the loss, ``loss.backward()``
through the autograd node, the one-submit optimizer step, and training parity with the torch
path.

Gradient tolerance (``ParityCheck``): against autograd in float64, the root mean square over the
adapter tensors of their max relative errors within twice PyTorch float32's own (at least
n·2^-24, n the longest float32 sum); each row is a real comparison because every lora_B is
randomised first. Quantised flavours: torch is fed the engine's int8
codes, every differing code must be a rounding tie, and there are few
(``integrations.quantisation``).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from torch_wgpu_lora import BitNetEngine, WgpuAdamW
from torch_wgpu_lora.engine.inputs import check_inputs
from torch_wgpu_lora.integrations.bitnet import lora_modules, lora_parameters
from torch_wgpu_lora.integrations.gradcheck import (ParityCheck, check_parity, compare_gradients, longest_sum,
                                                    randomize_lora_B)
from torch_wgpu_lora.integrations.tiny import FLAVOURS
from torch_wgpu_lora.engine.kernels.attention import policy
from torch_wgpu_lora.engine.kernels import projection
from torch_wgpu_lora.engine.kernels.gemms import f16_matrix_units
from torch_wgpu_lora.loss import labelled_tokens
from torch_wgpu_lora.ops.optimizer import adamw_reference
from torch_wgpu_lora.runtime import Recorder, get_device

from ..concurrency import in_forked_child
from .helpers import (CONFIGS, LOGIT_RTOL, LOSS_RTOL, TWIN_RTOL, PackedEngine, Packing, assert_close,
                      assert_parity, assert_twins_agree, batch, labelled_batch, micro_batches, packed_micro_batches, tiny_model,
                      torch_grads, torch_step, twins)


# Seven examples (of 1 to 9 tokens) packed into three rows of 9: one, two and three examples a row,
# examples of one token, and a row ending in padding (one more example, unlabelled).
PACKING = Packing([5, 1, 3, 9, 2, 2, 1], [[0, 1, 2], [3], [4, 5, 6]], tokens=9)


def rows_of(model: torch.nn.Module, rows: str) -> dict[str, torch.Tensor]:
    """A labelled batch of right-padded rows, or of packed rows as transformers takes them (position
    ids, no attention mask; the torch passes run without a cache)."""
    if rows == "packed":
        return PACKING.batch(labelled_batch(model, PACKING.lengths))
    return labelled_batch(model, [11, 6, 9])


@pytest.mark.parametrize("rows", ["padded", "packed"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_adapter_gradient_matches_autograd(flavour, config, rows):
    model = tiny_model(flavour, adapters=True, seed=1, **CONFIGS[config])
    randomize_lora_B(model, seed=2)
    engine = BitNetEngine(model)
    parity = check_parity(model, rows_of(model, rows), engine=engine)
    assert len(parity.report.rows) == 2 * len(lora_modules(model))
    assert_parity(parity, flavour)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_packed_row_trains_as_its_examples_alone(flavour):
    # the engine's loss and gradients from the packed rows against transformers' float64 autograd
    # over the examples as separate rows (right-padded, with an attention mask): the same criteria,
    # the packed pass's int8 codes fed to torch's separate rows at each real token
    model = tiny_model(flavour, adapters=True, seed=3, **CONFIGS["gqa-tied"])
    randomize_lora_B(model, seed=4)
    separate = labelled_batch(model, PACKING.lengths, seed=5)
    parity = check_parity(model, separate, engine=PackedEngine(BitNetEngine(model), PACKING))
    assert_parity(parity, flavour)


@pytest.mark.parametrize("flavour", ["packed", "dense"])
def test_adapter_gradients_of_a_bfloat16_model_match_autograd(flavour):
    # BitNet-2B-4T's weights are bfloat16: the engine multiplies them exactly in float32, and where the
    # device has f16 matrix units the LM head's two GEMMs may run there (matmul_mma.wgsl; always with
    # TORCH_WGPU_LORA_GEMMS=matrix_units, as scripts/matrix-units-lavapipe.sh runs this). The reference:
    # autograd in float64 on the same weights; the tolerance check_parity's, from PyTorch float32 on a
    # float32 copy of them (on the bfloat16 model itself torch would compute in bfloat16).
    model = tiny_model(flavour, adapters=True, seed=1)
    randomize_lora_B(model, seed=2)
    model = model.to(torch.bfloat16)
    rows = labelled_batch(model, [11, 6, 9])
    engine = BitNetEngine(model)
    exact = copy.deepcopy(model).double()
    report = compare_gradients(model, rows, reference=exact, same_forward=True, engine=engine)
    float32 = compare_gradients(copy.deepcopy(model).to(torch.float32), rows, reference=exact, same_forward=True,
                                backend="torch")
    assert_parity(ParityCheck(report, longest_sum(model, rows), float32.rms_rel_error,
                              unpinned_max_rel_error=float("nan"), whole_model=True), flavour)
    names = launched(engine.train_plan(3, 11))
    device = get_device()
    if device.settings.gemms == "matrix_units" and f16_matrix_units(device):  # x and dlogits split, two GEMMs
        assert names.count("matmul_mma.wgsl:split") == names.count("matmul_mma.wgsl:gemm_tiled") == 2
    elif device.settings.gemms == "general" or not f16_matrix_units(device):
        assert not any(name.startswith("matmul_mma.wgsl") for name in names)


def checked_train_plan(flavour: str) -> tuple:
    """A tiny model's adapter gradients from the engine checked against autograd; returns the model
    and the engine's training plan of that batch, whose launches the caller then inspects."""
    model = tiny_model(flavour, adapters=True, seed=1)
    randomize_lora_B(model, seed=2)
    engine = BitNetEngine(model)
    parity = check_parity(model, labelled_batch(model, [11, 6, 9]), engine=engine)
    assert parity.report.rms_rel_error <= parity.tolerance, str(parity)
    assert parity.passed
    return model, engine.train_plan(3, 11)  # the plan the check ran (cached)


def launched(plan) -> list[str]:
    """The kernel names of a training plan's first slot, in order (indirect launches included)."""
    return [launch.kernel.name for launch in plan.slots[0].program.launches]


@pytest.mark.parametrize("flavour", ["packed", "dense"])
def test_adapter_gradients_with_the_input_gradients_split_over_their_rows(flavour, monkeypatch):
    # split-K, the GPUs' default at 2B shapes (CPU adapters keep one range): forced to three ranges
    # of every input-gradient GEMM, the LM head's included
    monkeypatch.setattr(projection, "split_k_ranges", lambda workgroups, rows, device: 3)
    _, plan = checked_train_plan(flavour)
    assert any(kernel.endswith(":split_sum") for kernel in launched(plan))


@pytest.mark.matrix_units
@pytest.mark.parametrize("digits", [2, 3])
def test_adapter_gradients_with_fewer_input_gradient_digits_keep_to_their_floor(digits):
    # The input_grad_digits setting's less exact mode, every input gradient through the ternary
    # weights on the matrix units: ParityCheck's measure, its floor n·2^-24 (one float32 sum of n
    # terms) raised to n·2^(1 − 7D), a sum of n terms each kept to 2^(1 − 7D) of its row's largest
    # (bitlinear_t_mma.wgsl). A wrong gradient errs by order 1, far above it.
    device = get_device()
    previous = device.configure(input_grad_digits=digits, gemms="matrix_units")
    try:
        model = tiny_model("packed", adapters=True, seed=1)
        randomize_lora_B(model, seed=2)
        engine = BitNetEngine(model)
        parity = check_parity(model, labelled_batch(model, [11, 6, 9]), engine=engine)
        kernels = [launch.kernel for launch in engine.train_plan(3, 11).slots[0].program.launches
                   if launch.kernel.name == "bitlinear_t_mma.wgsl:gemm_tiled"]
    finally:
        device.configure(previous)
    assert kernels and all(k.constants["DIGITS"] == digits for k in kernels)
    tolerance = 2 * max(parity.float32_rms_rel_error, parity.longest_sum * 2.0 ** (1 - 7 * digits))
    assert parity.report.rms_rel_error <= tolerance, f"{parity}\nwith {digits} digits the tolerance is {tolerance:.2e}"


@pytest.mark.parametrize("keep", [True, False])
def test_adapter_gradients_with_p_kept_from_the_forward_or_computed_again(keep, monkeypatch):
    # each layer's attention probabilities kept for its backward (the default where they fit), or
    # past the budget the backward computing S again from q and k
    if not keep:
        monkeypatch.setattr(policy, "KEPT_PROBABILITIES_BYTES", 0)
    model, plan = checked_train_plan("packed")
    scores = launched(plan).count("attention_scores.wgsl:gemm_tiled")
    assert scores == (2 if keep else 3) * model.config.num_hidden_layers
    assert all((layer.scores is not None) == keep for layer in plan.layers)


@pytest.mark.parametrize("path", ["S again", "flash"])
def test_packed_rows_adapter_gradients_past_the_kept_scores(path, monkeypatch):
    # packed rows where a layer's P is not kept for the backward (which computes S again, masked to
    # each example), and where S is not kept whole at all (the flash kernels, masked alike)
    monkeypatch.setattr(policy, "KEPT_PROBABILITIES_BYTES", 0)
    if path == "flash":
        monkeypatch.setattr(policy, "SCORES_SCRATCH_BYTES", 0)
    model = tiny_model("packed", adapters=True, seed=1)
    randomize_lora_B(model, seed=2)
    engine = BitNetEngine(model)
    parity = check_parity(model, rows_of(model, "packed"), engine=engine)
    assert parity.report.rms_rel_error <= parity.tolerance, str(parity)
    assert parity.passed
    kernels = launched(engine.train_plan(3, 9, packed=True))
    assert ("attention_backward.wgsl:dq" in kernels) == (path == "flash")
    assert kernels.count("attention_scores.wgsl:gemm_tiled") == (0 if path == "flash" else 3 * len(model.model.layers))


@pytest.mark.parametrize("labelled", [5, 70])
def test_the_lm_head_runs_over_the_labelled_rows_only(labelled):
    """Instruction tuning labels the response, not the prompt, and padding has no labels: the
    head's GEMMs run over the labelled rows only (gathered in order, their gradients scattered
    back to their positions, zeros elsewhere), with grids of that many token tiles. Against
    autograd, at 2 × 80 positions with labels scattered over them, after a pass of the same plan
    with every position labelled: 5 (one token tile) and 70 (two)."""
    model = tiny_model("packed", adapters=True, seed=3)
    randomize_lora_B(model, seed=4)
    engine = BitNetEngine(model)
    ids, mask = batch(model.config.vocab_size, [80, 61], seed=5)
    labels = torch.full_like(ids, -100)
    candidates = torch.nonzero(mask[:, 1:]) + torch.tensor([0, 1])  # a label at position j is target j - 1
    chosen = candidates[torch.randperm(len(candidates), generator=torch.Generator().manual_seed(6))[:labelled]]
    labels[chosen[:, 0], chosen[:, 1]] = ids[chosen[:, 0], chosen[:, 1]]
    engine.loss_and_grads(ids, ids.clone(), [80, 61])  # every position labelled first: no row keeps it
    parity = check_parity(model, {"input_ids": ids, "attention_mask": mask, "labels": labels}, engine=engine)
    assert parity.report.rms_rel_error <= parity.tolerance, str(parity)
    assert parity.passed
    plan = engine.train_plan(2, 80)
    grids = np.empty(plan.slots[0].grids.shape, np.uint32)
    rec = Recorder()
    rec.read(plan.slots[0].grids, grids)
    rec.submit()
    used = grids.reshape(-1, 3)[:len(plan.slots[0].head_grids)]  # (the buffer has room for f16 splits too)
    assert {int(y) for y in used[:, 1]} == {-(-labelled // 64)}


@pytest.mark.parametrize("rows", ["padded", "packed"])
def test_loss_backward_fills_grad_through_the_autograd_node(rows):
    model = tiny_model("packed", adapters=True, seed=3)
    randomize_lora_B(model, seed=4)
    engine = BitNetEngine(model)
    data = rows_of(model, rows)
    seen = []
    params = lora_parameters(model)
    params[0].register_hook(lambda g: seen.append(g.clone()))  # gradient hooks run
    out = engine(**data)
    assert out.logits is None and out.loss.requires_grad
    (2.0 * out.loss).backward()
    ids, lengths, positions = check_inputs(engine.engine_config, data["input_ids"], data.get("attention_mask"),
                                          data["labels"], data.get("position_ids"))
    codes: dict = {}
    loss, grads = engine.loss_and_grads(ids, data["labels"], lengths, codes=codes, positions=positions)
    assert abs(out.loss.item() - loss.item()) == 0
    for p in params:
        assert torch.equal(p.grad, 2.0 * grads[p])  # the incoming gradient scales them
    assert torch.equal(seen[0], params[0].grad)
    total = torch.nn.utils.clip_grad_norm_(params, 1.0)  # torch's own tools work on them
    assert math.isfinite(float(total))


def test_a_parameter_changed_between_forward_and_backward_is_refused():
    model = tiny_model("dense", adapters=True)
    engine = BitNetEngine(model)
    out = engine(**labelled_batch(model, [6]))
    with torch.no_grad():
        lora_parameters(model)[1].add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()


def test_logits_come_with_the_loss_when_asked():
    model = tiny_model("dense", adapters=True)
    engine = BitNetEngine(model)
    data = labelled_batch(model, [7, 5])
    out = engine(**data, return_logits=True)
    with torch.no_grad():
        ref = model(**data)
    assert_close(out.logits, ref.logits, LOGIT_RTOL, "logits")
    assert_close(out.loss, ref.loss, LOSS_RTOL, "loss")


def test_one_optimizer_step_is_one_submit_and_matches_the_torch_path():
    # Micro-batches of different shapes, accumulation weighted per labelled token, clipping, AdamW.
    model = tiny_model("dense", adapters=True, seed=5)
    randomize_lora_B(model, seed=6)
    twin = copy.deepcopy(model)
    engine = BitNetEngine(model)
    # eps comparable to the gradients (not 1e-7): the update is then proportional to the gradient
    # rather than its sign, so the check sees the gradient's size too
    opt = WgpuAdamW(lora_parameters(model), lr=1e-2, eps=1e-3)
    device = get_device()
    micro = micro_batches(model, seed=7)
    before = device.submits
    done = engine.train_step(micro, opt, max_grad_norm=0.05)
    assert device.submits - before == 1
    # the torch path, step by step, on the twin
    params = lora_parameters(twin)
    tokens = sum(labelled_tokens(b["labels"]) for b in micro)
    _, loss_sum = torch_grads(twin, micro)
    norm = torch.nn.utils.clip_grad_norm_(params, 0.05)
    assert abs(done["loss"] - loss_sum / tokens) <= 1e-5 * loss_sum / tokens
    assert abs(done["grad_norm"] - norm.item()) <= 1e-4 * norm.item() and done["tokens"] == tokens
    for p in params:
        adamw_reference(p.data, p.grad, torch.zeros_like(p), torch.zeros_like(p), step=1, lr=1e-2,
                        betas=(0.9, 0.999), eps=1e-3, weight_decay=0.01)
    engine.adapters.pull()
    for ours, theirs in zip(lora_parameters(model), params):
        assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_twenty_engine_steps_match_twenty_torch_steps():
    """The engine with WgpuAdamW against the torch path with torch.optim.AdamW, from one start,
    within ``helpers.TWIN_RTOL``; the optimizer's state reads back like torch's."""
    model, twin, engine, ours, theirs = twins(8)
    for step in range(20):
        micro = micro_batches(model, seed=100 + step)
        engine.train_step(micro, ours, max_grad_norm=1.0)
        torch_step(twin, micro, theirs)
    assert_twins_agree(engine, model, twin)
    state = ours.state_dict()["state"]
    for i, p in enumerate(lora_parameters(twin)):
        assert state[i]["step"].item() == 20
        assert_close(state[i]["exp_avg"], theirs.state[p]["exp_avg"], TWIN_RTOL, f"exp_avg {i}")


def test_twenty_engine_steps_on_packed_rows_match_twenty_torch_steps():
    """Packed micro-batches of two shapes (the first padded to the second's in the step: its added
    columns one more example, its added row one example), against the torch path on the same
    packed rows (transformers' packing: position ids, no attention mask, no cache). Tolerance as in
    the twenty-step test."""
    model, twin, engine, ours, theirs = twins(9)
    for step in range(20):
        micro = packed_micro_batches(model, seed=600 + step)
        assert [b["input_ids"].shape for b in micro] == [(2, 9), (1, 11)] and micro[0]["attention_mask"][1, -1] == 0
        done = engine.train_step(micro, ours, max_grad_norm=1.0)
        loss_sum = torch_step(twin, micro, theirs)
        assert_close(done["loss"], loss_sum / done["tokens"], LOSS_RTOL, f"loss of step {step}")
    assert_twins_agree(engine, model, twin)


def test_a_step_of_packed_and_unpacked_micro_batches_is_refused():
    model, _, engine, ours, _ = twins(10)
    micro = [packed_micro_batches(model, seed=700)[0], micro_batches(model, seed=701)[0]]
    with pytest.raises(ValueError, match="1 of the 2 micro-batches hold packed rows .position_ids.: a step's "
                                         "micro-batches are all packed or none"):
        engine.train_step(micro, ours, max_grad_norm=1.0)
    bad = {**micro[0], "position_ids": micro[0]["position_ids"] + 1}
    with pytest.raises(ValueError, match="position_ids row 0 starts at 1"):
        engine.train_step([bad], ours, max_grad_norm=1.0)


def test_steps_in_a_row_keep_the_gpu_values_and_an_edit_in_torch_between_them_wins():
    """No readback before an engine step (one submit each), yet a Parameter edited in torch
    between two steps (after a pull brought the Parameters up to date, as the model's forward
    and state_dict hooks do) is uploaded for the next step while the others keep the GPU's
    values: against the torch path with the same edit. Tolerance as in the twenty-step test."""
    model, twin, engine, ours, theirs = twins(12)
    edited = "model.layers.1.self_attn.v_proj"
    device = get_device()
    for step in range(3):  # the last starts with the GPU's values newer than the Parameters
        micro = micro_batches(model, seed=200 + step)
        before = device.submits
        engine.train_step(micro, ours, max_grad_norm=1.0)
        assert device.submits - before == 1
        torch_step(twin, micro, theirs)
        if step == 0:
            engine.adapters.pull()
            with torch.no_grad():
                for m in (model, twin):
                    lora_modules(m)[edited].lora_A.mul_(-0.5)
    assert_twins_agree(engine, model, twin)


def test_the_step_encoded_ahead_runs_with_its_own_inputs_learning_rate_and_shape():
    """While the GPU runs a step, train_step encodes the next; none of a step's values are in
    that command buffer. Against the torch path: new inputs and a scheduler's learning rate at
    every step; a change of shape, then of max_grad_norm, each of which discards the step
    encoded ahead (so a step is encoded twice), while a repeat uses it (once). One submit a
    step. Tolerance as in the twenty-step test."""
    model, twin, engine, ours, theirs = twins(14)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (ours, theirs)]
    device = get_device()
    # (micro-batches, max_grad_norm, command buffers encoded in the step)
    steps = [(micro_batches(model, 300), 1.0, 2), (micro_batches(model, 301), 1.0, 1),
             ([labelled_batch(model, [11], seed=302)], 1.0, 2), ([labelled_batch(model, [11], seed=303)], 1.0, 1),
             ([labelled_batch(model, [11], seed=304)], 0.05, 2)]
    for micro, max_norm, encoded in steps:
        before, encoded_before = device.submits, engine.optimizer_step.encoded
        engine.train_step(micro, ours, max_grad_norm=max_norm)
        assert device.submits - before == 1 and engine.optimizer_step.encoded - encoded_before == encoded
        torch_step(twin, micro, theirs, max_norm)
        for schedule in schedules:
            schedule.step()
    assert_twins_agree(engine, model, twin)


def _steps_the_engine(engine, micro, optimizer) -> str:
    engine.train_step(micro, optimizer, max_grad_norm=1.0)
    return "no error"


def test_a_step_encoded_ahead_gives_a_forked_child_the_fork_error_and_still_serves_the_parent():
    model, twin, engine, ours, theirs = twins(18)
    micro = micro_batches(model, seed=500)
    engine.train_step(micro, ours, max_grad_norm=1.0)  # leaves the next step encoded
    torch_step(twin, micro, theirs)
    message = in_forked_child(_steps_the_engine, engine, micro, ours)
    assert "forked after its parent created the WebGPU device" in message
    engine.train_step(micro, ours, max_grad_norm=1.0)  # the parent submits the step encoded ahead
    torch_step(twin, micro, theirs)
    assert_twins_agree(engine, model, twin)


def test_a_micro_batch_without_labels_adds_nothing():
    """Its head GEMMs get empty grids (zero token tiles) and its positions zero gradients: the step
    equals the torch path's over the other micro-batch alone (the loss per labelled token of the
    step). Tolerance as in the twenty-step test."""
    model, twin, engine, ours, theirs = twins(16)
    micro = micro_batches(model, seed=400)
    empty = {**micro[1], "labels": torch.full_like(micro[1]["labels"], -100)}
    done = engine.train_step([micro[0], empty], ours, max_grad_norm=1.0)
    torch_step(twin, [micro[0]], theirs)
    assert done["tokens"] == labelled_tokens(micro[0]["labels"])
    assert_twins_agree(engine, model, twin)


def test_a_non_finite_step_is_skipped_on_the_gpu():
    model = tiny_model("dense", adapters=True, seed=10)
    engine = BitNetEngine(model)
    opt = WgpuAdamW(lora_parameters(model), lr=1e-2)
    with torch.no_grad():
        lora_modules(model)["model.layers.0.self_attn.q_proj"].lora_B[0, 0] = float("nan")
    before = [p.detach().clone() for p in lora_parameters(model)]
    done = engine.train_step(micro_batches(model, seed=11), opt, max_grad_norm=1.0)
    assert done["skipped"] and done["loss"] is None
    engine.adapters.pull()
    for p, b in zip(lora_parameters(model), before):
        assert torch.equal(p, b) or (torch.isnan(p) == torch.isnan(b)).all()
    assert opt.state_dict()["state"][0]["step"].item() == 0
