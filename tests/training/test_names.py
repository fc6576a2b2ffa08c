"""The Trainer's options under transformers' ``TrainingArguments`` names (training/names.py): each
means what transformers' own Trainer makes of it, and a short name with its transformers name is
refused."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
import transformers

from torch_wgpu_lora.training.names import SHORT_NAMES, interval_steps
from torch_wgpu_lora.training.trainer import Trainer, train

from .helpers import RECORDS, transformers_plan
from .test_trainer import base, fresh_model  # noqa: F401 - the tiny model fixture

SHARED = ("learning_rate", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
          "warmup_steps", "lr_scheduler_type", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
          "max_grad_norm", "seed", "save_steps", "save_total_limit")


def test_the_options_transformers_names_mean_what_its_trainer_makes_of_them(base, tmp_path):
    # a fraction of an epoch, warmup and checkpoint interval as fractions of the run
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), learning_rate=3e-3, num_train_epochs=1.5,
                                          per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                          warmup_steps=0.25, lr_scheduler_type="cosine", weight_decay=0.1,
                                          adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6, max_grad_norm=0.5,
                                          seed=5, save_steps=0.5, save_total_limit=3, report_to="none", use_cpu=True)
    plan = transformers_plan(args, len(RECORDS))
    run = tmp_path / "run"
    result = train(fresh_model(base), base[1], RECORDS, output_dir=run, max_length=128, progress=False, plot=False,
                   engine="torch", **{name: getattr(args, name) for name in SHARED})
    assert result.steps == plan["max_steps"] == 3  # 8 records, 2 a micro-batch, 2 micro-batches a step: 1.5 × 2
    lrs = [json.loads(line)["lr"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert lrs == plan["lrs"]  # transformers' scheduler on both sides, from the same numbers
    assert plan["warmup_steps"] == 1 and lrs[0] == 0.0
    steps = [int(p.name.split("-")[1]) for p in sorted((run / "checkpoints").iterdir())]
    assert plan["save_steps"] == 2 and steps == [2, 3]  # every save_steps, and at the end
    state = json.loads((run / "checkpoints" / "step-000003" / "state.json").read_text())
    group = state["optimizer"]["param_groups"][0]
    assert (group["weight_decay"], group["betas"], group["eps"]) == \
        (args.weight_decay, [args.adam_beta1, args.adam_beta2], args.adam_epsilon)
    assert state["trainer"]["settings"]["max_grad_norm"] == args.max_grad_norm


def test_transformers_names_are_trainer_options_and_short_names_are_aliases(base, tmp_path):
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    parameters = inspect.signature(Trainer.__init__).parameters
    assert set(SHARED) <= fields and set(SHARED) <= set(parameters)
    assert set(SHORT_NAMES.values()) <= fields and set(SHORT_NAMES.values()) <= set(parameters)
    assert not set(SHORT_NAMES) & set(parameters)
    values = {"learning_rate": 1e-3, "num_train_epochs": 2, "per_device_train_batch_size": 4,
              "lr_scheduler_type": "linear", "lr_scheduler_kwargs": {}, "save_steps": 3, "adam_epsilon": 1e-6}
    for short, name in SHORT_NAMES.items():
        aliased = Trainer(fresh_model(base), base[1], RECORDS, output_dir=tmp_path, progress=False,
                          **{short: values[name]})
        named = Trainer(fresh_model(base), base[1], RECORDS, output_dir=tmp_path, progress=False,
                        **{name: values[name]})
        assert aliased.settings == named.settings and aliased.save_every == named.save_every
        with pytest.raises(TypeError, match=f"{short} and {name} are the same option"):
            Trainer(fresh_model(base), base[1], RECORDS, output_dir=tmp_path, **{short: values[name],
                                                                                 name: values[name]})


def test_betas_is_the_pair_of_adam_beta1_and_adam_beta2(base, tmp_path):
    paired = Trainer(fresh_model(base), base[1], RECORDS, output_dir=tmp_path, progress=False, betas=(0.8, 0.99))
    named = Trainer(fresh_model(base), base[1], RECORDS, output_dir=tmp_path, progress=False, adam_beta1=0.8,
                    adam_beta2=0.99)
    assert paired.settings == named.settings and paired.optimizer.param_groups[0]["betas"] == (0.8, 0.99)
    with pytest.raises(TypeError, match="betas and adam_beta2 are the same option"):
        Trainer(fresh_model(base), base[1], RECORDS, output_dir=tmp_path, betas=(0.8, 0.99), adam_beta2=0.9)
    with pytest.raises(ValueError, match=r"betas must be a pair \(adam_beta1, adam_beta2\), got 0.9"):
        Trainer(fresh_model(base), base[1], RECORDS, output_dir=tmp_path, betas=0.9)


@pytest.mark.parametrize("value, steps", [(0, 0), (3, 3), (3.0, 3), (0.1, 3), (0.5, 13), (0.999, 25)])
def test_interval_steps_as_transformers_counts_them(value, steps, tmp_path):
    # transformers' own: warmup (TrainingArguments.get_warmup_steps) and the checkpoint interval
    args = transformers.TrainingArguments(output_dir=str(tmp_path), warmup_steps=value, save_steps=value or 1,
                                          report_to="none", use_cpu=True)
    assert interval_steps("warmup_steps", value, 25) == args.get_warmup_steps(25) == steps


@pytest.mark.parametrize("value", [-1, 2.5, float("nan"), float("inf"), True, "3"])
def test_interval_steps_refuse_what_is_not_a_number_of_steps(value):
    with pytest.raises(ValueError, match=f"save_steps must be a whole number of steps >= 0 or a fraction in "
                                         rf"\(0, 1\) of the run's steps \(as in transformers\), got"):
        interval_steps("save_steps", value, 10)
