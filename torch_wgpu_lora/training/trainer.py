"""``Trainer`` and ``train``: LoRA finetuning of a causal LM on instruction, chat or text data.

>>> # from torch_wgpu_lora import apply_lora, load_bitnet, train
>>> # model = apply_lora(load_bitnet("bitnet-bf16"), r=8)
>>> # tokenizer = AutoTokenizer.from_pretrained("bitnet-bf16")
>>> # result = train(model, tokenizer, "alpaca.json", output_dir="run", num_train_epochs=3)
>>> # result.adapter            # run/adapter: PEFT folder of the last good adapter

The options have the names of transformers' ``TrainingArguments`` (and TRL's ``SFTConfig``) where
they share its meaning (``training.names``): ``learning_rate``, ``num_train_epochs``,
``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``max_steps``, ``warmup_steps``,
``lr_scheduler_type``, ``lr_scheduler_kwargs``, ``weight_decay``, ``adam_beta1``, ``adam_beta2``,
``adam_epsilon``, ``max_grad_norm``, ``seed``, ``save_steps``, ``save_total_limit``, ``output_dir``,
``max_length``, ``packing``, ``group_by_length``, ``report_to``; ``lr``, ``epochs``, ``batch_size``,
``schedule``, ``scheduler_kwargs``, ``save_every`` and ``eps`` are short names for some of them,
``betas`` the pair (``adam_beta1``, ``adam_beta2``).

One optimiser step consumes ``gradient_accumulation_steps`` micro-batches of
``per_device_train_batch_size`` whole sequences. The loss is the mean cross-entropy over every response
token (and EOS) of the step: each micro-batch's summed loss is divided by the step's
total count of such tokens before its backward, so accumulating k micro-batches gives
the gradient of one batch of k·``per_device_train_batch_size`` sequences. Then global-norm clipping
(``max_grad_norm``, 0 = off), a ``WgpuAdamW`` update of the adapter, and one step of
the LR schedule (which follows the step count, skipped steps included).

Non-finite values: a step whose loss or gradient norm is not finite changes nothing
(no update) and warns; ``max_bad_steps`` of them in a row stop training with
``TrainingStopped``. Adapters are written only from good steps, so the last saved one
(``output_dir/adapter`` and the checkpoints) is never replaced by a broken one.

Files under ``output_dir``: ``metrics.jsonl`` (one line per step and per evaluation),
``checkpoints/step-NNNNNN`` (every ``save_steps`` steps and at the end; the newest
``save_total_limit`` are kept), ``adapter/`` (the adapter of the newest checkpoint),
``best-adapter/`` (``save_best``: the adapter of the lowest evaluation loss so far),
``runs/`` (``report_to="tensorboard"``) and ``loss.png`` (if matplotlib is installed).

Watching and steering a run: evaluations log the loss and its perplexity; ``early_stopping_patience``
ends the run when that many evaluations in a row did not lower the best loss by more than
``early_stopping_threshold``; a ``TrainerCallback`` hears each logged record, step, evaluation
and checkpoint, and may end the run (``Trainer.stop``). A run that ends early saves a checkpoint
and returns normally, its ``TrainResult.stopped`` saying why. ``train(resume_from=True)`` continues from the
newest checkpoint, bit for bit as if the run had not stopped. A fresh run refuses an
``output_dir`` that holds an earlier run's output unless told to ``overwrite`` it. Every
run starts by deleting the temporary checkpoint folders a killed run left behind.

Data-parallel training: a ``Trainer`` made in each process of an initialised
``torch.distributed`` process group of more than one process (``torchrun --nproc-per-node N
-m torch_wgpu_lora train ...``, ``accelerate launch``, or a program of one's own) trains one
adapter over all of them; ``training.distributed`` says what they exchange. Each epoch's
seeded order is dealt out among the ranks as ``DistributedSampler`` deals it (``data.shard``),
so with ``per_device_train_batch_size`` b on each of W ranks, each step covers the examples one process with
batch W·b would. Each step all-reduces the labelled-token count first and scales every rank's
loss by the global count, then all-reduces the flattened adapter gradients (with the loss; on
the engine in buckets of ``ddp_bucket_cap_mb`` while the backward runs, as DDP's buckets):
the loss, the gradient, the clip and the AdamW update are those of one process with the
whole batch, up to float32 summation order, and every rank applies the same update (a
checksum all-gather every ``check_every`` steps and before each checkpoint proves it).
Rank 0 alone touches ``output_dir`` (checkpoints, ``metrics.jsonl``, the adapter, the plot;
the logged loss and token counts are global); the others wait for it at each checkpoint.
Checkpoints store the world size and every rank's random state: resuming needs the same
number of processes, and refuses another. A rank that dies or hangs ends the others with
``RankLost`` (the process group's timeout), not a hang.
"""

from __future__ import annotations

import hashlib
import math
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..engine import choose_engine
from ..engine.step import DEFAULT_BUCKET_BYTES
from ..integrations.adapter_files import load_adapter_file, save_adapter
from ..integrations.bitnet import lora_parameters
from ..integrations.peft import from_peft, peft_layers
from ..limits import check_context, model_context
from ..loss import causal_lm_loss, labelled_tokens
from ..ops.optimizer import WgpuAdamW, clip_grad_norm
from .checkpoint import (DamagedCheckpoint, checkpoint_name, checkpoint_step, latest_checkpoint, list_checkpoints,
                         load_checkpoint, read_checkpoint, read_rank_rngs, remove_unfinished, rng_state,
                         save_checkpoint, set_rng_state)
from .data import Example, collate, encode_records, epoch_order, length_grouped_order, pack, read_records, shard
from .distributed import DataParallel, RankLost
from .metrics import MetricsLog, Reporters, perplexity, plot_loss
from .names import accepts_short_names, interval_steps
from .schedule import make_scheduler, metric_driven, warmup_steps as ratio_warmup

__all__ = ["TrainResult", "Trainer", "TrainerCallback", "TrainingStopped", "accumulate_gradients", "earlier_run",
           "evaluate", "train"]

SEED_LIMIT = 2 ** 32  # numpy's legacy seed (np.random.seed), which the Trainer sets
# What a run writes into its output folder (besides checkpoints/), by the Trainer's names.
_OUTPUTS = ("adapter", "best-adapter", "metrics.jsonl", "loss.png", "runs")
_WARMUP_RATIO = 0.06  # the share of steps warming up when neither warmup_steps nor warmup_ratio is given
# Settings recorded in checkpoints since a later version, at the value a checkpoint without them had.
_SETTINGS_BEFORE = {"warmup_steps": None, "scheduler_kwargs": None, "packing": False, "group_by_length": False}


class TrainingStopped(RuntimeError):
    """Training gave up: too many non-finite steps in a row."""


@dataclass(frozen=True)
class TrainResult:
    """What a finished run left behind."""

    steps: int
    loss: float | None  # mean loss per response token of the last step (None if it was skipped)
    eval_loss: float | None  # on eval_data at the end, when given
    adapter: Path
    checkpoint: Path
    metrics: Path
    plot: Path | None
    best_eval_loss: float | None = None  # the lowest evaluation loss, and its step
    best_step: int | None = None
    best_adapter: Path | None = None  # its adapter (save_best)
    stopped: str | None = None  # why the run ended before its last step (early stopping, a callback), else None


class TrainerCallback:
    """Hooks into a run; override the ones needed (each gets the ``Trainer``). ``trainer.stop(why)``,
    from any of them, ends the run after the current step: a checkpoint is saved and ``train``
    returns, ``TrainResult.stopped`` being ``why``.

    >>> class StopAtLoss(TrainerCallback):
    ...     def on_log(self, trainer, record):
    ...         if record.get("loss") is not None and record["loss"] < 0.5:
    ...             trainer.stop("the loss fell below 0.5")
    """

    def on_log(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """A metrics record (a step's or an evaluation's, as in metrics.jsonl), right after it is written."""

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        """Optimiser step ``step`` (from 1) is done."""

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        """An evaluation finished: ``metrics`` has ``step``, ``eval_loss`` and ``eval_perplexity``."""

    def on_save(self, trainer: Trainer, checkpoint: Path) -> None:
        """A checkpoint was written (on every rank, once rank 0 has written it)."""


class _OnLog(TrainerCallback):
    """A plain function as the callback: it hears each metrics record."""

    def __init__(self, function: Callable[[dict[str, Any]], None]) -> None:
        self.function = function

    def on_log(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.function(record)


def _summed_token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy summed over the batch's labelled positions (token t predicts t+1). A packed batch
    goes in with its ``position_ids``, no attention mask and no cache: transformers then attends within
    each packed example only (its masks take position ids restarting at 0 as example boundaries), and
    so does ``BitNetEngine``."""
    if "position_ids" in batch:
        # Positions restart at each packed example: the longest example is what meets the context.
        check_context(model_context(model), int(batch["position_ids"][batch["attention_mask"].bool()].max()) + 1)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    else:
        check_context(model_context(model), batch["input_ids"].shape[1])  # the engine checks the same
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return causal_lm_loss(logits, batch["labels"], reduction="sum")


def _loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    return labelled_tokens(batch["labels"])


def accumulate_gradients(model: torch.nn.Module, micro_batches: Sequence[dict[str, torch.Tensor]],
                         total_tokens: int | None = None) -> float:
    """Backpropagate the mean loss per labelled token over all ``micro_batches`` into ``.grad``.

    Returns that mean loss, or NaN (stopping early) when a micro-batch's loss is not finite.
    Gradients add to what ``.grad`` holds; zero them between optimiser steps.
    ``total_tokens`` replaces the micro-batches' own count of labelled tokens as the divisor:
    in data-parallel training, the count over every process, so that the processes' losses
    and gradients add up to the mean over the whole global batch.
    """
    if total_tokens is None:
        total_tokens = sum(_loss_tokens(b) for b in micro_batches)
    if total_tokens == 0:
        raise ValueError("the micro-batches hold no labelled token: nothing to compute a loss on")
    loss_sum = 0.0
    for batch in micro_batches:
        summed = _summed_token_loss(model, batch)
        if not torch.isfinite(summed):
            return math.nan
        (summed / total_tokens).backward()
        loss_sum += summed.item()
    return loss_sum / total_tokens


@torch.no_grad()
def _loss_sums(model: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]]) -> tuple[float, int]:
    """Summed loss and labelled tokens over ``batches``, in eval mode (the mode is restored)."""
    was_training = model.training
    model.eval()
    try:
        loss_sum = sum(_summed_token_loss(model, b).item() for b in batches)
    finally:
        model.train(was_training)
    return loss_sum, sum(_loss_tokens(b) for b in batches)


def evaluate(model: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]]) -> float:
    """Mean loss per labelled token over ``batches``, in eval mode (the mode is restored)."""
    loss_sum, tokens = _loss_sums(model, batches)
    return loss_sum / tokens


def _positive_int(name: str, value: Any, allow_zero: bool = False) -> int:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def earlier_run(output_dir: str | Path) -> str | None:
    """What an earlier run left in ``output_dir`` (e.g. ``"checkpoints (newest: step-000100)"`` or
    ``"adapter, metrics.jsonl"``), or None when a fresh run can start there without replacing anything.

    >>> # earlier_run("run")  # -> None for a new or empty folder
    """
    output_dir = Path(output_dir)
    newest = latest_checkpoint(output_dir / "checkpoints")
    if newest is not None:
        return f"checkpoints (newest: {newest.name})"
    found = [name for name in _OUTPUTS if (output_dir / name).exists()]
    return ", ".join(found) or None


def _fingerprint(examples: list[Example]) -> str:
    digest = hashlib.sha256()
    for e in examples:
        digest.update(np.asarray(e.input_ids, np.int64).tobytes())
        digest.update(np.asarray(e.labels, np.int64).tobytes())
    return digest.hexdigest()[:16]


class Trainer:
    """Finetunes the LoRA adapters of ``model`` (``apply_lora`` first) on ``data``.

    ``model``: a transformers model holding adapters (``apply_lora``), or a ``PeftModel`` (or a base
    ``get_peft_model`` wrapped), whose adapter is trained through ``integrations.peft.from_peft``:
    the Parameters are the PeftModel's own, so it holds the trained values afterwards.

    ``data`` and ``eval_data``: records in any form ``training.data`` reads (chat ``messages``,
    ``prompt``/``completion``, ``text``, Alpaca), from a JSON/JSONL/Parquet/CSV path, a
    ``datasets.Dataset`` or a list of dicts. ``packing=True`` packs several examples into each
    sequence of ``max_length`` tokens (``data.pack``: each example attends to itself only, on
    either path); ``group_by_length=True`` batches examples of similar length together
    (``data.length_grouped_order``).
    Training runs ``num_train_epochs`` passes over the data (a fraction of an epoch: that share of
    its steps, rounded up, as in transformers), or exactly ``max_steps`` optimiser steps (passing
    over the data as often as needed); give one of them, or neither for one epoch.
    ``seed`` (in [0, 2**32)) fixes the data order and seeds Python's, numpy's and torch's
    RNGs (LoRA dropout) at the start of a fresh run.
    ``eval_every`` (steps, 0 = only at the end) evaluates on ``eval_data``; ``save_steps``
    (steps, or a fraction in (0, 1) of the run's steps as in transformers; 0 = only at the end)
    writes a checkpoint. ``progress=False`` hides the bar.
    ``overwrite=True`` lets a fresh run replace an earlier run's output in ``output_dir``
    (its checkpoints are deleted when training starts); without it that is refused.
    ``max_length`` cuts each example to that many tokens. An example still longer than the
    model's context (``max_position_embeddings``), in ``data`` or ``eval_data``, is refused
    before training starts, naming the record (``long_examples="refuse"``, the default), or
    cut to the context (``"truncate"``, warning how many were cut); on either path.
    ``callback``, when given, is a ``TrainerCallback``, or a function called with each metrics
    record (a training step's or an evaluation's dict, as in ``metrics.jsonl``) right after it is
    written, e.g. to draw a live loss plot in a notebook.

    Schedule: ``lr_scheduler_type`` is any transformers scheduler (``training.schedule``), warming
    up for ``warmup_steps`` steps (a fraction in (0, 1): that share of the steps, rounded up, as in
    transformers) or a ``warmup_ratio`` of them (transformers 4's name; default 0.06), with
    ``lr_scheduler_kwargs`` its own options; "reduce_lr_on_plateau" and "greedy" follow the evaluation loss (they need
    ``eval_data`` and ``eval_every``). Evaluation: ``early_stopping_patience`` (evaluations, 0 =
    off) and ``early_stopping_threshold`` stop a run that no longer improves; ``save_best`` keeps
    the adapter of the lowest evaluation loss in ``output_dir/best-adapter``, and
    ``load_best_at_end`` puts it into the model when the run ends. ``report_to``: "tensorboard"
    and/or "wandb" (a name or a list) also get every record, through each library's own writer
    (optional dependencies).

    ``engine``: ``"wgpu"`` runs the whole model on WebGPU (``BitNetEngine``): each optimizer
    step, every micro-batch's forward and backward, the clip and the AdamW update, is one
    command buffer, and gradients and moments never leave the GPU (the Parameters are brought
    up to date when read: checkpoints, the saved adapter, evaluation, the end of training).
    ``"torch"`` runs transformers' modules with the adapters on their backend. ``"auto"``
    (default) takes the engine when it can run the model.

    In an initialised ``torch.distributed`` group of more than one process, every process makes
    its own ``Trainer`` with the same arguments and they train together (see the module
    docstring): ``per_device_train_batch_size`` is per process, ``seed`` also seeds each rank's own random
    streams (rank 0 takes ``seed`` itself), ``callback`` runs on every rank with the global
    record, the progress bar and every file belong to rank 0, and ``check_every`` (steps, 0 =
    only at checkpoints) says how often the ranks compare checksums of their adapters. The
    engine exchanges the gradients in buckets of ``ddp_bucket_cap_mb`` MiB (the same on every
    rank) while the backward runs: each bucket, a run of layers, is all-reduced as soon as the
    backward has passed those layers (``BitNetEngine.train_step``'s ``all_reduce``).

    >>> # trainer = Trainer(model, tokenizer, "train.jsonl", eval_data="val.jsonl", max_steps=200)
    >>> # result = trainer.train()             # or trainer.train(resume_from=True) after a stop
    """

    @accepts_short_names
    def __init__(self, model: torch.nn.Module, tokenizer: Any, data: Any, *, eval_data: Any = None,
                 output_dir: str | Path = "lora-output", num_train_epochs: float | None = None,
                 max_steps: int | None = None, per_device_train_batch_size: int = 4,
                 gradient_accumulation_steps: int = 1, learning_rate: float = 2e-4,
                 adam_beta1: float = 0.9, adam_beta2: float = 0.999, adam_epsilon: float = 1e-7,
                 weight_decay: float = 0.01,
                 max_grad_norm: float = 1.0, lr_scheduler_type: str = "cosine", warmup_ratio: float | None = None,
                 warmup_steps: float | None = None, lr_scheduler_kwargs: dict[str, Any] | None = None,
                 max_length: int = 512, packing: bool = False, group_by_length: bool = False, seed: int = 42,
                 save_steps: float = 100, eval_every: int = 0, save_total_limit: int = 2, max_bad_steps: int = 3,
                 early_stopping_patience: int = 0, early_stopping_threshold: float = 0.0, save_best: bool = False,
                 load_best_at_end: bool = False, report_to: str | Sequence[str] = (), progress: bool = True,
                 plot: bool = True, overwrite: bool = False,
                 callback: TrainerCallback | Callable[[dict[str, Any]], None] | None = None,
                 engine: str = "auto", check_every: int = 50, long_examples: str = "refuse",
                 ddp_bucket_cap_mb: float = DEFAULT_BUCKET_BYTES / 2**20) -> None:
        if peft_layers(model):  # a PeftModel: trained through our adapters sharing its Parameters
            model = from_peft(model)
        self.params = lora_parameters(model)
        if not self.params:
            raise ValueError("the model has no LoRA adapters to train; call apply_lora(model, ...) first")
        self.batch_size = _positive_int("per_device_train_batch_size", per_device_train_batch_size)
        self.accumulation = _positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        self.seed = _positive_int("seed", seed, allow_zero=True)
        if self.seed >= SEED_LIMIT:
            raise ValueError(f"seed must be below 2**32 (numpy's seed range), got {seed!r}")
        self.eval_every = _positive_int("eval_every", eval_every, allow_zero=True)
        self.save_total_limit = _positive_int("save_total_limit", save_total_limit)
        self.max_bad_steps = _positive_int("max_bad_steps", max_bad_steps)
        self.check_every = _positive_int("check_every", check_every, allow_zero=True)
        if isinstance(ddp_bucket_cap_mb, bool) or not isinstance(ddp_bucket_cap_mb, (int, float)) \
                or not 0 < ddp_bucket_cap_mb < math.inf:
            raise ValueError(f"ddp_bucket_cap_mb must be a number of MiB > 0, got {ddp_bucket_cap_mb!r}")
        self.bucket_bytes = max(1, round(ddp_bucket_cap_mb * 2**20))
        self.max_grad_norm = max_grad_norm
        clip_grad_norm([], max_grad_norm)  # checks the value now rather than at the first step
        if callback is not None and not isinstance(callback, TrainerCallback) and not callable(callback):
            raise TypeError(f"callback must be a TrainerCallback or a function taking one metrics record, got "
                            f"{type(callback).__name__}")
        for name, flag in (("packing", packing), ("group_by_length", group_by_length), ("save_best", save_best),
                           ("load_best_at_end", load_best_at_end)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        self.early_stopping_patience = _positive_int("early_stopping_patience", early_stopping_patience,
                                                     allow_zero=True)
        if isinstance(early_stopping_threshold, bool) or not isinstance(early_stopping_threshold, (int, float)) \
                or not 0 <= early_stopping_threshold < math.inf:
            raise ValueError(f"early_stopping_threshold must be a finite number >= 0, got {early_stopping_threshold!r}")
        self.early_stopping_threshold = float(early_stopping_threshold)
        self.save_best, self.load_best_at_end, self.group_by_length = save_best, load_best_at_end, group_by_length
        self.model, self.tokenizer = model, tokenizer
        context = model_context(model)
        self.examples = encode_records(tokenizer, read_records(data), max_length, context, long_examples)
        if packing:
            self.examples = pack(self.examples, max_length)
        try:
            self.eval_examples = None if eval_data is None else encode_records(
                tokenizer, read_records(eval_data), max_length, context, long_examples)
        except ValueError as err:
            raise ValueError(f"eval_data: {err}") from None
        needs_eval = [name for name, on in (("early_stopping_patience", self.early_stopping_patience),
                                            ("save_best", save_best), ("load_best_at_end", load_best_at_end),
                                            (f"lr_scheduler_type={lr_scheduler_type!r}",
                                             metric_driven(lr_scheduler_type))) if on]
        if needs_eval and (self.eval_examples is None or not self.eval_every):
            raise ValueError(f"{needs_eval[0]} follows the evaluation loss: give eval_data and eval_every > 0")
        if load_best_at_end and not save_best:
            raise ValueError("load_best_at_end loads the adapter save_best keeps: pass save_best=True too")
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.dist = DataParallel.current()  # None when this process trains alone
        self.rank, self.world_size = (0, 1) if self.dist is None else (self.dist.rank, self.dist.world_size)
        per_rank = math.ceil(len(self.examples) / self.world_size)  # each rank's shard of an epoch (data.shard)
        steps_per_epoch = math.ceil(math.ceil(per_rank / self.batch_size) / self.accumulation)
        if max_steps is not None and num_train_epochs is not None:
            raise ValueError(f"give num_train_epochs or max_steps, not both (got num_train_epochs="
                             f"{num_train_epochs!r}, max_steps={max_steps!r})")
        if max_steps is None:
            epochs = 1 if num_train_epochs is None else num_train_epochs
            if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not 0 < epochs < math.inf:
                raise ValueError(f"num_train_epochs must be a number > 0, got {epochs!r}")
            # a fraction of an epoch runs that share of its steps, rounded up, as in transformers
            self.total_steps = math.ceil(epochs * steps_per_epoch)
        else:
            self.total_steps = _positive_int("max_steps", max_steps)
        self.save_every = interval_steps("save_steps", save_steps, self.total_steps)
        if not isinstance(overwrite, bool):
            raise TypeError(f"overwrite must be True or False, got {overwrite!r}")
        self.overwrite = overwrite
        self.engine = choose_engine(model, engine)
        betas = (adam_beta1, adam_beta2)
        self.optimizer = WgpuAdamW(self.params, lr=learning_rate, betas=betas, eps=adam_epsilon,
                                   weight_decay=weight_decay)
        if warmup_steps is not None and warmup_ratio is not None:
            raise ValueError(f"give warmup_steps or warmup_ratio, not both (got {warmup_steps!r} and {warmup_ratio!r})")
        if warmup_steps is None:
            warmup_ratio = _WARMUP_RATIO if warmup_ratio is None else warmup_ratio
            warmup = ratio_warmup(self.total_steps, warmup_ratio)
        else:
            warmup = interval_steps("warmup_steps", warmup_steps, self.total_steps)
        self.scheduler = make_scheduler(self.optimizer, lr_scheduler_type, self.total_steps, warmup,
                                        lr_scheduler_kwargs)
        self.metric_schedule = metric_driven(lr_scheduler_type)
        self.output_dir = Path(output_dir)
        self.checkpoints = self.output_dir / "checkpoints"
        self.adapter_path = self.output_dir / "adapter"
        self.best_path = self.output_dir / "best-adapter"
        self.metrics = MetricsLog(self.output_dir / "metrics.jsonl")
        self.reporters = Reporters(report_to, self.output_dir / "runs")
        self.progress, self.plot = progress, plot
        self.callback = _OnLog(callback) if callback is not None and not isinstance(callback, TrainerCallback) \
            else callback
        # What must match for a resumed run to continue this one exactly.
        self.settings = {
            "data": _fingerprint(self.examples), "batch_size": self.batch_size,
            "gradient_accumulation_steps": self.accumulation, "total_steps": self.total_steps,
            "seed": self.seed, "schedule": lr_scheduler_type, "warmup_ratio": warmup_ratio,
            "warmup_steps": warmup_steps, "scheduler_kwargs": lr_scheduler_kwargs, "lr": learning_rate,
            "betas": list(betas), "eps": adam_epsilon,
            "weight_decay": weight_decay, "max_grad_norm": max_grad_norm, "world_size": self.world_size,
            "packing": packing, "group_by_length": group_by_length,
        }

    def stop(self, why: str = "stopped by a callback") -> None:
        """End the run after the current step (from a ``TrainerCallback``): a checkpoint is saved and
        ``train`` returns, its result's ``stopped`` being ``why``."""
        self.stop_reason = why

    # -- the run --------------------------------------------------------------------------------

    def train(self, resume_from: str | Path | bool | None = None) -> TrainResult:
        """Run to ``total_steps``; ``resume_from`` is a checkpoint folder, or True for the newest one."""
        from tqdm.auto import tqdm

        if resume_from and self.overwrite:
            raise ValueError("resume_from continues the run in output_dir and overwrite replaces it: pass one of them")
        self.last_saved = None
        self.stop_reason = None
        try:
            return self._train(resume_from, tqdm)
        except RankLost as err:  # say where to resume from
            saved = (f"the newest checkpoint is {self.checkpoints / checkpoint_name(self.last_saved)} (step "
                     f"{self.last_saved}): resume from it with all {self.world_size} processes" if self.last_saved
                     else "no checkpoint had been saved yet")
            raise RankLost(f"{err}; {saved}") from err.__cause__

    def _train(self, resume_from: str | Path | bool | None, tqdm: Any) -> TrainResult:
        position = self._begin(resume_from)
        step, epoch, group = position["step"], position["epoch"], position["group"]
        self.bad_streak = position["bad_streak"]
        # The best evaluation so far and the evaluations since (early stopping); None before the first.
        self.best = position.get("best")
        self.stale_evals = position.get("stale_evals", 0)
        self.last_saved = position["step"] if resume_from else None
        last_loss = eval_loss = None
        evaluated = None  # the step of the last evaluation
        self.model.train()
        bar = tqdm(total=self.total_steps, initial=step, desc="training", unit="step",
                   disable=not self.progress or self.rank != 0)
        try:
            while step < self.total_steps:
                groups = self._epoch_groups(epoch)
                while step < self.total_steps:
                    step, group = step + 1, group + 1
                    record = self._step(step, [collate(mb, self.pad_token_id) for mb in groups[group - 1]])
                    last_loss = record["loss"]
                    self._log({"step": step, "epoch": epoch + group / len(groups), **record})
                    bar.update(1)
                    bar.set_postfix({"loss": "skipped" if last_loss is None else f"{last_loss:.4f}",
                                     "lr": f"{record['lr']:.2e}", "tok/s": f"{record['tokens_per_s']:.0f}"})
                    if self.bad_streak >= self.max_bad_steps:
                        raise TrainingStopped(self._stop_message(step))
                    if group == len(groups):  # positions are saved as (next epoch, 0), never (epoch, len)
                        epoch, group = epoch + 1, 0
                    if self.dist is not None and self.check_every and step % self.check_every == 0:
                        self._check_in_sync(step)
                    if self.eval_examples and self.eval_every and step % self.eval_every == 0:
                        eval_loss, evaluated = self._evaluate(step), step
                    if self.callback is not None:
                        self.callback.on_step_end(self, step)
                    self._agree_on_stop(step)
                    if self.stop_reason is not None:
                        break
                    if step < self.total_steps and self.save_every and step % self.save_every == 0:
                        self._save(step, epoch, group)
                    if group == 0:
                        break
                if self.stop_reason is not None:
                    break
        finally:
            bar.close()
            if self.engine is not None:  # also when training stops early: the Parameters are current
                self.engine.adapters.pull()
        try:
            if self.eval_examples and evaluated != step:
                eval_loss = self._evaluate(step)
            checkpoint = self._save(step, epoch, group)
            if self.load_best_at_end and self.best is not None:
                self._on_rank0(lambda: load_adapter_file(self.model, self.best_path, format="peft"),
                               "loading the best adapter on rank 0")
                if self.dist is not None:
                    self.dist.broadcast_(self.params, "the broadcast of the best adapter")
            plot = self._on_rank0(lambda: plot_loss(self.metrics.read(), self.output_dir / "loss.png"),
                                  "drawing the loss plot") if self.plot else None
        finally:
            self.reporters.close()
        best = self.best or {}
        return TrainResult(steps=step, loss=last_loss, eval_loss=eval_loss, adapter=self.adapter_path,
                           checkpoint=checkpoint, metrics=self.metrics.path, plot=plot,
                           best_eval_loss=best.get("loss"), best_step=best.get("step"),
                           best_adapter=self.best_path if self.save_best and self.best else None,
                           stopped=self.stop_reason)

    def _agree_on_stop(self, step: int) -> None:
        """Data-parallel with a callback: every rank stops if any callback asked its rank to (early
        stopping follows the global evaluation loss, the same on every rank)."""
        if self.dist is None or self.callback is None:
            return
        asked = self.stop_reason is not None
        if self.dist.sum_ints([int(asked)], f"agreeing whether to stop after step {step}")[0] and not asked:
            self.stop_reason = "stopped by a callback on another rank"

    def _on_rank0(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` on rank 0 alone, its result (or error) on every rank (``DataParallel.on_rank0``)."""
        return fn() if self.dist is None else self.dist.on_rank0(fn, what)

    def _begin(self, resume_from: str | Path | bool | None) -> dict[str, int]:
        """Prepare the output folder and the state to start from; returns the trainer state."""
        if self.dist is None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            remove_unfinished(self.checkpoints)
            position = self._resume(resume_from) if resume_from else self._start()
            if not resume_from:
                self._seed(self.seed)
            return position

        # Whatever decides the ranks' sequence of collectives must agree, or they would wait on each other.
        self.dist.check_same({**self.settings, "engine": "torch" if self.engine is None else "wgpu",
                              "eval_data": None if self.eval_examples is None else _fingerprint(self.eval_examples),
                              "eval_every": self.eval_every, "save_every": self.save_every,
                              "check_every": self.check_every, "resume_from": bool(resume_from),
                              "ddp_bucket_cap_mb": self.bucket_bytes / 2**20,
                              "adapters": [list(p.shape) for p in self.params]}, "training settings")

        def prepare() -> dict[str, Any]:  # rank 0: the files; what it read goes to every rank
            self.output_dir.mkdir(parents=True, exist_ok=True)
            remove_unfinished(self.checkpoints)
            if not resume_from:
                return {"position": self._start()}
            position = self._resume(resume_from)
            rngs = read_rank_rngs(self._resumed_from)
            if len(rngs) != self.world_size - 1:
                raise DamagedCheckpoint(f"checkpoint {self._resumed_from} is damaged: it holds the random states "
                                        f"of {len(rngs) + 1} processes, its settings say {self.world_size}")
            return {"position": position, "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "rngs": rngs}

        shared = self.dist.on_rank0(prepare, "resuming from rank 0's checkpoint" if resume_from
                                    else "preparing the output folder on rank 0")
        # Every rank starts from rank 0's adapters (fresh: whatever each was initialised with).
        self.dist.broadcast_(self.params, "the broadcast of rank 0's adapters")
        if not resume_from:
            self._seed(self.seed if self.rank == 0 else int(np.random.SeedSequence([self.seed, self.rank])
                                                            .generate_state(1)[0]))
        elif self.rank != 0:
            self.optimizer.load_state_dict(shared["optimizer"])
            self.scheduler.load_state_dict(shared["scheduler"])
            set_rng_state(shared["rngs"][self.rank - 1])
        return shared["position"]

    @staticmethod
    def _seed(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _start(self) -> dict[str, int]:
        """A fresh run's files: refuse or clear an earlier run's output (rank 0's part of a start)."""
        found = earlier_run(self.output_dir)
        if found is not None and not self.overwrite:
            resume = "resume_from=True to continue that run, " if found.startswith("checkpoints") else ""
            raise ValueError(f"{self.output_dir} already holds {found} of an earlier run; pass {resume}"
                             "overwrite=True to replace it, or choose another output_dir")
        shutil.rmtree(self.checkpoints, ignore_errors=True)  # an earlier run's: overwrite=True said so
        self.metrics.clear()
        return {"step": 0, "epoch": 0, "group": 0, "bad_streak": 0, "best": None, "stale_evals": 0}

    def _resume(self, resume_from: str | Path | bool) -> dict[str, int]:
        if resume_from is True:
            folder = latest_checkpoint(self.checkpoints)
            if folder is None:
                raise FileNotFoundError(f"resume_from=True, but {self.checkpoints} holds no checkpoint")
        else:
            folder = Path(resume_from)
        try:
            saved = self._read_checkpoint(folder)["settings"]  # checked before anything is loaded
        except DamagedCheckpoint as err:
            raise DamagedCheckpoint(f"{err}; {self._previous_good(folder)}") from None
        saved = {"world_size": 1, **saved}  # checkpoints from before data-parallel training: one process
        if saved["world_size"] != self.world_size:
            there = saved["world_size"]
            how = f"with {there} processes (e.g. torchrun --nproc-per-node {there} ...)" if there != 1 else \
                "in one process (without torchrun)"
            raise ValueError(f"{folder} was written by a run of {there} process{'es' if there != 1 else ''} (world "
                             f"size {there}); this run has {self.world_size}. Resume it {how}: each process's "
                             "share of the data, the batch of a step and the saved random states all depend on "
                             "the world size, so another one would not continue that run")
        saved = {**_SETTINGS_BEFORE, **saved}
        differ = [f"{key}: {saved.get(key)!r} there, {value!r} here" for key, value in self.settings.items()
                  if saved.get(key) != value]
        if differ:
            raise ValueError(f"{folder} was written by a run with other settings ({'; '.join(differ)}); resuming "
                             "would not continue that run. Use the same settings and data, or a new output_dir")
        state = load_checkpoint(folder, self.model, self.optimizer, self.scheduler)
        self.metrics.keep_until(state["step"])
        self._resumed_from = folder
        return state

    @staticmethod
    def _read_checkpoint(folder: Path) -> dict[str, Any]:
        """The trainer state of checkpoint ``folder``, with every file of it read and checked."""
        state = read_checkpoint(folder)[0]["trainer"]
        missing = [key for key in ("step", "epoch", "group", "bad_streak", "settings") if key not in state]
        if missing:
            raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {folder / 'state.json'} has no "
                                    f"trainer.{missing[0]} entry")
        return state

    def _previous_good(self, damaged: Path) -> str:
        """Names the newest checkpoint before ``damaged`` that reads back, for the error message."""
        try:
            step = checkpoint_step(damaged)
        except ValueError:  # a folder named otherwise: any checkpoint of this run is earlier
            step = math.inf
        for folder in reversed(list_checkpoints(self.checkpoints)):
            if checkpoint_step(folder) >= step:
                continue
            try:
                self._read_checkpoint(folder)
            except ValueError:  # DamagedCheckpoint, or another format
                continue
            return f"the previous good checkpoint is {folder}: resume from it (resume_from / --resume {folder})"
        return "no earlier checkpoint reads back: start the run again"

    def _epoch_groups(self, epoch: int) -> list[list[list[Example]]]:
        """The epoch's optimiser steps, each a list of micro-batches of examples."""
        if self.group_by_length:
            order = length_grouped_order([len(e.input_ids) for e in self.examples],
                                         self.batch_size * self.world_size, epoch, self.seed)
        else:
            order = epoch_order(len(self.examples), epoch, self.seed)
        if self.dist is not None:  # this rank's share, as DistributedSampler deals it
            order = shard(order, self.rank, self.world_size)
        micro = [[self.examples[i] for i in order[start:start + self.batch_size]]
                 for start in range(0, len(order), self.batch_size)]
        return [micro[start:start + self.accumulation] for start in range(0, len(micro), self.accumulation)]

    def _step(self, step: int, micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """Optimiser step number ``step`` (from 1) over ``micro_batches``; returns its metrics."""
        start = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        labelled = sum(_loss_tokens(b) for b in micro_batches)
        tokens = int(sum(b["attention_mask"].sum() for b in micro_batches))
        if self.dist is not None:  # global counts first: every rank divides its loss by the global count
            labelled, tokens = self.dist.sum_ints([labelled, tokens], f"the token-count all-reduce of step {step}")
        if self.engine is not None:  # the whole step in one submit (a few when data-parallel)
            reduce = None if self.dist is None else (
                lambda flat: self.dist.all_reduce_(flat, f"the gradient all-reduce of step {step}"))
            done = self.engine.train_step(micro_batches, self.optimizer, self.max_grad_norm, all_reduce=reduce,
                                          labelled_total=None if self.dist is None else labelled,
                                          bucket_bytes=self.bucket_bytes)
            loss = math.nan if done["skipped"] else done["loss"]
            grad_norm, skipped = done["grad_norm"], done["skipped"]
        else:
            if self.dist is None:
                loss = accumulate_gradients(self.model, micro_batches)
            else:  # this rank's share of the global mean, then the sum of the shares (and of the gradients)
                share = accumulate_gradients(self.model, micro_batches, total_tokens=labelled)
                loss = self.dist.reduce_gradients(self.params, share, f"the gradient all-reduce of step {step}")
            grad_norm = clip_grad_norm(self.params, self.max_grad_norm) if math.isfinite(loss) else math.nan
            skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if skipped:
            self.bad_streak += 1
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            if self.rank == 0:
                warnings.warn(f"non-finite {what} at step {step}: the step was skipped "
                              f"({self.bad_streak} in a row; training stops at {self.max_bad_steps})", RuntimeWarning,
                              stacklevel=4)
        else:
            if self.engine is None:
                self.optimizer.step()
            self.bad_streak = 0
        self.optimizer.zero_grad(set_to_none=True)
        if not self.metric_schedule:  # the others step with each evaluation's loss
            self.scheduler.step()
        return {"loss": None if skipped else loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                "tokens_per_s": tokens / (time.perf_counter() - start), "skipped": skipped}

    def _check_in_sync(self, step: int) -> None:
        """Data-parallel: RanksDiverged unless every rank holds rank 0's adapter values."""
        if self.engine is not None:
            self.engine.adapters.pull()
        self.dist.check_in_sync(self.params, step)

    def _evaluate(self, step: int) -> float:
        examples = self.eval_examples if self.dist is None else self.eval_examples[self.rank::self.world_size]
        batches = [collate(examples[i:i + self.batch_size], self.pad_token_id)
                   for i in range(0, len(examples), self.batch_size)]
        loss_sum, tokens = _loss_sums(self.engine or self.model, batches)
        if self.dist is not None:  # each rank evaluated its share; the loss is over all of them
            loss_sum, tokens = self.dist.sum_floats([loss_sum, tokens], f"the evaluation all-reduce at step {step}")
        loss = loss_sum / tokens
        metrics = {"step": step, "eval_loss": loss, "eval_perplexity": perplexity(loss)}
        self._log(metrics)
        if self.metric_schedule:
            self.scheduler.step(loss)
        if self.best is None or loss < self.best["loss"] - self.early_stopping_threshold:
            self.best, self.stale_evals = {"loss": loss, "step": step}, 0
            if self.save_best:
                self._on_rank0(lambda: save_adapter(self.model, self.best_path, format="peft"),
                               f"saving the best adapter (step {step}) on rank 0")
        else:
            self.stale_evals += 1
            if self.early_stopping_patience and self.stale_evals >= self.early_stopping_patience:
                self.stop_reason = (f"early stopping: {self.stale_evals} evaluations without an evaluation loss "
                                    f"below {self.best['loss'] - self.early_stopping_threshold:.6g} (the best, "
                                    f"{self.best['loss']:.6g}, was at step {self.best['step']})")
        if self.callback is not None:
            self.callback.on_evaluate(self, metrics)
        return loss

    def _log(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            self.metrics.append(record)
            self.reporters.log(record)
        if self.callback is not None:
            self.callback.on_log(self, record)

    def _save(self, step: int, epoch: int, group: int) -> Path:
        if self.engine is not None:  # the Parameters take the GPU's values before they are written
            self.engine.adapters.pull()
        state = {"step": step, "epoch": epoch, "group": group, "bad_streak": self.bad_streak,
                 "settings": self.settings, "best": self.best, "stale_evals": self.stale_evals}
        rank_rngs = None
        if self.dist is not None:  # rank 0 writes what every rank holds, and the others' random states
            self._check_in_sync(step)
            rank_rngs = self.dist.gather_objects(rng_state(), f"gathering random states for step {step}'s checkpoint")

        def write() -> Path:
            folder = save_checkpoint(self.checkpoints / checkpoint_name(step), self.model, self.optimizer,
                                     self.scheduler, state, rank_rngs=rank_rngs[1:] if rank_rngs else None)
            save_adapter(self.model, self.adapter_path, format="peft")
            for old in list_checkpoints(self.checkpoints)[:-self.save_total_limit]:
                shutil.rmtree(old)
            return folder

        folder = self._on_rank0(write, f"saving the checkpoint of step {step} on rank 0")
        self.last_saved = step
        if self.callback is not None:
            self.callback.on_save(self, folder)
        return folder

    def _stop_message(self, step: int) -> str:
        saved = (f"the last good adapter is {self.adapter_path} (step {self.last_saved}); resume from "
                 f"{self.checkpoints / checkpoint_name(self.last_saved)}" if self.last_saved is not None
                 else "no adapter had been saved yet")
        return (f"training stopped at step {step}: {self.bad_streak} steps in a row had a non-finite loss or "
                f"gradient (try a lower learning_rate or max_grad_norm > 0); {saved}")


def train(model: torch.nn.Module, tokenizer: Any, data: Any, *, resume_from: str | Path | bool | None = None,
          **options: Any) -> TrainResult:
    """``Trainer(model, tokenizer, data, **options).train(resume_from)`` in one call.

    >>> # result = train(model, tokenizer, "alpaca.json", output_dir="run", max_steps=100, learning_rate=2e-4)
    """
    return Trainer(model, tokenizer, data, **options).train(resume_from=resume_from)
