"""transformers' Trainer and TRL's SFTTrainer / DPOTrainer on tiny BitNets of each flavour (dense, online,
and both packed ones: packed-autobitlinear is microsoft/bitnet-b1.58-2B-4T's format), the adapters'
WebGPU kernels or the whole-model engine doing the work: the loss falls, and the gradient the Trainer's
optimizer steps with is autograd's.

The gradient check has two links, each against an independent computation:

1. The gradient the Trainer hands its optimizer at step 1 (caught before the update, unclipped) against
   the gradient of the same loss on the same batch, computed outside the Trainer from a copy of the model
   taken before training: for the Trainer and SFTTrainer, transformers' causal LM loss of the model (or
   of a ``BitNetEngine`` of it); for DPO, the sigmoid DPO loss written out below from the policy's
   log-probabilities and those of a fresh transformers model of the checkpoint without adapters. The two
   run the same float32 kernels on the same values, differing only in how the loss is summed (TRL's
   chunked cross-entropy, transformers' sum / num_items against a mean; measured up to 7.6e-7 of the
   largest gradient): ``SAME``, 1e-5 (about 170 float32 ulps), covers that with room; a wrong batch,
   reference, loss scale or gradient is off by O(1).
2. That copy's adapter gradients against PyTorch autograd in float64 with the forward pinned
   (``check_parity``, the project's parity check and its tolerance: twice PyTorch float32's own error).
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoTokenizer, Trainer, TrainerCallback, TrainingArguments
from trl import DPOConfig, SFTConfig

import torch_wgpu_lora as twl
from torch_wgpu_lora.engine import BitNetEngine
from torch_wgpu_lora.integrations.bitnet import load_bitnet, lora_modules
from torch_wgpu_lora.integrations.gradcheck import check_parity, randomize_lora_B
from torch_wgpu_lora.integrations.tiny import CHAT_TEMPLATE, build_tiny_bitnet, build_tiny_tokenizer
from torch_wgpu_lora.modules import LoRALinear
from torch_wgpu_lora.training.hf_trainers import AdapterDisabled, DPOTrainer, EngineMixin, SFTTrainer

SAME = 1e-5  # link 1's tolerance, relative to the largest gradient (the module docstring)
FLAVOURS = ("dense", "online", "packed", "packed-autobitlinear")
PAIRS = [("Name a primary colour.", "Red."), ("Say hello in Spanish.", "Hola."), ("Count to three.", "One, two, three."),
         ("Name a fruit.", "A pear.")]
CHATS = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in PAIRS]
PREFERENCES = [{"prompt": q, "chosen": a, "rejected": PAIRS[(i + 1) % len(PAIRS)][1]} for i, (q, a) in enumerate(PAIRS)]
STEPS = 3


@pytest.fixture(scope="module", params=FLAVOURS)
def folder(request, tmp_path_factory):
    path = build_tiny_bitnet(tmp_path_factory.mktemp(request.param), flavour=request.param, seed=0)
    return build_tiny_tokenizer(path, [f"User: {q} Assistant: {a}" for q, a in PAIRS], chat_template=CHAT_TEMPLATE)


def model_with_adapters(folder):
    model = twl.apply_lora(load_bitnet(folder), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    return randomize_lora_B(model, seed=1)  # a nonzero B: lora_A's gradients are real comparisons


class FirstStep(TrainerCallback):
    """The adapters' gradients as the optimizer gets them at step 1."""

    def __init__(self, model):
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in self.params.items()}


def recording(cls):
    """``cls`` keeping a copy of each batch its compute_loss gets (``trainer.batches``)."""
    class Recording(cls):
        batches: list

        def compute_loss(self, model, inputs, *args, **kwargs):
            self.batches.append({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return super().compute_loss(model, inputs, *args, **kwargs)

    Recording.batches = []
    return Recording


def common(output_dir, **more):
    return dict(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=2e-2,
                max_grad_norm=0.0, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", **more)


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def assert_same_gradients(theirs, params, ours):
    """Link 1: the Trainer's step-1 gradient ``theirs`` (by name) against ``ours`` (by name, for ``params``)."""
    assert set(theirs) == set(params)
    for name in params:
        scale = ours[name].abs().max().item()
        assert scale > 0, f"{name}: a zero reference gradient compares nothing"
        error = (theirs[name] - ours[name]).abs().max().item()
        assert error <= SAME * scale, f"{name}: the Trainer's gradient is {error:.3g} from autograd's (scale {scale:.3g})"


def grads_by_name(model, loss):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return dict(zip([n for n, _ in named], torch.autograd.grad(loss, [p for _, p in named])))


def assert_parity(snapshot, batch, engine=None):
    """Link 2: the copy's gradients (kernels or engine) against float64 autograd, forward pinned."""
    check = check_parity(snapshot, batch, engine=engine)
    assert check.passed, str(check)


# -- transformers' Trainer, the adapters' kernels ----------------------------------------------------

def test_transformers_trainer_trains_each_flavour_with_autograds_gradient(folder, tmp_path):
    model = model_with_adapters(folder)
    assert {m.backend for m in lora_modules(model).values()} == {"wgpu"}
    snapshot = copy.deepcopy(model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = [tokenizer(f"User: {q} Assistant: {a}")["input_ids"] for q, a in PAIRS]
    length = min(len(r) for r in rows)
    data = Dataset.from_dict({"input_ids": [r[:length] for r in rows], "labels": [r[:length] for r in rows]})
    first = FirstStep(model)
    trainer = recording(Trainer)(model=model, args=TrainingArguments(**common(tmp_path)), train_dataset=data,
                                 callbacks=[first])
    trainer.train()  # the packed flavours: no "cannot perform fine-tuning on purely quantized models"

    assert losses(trainer)[-1] < losses(trainer)[0]
    batch = {k: trainer.batches[0][k] for k in ("input_ids", "labels")}
    assert_same_gradients(first.grads, first.params, grads_by_name(snapshot, snapshot(**batch).loss))
    assert_parity(snapshot, batch)


# -- TRL's SFTTrainer, on the engine ----------------------------------------------------------------

def test_sft_trainer_on_the_engine_trains_each_flavour_with_autograds_gradient(folder, tmp_path, monkeypatch):
    model = model_with_adapters(folder)
    snapshot = copy.deepcopy(model)
    passes, original = [], BitNetEngine.loss_and_grads

    def counted(self, *args, **kwargs):
        passes.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BitNetEngine, "loss_and_grads", counted)
    first = FirstStep(model)
    # two micro-batches a step, of other labelled-token counts: the loss is weighted per token over the step
    config = SFTConfig(**{**common(tmp_path, assistant_only_loss=True, max_length=64, bf16=False),
                          "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2})
    trainer = recording(SFTTrainer)(model=model, args=config, train_dataset=Dataset.from_list(CHATS),
                                    processing_class=AutoTokenizer.from_pretrained(folder), callbacks=[first],
                                    engine="wgpu")
    assert isinstance(trainer.engine, BitNetEngine)
    trainer.train()

    assert passes == [trainer.engine] * (2 * STEPS)  # every micro-batch's loss and gradients: the trainer's engine
    assert losses(trainer)[-1] < losses(trainer)[0]
    assert all(0 <= entry["mean_token_accuracy"] <= 1 for entry in trainer.state.log_history if "loss" in entry)
    batches = [{k: b[k] for k in ("input_ids", "attention_mask", "labels")} for b in trainer.batches[:2]]
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    assert counts[0] != counts[1]
    engine = BitNetEngine(snapshot)
    loss = sum(engine(**b).loss * count / sum(counts) for b, count in zip(batches, counts))
    assert_same_gradients(first.grads, first.params, grads_by_name(snapshot, loss))
    assert_parity(snapshot, batches[0], engine=engine)


def test_sft_trainer_peft_config_puts_our_layers_on_the_model(tmp_path):
    folder = build_tiny_tokenizer(build_tiny_bitnet(tmp_path / "m", flavour="packed-autobitlinear"),
                                  [f"User: {q} Assistant: {a}" for q, a in PAIRS], chat_template=CHAT_TEMPLATE)
    config = SFTConfig(**common(tmp_path / "sft", bf16=False))
    # the model as a checkpoint folder, as TRL takes a model id
    trainer = SFTTrainer(model=str(folder), args=config, train_dataset=Dataset.from_list(CHATS),
                         processing_class=AutoTokenizer.from_pretrained(folder),
                         peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    modules = lora_modules(trainer.model)
    assert len(modules) == 4 and all(type(m) is LoRALinear and m.backend == "wgpu" for m in modules.values())
    assert not any(isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer) for m in trainer.model.modules())
    trainer.train()
    assert losses(trainer)[-1] < losses(trainer)[0]


def test_refusals_name_the_way(tmp_path):
    folder = build_tiny_tokenizer(build_tiny_bitnet(tmp_path / "m", flavour="dense"),
                                  [f"User: {q} Assistant: {a}" for q, a in PAIRS], chat_template=CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = Dataset.from_list(CHATS)
    with pytest.raises(ValueError, match="already holds LoRA adapters"):
        SFTTrainer(model=model_with_adapters(folder), args=SFTConfig(**common(tmp_path / "a")), train_dataset=data,
                   processing_class=tokenizer, peft_config=peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"loss_type='dft'.*engine='torch'"):
        SFTTrainer(model=model_with_adapters(folder), args=SFTConfig(**common(tmp_path / "b"), loss_type="dft"),
                   train_dataset=data, processing_class=tokenizer, engine="wgpu")

    class EngineTrainer(EngineMixin, Trainer):
        pass

    ids = torch.randint(3, 300, (2, 8), generator=torch.Generator().manual_seed(0)).tolist()
    args = TrainingArguments(**common(tmp_path / "c"), remove_unused_columns=False)  # keeps token_type_ids
    trainer = EngineTrainer(model=model_with_adapters(folder), args=args,
                            train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids,
                                                             "token_type_ids": [[0] * 8] * 2}),
                            engine="wgpu")
    with pytest.raises(ValueError, match=r"\['token_type_ids'\].*engine='torch'"):
        trainer.train()


# -- TRL's DPOTrainer, the reference being the adapters disabled ------------------------------------

def completion_logps(model, batch):
    """TRL's sequence log-probability: the sum over completion tokens of log p(token | before)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets, mask = batch["input_ids"][:, 1:], batch["completion_mask"][:, 1:].bool()
    per_token = torch.gather(F.log_softmax(logits.float(), -1), 2, targets.unsqueeze(-1)).squeeze(-1)
    return (per_token * mask).sum(-1)


def test_dpo_trainer_trains_each_flavour_against_the_adapter_disabled_model(folder, tmp_path):
    model = model_with_adapters(folder)
    snapshot = copy.deepcopy(model)
    first = FirstStep(model)
    config = DPOConfig(**common(tmp_path, bf16=False, max_length=64))
    trainer = recording(DPOTrainer)(model=model, args=config, train_dataset=Dataset.from_list(PREFERENCES),
                                    processing_class=AutoTokenizer.from_pretrained(folder), callbacks=[first])
    # the reference is the policy itself, adapters disabled: no second copy of the base
    assert isinstance(trainer.ref_model, AdapterDisabled) and trainer.ref_model.policy is model
    assert {p.data_ptr() for p in trainer.ref_model.parameters()} == {p.data_ptr() for p in model.parameters()}
    trainer.train()

    assert losses(trainer)[-1] < losses(trainer)[0]
    batch = trainer.batches[0]
    with torch.no_grad():  # the reference: transformers' model of the checkpoint, no adapters
        reference = completion_logps(load_bitnet(folder).eval(), batch)
    policy = completion_logps(snapshot.eval(), batch)
    margin = (policy - reference).chunk(2)  # chosen rows first, then rejected (TRL's concatenation)
    loss = -F.logsigmoid(config.beta * (margin[0] - margin[1])).mean()  # TRL's loss_type "sigmoid"
    assert_same_gradients(first.grads, first.params, grads_by_name(snapshot, loss))
    assert_parity(snapshot, {k: batch[k] for k in ("input_ids", "attention_mask")})
