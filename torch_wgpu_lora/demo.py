"""The offline demo: a small BitNet built on first use, the bundled dataset, the whole loop.

>>> # from torch_wgpu_lora.demo import build_demo_checkpoint, demo_records, run_demo
>>> # path = build_demo_checkpoint()        # ~/.cache/torch_wgpu_lora/demo-model-v1, built once
>>> # model = load_bitnet(path); tokenizer = AutoTokenizer.from_pretrained(path)
>>> # result = run_demo(output_dir="demo-out")   # what `torch-wgpu-lora demo` prints
>>> # result.loss_before, result.loss_after, result.generation_after

**The demo model** is a small, randomly initialised ``BitNetForCausalLM`` (4 layers,
hidden size 256, 8 query / 2 key-value heads, MLP 640, about 2.8 M parameters), written
in the format of microsoft/bitnet-b1.58-2B-4T: ternary projection weights packed four to
a byte with a ``weight_scale`` each, ``linear_class "autobitlinear"``, offline
quantisation. Its tokenizer is a byte-level BPE (512 tokens) trained on the bundled
dataset's texts. Both are built deterministically from fixed seeds (the same bytes every
time, on every machine with the same library versions), nothing is downloaded. It knows
no language: training shows the adapters learning the dataset, not a useful assistant.

**The run** (``run_demo``): greedy generation for one training prompt and the mean loss
per response token over the dataset, then LoRA training of the Q and V projections on
WebGPU (progress bar from the Trainer), the same loss and generation again, a gradient
parity table of the trained adapters (WebGPU kernels against PyTorch autograd, see
``ParityCheck``) and the adapter saved in PEFT's layout.

It runs eagerly: transformers wraps ``AutoBitLinear``'s activation quantisation in
``torch.compile``, whose first call compiles with inductor (tens of seconds on a 2-core
CPU, again for new sequence-length shapes) for no gain on a model this small. Eager and
compiled results are bit-identical for packed checkpoints like the demo model, and equal
up to float32 rounding (about 1e-6 relative) for online (bf16) ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import torch

from .config import LoraConfig
from .files import make_temp_dir, write_atomic
from .generation import generate
from .integrations.bitnet import load_model_and_tokenizer, lora_modules
from .integrations.gradcheck import ParityCheck, check_parity
from .integrations.peft import apply_lora
from .integrations.tiny import build_tiny_bitnet, build_tiny_tokenizer
from .prompts import format_prompt
from .training.data import collate
from .training.trainer import TrainResult, Trainer, evaluate

DEMO_MODEL_NAME = "demo-model-v1"  # change the suffix whenever the recipe below changes
DEMO_SEED = 0
DEMO_VOCAB_SIZE = 512
DEMO_CONFIG = dict(
    hidden_size=256, intermediate_size=640, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    max_position_embeddings=512,
    # Larger than BitNet's 0.02: the tied embeddings then give logits a range in which a
    # random model's loss can fall within the demo's few minutes of training.
    initializer_range=0.1,
)
MANIFEST_NAME = "demo-manifest.json"
RUN_MARKER_NAME = "demo-run.json"

# Defaults of the demo run on the demo model (a real checkpoint takes a lower learning rate).
DEMO_STEPS = 120
DEMO_LR = 1e-2
PRETRAINED_LR = 2e-4


# -- the model -----------------------------------------------------------------------------------

def demo_records() -> list[dict[str, str]]:
    """The bundled instruction dataset (``assets/alpaca_demo.json``): {instruction, input, output} dicts."""
    text = (resources.files(__package__) / "assets" / "alpaca_demo.json").read_text(encoding="utf-8")
    return json.loads(text)


def default_demo_path() -> Path:
    """Where the demo model lives: ``$XDG_CACHE_HOME/torch_wgpu_lora/demo-model-v1`` (``~/.cache`` by default)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "torch_wgpu_lora" / DEMO_MODEL_NAME


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete demo checkpoint, or None when it is.

    Complete means: the manifest (written last) names this recipe's version, and every file
    it lists is present with the recorded SHA-256.
    """
    path = Path(path)
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        return f"it has no {MANIFEST_NAME}"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        version, files = manifest["version"], dict(manifest["files"])
    except (ValueError, KeyError, TypeError) as err:
        return f"its {MANIFEST_NAME} is unreadable ({err})"
    if version != DEMO_MODEL_NAME:
        return f"it holds {version!r}, not {DEMO_MODEL_NAME!r}"
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if _sha256(file) != digest:
            return f"{name} differs from when it was built"
    return None


def _build_into(folder: Path) -> None:
    from transformers import AutoTokenizer

    texts = [format_prompt(r["instruction"], r["input"]) + r["output"] for r in demo_records()]
    build_tiny_tokenizer(folder, texts, vocab_size=DEMO_VOCAB_SIZE)
    vocab_size = len(AutoTokenizer.from_pretrained(folder))
    with torch.random.fork_rng(devices=[]):  # build_tiny_bitnet seeds torch; leave the caller's RNG alone
        build_tiny_bitnet(folder, flavour="packed-autobitlinear", seed=DEMO_SEED, vocab_size=vocab_size,
                          **DEMO_CONFIG)
    files = {p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file()}
    write_atomic(folder / MANIFEST_NAME, json.dumps({"version": DEMO_MODEL_NAME, "files": files}, indent=1).encode())


def build_demo_checkpoint(path: str | os.PathLike | None = None) -> Path:
    """The demo model and tokenizer folder at ``path`` (default ``default_demo_path()``), built if absent.

    The folder loads with ``load_bitnet(path)`` and ``AutoTokenizer.from_pretrained(path)``.
    It is built into a temporary sibling and renamed into place, so it is complete or
    absent; a complete one is reused (checked against its manifest). An existing folder
    that is not a complete demo checkpoint raises ValueError rather than being touched.

    >>> # path = build_demo_checkpoint()            # first call: a few seconds; later: instant
    """
    path = default_demo_path() if path is None else Path(path)
    if path.exists():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(f"{path} exists but is not a complete demo model ({problem}); "
                             "delete it to have it rebuilt, or choose another path")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(path)
    try:
        _build_into(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process finished first: keep its (identical) folder
            if checkpoint_problem(path) is not None:
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# -- the run ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DemoResult:
    """What ``run_demo`` measured and wrote."""

    model: Path
    prompt: dict[str, str]
    loss_before: float  # mean loss per response token over the dataset, before training
    loss_after: float
    generation_before: str
    generation_after: str
    parity: ParityCheck
    training: TrainResult
    adapter: Path


def _prepare_output(output_dir: Path, settings: dict[str, Any]) -> None:
    """Mark ``output_dir`` as a demo run's (the Trainer, told to overwrite, replaces an earlier
    demo run's output); a folder holding anything else is refused."""
    if output_dir.exists() and any(output_dir.iterdir()) and not (output_dir / RUN_MARKER_NAME).is_file():
        raise ValueError(f"{output_dir} is not empty and holds no earlier demo run ({RUN_MARKER_NAME}); "
                         "choose another output folder")
    output_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(output_dir / RUN_MARKER_NAME, json.dumps(settings, indent=1).encode())


def run_demo(model_path: str | os.PathLike | None = None, output_dir: str | os.PathLike = "torch-wgpu-lora-demo",
             *, steps: int = DEMO_STEPS, lr: float | None = None, rank: int = 8, lora_alpha: float = 16.0,
             batch_size: int = 8, max_length: int = 256, seed: int = 0, prompt_index: int = 0,
             max_new_tokens: int = 32, dtype: torch.dtype = torch.float32, progress: bool = True,
             engine: str = "auto", out: Callable[[str], None] = print) -> DemoResult:
    """Train Q/V LoRA adapters on the bundled dataset and show what changed; returns the numbers.

    ``model_path=None`` uses the demo model (``build_demo_checkpoint()``); any BitNet
    checkpoint folder with its tokenizer works too, e.g. microsoft/bitnet-b1.58-2B-4T-bf16
    downloaded by you (``hf download microsoft/bitnet-b1.58-2B-4T-bf16 --local-dir bitnet``;
    expect minutes per step on a CPU adapter: pass a few ``steps``). ``lr`` defaults to
    ``DEMO_LR`` for the demo model (random weights need large steps to show learning in a
    few minutes) and ``PRETRAINED_LR`` for another checkpoint. ``output_dir`` receives the
    Trainer's output (``adapter/`` in PEFT's layout, ``checkpoints/``, ``metrics.jsonl``,
    ``loss.png``), replacing an earlier demo run's. ``out`` receives every
    printed line. The same arguments give the same numbers (seeded data order and adapters).
    ``engine`` as the Trainer's: by default the whole model trains and generates on WebGPU.

    >>> # result = run_demo(output_dir="demo-out", steps=120)
    >>> # result.loss_after < result.loss_before
    """
    records = demo_records()
    if isinstance(prompt_index, bool) or not isinstance(prompt_index, int) or not 0 <= prompt_index < len(records):
        raise ValueError(f"prompt_index must be an integer in [0, {len(records)}), got {prompt_index!r}")
    model_path = build_demo_checkpoint() if model_path is None else Path(model_path)
    is_demo_model = checkpoint_problem(model_path) is None
    if lr is None:
        lr = DEMO_LR if is_demo_model else PRETRAINED_LR
    output_dir = Path(output_dir)
    settings = {"model": str(model_path), "steps": steps, "lr": lr, "rank": rank, "lora_alpha": lora_alpha,
                "batch_size": batch_size, "max_length": max_length, "seed": seed}
    lora_config = LoraConfig(r=rank, lora_alpha=lora_alpha, target_modules=("q_proj", "v_proj"), seed=seed)
    with torch.compiler.set_stance("force_eager"):  # see the module docstring
        model, tokenizer = load_model_and_tokenizer(model_path, dtype=dtype)
        apply_lora(model, lora_config)
        trainer = Trainer(model, tokenizer, records, output_dir=output_dir, max_steps=steps,
                          per_device_train_batch_size=batch_size, learning_rate=lr, max_length=max_length, seed=seed,
                          save_steps=0, progress=progress, overwrite=True, engine=engine)
        runner = trainer.engine or model
        _prepare_output(output_dir, settings)  # after the Trainer checked every argument
        batches = [collate(trainer.examples[i:i + batch_size], trainer.pad_token_id)
                   for i in range(0, len(trainer.examples), batch_size)]
        prompt = {"instruction": records[prompt_index]["instruction"], "input": records[prompt_index]["input"]}

        def show_model() -> tuple[float, str]:
            loss = evaluate(runner, batches)
            text = generate(runner, tokenizer, prompt, max_new_tokens=max_new_tokens)
            out(f"  loss (mean per response token, {len(trainer.examples)} examples): {loss:.4f}")
            out(f"  greedy generation: {text!r}")
            return loss, text

        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        out(f"model: {model_path} ({frozen / 1e6:.1f} M frozen parameters"
            + (", the small randomly initialised demo BitNet)" if is_demo_model else ")"))
        out(f"adapters: LoRA r={rank}, alpha={lora_alpha} on q_proj and v_proj of {len(lora_modules(model)) // 2} "
            f"layers, {sum(p.numel() for p in trainer.params):,} trainable parameters; "
            + ("the whole model on WebGPU (BitNetEngine)" if trainer.engine else
               "the base model in torch, the adapters on WebGPU"))
        out(f"prompt: {format_prompt(prompt['instruction'], prompt['input'])!r}")
        out(f"  expected: {records[prompt_index]['output']!r}")
        out("before training:")
        loss_before, generation_before = show_model()
        out(f"training {steps} steps of {batch_size} examples, lr {lr:g} (cosine schedule)")
        training = trainer.train()
        out("after training:")
        loss_after, generation_after = show_model()
        out("gradient parity of the trained adapters on one batch ("
            + ("the WebGPU engine" if trainer.engine else "WebGPU kernels") + " vs PyTorch autograd):")
        parity = check_parity(model, batches[0], engine=trainer.engine)
        out(str(parity))
        out(f"adapter saved in PEFT layout: {training.adapter}")
    return DemoResult(model=model_path, prompt=prompt, loss_before=loss_before, loss_after=loss_after,
                      generation_before=generation_before, generation_after=generation_after, parity=parity,
                      training=training, adapter=training.adapter)


__all__ = ["DEMO_CONFIG", "DEMO_MODEL_NAME", "DemoResult", "build_demo_checkpoint", "checkpoint_problem",
           "default_demo_path", "demo_records", "run_demo"]
