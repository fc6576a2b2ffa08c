"""The ``torch-wgpu-lora`` command (also ``python -m torch_wgpu_lora``).

Subcommands::

    torch-wgpu-lora demo                       # offline: demo model, bundled data, train, compare
    torch-wgpu-lora train --model DIR --data train.jsonl --output run
    torch-wgpu-lora train --config run.yaml --lr 1e-4   # options from a file; the command line wins
    torch-wgpu-lora generate --model DIR --adapter run/adapter --prompt "Name a primary colour." [--stream]
    torch-wgpu-lora generate --model DIR --prompts-file prompts.jsonl [--output results.jsonl]
    torch-wgpu-lora gradcheck --model DIR      # per-layer gradient parity table, WebGPU vs PyTorch
    torch-wgpu-lora info [--json]              # the WebGPU adapter, backend and limits
    torch-wgpu-lora bench [--quick]            # the LoRA op benchmark (torch_wgpu_lora.benchmarks)

Exit status: 0 on success; 1 when a check fails (gradcheck or the demo's parity table
above its tolerance) or training stops on non-finite losses; 2 for a mistake in what
was asked (a missing file, malformed data, an unknown target module, a folder that is
not a BitNet checkpoint, bad option values), reported as one line
``torch-wgpu-lora: error: <what was wrong>`` on stderr. Anything else is a bug and
keeps its traceback.

``train --config FILE`` reads options from a YAML or JSON mapping, keyed by the options'
names (``max_steps`` or ``max-steps``, each option once), each value checked against its
option before anything runs: flags true or false; ``resume`` true (the bare ``--resume``: the
newest checkpoint in --output) or a checkpoint path; integers; finite numbers (YAML's ``1e-4``
included); strings (a name that looks like a number quoted); ``targets`` and ``report_to`` a
name or a list of names; ``lr_scheduler_kwargs`` a mapping; null leaves an option at its
default. An option also given on the command line takes the command line's value. One
``--config`` a command (files are not merged); no YAML anchors or aliases (nested aliases
expand exponentially); at most 1 MiB. Options are spelled out in full on every command:
argparse's abbreviations are off, so no abbreviation hides which option of a file it overrides.

Options also have the names of transformers' ``TrainingArguments`` and TRL's ``SFTConfig``,
``ModelConfig`` and ``ScriptArguments`` where they mean what those mean (``--learning-rate`` for
``--lr``, ``--num-train-epochs``, ``--per-device-train-batch-size``, ``--gradient-accumulation-steps``,
``--lr-scheduler-type``, ``--save-steps``, ``--save-total-limit``, ``--adam-beta1``, ``--adam-beta2``,
``--adam-epsilon``, ``--output-dir``, ``--model-name-or-path``,
``--dataset-name`` (a local data file), ``--lora-r``, ``--lora-alpha``, ``--lora-dropout``,
``--lora-target-modules``, ``--resume-from-checkpoint``, ``--use-rslora``; ``--warmup-steps`` and ``--save-steps``
take a fraction of the run's steps as transformers does), so a TRL-style file (``trl sft
--config``'s keys: ``model_name_or_path``, ``dataset_name``, ``learning_rate``, ``use_peft: true``,
``lora_r``, ...) drives ``train --config`` as it is. One option under two of its names, in a file
or on the command line, is refused; so is every key train does not have (``logging_steps``,
``eval_strategy``, ...), by name.

Several processes (data-parallel training, ``torchrun --nproc-per-node N -m torch_wgpu_lora
train ...`` or ``accelerate launch``): ``train`` makes the torch.distributed process group
(gloo, with ``--dist-timeout``) when ``WORLD_SIZE`` > 1 and none exists; rank 0 alone checks
the output folder, writes and prints; every rank's error line names its rank; a rank that
died or hung ends the others with exit status 1 (``training.distributed.RankLost``).

Every command runs PyTorch eagerly. transformers wraps BitNet's weight unpacking and
activation quantisation in ``torch.compile``; on the CPU, where the base model runs, the
first call compiles with inductor for tens of seconds (again for new shapes), while
eager results are bit-identical to compiled ones for packed checkpoints and equal up
to float32 rounding (about 1e-6 relative) for online ones.

>>> # main(["train", "--model", "bitnet", "--data", "alpaca.json", "--max-steps", "100"])  # -> 0
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from .limits import check_seed

PROG = "torch-wgpu-lora"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DTYPES = ("float32", "bfloat16")


class UsageError(Exception):
    """A mistake in what the user asked for; ``main`` prints its message and exits 2."""


def _training_stopped() -> tuple[type[BaseException], ...]:
    """``TrainingStopped`` (and data-parallel training's ``DistributedError``) if their modules are
    loaded (nothing else raises them), without importing them: an import here, while reporting an
    error, could fail again (e.g. on a bad environment variable)."""
    trainer = sys.modules.get(f"{__package__}.training.trainer")
    distributed = sys.modules.get(f"{__package__}.training.distributed")
    return ((() if trainer is None else (trainer.TrainingStopped,))
            + (() if distributed is None else (distributed.DistributedError,)))


def _rank_tag() -> str:
    """`` (rank R of W)`` in a data-parallel run, else empty (without importing torch.distributed)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return f" (rank {dist.get_rank()} of {dist.get_world_size()})"
    except Exception:  # reporting an error must not fail
        pass
    return ""


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that report a user's mistake (the library's checks raise these)."""
    # ValueError covers json.JSONDecodeError and UnicodeDecodeError; OSError covers
    # FileNotFoundError, NotADirectoryError, PermissionError. TrainingStopped is listed
    # separately: it is a RuntimeError, and other RuntimeErrors stay tracebacks.
    return (UsageError, ValueError, OSError, *_training_stopped())


def _exit_code(error: BaseException) -> int:
    return EXIT_FAILED if isinstance(error, _training_stopped()) else EXIT_USAGE


# -- shared helpers -------------------------------------------------------------------------------

def _defaults(function: Callable[..., Any]) -> dict[str, Any]:
    """A function's keyword defaults, so the library stays the one source of them."""
    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _targets(text: str) -> tuple[str, ...] | str:
    """Comma-separated module names, or one string LoraConfig takes whole: "all-linear" or a regex."""
    if text.strip().lower() == "all-linear" or any(c in text for c in "*?[(|\\^$+"):
        return text.strip()
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    if not targets:
        raise argparse.ArgumentTypeError("give at least one module name, e.g. q_proj,v_proj, or all-linear")
    return targets


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"min_lr_rate\": 0.1}}', got {text!r}")
    return value


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return int(value) if value == int(value) else value


def _steps(text: str) -> float:
    """A number of steps as transformers' warmup_steps and save_steps take it: whole (0 included), or a
    fraction in (0, 1) of the run's steps (``training.names.interval_steps`` checks the rest)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf or (value >= 1 and value != int(value)):
        raise argparse.ArgumentTypeError(f"must be a whole number of steps >= 0 or a fraction in (0, 1) of the "
                                         f"run's steps, got {text!r}")
    return int(value) if value == int(value) else value


def _seed(text: str) -> int:
    """A seed for every RNG the commands seed; numpy's legacy seed (the Trainer's) is the narrowest range."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2 ** 32:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {text!r}")
    return value


def _generation_seed(text: str) -> int:
    """generate's --seed, checked as the API checks ``generate(seed=...)``, with its message."""
    try:
        value: Any = int(text)
    except ValueError:
        value = text
    try:
        check_seed(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def _require_webgpu() -> dict[str, Any]:
    """The device's description, or a UsageError saying what to install when there is no adapter."""
    from .runtime import device_info

    try:
        return device_info()
    except RuntimeError as err:  # raised with the install hint when no adapter exists
        raise UsageError(str(err)) from None


def _load(model: str, dtype: str, with_tokenizer: bool) -> tuple[Any, Any]:
    from .integrations.bitnet import load_bitnet, load_model_and_tokenizer

    if with_tokenizer:
        return load_model_and_tokenizer(model, dtype=_dtype(dtype))
    return load_bitnet(model, dtype=_dtype(dtype)), None


def _add_model(parser: argparse.ArgumentParser, required: bool = True, default_help: str = "") -> None:
    parser.add_argument("--model", "--model-name-or-path", dest="model", required=required, metavar="PATH",
                        help="BitNet checkpoint folder (config.json, *.safetensors, tokenizer files), e.g. "
                             "microsoft/bitnet-b1.58-2B-4T-bf16 downloaded with `hf download`, or a GGUF file "
                             "(bitnet.cpp's i2_s, llama.cpp's TQ1_0/TQ2_0; needs the gguf extra)" + default_help)
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="dtype of the base model's weights (default: %(default)s)")


# -- subcommands ----------------------------------------------------------------------------------

def cmd_train(args: argparse.Namespace) -> int:
    from .training.distributed import check_timeout, init_from_env

    if args.dist_timeout is not None:
        check_timeout(args.dist_timeout, "--dist-timeout")
    created = init_from_env(args.dist_timeout)  # several processes (torchrun): the process group first
    status = _train(args)
    if created:
        import torch.distributed

        torch.distributed.destroy_process_group()
    return status


def _train(args: argparse.Namespace) -> int:
    from .config import LoraConfig
    from .integrations.peft import apply_lora
    from .training.data import read_records
    from .training.distributed import DataParallel
    from .training.trainer import Trainer, earlier_run

    parallel = DataParallel.current()  # None in a single process
    output = Path(args.output)

    def check_output() -> None:  # the output folder is rank 0's: it decides for every rank
        found = earlier_run(output)
        if not args.resume and not args.overwrite and found is not None:
            resume = "--resume to continue it, " if found.startswith("checkpoints") else ""
            raise UsageError(f"{output} already holds {found} of an earlier run: pass {resume}--overwrite to "
                             "replace it, or choose another --output")

    if parallel is None:
        check_output()
    else:
        parallel.on_rank0(check_output, "checking the output folder on rank 0")
    # Check the settings and read the data first: a mistake in them should not wait for a large model to load.
    lora_config = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=args.targets,
                             lora_dropout=args.dropout, use_rslora=args.use_rslora, seed=args.seed,
                             backend=args.backend)
    missing = ("", *args.na_values)
    records = read_records(args.data, na_values=missing)
    eval_records = None if args.eval_data is None else read_records(args.eval_data, na_values=missing)
    if args.backend == "wgpu" or args.engine != "torch":
        _require_webgpu()
    model, tokenizer = _load(args.model, args.dtype, with_tokenizer=True)
    apply_lora(model, lora_config)
    trainer = Trainer(model, tokenizer, records, eval_data=eval_records, output_dir=output,
                      num_train_epochs=args.epochs, engine=args.engine,
                      max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
                      gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr,
                      weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
                      adam_epsilon=args.adam_epsilon, max_grad_norm=args.max_grad_norm,
                      lr_scheduler_type=args.schedule, warmup_ratio=args.warmup_ratio,
                      warmup_steps=args.warmup_steps, lr_scheduler_kwargs=args.lr_scheduler_kwargs,
                      max_length=args.max_length, packing=args.packing, group_by_length=args.group_by_length,
                      seed=args.seed, save_steps=args.save_every, save_total_limit=args.save_total_limit,
                      eval_every=args.eval_every,
                      early_stopping_patience=args.early_stopping_patience,
                      early_stopping_threshold=args.early_stopping_threshold, save_best=args.save_best,
                      report_to=args.report_to, progress=not args.no_progress, overwrite=args.overwrite,
                      long_examples=args.long_examples, ddp_bucket_cap_mb=args.ddp_bucket_cap_mb)
    result = trainer.train(resume_from=args.resume)
    if parallel is not None and not parallel.is_main:
        return EXIT_OK  # rank 0 reports
    loss = "skipped" if result.loss is None else f"{result.loss:.4f}"
    print(f"trained {result.steps} steps; last loss {loss}"
          + ("" if result.eval_loss is None else f", eval loss {result.eval_loss:.4f}")
          + ("" if result.stopped is None else f" ({result.stopped})"))
    if result.best_adapter is not None:
        print(f"best adapter: {result.best_adapter} (eval loss {result.best_eval_loss:.4f} at step {result.best_step})")
    print(f"adapter (PEFT layout): {result.adapter}")
    print(f"checkpoint: {result.checkpoint}; metrics: {result.metrics}" + (f"; plot: {result.plot}" if result.plot else ""))
    return EXIT_OK


def cmd_generate(args: argparse.Namespace) -> int:
    from .generation import generate
    from .integrations.adapter_files import check_adapter_path
    from .integrations.bitnet import set_backend
    from .integrations.peft import load_adapter

    if args.prompts_file is not None:
        if args.input is not None or args.stream:
            raise UsageError("--input and --stream go with --prompt; each record of --prompts-file holds its prompt")
    elif args.output is not None:
        raise UsageError("--output goes with --prompts-file")
    if args.adapter is not None:
        check_adapter_path(args.adapter)
    if (args.adapter is not None and args.backend == "wgpu") or args.engine != "torch":
        _require_webgpu()
    model, tokenizer = _load(args.model, args.dtype, with_tokenizer=True)
    if args.adapter is not None:
        set_backend(load_adapter(model, args.adapter), args.backend)
    from .engine import choose_engine

    runner = choose_engine(model, args.engine) or model
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                   use_template=args.template)
    if args.prompts_file is not None:
        from .prompts_file import generate_file

        total, new = generate_file(runner, tokenizer, args.prompts_file, args.output, batch_size=args.batch_size,
                                   progress=not args.no_progress, **options)
        if args.output is not None:  # else the records went to standard output, which holds them alone
            print(f"{args.output}: {total} records ({new} generated now, {total - new} by an earlier run)")
        return EXIT_OK
    prompt: Any = args.prompt
    if args.input is not None:
        if not args.template:
            raise UsageError("--input goes into the Alpaca template; it cannot be combined with --no-template")
        prompt = {"instruction": args.prompt, "input": args.input}
    if args.stream:
        from transformers import TextStreamer

        # prints each piece of text as its tokens come, and a newline at the end
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        generate(runner, tokenizer, prompt, streamer=streamer, **options)
        return EXIT_OK
    print(generate(runner, tokenizer, prompt, **options))
    return EXIT_OK


def cmd_gradcheck(args: argparse.Namespace) -> int:
    import torch

    from .config import LoraConfig
    from .demo import build_demo_checkpoint
    from .integrations.adapter_files import check_adapter_path
    from .integrations.bitnet import lora_modules
    from .integrations.gradcheck import check_parity
    from .integrations.peft import apply_lora, load_adapter

    if args.adapter is not None:
        check_adapter_path(args.adapter)
    lora_config = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=args.targets, seed=args.seed)
    _require_webgpu()
    path = build_demo_checkpoint() if args.model is None else args.model
    model, _ = _load(path, args.dtype, with_tokenizer=False)
    if args.adapter is not None:
        load_adapter(model, args.adapter)
    else:
        apply_lora(model, lora_config)
        # A fresh adapter's B is zero, which makes lora_A's gradient exactly zero: seeded
        # N(0, 0.1²) values (as the parity tests use) make every row compare a real gradient.
        with torch.no_grad():
            generator = torch.Generator().manual_seed(args.seed)
            for m in lora_modules(model).values():
                m.lora_B.normal_(0.0, 0.1, generator=generator)
    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(args.seed))
    from .engine import choose_engine

    parity = check_parity(model, {"input_ids": ids}, engine=choose_engine(model, args.engine))
    print(f"model: {path}; batch {args.batch}×{args.seq_len} random tokens (seed {args.seed})")
    print(parity)
    return EXIT_OK if parity.passed else EXIT_FAILED


def cmd_info(args: argparse.Namespace) -> int:
    import importlib.metadata

    from . import __version__

    info = _require_webgpu()
    versions = {"torch_wgpu_lora": __version__}
    for package in ("torch", "wgpu", "wgpudawn", "transformers"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    if args.json:
        print(json.dumps({**info, "versions": versions}, indent=1))
        return EXIT_OK
    print(f"adapter:  {info['adapter']}")
    print(f"vendor:   {info['vendor']}")
    print(f"backend:  {info['backend']} ({info['adapter_type']})")
    print(f"chosen:   {info['choice']}")
    print(f"webgpu:   {info['webgpu']} ({info['webgpu_version']}): {info['webgpu_choice']}")
    configs = info["subgroup_matrix_configs"]
    print(f"subgroup matrices: {len(configs)} configurations" if configs else "subgroup matrices: none")
    for c in configs:
        print(f"  {c['component_type']} -> {c['result_component_type']}, M={c['m']} N={c['n']} K={c['k']}")
    print(f"features: {', '.join(info['features']) or '(none)'}")
    memory, settings = info["memory"], info["settings"]
    print(f"settings: shader checks {settings['shader_checks']}, subgroups {settings['subgroups']}")
    print(f"memory:   {memory['allocated_bytes'] >> 20} MiB allocated; the buffer pool keeps "
          f"{memory['pooled_bytes'] >> 20} of at most {memory['pool_bound_bytes'] >> 20} MiB")
    print("limits:")
    width = max(map(len, info["limits"]))
    for name, value in info["limits"].items():
        print(f"  {name:<{width}}  {value}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    _require_webgpu()
    result = run_demo(args.model, args.output, steps=args.steps, lr=args.lr, rank=args.rank, lora_alpha=args.alpha,
                      batch_size=args.batch_size, seed=args.seed, prompt_index=args.prompt_index,
                      max_new_tokens=args.max_new_tokens, dtype=_dtype(args.dtype), progress=not args.no_progress,
                      engine=args.engine)
    print(f"loss before {result.loss_before:.4f}, after {result.loss_after:.4f}")
    return EXIT_OK if result.parity.passed else EXIT_FAILED


def cmd_bench(argv: list[str]) -> int:
    from .benchmarks.cli import main as bench_main

    if not {"-h", "--help"} & set(argv):
        _require_webgpu()
    return bench_main(argv)


# -- the parser -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from .config import BACKENDS, LoraConfig
    from .demo import DEMO_STEPS, run_demo
    from .generation import generate
    from .engine import ENGINES
    from .training.data import LONG_EXAMPLES
    from .training.metrics import REPORTERS
    from .training.trainer import Trainer

    lora = {field.name: field.default for field in dataclasses.fields(LoraConfig)}
    trainer = _defaults(Trainer.__init__)
    sampling = _defaults(generate)
    demo = _defaults(run_demo)
    # allow_abbrev=False: options are spelled out, so an abbreviation cannot hide which option (or
    # --config file key) it overrides, nor become ambiguous when an option is added
    parser = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, description="Finetune LoRA adapters of BitNet "
                                     "b1.58 models with WebGPU compute kernels. Start with `torch-wgpu-lora demo`.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = commands.add_parser("train", allow_abbrev=False, help="train LoRA adapters on an instruction dataset",
                            description="Train LoRA adapters of a BitNet checkpoint on chat ({messages}), "
                            "{prompt, completion}, {text} or Alpaca ({instruction, input?, output}) records from a "
                            "JSON array, JSONL, Parquet or CSV file. Writes OUTPUT/adapter (PEFT layout), "
                            "OUTPUT/checkpoints, OUTPUT/metrics.jsonl, OUTPUT/loss.png.")
    p.add_argument("--config", metavar="FILE", help="read options from a YAML or JSON file (keys: the options' "
                   "names; values checked against each option); options given on the command line win")
    _add_model(p)
    p.add_argument("--data", "--dataset-name", dest="data", required=True, metavar="FILE",
                   help="training records: a JSON array, JSONL, Parquet or CSV file")
    p.add_argument("--eval-data", metavar="FILE", help="evaluation records (loss at the end and every --eval-every)")
    p.add_argument("--na-values", type=_names, default=(), metavar="TEXTS",
                   help="comma-separated cell texts of a CSV or TSV data file read as missing values besides the "
                   "empty cell, e.g. NA,null (default: none; a cell reading NA is that text)")
    p.add_argument("--output", "--output-dir", dest="output", default=trainer["output_dir"], metavar="DIR",
                   help="output folder (default: %(default)s)")
    p.add_argument("--rank", "--lora-r", dest="rank", type=int, default=lora["r"],
                   help="LoRA rank r (default: %(default)s)")
    p.add_argument("--alpha", "--lora-alpha", dest="alpha", type=float, default=lora["lora_alpha"],
                   help="lora_alpha; scaling = alpha / r (default: %(default)s)")
    p.add_argument("--targets", "--lora-target-modules", dest="targets", type=_targets,
                   default=lora["target_modules"], metavar="NAMES",
                   help="comma-separated module names to adapt, all-linear, or a regular expression a whole module "
                   "name matches (default: q_proj,v_proj)")
    p.add_argument("--dropout", "--lora-dropout", dest="dropout", type=float, default=lora["lora_dropout"],
                   help="LoRA dropout (default: %(default)s)")
    p.add_argument("--use-rslora", action="store_true", help="rank-stabilised scaling alpha / sqrt(r)")
    length = p.add_mutually_exclusive_group()
    # No default here: one would hide a conflict with --max-steps (argparse sees a given default as not given).
    length.add_argument("--epochs", "--num-train-epochs", dest="epochs", type=_positive_number,
                        help="passes over the data; a fraction runs that share of the last pass (default: 1)")
    length.add_argument("--max-steps", type=int, help="exactly this many optimiser steps (instead of --epochs)")
    p.add_argument("--batch-size", "--per-device-train-batch-size", dest="batch_size", type=int,
                   default=trainer["per_device_train_batch_size"], help="examples per micro-batch, per process "
                   "(default: %(default)s)")
    p.add_argument("--grad-accum", "--gradient-accumulation-steps", dest="grad_accum", type=int,
                   default=trainer["gradient_accumulation_steps"],
                   help="micro-batches per optimiser step (default: %(default)s)")
    p.add_argument("--lr", "--learning-rate", dest="lr", type=float, default=trainer["learning_rate"],
                   help="peak learning rate (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=trainer["weight_decay"],
                   help="AdamW's decoupled weight decay (default: %(default)s)")
    p.add_argument("--adam-beta1", type=float, default=trainer["adam_beta1"],
                   help="AdamW's first-moment decay (default: %(default)s)")
    p.add_argument("--adam-beta2", type=float, default=trainer["adam_beta2"],
                   help="AdamW's second-moment decay (default: %(default)s)")
    p.add_argument("--adam-epsilon", type=float, default=trainer["adam_epsilon"],
                   help="AdamW's epsilon (default: %(default)s)")
    p.add_argument("--lr-scheduler", "--lr-scheduler-type", "--schedule", dest="schedule",
                   default=trainer["lr_scheduler_type"], metavar="NAME",
                   help="learning-rate schedule, any of transformers' (linear, cosine, cosine_with_restarts, "
                   "polynomial, constant, constant_with_warmup, inverse_sqrt, cosine_with_min_lr, warmup_stable_decay, "
                   "reduce_lr_on_plateau, ...) (default: %(default)s)")
    p.add_argument("--lr-scheduler-kwargs", type=_json_object, metavar="JSON",
                   help="the schedule's own options as a JSON object, e.g. '{\"min_lr_rate\": 0.1}'")
    warmup = p.add_mutually_exclusive_group()
    warmup.add_argument("--warmup-steps", type=_steps, help="optimiser steps spent warming up, or a fraction in "
                        "(0, 1) of them (as in transformers)")
    warmup.add_argument("--warmup-ratio", type=float, help="share of the steps spent warming up (default: 0.06)")
    p.add_argument("--max-grad-norm", type=float, default=trainer["max_grad_norm"],
                   help="clip the gradient norm to this; 0 = no clipping (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=trainer["max_length"], help="tokens per example, longer "
                   "ones are cut (default: %(default)s)")
    p.add_argument("--long-examples", choices=LONG_EXAMPLES, default=trainer["long_examples"],
                   help="an example longer than the model's context (max_position_embeddings) is refused, naming "
                   "it, or cut to the context, counting them (default: %(default)s)")
    p.add_argument("--packing", action="store_true", help="pack several examples into each sequence of "
                   "--max-length tokens (each attends to itself only)")
    p.add_argument("--group-by-length", action="store_true", help="batch examples of similar length together")
    p.add_argument("--seed", type=_seed, default=trainer["seed"], help="seeds the adapters' init, the data order "
                   "and dropout (default: %(default)s)")
    p.add_argument("--save-every", "--save-steps", dest="save_every", type=_steps, default=trainer["save_steps"],
                   help="checkpoint every N steps, or after each such fraction in (0, 1) of them; 0 = only at the "
                   "end (default: %(default)s)")
    p.add_argument("--save-total-limit", type=_positive_int, default=trainer["save_total_limit"], metavar="N",
                   help="keep the newest N checkpoints (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=trainer["eval_every"], help="evaluate every N steps; 0 = "
                   "only at the end (default: %(default)s)")
    p.add_argument("--early-stopping-patience", type=int, default=trainer["early_stopping_patience"], metavar="N",
                   help="stop after N evaluations in a row without a lower evaluation loss; 0 = never "
                   "(default: %(default)s)")
    p.add_argument("--early-stopping-threshold", type=float, default=trainer["early_stopping_threshold"],
                   help="how much lower an evaluation loss must be to count as better (default: %(default)s)")
    p.add_argument("--save-best", action="store_true", help="keep the adapter of the lowest evaluation loss in "
                   "OUTPUT/best-adapter")
    p.add_argument("--report-to", type=_names, default=(), metavar="NAMES",
                   help=f"also log to these trackers, comma-separated: {', '.join(REPORTERS)} (their packages are "
                   "optional)")
    earlier = p.add_mutually_exclusive_group()
    earlier.add_argument("--resume", "--resume-from-checkpoint", dest="resume", nargs="?", const=True, default=None,
                         metavar="CHECKPOINT",
                         help="continue the run in --output from its newest checkpoint, or from CHECKPOINT")
    earlier.add_argument("--overwrite", action="store_true", help="replace an earlier run's output in --output "
                         "(its adapter, metrics and checkpoints); without it such a folder is refused")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="wgpu: the whole model on WebGPU (BitNetEngine); torch: transformers' modules with the "
                   "adapters on --backend; auto: the engine when it can run the model (default: %(default)s)")
    p.add_argument("--backend", choices=BACKENDS, default=lora["backend"],
                   help="compute the adapters with the WebGPU kernels or plain torch (default: %(default)s)")
    p.add_argument("--dist-timeout", type=float, default=None, metavar="SECONDS",
                   help="several processes (torchrun, accelerate launch): how long a process waits for the others "
                   "in a collective before the run stops with an error (default: $TORCH_WGPU_LORA_DIST_TIMEOUT "
                   "or 300)")
    p.add_argument("--ddp-bucket-cap-mb", type=float, default=trainer["ddp_bucket_cap_mb"], metavar="MIB",
                   help="several processes: MiB of adapter gradients per all-reduce bucket; each bucket leaves the "
                   "GPU as soon as the backward has produced it, the last layers' first (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_train)
    # train's options by option string, for --config (argparse has no public list of a parser's actions).
    parser.train_options = {option: action for action in p._actions for option in action.option_strings}

    p = commands.add_parser("generate", allow_abbrev=False, help="generate text, with or without an adapter",
                            description="Continue a prompt with a BitNet checkpoint, optionally with a trained "
                            "adapter. The prompt goes into the Alpaca template the trainer uses, unless "
                            "--no-template. With --prompts-file, generate for every record of a JSONL file "
                            "(each with instruction (and input), prompt, or chat messages), --batch-size at once, into "
                            "--output, or standard output without it: each record with generated_text added, in "
                            "order. A run "
                            "into --output that stopped is continued by the same command: records already in "
                            "--output are skipped.")
    _add_model(p)
    p.add_argument("--adapter", metavar="PATH", help="a PEFT adapter folder or a Hesper .lora file")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the instruction (or, with --no-template, the raw text)")
    source.add_argument("--prompts-file", metavar="FILE", help="JSONL records to generate for, one object a line: "
                        "instruction (and input), prompt, or messages")
    p.add_argument("--output", metavar="FILE", help="with --prompts-file: the JSONL file of results (default: "
                   "standard output)")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="with --prompts-file: prompts generated at "
                   "once (rows decoded together; with the engine, a finished row takes the next prompt) and records "
                   "written to --output at a time (default: %(default)s)")
    p.add_argument("--stream", action="store_true", help="print the text as its tokens come")
    p.add_argument("--no-progress", action="store_true", help="with --prompts-file: no progress bar")
    p.add_argument("--input", help="the record's input, placed under '### Input:' in the template")
    p.add_argument("--template", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the Alpaca template (default: on)")
    p.add_argument("--do-sample", action="store_true", help="sample (after --temperature, --top-k, --top-p) "
                   "instead of taking the most likely token, as transformers' do_sample")
    p.add_argument("--temperature", type=float, default=sampling["temperature"],
                   help="sampling temperature (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=sampling["top_k"], help="with --do-sample: keep this many tokens; "
                   "0 = all (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=sampling["top_p"], help="with --do-sample: keep the nucleus of "
                   "this probability; 1.0 = all (default: %(default)s)")
    p.add_argument("--repetition-penalty", type=float, default=sampling["repetition_penalty"],
                   help="CTRL's penalty on seen tokens; 1.0 = off (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=sampling["max_new_tokens"],
                   help="most tokens to generate (default: %(default)s)")
    p.add_argument("--seed", type=_generation_seed, help="seed for sampling, in [0, 2**32) (default: a fresh "
                   "random seed)")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="wgpu: the whole model on WebGPU (BitNetEngine); torch: transformers' modules with the "
                   "adapters on --backend; auto: the engine when it can run the model (default: %(default)s)")
    p.add_argument("--backend", choices=BACKENDS, default=lora["backend"],
                   help="compute the adapter with the WebGPU kernels or plain torch (default: %(default)s)")
    p.set_defaults(run=cmd_generate)

    p = commands.add_parser("gradcheck", allow_abbrev=False,
                            help="per-layer gradient parity table, WebGPU kernels vs PyTorch",
                            description="Compare every adapter gradient computed by the WebGPU kernels with "
                            "PyTorch autograd in float64 on one batch of random tokens, and print the table. Both passes "
                            "see the same forward (see torch_wgpu_lora.integrations.gradcheck), so the table is the "
                            "kernels' error alone; the error of two independent forwards is printed below it. "
                            "Exits 1 when an error exceeds the tolerance: twice PyTorch float32's own error against "
                            "float64 (at least n·2^-24, n the longest sum). The float64 copy of the model needs twice "
                            "its memory. Without --adapter the adapters get seeded random lora_B values so "
                            "that lora_A's gradient is not zero.")
    _add_model(p, required=False, default_help=" (default: the demo model)")
    p.add_argument("--adapter", metavar="PATH", help="check this trained adapter (PEFT folder or Hesper file)")
    p.add_argument("--rank", type=int, default=lora["r"], help="LoRA rank without --adapter (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=lora["lora_alpha"], help="lora_alpha without --adapter "
                   "(default: %(default)s)")
    p.add_argument("--targets", type=_targets, default=lora["target_modules"], metavar="NAMES",
                   help="comma-separated modules to adapt without --adapter (default: q_proj,v_proj)")
    p.add_argument("--batch", type=_positive_int, default=2, help="sequences in the batch (default: %(default)s)")
    p.add_argument("--seq-len", type=_positive_int, default=64, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--seed", type=_seed, default=0, help="seeds the tokens and lora_B (default: %(default)s)")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="wgpu: gradients from the whole-model engine; torch: from the LoRA kernels inside "
                   "transformers' modules; auto: the engine when it can run the model (default: %(default)s)")
    p.set_defaults(run=cmd_gradcheck)

    p = commands.add_parser("info", allow_abbrev=False, help="the WebGPU adapter, backend and limits",
                            description="Describe the WebGPU adapter this library uses (override with "
                            "TORCH_WGPU_LORA_ADAPTER=<part of its name>), its limits and features.")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=cmd_info)

    p = commands.add_parser("demo", allow_abbrev=False,
                            help="the offline demo: train Q/V adapters on a small BitNet",
                            description="Build (once, offline) the demo model, a small randomly initialised "
                            "BitNet in the packed-ternary format of microsoft/bitnet-b1.58-2B-4T, with a tokenizer "
                            "trained on the bundled dataset; then print greedy generation and loss before training, "
                            "train Q/V LoRA adapters on WebGPU, print both again, print the gradient parity table "
                            "and save the adapter in PEFT layout. With --model DIR the same runs on a real "
                            "checkpoint folder, e.g. `hf download microsoft/bitnet-b1.58-2B-4T-bf16 --local-dir "
                            "bitnet` then `torch-wgpu-lora demo --model bitnet --steps 5` (slow on a CPU adapter).")
    p.add_argument("--model", metavar="DIR", help="a BitNet checkpoint folder with its tokenizer (default: the "
                   "demo model, built in ~/.cache/torch_wgpu_lora on first use)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the base model's weights "
                   "(default: %(default)s)")
    p.add_argument("--output", default=demo["output_dir"], metavar="DIR", help="output folder; a previous demo "
                   "output there is replaced (default: %(default)s)")
    p.add_argument("--steps", type=int, default=DEMO_STEPS, help="training steps (default: %(default)s)")
    p.add_argument("--lr", type=float, help="learning rate (default: 1e-2 on the demo model, 2e-4 otherwise)")
    p.add_argument("--rank", type=int, default=demo["rank"], help="LoRA rank (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=demo["lora_alpha"], help="lora_alpha (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=demo["batch_size"], help="examples per step "
                   "(default: %(default)s)")
    p.add_argument("--seed", type=_seed, default=demo["seed"], help="seed (default: %(default)s)")
    p.add_argument("--prompt-index", type=int, default=demo["prompt_index"], help="which dataset record to "
                   "generate for (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=demo["max_new_tokens"], help="tokens to generate "
                   "(default: %(default)s)")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="wgpu: the whole model on WebGPU (BitNetEngine); torch: transformers' modules with the "
                   "adapters on --backend; auto: the engine when it can run the model (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_demo)

    # Listed for --help; its arguments are torch_wgpu_lora.benchmarks.cli's own (main() hands them over).
    commands.add_parser("bench", add_help=False, help="benchmark the LoRA op against torch "
                        "(`torch-wgpu-lora bench --help` for its options)")
    return parser


# A train config holds a few dozen options; past this size a file is not one (and PyYAML reads
# about a megabyte a second).
MAX_CONFIG_BYTES = 1 << 20


def _yaml_loader(yaml: Any, path: str) -> type:
    """PyYAML's safe loader for ``--config`` files: no anchors or aliases (an alias repeats a node, so
    nested ones expand exponentially, a few lines standing for billions of values), no key given twice
    (PyYAML keeps the last silently), and 1e-4 read as a number, as YAML 1.2 reads it (PyYAML's YAML
    1.1 wants 1.0e-4 and reads 1e-4 as a string)."""

    class ConfigLoader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
                raise UsageError(f"--config {path}, line {event.start_mark.line + 1}: YAML anchors and aliases "
                                 f"({sign}{event.anchor}) are not read in a config file; write each value out")
            return super().compose_node(parent, index)

        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            seen = set()
            for key_node, _ in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                if key in seen:
                    raise UsageError(f"--config {path}, line {key_node.start_mark.line + 1}: {key!r} is given twice")
                seen.add(key)
            return super().construct_mapping(node, deep)

    ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
                                       list("-+0123456789"))
    return ConfigLoader


def _read_config(path: str) -> dict[str, Any]:
    """The options in a YAML or JSON file (a mapping), read within the bounds ``_yaml_loader`` and
    MAX_CONFIG_BYTES set."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--config {path}: no such file")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise UsageError(f"--config {path} is {file.stat().st_size} bytes; a config file of options is at most "
                         f"{MAX_CONFIG_BYTES}")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"--config {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    try:
        if file.suffix.lower() in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise UsageError(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml), or write the "
                                 "options as JSON") from None
            try:
                options = yaml.load(text, Loader=_yaml_loader(yaml, path))
            except yaml.YAMLError as err:
                raise UsageError(f"--config {path} is not valid YAML: {err}") from None
        else:
            def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
                keys = [key for key, _ in items]
                twice = next((key for key in keys if keys.count(key) > 1), None)
                if twice is not None:
                    raise UsageError(f"--config {path}: {twice!r} is given twice")
                return dict(items)

            def constant(name: str) -> None:  # NaN, Infinity: not JSON, though Python's reader takes them
                raise UsageError(f"--config {path}: {name} is not a JSON number")

            try:
                options = json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
            except json.JSONDecodeError as err:
                raise UsageError(f"--config {path} is not valid JSON: {err}") from None
    except RecursionError:
        raise UsageError(f"--config {path} is nested too deeply to be a file of options") from None
    if not isinstance(options, dict):
        raise UsageError(f"--config {path} must hold a mapping of option names to values, got {type(options).__name__}")
    return options


def _config_kind(action: argparse.Action) -> str:
    """What a ``--config`` file gives for a train option: "flag" (true or false), "flag-or-path"
    (--resume: true, the bare flag, or a path), "integer", "number", "names" (a string or a list of
    strings), "mapping", or "string"."""
    if action.nargs == 0:
        return "flag"
    if action.nargs == "?" and action.const is True:
        return "flag-or-path"
    kinds = {int: "integer", _positive_int: "integer", _seed: "integer", float: "number", _positive_number: "number",
             _steps: "number", _targets: "names",
             _names: "names", _json_object: "mapping", None: "string"}
    if action.type not in kinds:
        raise TypeError(f"train option {action.option_strings[0]} has no kind for --config files (cli._config_kind)")
    return kinds[action.type]


def _config_value(path: str, key: str, value: Any, action: argparse.Action) -> list[str] | None:
    """The command-line tokens after the option for the file's ``key: value`` (None: the option is not
    given; false for a flag), once the value is checked against the option: its kind (``_config_kind``), its choices and
    the option's own check (argparse's ``type``), each refusal naming the file and the key."""
    kind = _config_kind(action)

    def refuse(wanted: str) -> UsageError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:60] + "..."
        return UsageError(f"--config {path}: {key} is {shown}; give {wanted}")

    if kind == "flag":
        if not isinstance(value, bool):
            raise refuse("true or false")
        return [] if value else None
    if kind == "flag-or-path":
        if isinstance(value, bool):
            return [] if value else None
        if not isinstance(value, str) or not value:
            raise refuse("true (the newest checkpoint in --output) or a checkpoint folder's path")
        return [value]
    if kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            raise refuse("an integer")
        text = str(value)
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise refuse("a finite number")
        text = repr(float(value))
    elif kind == "names":
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n and "," not in n
                                                               for n in names):
            raise refuse("a name or a list of names")
        text = ",".join(names)
    elif kind == "mapping":
        if not isinstance(value, dict):
            raise refuse("a mapping")
        text = json.dumps(value)
    else:
        if not isinstance(value, str):
            raise refuse("a string (quote it)")
        text = value
    if action.choices is not None and text not in action.choices:
        raise refuse(f"one of {', '.join(map(str, action.choices))}")
    if action.type is not None:
        try:
            action.type(text)
        except (argparse.ArgumentTypeError, ValueError) as err:
            raise UsageError(f"--config {path}: {key}: {err}") from None
    return [text]


def _with_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with the options of ``train --config FILE`` put before the command line's own (argparse
    keeps the last value of an option, so the command line wins). An option of the file that the
    command line gives, or one that cannot go with one it gives (--epochs and --max-steps), is left out.
    Every value of the file is checked against its option (``_config_value``) first; one option given
    twice in the file (max_steps and max-steps), two that exclude each other, a second --config are
    refused."""
    if not argv or argv[0] != "train":
        return argv
    options = parser.train_options
    _check_spellings(options, argv[1:])
    rest, paths = list(argv[1:]), []
    i = 0
    while i < len(rest):
        if rest[i] == "--config" and i + 1 < len(rest):
            paths.append(rest[i + 1])
            del rest[i:i + 2]
        elif rest[i].startswith("--config="):
            paths.append(rest[i].split("=", 1)[1])
            del rest[i]
        else:
            i += 1
    if not paths:
        return argv
    if len(paths) > 1:
        raise UsageError(f"--config given {len(paths)} times ({', '.join(paths)}); give one file (files are not "
                         "merged)")
    path = paths[0]
    given = {options[t.split("=", 1)[0]].dest for t in rest if t.split("=", 1)[0] in options}
    excluded = set(given)
    for group in _TRAIN_EXCLUSIVE:
        if given & set(group):
            excluded |= set(group)
    tokens: list[str] = []
    keys: dict[str, str] = {}  # dest -> the file's key that names it
    set_by_file = set()
    for key, value in _read_config(path).items():
        if key == "use_peft":  # TRL's switch for training a LoRA adapter (ModelConfig), which is all train does
            if value is not True:
                raise UsageError(f"--config {path}: use_peft is {value!r}; train trains LoRA adapters only, so it "
                                 "takes use_peft: true (or no use_peft)")
            continue
        flag = "--" + str(key).replace("_", "-")
        action = options.get(flag)
        if action is None or flag == "--config":
            raise UsageError(f"--config {path}: unknown option {key!r}; the train options are "
                             f"{sorted(o[2:] for o in options if o != '--config')}")
        if action.dest in keys:
            raise UsageError(f"--config {path}: {keys[action.dest]!r} and {key!r} are the same option")
        keys[action.dest] = key
        if action.dest in excluded or value is None:
            continue
        after = _config_value(path, key, value, action)
        if after is not None:
            tokens += [flag, *after]
            set_by_file.add(action.dest)
    for group in _TRAIN_EXCLUSIVE:
        both = [keys[dest] for dest in group if dest in set_by_file]
        if len(both) > 1:
            raise UsageError(f"--config {path}: {both[0]} and {both[1]} cannot be given together")
    return ["train", *tokens, *rest]


def _check_spellings(options: dict[str, argparse.Action], tokens: list[str]) -> None:
    """Refuse one option given under two of its names on the command line (--lr and --learning-rate):
    argparse would keep the last silently."""
    spelled: dict[str, str] = {}
    for token in tokens:
        flag = token.split("=", 1)[0]
        action = options.get(flag)
        if action is None or action.dest == "help":
            continue
        first = spelled.setdefault(action.dest, flag)
        if first != flag:
            raise UsageError(f"{first} and {flag} are the same option; give one")


# Options of train that exclude each other (argparse's mutually exclusive groups), by dest.
_TRAIN_EXCLUSIVE = (("epochs", "max_steps"), ("resume", "overwrite"), ("warmup_steps", "warmup_ratio"))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    # Before torch loads OpenMP (it is read once): on a CPU adapter, lavapipe runs the WebGPU
    # kernels on the cores where PyTorch's OpenMP threads spin-wait between operations, and
    # spinning threads starve it (benchmarks/RESULTS.md, "On lavapipe"). A user's setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "bench":
            return cmd_bench(argv[1:])
        parser = build_parser()
        args = parser.parse_args(_with_config(parser, argv))
        import torch

        with torch.compiler.set_stance("force_eager"):  # see the module docstring
            return args.run(args)
    except _user_errors() as error:
        print(f"{PROG}: error{_rank_tag()}: {error}", file=sys.stderr)
        return _exit_code(error)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
