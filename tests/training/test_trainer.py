"""The Trainer on a tiny BitNet: loss and accumulation, outputs, resume, the non-finite guard,
atomic checkpoints, output folders (umask, earlier runs, leftovers) and damaged files."""

import hashlib
import json
import math
import os
import random
import re
import shutil
import stat
import sys

import numpy as np
import pytest
import torch

from torch_wgpu_lora import Trainer, train
from torch_wgpu_lora.engine import BitNetEngine
from torch_wgpu_lora.integrations.adapter_files import load_adapter_file
from torch_wgpu_lora.integrations.bitnet import add_lora_layers, load_bitnet, lora_parameters, lora_state_dict
from torch_wgpu_lora.integrations.tiny import build_tiny_bitnet, build_tiny_tokenizer
from torch_wgpu_lora.prompts import format_prompt
from torch_wgpu_lora.training import checkpoint as checkpoint_module
from torch_wgpu_lora.loss import IGNORE_INDEX
from torch_wgpu_lora.training.data import Example, collate, encode_records, pack, read_records
from torch_wgpu_lora.training.metrics import MetricsLog, plot_loss
from torch_wgpu_lora.ops.optimizer import WgpuAdamW
from torch_wgpu_lora.training.schedule import make_scheduler
from torch_wgpu_lora.training.trainer import TrainerCallback, TrainingStopped, accumulate_gradients, evaluate

from ..engine.helpers import LOSS_RTOL, TWIN_RTOL, assert_close
from .helpers import EVAL_RECORDS, RECORDS


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tiny")
    texts = [format_prompt(r["instruction"], r.get("input", "")) + r["output"] for r in RECORDS + EVAL_RECORDS]
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_tokenizer(root / "tok", texts))
    return build_tiny_bitnet(root / "model", flavour="dense"), tokenizer


def fresh_model(base, dropout=0.0):
    return add_lora_layers(load_bitnet(base[0]), r=4, lora_alpha=8, lora_dropout=dropout)


def options(tmp_path, **overrides):
    # Small and quick: 8 records, batches of 2, no progress bar unless a test wants it.
    return {"output_dir": tmp_path, "batch_size": 2, "lr": 5e-3, "max_length": 128, "progress": False,
            "plot": False, **overrides}


def adapter_tensors(model):
    return {k: v.clone() for k, v in lora_state_dict(model).items()}


def assert_same_adapter(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_accumulated_micro_batches_equal_one_batch(base):
    model = fresh_model(base)
    with torch.no_grad():  # B starts at zero, which would leave A's gradient zero
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(0))
    examples = encode_records(base[1], read_records(RECORDS[:4]))
    pad = base[1].pad_token_id
    params = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)

    def grads_after(batches):
        model.zero_grad(set_to_none=True)
        loss = accumulate_gradients(model, batches)
        return loss, {n: p.grad.clone() for n, p in params.items()}

    one = collate(examples, pad)
    halves = [collate(examples[:2], pad), collate(examples[2:], pad)]
    loss_one, grads_one = grads_after([one])
    loss_acc, grads_acc = grads_after(halves)
    # The halves pad to other lengths, so matmuls group sums differently: float32 rounding only.
    assert loss_acc == pytest.approx(loss_one, rel=1e-6)
    for name in grads_one:
        assert grads_one[name].abs().max() > 0, name
        torch.testing.assert_close(grads_acc[name], grads_one[name], rtol=1e-4, atol=1e-6)
    # Same loss as transformers' own (which shifts labels itself and averages over labelled tokens).
    with torch.no_grad():
        hf_loss = model(**one).loss.item()
    assert loss_one == pytest.approx(hf_loss, rel=1e-5)  # float32 sums in another order
    # The halves differ in token counts, so averaging per-micro-batch means would be wrong:
    # this test can tell the two weightings apart.
    tokens = [int((b["labels"][:, 1:] != -100).sum()) for b in halves]
    assert tokens[0] != tokens[1]
    mean_of_means = sum(accumulate_gradients(model, [h]) for h in halves) / 2
    assert abs(mean_of_means - loss_one) > 1e-4


def test_training_writes_metrics_checkpoints_adapter_plot_and_progress(base, tmp_path, capsys):
    model = fresh_model(base)
    before = adapter_tensors(model)
    result = train(model, base[1], RECORDS[:6], eval_data=EVAL_RECORDS,
                   **options(tmp_path, epochs=3, eval_every=3, save_every=3, progress=True, plot=True))
    assert result.steps == 9  # 6 records / batches of 2 = 3 steps an epoch
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 10))
    assert [r["step"] for r in evals] == [3, 6, 9] and result.eval_loss == evals[-1]["eval_loss"]
    assert steps[0]["lr"] == 0.0 and steps[1]["lr"] == 5e-3  # cosine, ceil(6% of 9) = 1 warmup step
    assert steps[-1]["epoch"] == 3.0 and not any(r["skipped"] for r in steps)
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in steps)
    first_epoch, last_epoch = (sum(r["loss"] for r in steps[i:i + 3]) / 3 for i in (0, 6))
    assert last_epoch < first_epoch  # it learns (same examples each epoch)
    # Checkpoints at 3, 6, 9; the newest two kept.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000006", "step-000009"]
    # The adapter folder holds the trained adapter, and loads into a fresh model.
    trained = adapter_tensors(model)
    assert any(not torch.equal(trained[k], before[k]) for k in trained)
    reloaded = load_adapter_file(fresh_model(base), result.adapter)
    assert_same_adapter(adapter_tensors(reloaded), trained)
    assert result.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bar = capsys.readouterr().err
    assert "loss=" in bar and "lr=" in bar and "tok/s=" in bar and "9/9" in bar


def test_callback_gets_each_metrics_record_right_after_it_is_written(base, tmp_path):
    seen = []

    def callback(record):
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        seen.append((record, json.loads(lines[-1])))  # the newest line of the file, at the time of the call

    train(fresh_model(base), base[1], RECORDS[:4], eval_data=EVAL_RECORDS,
          **options(tmp_path, max_steps=3, eval_every=2, save_every=0, callback=callback))
    assert [(r["step"], "eval_loss" in r) for r, _ in seen] == [(1, False), (2, False), (2, True), (3, False),
                                                                 (3, True)]
    assert all(record == line for record, line in seen)
    with pytest.raises(TypeError, match="callback must be a TrainerCallback or a function taking one metrics record, "
                                        "got str"):
        Trainer(fresh_model(base), base[1], RECORDS, **options(tmp_path, callback="plot"))


class Crash(Exception):
    pass


def crash_on_forward(model, call):
    """Make the model's forward number ``call`` (from 1) raise, as a killed process would stop."""
    calls = {"n": 0}

    def hook(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise Crash(f"forward {call}")

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def test_resume_continues_bit_identically(base, tmp_path):
    # Dropout on: the resumed run must also restore torch's RNG. Two micro-batches a step, in torch
    # (the crash is a forward hook; the engine's resume has its own test below).
    settings = dict(max_steps=10, save_every=5, gradient_accumulation_steps=2, seed=3, engine="torch")
    straight = fresh_model(base, dropout=0.1)
    train(straight, base[1], RECORDS, **options(tmp_path / "straight", **settings))

    interrupted = fresh_model(base, dropout=0.1)
    crash_on_forward(interrupted, call=2 * 7 + 1)  # dies inside step 8, after the step-5 checkpoint
    with pytest.raises(Crash):
        train(interrupted, base[1], RECORDS, **options(tmp_path / "resumed", **settings))
    torch.manual_seed(12345)  # whatever the RNGs hold now must not matter
    resumed = fresh_model(base, dropout=0.1)
    result = train(resumed, base[1], RECORDS, resume_from=True, **options(tmp_path / "resumed", **settings))

    assert result.steps == 10
    assert_same_adapter(adapter_tensors(resumed), adapter_tensors(straight))
    logs = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("straight", "resumed")]
    assert [r["step"] for r in logs[1]] == list(range(1, 11))  # steps 6-7 of the crashed run were dropped
    assert [r["loss"] for r in logs[1]] == [r["loss"] for r in logs[0]]


def test_resume_on_the_engine_continues_bit_identically(base, tmp_path, monkeypatch):
    # The engine's step is one submit; a crash inside step 8 (after the step-5 checkpoint), then a
    # resume: the moments come back from the checkpoint into the engine's flat buffers, and torch's
    # RNG, from which the engine draws its dropout seeds.
    from torch_wgpu_lora.engine.model import BitNetEngine

    settings = dict(max_steps=10, save_every=5, gradient_accumulation_steps=2, seed=3, engine="wgpu")
    straight = fresh_model(base, dropout=0.1)
    train(straight, base[1], RECORDS, **options(tmp_path / "straight", **settings))

    real_step, calls = BitNetEngine.train_step, {"n": 0}

    def crashing_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 8:
            raise Crash("step 8")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(BitNetEngine, "train_step", crashing_step)
    with pytest.raises(Crash):
        train(fresh_model(base, dropout=0.1), base[1], RECORDS, **options(tmp_path / "resumed", **settings))
    monkeypatch.setattr(BitNetEngine, "train_step", real_step)
    torch.manual_seed(12345)  # whatever the RNGs hold now must not matter
    resumed = fresh_model(base, dropout=0.1)
    result = train(resumed, base[1], RECORDS, resume_from=True, **options(tmp_path / "resumed", **settings))

    assert result.steps == 10
    assert_same_adapter(adapter_tensors(resumed), adapter_tensors(straight))
    logs = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("straight", "resumed")]
    assert [r["loss"] for r in logs[1]] == [r["loss"] for r in logs[0]]


def nan_logits_from(model, step):
    """Make every forward from optimiser step ``step`` on (one micro-batch a step) give NaN logits."""
    calls = {"n": 0}

    def hook(module, args, output):
        calls["n"] += 1
        if calls["n"] >= step:
            output.logits = output.logits * float("nan")
        return output

    return model.register_forward_hook(hook)


def nan_on_the_gpu_from(trainer, step):
    """On the engine: from optimiser step ``step`` on, the frozen final norm's weight is NaN on the
    GPU, so the loss is not finite (the adapters themselves stay good)."""
    from torch_wgpu_lora.runtime import write

    class PoisonTheNorm(TrainerCallback):
        def on_log(self, trainer, record):
            if record.get("step") == step - 1 and "loss" in record:
                norm = trainer.engine.weights.final_norm
                write(norm, np.full(norm.shape, np.nan, np.float32))

    trainer.callback = PoisonTheNorm()


@pytest.mark.parametrize("engine", ["torch", "wgpu"])
def test_a_non_finite_loss_skips_the_step(base, tmp_path, engine):
    model = fresh_model(base)
    trainer = Trainer(model, base[1], RECORDS, engine=engine, **options(tmp_path, max_steps=3, save_every=2))
    handle = nan_logits_from(model, step=3) if engine == "torch" else nan_on_the_gpu_from(trainer, step=3)
    with pytest.warns(RuntimeWarning, match=r"non-finite loss at step 3: the step was skipped \(1 in a row"):
        trainer.train()
    if handle is not None:
        handle.remove()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in lines] == [False, False, True] and lines[2]["loss"] is None
    # Step 3 changed nothing: the final checkpoint equals step 2's, moments' step counts included.
    state = json.loads((tmp_path / "checkpoints" / "step-000003" / "state.json").read_text())
    assert set(state["optimizer"]["steps"].values()) == {2.0}
    at_step_2 = load_adapter_file(fresh_model(base), tmp_path / "checkpoints" / "step-000002" / "adapter")
    assert_same_adapter(adapter_tensors(model), adapter_tensors(at_step_2))


def test_a_non_finite_gradient_skips_the_step_and_training_goes_on(base, tmp_path):
    model = fresh_model(base)
    calls = {"n": 0}

    def poison(grad):  # the second step's gradient of one adapter matrix becomes infinite
        calls["n"] += 1
        return grad * float("inf") if calls["n"] == 2 else grad

    model.model.layers[1].self_attn.q_proj.lora_B.register_hook(poison)  # autograd's hooks: the torch path
    with pytest.warns(RuntimeWarning, match="non-finite gradient norm at step 2: the step was skipped"):
        train(model, base[1], RECORDS, engine="torch", **options(tmp_path, max_steps=3, save_every=0))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in lines] == [False, True, False]
    state = json.loads((tmp_path / "checkpoints" / "step-000003" / "state.json").read_text())
    assert set(state["optimizer"]["steps"].values()) == {2.0} and state["trainer"]["bad_streak"] == 0


@pytest.mark.parametrize("engine", ["torch", "wgpu"])
def test_non_finite_steps_in_a_row_stop_training_and_keep_the_last_good_adapter(base, tmp_path, engine):
    model = fresh_model(base)
    trainer = Trainer(model, base[1], RECORDS, engine=engine, **options(tmp_path, max_steps=10, save_every=2))
    if engine == "torch":
        nan_logits_from(model, step=3)
    else:
        nan_on_the_gpu_from(trainer, step=3)
    with pytest.warns(RuntimeWarning), pytest.raises(
            TrainingStopped, match=r"training stopped at step 5: 3 steps in a row had a non-finite loss or gradient"
    ) as stopped:
        trainer.train()
    assert f"the last good adapter is {tmp_path / 'adapter'} (step 4)" in str(stopped.value)
    # Nothing after step 2 was an update; what is on disk is step 2's adapter, and no checkpoint after 4.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    at_step_2 = adapter_tensors(load_adapter_file(fresh_model(base), tmp_path / "checkpoints" / "step-000002" / "adapter"))
    assert_same_adapter(adapter_tensors(load_adapter_file(fresh_model(base), tmp_path / "adapter")), at_step_2)
    assert_same_adapter(adapter_tensors(model), at_step_2)


def test_a_checkpoint_is_complete_or_absent(base, tmp_path, monkeypatch):
    write = checkpoint_module.write_atomic
    calls = {"n": 0}

    def failing_write(path, data):  # the disk fills up inside the second checkpoint
        calls["n"] += 1
        if path.name == "rng.safetensors" and calls["n"] > 3:
            raise OSError("No space left on device")
        write(path, data)

    monkeypatch.setattr(checkpoint_module, "write_atomic", failing_write)
    with pytest.raises(OSError, match="No space left on device"):
        train(fresh_model(base), base[1], RECORDS, **options(tmp_path, max_steps=4, save_every=2))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000002"]  # no half-written folder
    monkeypatch.setattr(checkpoint_module, "write_atomic", write)
    result = train(fresh_model(base), base[1], RECORDS, resume_from=True, **options(tmp_path, max_steps=4,
                                                                                    save_every=2))
    assert result.steps == 4


def test_a_checkpoint_restores_optimizer_scheduler_and_every_rng(base, tmp_path):
    model = fresh_model(base)
    optimizer = WgpuAdamW(lora_parameters(model), lr=1e-2)
    scheduler = make_scheduler(optimizer, "cosine", total_steps=10)
    for p in lora_parameters(model):
        p.grad = torch.ones_like(p)
    optimizer.step()
    scheduler.step()
    checkpoint_module.save_checkpoint(tmp_path / "step-000001", model, optimizer, scheduler, {"step": 1})
    saved = optimizer.state_dict()
    draws = (random.random(), float(np.random.rand()), torch.rand(1).item())

    model2 = fresh_model(base)
    optimizer2 = WgpuAdamW(lora_parameters(model2))
    scheduler2 = make_scheduler(optimizer2, "cosine", total_steps=10)
    assert checkpoint_module.load_checkpoint(tmp_path / "step-000001", model2, optimizer2, scheduler2) == {"step": 1}
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == draws
    assert_same_adapter(adapter_tensors(model2), adapter_tensors(model))
    assert scheduler2.last_epoch == 1 and optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    loaded = optimizer2.state_dict()["state"]
    for i, entry in saved["state"].items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[i][name], entry[name]), (i, name)


def test_bad_setups_are_refused_with_reasons(base, tmp_path):
    with pytest.raises(ValueError, match=r"no LoRA adapters to train; call apply_lora"):
        Trainer(load_bitnet(base[0]), base[1], RECORDS, **options(tmp_path))
    half_bad = tmp_path / "data.jsonl"  # nothing is trained on a file that does not read whole
    half_bad.write_text(json.dumps(RECORDS[0]) + "\n{not json\n" + json.dumps(RECORDS[1]) + "\n")
    with pytest.raises(ValueError, match=r"data.jsonl, line 2: not valid JSON"):
        train(fresh_model(base), base[1], half_bad, **options(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be an integer >= 1, got 0"):
        Trainer(fresh_model(base), base[1], RECORDS, **options(tmp_path, gradient_accumulation_steps=0))
    for cap in (0, -1.0, math.nan, math.inf, True, "25"):
        with pytest.raises(ValueError, match=rf"ddp_bucket_cap_mb must be a number of MiB > 0, got {cap!r}"):
            Trainer(fresh_model(base), base[1], RECORDS, **options(tmp_path, ddp_bucket_cap_mb=cap))
    with pytest.raises(FileNotFoundError, match="resume_from=True, but .* holds no checkpoint"):
        train(fresh_model(base), base[1], RECORDS, resume_from=True, **options(tmp_path))
    train(fresh_model(base), base[1], RECORDS, **options(tmp_path, max_steps=1))
    with pytest.raises(ValueError, match=r"already holds checkpoints \(newest: step-000001\) of an earlier run; "
                                         r"pass resume_from=True to continue that run, overwrite=True to replace it"):
        train(fresh_model(base), base[1], RECORDS, **options(tmp_path, max_steps=1))
    with pytest.raises(ValueError, match=r"other settings \(batch_size: 2 there, 4 here\)"):
        train(fresh_model(base), base[1], RECORDS, resume_from=True, **options(tmp_path, max_steps=1, batch_size=4))


def test_loss_plot_is_optional(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    with pytest.warns(UserWarning, match=r"matplotlib is not installed, so no loss curve was drawn"):
        assert plot_loss([{"step": 1, "loss": 1.0}], tmp_path / "loss.png") is None
    assert not (tmp_path / "loss.png").exists()


# -- output folders, files and damage ---------------------------------------------------------

def test_outputs_are_readable_as_the_umask_allows(base, tmp_path):
    old = os.umask(0o022)
    try:
        train(fresh_model(base), base[1], RECORDS[:4], **options(tmp_path / "run", max_steps=2, save_every=1,
                                                                 plot=True))
        (tmp_path / "opened").write_bytes(b"")  # what open() gives under this umask
    finally:
        os.umask(old)
    run = tmp_path / "run"
    file_mode, dir_mode = stat.S_IMODE((tmp_path / "opened").stat().st_mode), 0o755
    files = [run / "metrics.jsonl", run / "loss.png", *(run / "adapter").iterdir(),
             *(p for p in (run / "checkpoints").rglob("*") if p.is_file())]
    folders = [run / "adapter", *(p for p in (run / "checkpoints").rglob("*") if p.is_dir())]
    # a checkpoint: adapter (2 files), optimizer, rng, state, checksums
    assert len(files) == 2 + 2 + 2 * 6 and file_mode == 0o644
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: file_mode for p in files}
    assert {str(p): stat.S_IMODE(p.stat().st_mode) for p in folders} == {str(p): dir_mode for p in folders}


def test_a_torn_last_metrics_line_is_dropped_on_resume(base, tmp_path):
    train(fresh_model(base), base[1], RECORDS, **options(tmp_path, max_steps=2, save_every=1))
    log = tmp_path / "metrics.jsonl"
    with open(log, "ab") as f:  # step 3's line, cut short by a full disk
        f.write(b'{"step": 3, "epoch": 0.75, "loss": 2.5, "lr": 0.00')
    with pytest.warns(RuntimeWarning, match=r"metrics.jsonl: the last line is torn .* and was dropped"):
        train(fresh_model(base), base[1], RECORDS,
              resume_from=tmp_path / "checkpoints" / "step-000001", **options(tmp_path, max_steps=2, save_every=1))
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("tail", [b'{"step": 3, "lo', b"\x00\x00\x00\x00", b'{"step": 3, "note": "\xc3'])
def test_metrics_log_reads_past_a_torn_last_line_only(tmp_path, tail):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"step": 1, "loss": 2.0})
    log.append({"step": 2, "loss": 1.5})
    with open(log.path, "ab") as f:
        f.write(tail)
    with pytest.warns(RuntimeWarning, match="the last line is torn"):
        assert log.read() == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    with open(log.path, "ab") as f:  # the torn line is no longer the last one: something else broke the file
        f.write(b'\n{"step": 4, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 3: damaged"):
        log.read()


def test_an_earlier_runs_output_is_replaced_only_when_asked(base, tmp_path):
    train(fresh_model(base), base[1], RECORDS, **options(tmp_path, max_steps=2, save_every=1))
    shutil.rmtree(tmp_path / "checkpoints")  # adapter and metrics remain, as after save_total_limit=0 or a cleanup
    before = (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"already holds adapter, metrics.jsonl of an earlier run; pass "
                                         r"overwrite=True to replace it, or choose another output_dir"):
        train(fresh_model(base), base[1], RECORDS, **options(tmp_path, max_steps=1))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == before
    with pytest.raises(ValueError, match="resume_from continues the run in output_dir and overwrite replaces it"):
        train(fresh_model(base), base[1], RECORDS, resume_from=True, **options(tmp_path, max_steps=1, overwrite=True))

    train(fresh_model(base), base[1], RECORDS, **options(tmp_path, max_steps=3, save_every=1, overwrite=True))
    assert len(list((tmp_path / "checkpoints").iterdir())) == 2
    result = train(fresh_model(base), base[1], RECORDS, **options(tmp_path, max_steps=1, overwrite=True))
    assert result.steps == 1
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000001"]  # the old run's are gone
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_length_and_seed_are_checked(base, tmp_path):
    with pytest.raises(ValueError, match=r"give num_train_epochs or max_steps, not both \(got num_train_epochs=1, "
                                         r"max_steps=3\)"):
        Trainer(fresh_model(base), base[1], RECORDS, **options(tmp_path, epochs=1, max_steps=3))
    assert Trainer(fresh_model(base), base[1], RECORDS, **options(tmp_path)).total_steps == 4  # one epoch
    with pytest.raises(ValueError, match=r"seed must be below 2\*\*32 \(numpy's seed range\), got 4294967296"):
        Trainer(fresh_model(base), base[1], RECORDS, **options(tmp_path, seed=2 ** 32))


def test_a_killed_runs_temporary_checkpoints_are_removed_on_the_next_start(base, tmp_path):
    train(fresh_model(base), base[1], RECORDS, **options(tmp_path, max_steps=2, save_every=1))
    root = tmp_path / "checkpoints"
    (root / ".step-000003.1a2b3c4d.tmp" / "adapter").mkdir(parents=True)  # killed while filling step 3
    (root / ".step-000003.1a2b3c4d.tmp" / "optimizer.safetensors").write_bytes(bytes(1000))
    # Killed while replacing step 2: the old one moved aside, the new one not yet in place.
    (root / ".step-000002.5e6f7a8b.old").mkdir()
    os.replace(root / "step-000002", root / ".step-000002.5e6f7a8b.old" / "step-000002")
    train(fresh_model(base), base[1], RECORDS, resume_from=True, **options(tmp_path, max_steps=2, save_every=1))
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002"]


def relist_checksums(folder):
    """Rewrite a checkpoint's checksums.sha256 (sha256sum's format) for its files as they are now."""
    listing = folder / "checksums.sha256"
    names = [line.split("  ", 1)[1] for line in listing.read_text().splitlines()]
    listing.write_text("".join(f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}\n" for n in names))


@pytest.mark.parametrize("name", ["optimizer.safetensors", "rng.safetensors", "state.json",
                                  "adapter/adapter_config.json", "adapter/adapter_model.safetensors"])
def test_a_flipped_bit_in_any_file_of_a_checkpoint_is_refused_naming_the_previous_good_one(base, tmp_path, name):
    train(fresh_model(base), base[1], RECORDS, **options(tmp_path, max_steps=2, save_every=1))
    damaged = tmp_path / "checkpoints" / "step-000002"
    path = damaged / name
    data = bytearray(path.read_bytes())
    # The lowest bit of the last tensor byte, or of the last digit in JSON: the file stays well-formed.
    at = len(data) - 1 if name.endswith(".safetensors") else max(data.rfind(bytes([d])) for d in b"0123456789")
    data[at] ^= 1
    path.write_bytes(bytes(data))
    model = fresh_model(base)
    untouched = adapter_tensors(model)
    good = tmp_path / "checkpoints" / "step-000001"
    with pytest.raises(checkpoint_module.DamagedCheckpoint, match=re.escape(
            f"checkpoint {damaged} is damaged: {path} differs from when it was written (SHA-256 mismatch with "
            f"checksums.sha256); the previous good checkpoint is {good}: resume from it "
            f"(resume_from / --resume {good})")):
        train(model, base[1], RECORDS, resume_from=True, **options(tmp_path, max_steps=3, save_every=1))
    assert_same_adapter(adapter_tensors(model), untouched)  # nothing was restored


@pytest.mark.parametrize("damage, message", [
    (lambda c: (c / "optimizer.safetensors").write_bytes((c / "optimizer.safetensors").read_bytes()[:100]),
     "optimizer.safetensors is truncated or corrupt"),
    (lambda c: (c / "rng.safetensors").unlink(), "it has no rng.safetensors"),
    (lambda c: (c / "state.json").write_text(json.dumps({k: v for k, v in json.loads(
        (c / "state.json").read_text()).items() if k != "scheduler"})), "state.json has no 'scheduler' entry"),
    (lambda c: (c / "state.json").write_text((c / "state.json").read_text()[:-40]), "state.json is not valid JSON"),
])
def test_a_damaged_checkpoint_is_named_with_the_previous_good_one(base, tmp_path, damage, message):
    train(fresh_model(base), base[1], RECORDS, **options(tmp_path, max_steps=3, save_every=1, save_total_limit=3))
    root = tmp_path / "checkpoints"
    state = json.loads((root / "step-000002" / "state.json").read_text())
    del state["trainer"]["bad_streak"]  # step 2 is damaged too: the previous good one is step 1
    (root / "step-000002" / "state.json").write_text(json.dumps(state))
    relist_checksums(root / "step-000002")  # its files read back as listed: the missing entry is what is named
    damage(root / "step-000003")
    model = fresh_model(base)
    untouched = adapter_tensors(model)
    with pytest.raises(checkpoint_module.DamagedCheckpoint) as damaged:
        train(model, base[1], RECORDS, resume_from=True, **options(tmp_path, max_steps=3, save_every=1))
    assert str(damaged.value).startswith(f"checkpoint {root / 'step-000003'} is damaged: ")
    assert message in str(damaged.value)
    assert str(damaged.value).endswith(f"; the previous good checkpoint is {root / 'step-000001'}: resume from it "
                                       f"(resume_from / --resume {root / 'step-000001'})")
    assert_same_adapter(adapter_tensors(model), untouched)  # nothing was restored
    with pytest.raises(checkpoint_module.DamagedCheckpoint, match=r"has no trainer.bad_streak entry; the previous "
                                                                  r"good checkpoint is .*step-000001"):
        train(model, base[1], RECORDS, resume_from=root / "step-000002", **options(tmp_path, max_steps=3))


def test_examples_longer_than_the_context_are_refused_or_cut_as_the_engine_refuses_them(base, tmp_path):
    model, tokenizer = fresh_model(base), base[1]
    long = {"instruction": "Repeat the word.", "input": "cat", "output": " ".join(["cat"] * 400)}
    records = RECORDS[:3] + [long]
    tokens = len(tokenizer(format_prompt(long["instruction"], long["input"]))["input_ids"]) + \
        len(tokenizer(long["output"], add_special_tokens=False)["input_ids"]) + 1  # and EOS
    assert tokens > 512 and model.config.max_position_embeddings == 256
    with pytest.raises(ValueError) as by_engine:
        BitNetEngine(model)(torch.zeros(1, 512, dtype=torch.long))
    # The default max_length (512) cuts the record to 512 tokens, still twice the context.
    with pytest.raises(ValueError) as refused:
        Trainer(model, tokenizer, records, **options(tmp_path, max_length=512, engine="torch"))
    assert str(refused.value) == (f"record 3: {by_engine.value}; long_examples='truncate' (--long-examples truncate) "
                                  "cuts such records to the context")
    with pytest.raises(ValueError, match=r"^eval_data: record 0: 512 tokens exceed the model's context"):
        Trainer(model, tokenizer, RECORDS, eval_data=[long], **options(tmp_path, max_length=512))

    with pytest.warns(UserWarning, match=r"^1 of 4 records were cut to the model's context of 256 positions"):
        trainer = Trainer(model, tokenizer, records, **options(tmp_path, max_length=512, engine="torch",
                                                                 long_examples="truncate", max_steps=1))
    assert [len(e.input_ids) for e in trainer.examples][3] == 256
    assert trainer.train().steps == 1

    # The torch path's own loss functions check a batch as the engine does.
    batch = {"input_ids": torch.zeros(1, 512, dtype=torch.long), "attention_mask": torch.ones(1, 512, dtype=torch.long),
             "labels": torch.zeros(1, 512, dtype=torch.long)}
    for run in (lambda: evaluate(model, [batch]), lambda: accumulate_gradients(model, [batch])):
        with pytest.raises(ValueError) as by_torch:
            run()
        assert str(by_torch.value) == str(by_engine.value)



def test_a_packed_batch_meets_the_context_with_its_longest_example(base):
    # Positions restart at each packed example: two of 200 tokens make a row of 400 positions
    # numbered up to 199, within the context of 256; one of 300 tokens is refused as the engine
    # refuses 300 tokens.
    model = fresh_model(base)
    assert model.config.max_position_embeddings == 256
    g = torch.Generator().manual_seed(0)

    def example(length):
        ids = torch.randint(3, model.config.vocab_size, (length,), generator=g).tolist()
        return Example(input_ids=ids, labels=[IGNORE_INDEX, *ids[1:]])

    two = collate(pack([example(200), example(200)], 400), pad_token_id=2)
    assert two["input_ids"].shape == (1, 400) and int(two["position_ids"].max()) == 199
    assert math.isfinite(evaluate(model, [two]))
    with pytest.raises(ValueError) as by_engine:
        BitNetEngine(model)(torch.zeros(1, 300, dtype=torch.long))
    long = collate(pack([example(300), example(50)], 400), pad_token_id=2)
    with pytest.raises(ValueError) as by_torch:
        evaluate(model, [long])
    assert str(by_torch.value) == str(by_engine.value)


# -- watching and steering a run ------------------------------------------------------------------

def read_metrics(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_any_transformers_schedule_with_warmup_steps_and_its_options(base, tmp_path):
    from transformers import get_scheduler

    train(fresh_model(base), base[1], RECORDS, **options(tmp_path, max_steps=6, lr=1e-2, schedule="cosine_with_min_lr",
                                                         warmup_steps=2, scheduler_kwargs={"min_lr_rate": 0.25}))
    logged = [r["lr"] for r in read_metrics(tmp_path)]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    reference = get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=2, num_training_steps=6,
                              scheduler_specific_kwargs={"min_lr_rate": 0.25})
    expected = []
    for _ in range(6):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        reference.step()
    assert logged == expected and expected[0] == 0.0 and min(expected[2:]) >= 0.25e-2
    with pytest.raises(ValueError, match="give warmup_steps or warmup_ratio, not both"):
        Trainer(fresh_model(base), base[1], RECORDS, **options(tmp_path, warmup_steps=1, warmup_ratio=0.1))


def test_a_plateau_schedule_follows_the_evaluation_loss(base, tmp_path):
    train(fresh_model(base), base[1], RECORDS, eval_data=EVAL_RECORDS,
          **options(tmp_path, max_steps=6, lr=5e-2, eval_every=1, schedule="reduce_lr_on_plateau",
                    scheduler_kwargs={"patience": 0, "factor": 0.5}))
    lines = read_metrics(tmp_path)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=5e-2)
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    for record in lines:  # torch's own scheduler, fed the same evaluation losses at the same points
        if "loss" in record:
            assert record["lr"] == optimizer.param_groups[0]["lr"]
        else:
            reference.step(record["eval_loss"])
    with pytest.raises(ValueError, match=r"lr_scheduler_type='reduce_lr_on_plateau' follows the evaluation loss: give "
                                         r"eval_data and eval_every > 0"):
        Trainer(fresh_model(base), base[1], RECORDS, **options(tmp_path, schedule="reduce_lr_on_plateau"))


def test_evaluations_log_perplexity_and_early_stopping_ends_the_run(base, tmp_path):
    # A threshold no loss can beat: every evaluation after the first counts as no better.
    result = train(fresh_model(base), base[1], RECORDS, eval_data=EVAL_RECORDS,
                   **options(tmp_path, max_steps=20, eval_every=2, save_every=0, early_stopping_patience=2,
                             early_stopping_threshold=1e9))
    evals = [r for r in read_metrics(tmp_path) if "eval_loss" in r]
    assert all(r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-12) for r in evals)
    assert [r["step"] for r in evals] == [2, 4, 6]  # best at 2, no better at 4 and 6: patience 2 is spent
    assert result.steps == 6 and result.stopped.startswith("early stopping: 2 evaluations without")
    assert result.checkpoint.name == "step-000006" and result.eval_loss == evals[-1]["eval_loss"]
    assert (result.best_step, result.best_eval_loss) == (2, evals[0]["eval_loss"])


def test_the_best_adapter_is_kept_and_loaded_at_the_end(base, tmp_path):
    model = fresh_model(base)
    result = train(model, base[1], RECORDS, eval_data=EVAL_RECORDS,
                   **options(tmp_path, max_steps=6, lr=0.3, eval_every=1, save_every=1, save_total_limit=6,
                             save_best=True, load_best_at_end=True))
    evals = [r for r in read_metrics(tmp_path) if "eval_loss" in r]
    best = min(evals, key=lambda r: r["eval_loss"])
    assert (result.best_step, result.best_eval_loss) == (best["step"], best["eval_loss"])
    assert best["step"] != 6, "a run whose last step is its best does not show the best being kept"
    at_best = load_adapter_file(fresh_model(base), tmp_path / "checkpoints" / f"step-{best['step']:06d}" / "adapter")
    assert_same_adapter(adapter_tensors(load_adapter_file(fresh_model(base), result.best_adapter)), adapter_tensors(at_best))
    assert_same_adapter(adapter_tensors(model), adapter_tensors(at_best))  # load_best_at_end


def test_tensorboard_gets_every_record_through_its_own_writer(base, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(fresh_model(base), base[1], RECORDS[:4], eval_data=EVAL_RECORDS,
          **options(tmp_path, max_steps=3, eval_every=2, report_to="tensorboard"))
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    lines = read_metrics(tmp_path)
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("eval/loss", "eval_loss"),
                     ("eval/perplexity", "eval_perplexity")):
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        expected = [(r["step"], r[key]) for r in lines if key in r]
        assert [s for s, _ in logged] == [s for s, _ in expected], tag
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6), tag  # float32 in events


def test_a_tracker_that_is_not_installed_is_named(base, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(ValueError, match=r"report_to='wandb' needs the wandb package, which is not installed"):
        Trainer(fresh_model(base), base[1], RECORDS, **options(tmp_path, report_to=["wandb"]))
    with pytest.raises(ValueError, match=r"report_to takes \('tensorboard', 'wandb'\), got 'mlflow'"):
        Trainer(fresh_model(base), base[1], RECORDS, **options(tmp_path, report_to="mlflow"))


def test_callbacks_hear_each_event_and_can_stop_the_run(base, tmp_path):
    events = []

    class Watcher(TrainerCallback):
        def on_log(self, trainer, record):
            events.append(("log", record["step"], "eval_loss" in record))

        def on_step_end(self, trainer, step):
            events.append(("step", step))
            if step == 4:
                trainer.stop("seen enough")

        def on_evaluate(self, trainer, metrics):
            events.append(("evaluate", metrics["step"], metrics["eval_perplexity"] > 1))

        def on_save(self, trainer, checkpoint):
            events.append(("save", checkpoint.name))

    result = train(fresh_model(base), base[1], RECORDS, eval_data=EVAL_RECORDS,
                   **options(tmp_path, max_steps=10, eval_every=2, save_every=3, callback=Watcher()))
    assert events == [("log", 1, False), ("step", 1), ("log", 2, False), ("log", 2, True), ("evaluate", 2, True),
                      ("step", 2), ("log", 3, False), ("step", 3), ("save", "step-000003"), ("log", 4, False),
                      ("log", 4, True), ("evaluate", 4, True), ("step", 4), ("save", "step-000004")]
    assert result.steps == 4 and result.stopped == "seen enough" and result.checkpoint.name == "step-000004"


def test_packing_trains_on_the_same_loss_as_the_examples_alone(base, tmp_path):
    """One step over every example, packed: its loss is the mean over the examples' labelled tokens
    computed unpacked (transformers' forward either way; 1e-5 relative covers float32 sums over rows
    of other lengths, where attention across examples would move the loss by far more)."""
    model = fresh_model(base)
    examples = encode_records(base[1], read_records(RECORDS), 128)
    alone = accumulate_gradients(model, [collate(examples, base[1].pad_token_id)])
    model.zero_grad()
    result = train(model, base[1], RECORDS, **options(tmp_path, max_steps=1, batch_size=8, lr=0.0, packing=True,
                                                      engine="auto"))
    assert result.loss == pytest.approx(alone, rel=1e-5)


def test_packed_training_on_the_engine_matches_the_torch_path(base, tmp_path):
    """Six steps over rows of two packed examples (two rows a micro-batch, two micro-batches a step)
    on the engine and on the torch path from one start: the adapters within the engine's twin
    tolerance (``TWIN_RTOL``), every step's loss within ``LOSS_RTOL``."""
    settings = dict(max_steps=6, packing=True, max_length=160, gradient_accumulation_steps=2, seed=5)
    runs = {}
    for engine in ("wgpu", "torch"):
        model = fresh_model(base)
        with torch.no_grad():  # B starts at zero, which would leave A's first gradient zero
            for name, p in model.named_parameters():
                if name.endswith("lora_B"):
                    p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(0))
        trainer = Trainer(model, base[1], RECORDS, **options(tmp_path / engine, engine=engine, **settings))
        assert (trainer.engine is not None) == (engine == "wgpu")
        assert [e.position_ids.count(0) for e in trainer.examples] == [2] * (len(RECORDS) // 2)
        trainer.train()
        runs[engine] = (model, read_metrics(tmp_path / engine))
    (ours, ours_log), (theirs, theirs_log) = runs["wgpu"], runs["torch"]
    for a, b in zip(ours_log, theirs_log):
        assert a["step"] == b["step"] and a["tokens"] == b["tokens"]
        assert_close(a["loss"], b["loss"], LOSS_RTOL, f"loss of step {a['step']}")
    for (name, a), b in zip(adapter_tensors(ours).items(), adapter_tensors(theirs).values()):
        assert_close(a, b, TWIN_RTOL, name)


def test_length_grouped_batches_train(base, tmp_path):
    result = train(fresh_model(base), base[1], RECORDS, **options(tmp_path, epochs=1, group_by_length=True))
    assert result.steps == 4 and all(r["loss"] is not None for r in read_metrics(tmp_path))
