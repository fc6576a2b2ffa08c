"""transformers' ``Trainer`` and TRL's ``SFTTrainer`` / ``DPOTrainer`` on a model holding torch_wgpu_lora's
adapters, on every checkpoint flavour (dense, online, packed), with our kernels doing the work.

>>> # model = apply_lora(load_bitnet(folder), peft.LoraConfig(r=8, target_modules="all-linear"))
>>> # transformers.Trainer(model=model, args=..., train_dataset=...).train()    # as it is: adapters' kernels
>>> # SFTTrainer(model=model, args=SFTConfig(...), train_dataset=..., engine="wgpu").train()  # the whole model
>>> # DPOTrainer(model=model, args=DPOConfig(...), train_dataset=...).train()  # reference: adapters disabled
>>> # SFTTrainer(model=load_bitnet(folder), peft_config=peft.LoraConfig(...), ...)  # our layers, from peft's config

**transformers' and TRL's own classes.** A model ``apply_lora`` (or ``load_adapter``) gave adapters to
trains with ``transformers.Trainer`` and TRL's ``SFTTrainer`` as it is: its adapters' forward and backward are
the WebGPU kernels (``LoRALinear``, backend ``"wgpu"``), the base runs in transformers' modules, and the
Trainer's optimizer steps the adapters alone. On the packed flavours (microsoft/bitnet-b1.58-2B-4T's
format) transformers trains a quantised model only when it holds trainable adapters on its frozen base,
as a model PEFT's adapters were attached to; our models say they hold them
(``LoraModelMixin._hf_peft_config_loaded``, transformers' own mark).

**This module's trainers** are TRL's, with what TRL decides by ``isinstance(model, peft.PeftModel)``
decided for our models as TRL decides it for a ``PeftModel``:

* ``DPOTrainer``: the reference model is the policy with its adapters disabled (TRL's reference for a
  ``PeftModel`` trained from a ``peft_config``), run by ``AdapterDisabled``, which shares every tensor
  with the policy: no second copy of the base. TRL's own ``DPOTrainer`` does not see a PEFT model in
  ours and loads the checkpoint again from ``config._name_or_path`` as the reference (a second base).
  A reference of one's own (``ref_model=``) is used as given. (Given a ``PeftModel`` whose adapter was
  trained before, TRL compares against a frozen copy of that adapter; here the reference is always the
  base alone, which is the same for a fresh adapter, whose ``lora_B`` is zero.)
* ``peft_config=`` (both trainers): our ``LoRALinear`` layers are put on the model from that config
  (``apply_lora``, which reads peft's ``LoraConfig`` and refuses by name what it does not run), where
  TRL's own trainers would build a ``PeftModel`` whose torch layers run instead of our kernels. A model
  that already holds adapters is refused with it, as TRL refuses a ``PeftModel`` with one.
* ``SFTTrainer(engine=...)``: ``"wgpu"`` computes each micro-batch's causal LM loss and the adapters'
  gradients in ``BitNetEngine`` (the whole model on WebGPU: one submit for forward, loss and backward,
  and one for the logits TRL's token accuracy and entropy read); the Trainer's optimizer then steps
  the Parameters the engine shares. ``"auto"`` takes the engine where ``choose_engine`` does (a GPU
  adapter); ``"torch"`` (the default) runs transformers' modules with the adapters' kernels.
  ``EngineMixin`` gives the same to ``transformers.Trainer``:
  ``class EngineTrainer(EngineMixin, transformers.Trainer)`` (there without the logits' submit).

DPO's loss reads per-token log-probabilities of the policy and of the reference, which the engine's
loss (the causal LM cross-entropy) does not give: ``DPOTrainer`` runs the adapters' kernels on
transformers' modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    import trl
except ImportError as err:  # pragma: no cover - trl is an extra
    raise ImportError("torch_wgpu_lora's SFTTrainer and DPOTrainer subclass TRL's: pip install "
                      "'torch_wgpu_lora[trl]'") from err
from trl.trainer.utils import entropy_from_logits

from ..engine import BitNetEngine, choose_engine
from ..engine.config import WITHOUT_ENGINE
from ..integrations.bitnet import load_bitnet, lora_modules
from ..integrations.peft import apply_lora, peft_layers
from ..loss import IGNORE_INDEX, labelled_tokens

__all__ = ["AdapterDisabled", "DPOTrainer", "EngineMixin", "SFTTrainer"]


def _with_our_adapters(model: Any, peft_config: Any, trainer: str) -> Any:
    """``model`` (a model or a local checkpoint path) with our adapters from ``peft_config`` where given;
    refuses a ``peft_config`` with a model that already holds adapters (ours or PEFT's)."""
    if isinstance(model, (str, Path)):
        model = load_bitnet(model)
    if peft_config is None:
        return model
    if lora_modules(model) or peft_layers(model):
        raise ValueError(f"{trainer} was given peft_config and a model that already holds LoRA adapters: pass the "
                         "model without adapters with peft_config, or the model with its adapters and no peft_config")
    return apply_lora(model, peft_config)


class AdapterDisabled(nn.Module):
    """``model`` with its adapters disabled (``disable_adapter()``), as a module of its own: DPO's
    reference model, sharing every tensor with ``model`` (the policy). Calls run without autograd."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not lora_modules(model) or not hasattr(model, "disable_adapter"):
            raise ValueError(f"AdapterDisabled takes a model holding torch_wgpu_lora adapters (apply_lora); the "
                             f"{type(model).__name__} holds none")
        self.policy = model

    @property
    def config(self) -> Any:
        return self.policy.config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), self.policy.disable_adapter():
            return self.policy(*args, **kwargs)


class DPOTrainer(trl.DPOTrainer):
    """TRL's ``DPOTrainer`` for a model holding torch_wgpu_lora's adapters (or a model and a
    ``peft_config``, whose adapters become ours): without ``ref_model``, the reference is the policy
    with its adapters disabled (``AdapterDisabled``), as TRL's for a ``PeftModel``. Arguments as TRL's."""

    def __init__(self, model: Any, ref_model: nn.Module | None = None, args: Any = None, *rest: Any,
                 peft_config: Any = None, **kwargs: Any) -> None:
        model = _with_our_adapters(model, peft_config, "DPOTrainer")
        if ref_model is None and lora_modules(model):  # (precompute_ref_log_probs reads it once, before training)
            ref_model = AdapterDisabled(model)
        super().__init__(model, ref_model, args, *rest, **kwargs)


class EngineMixin:
    """For a transformers ``Trainer`` subclass (``class T(EngineMixin, transformers.Trainer)``): with
    ``engine="wgpu"`` (or ``"auto"``: ``choose_engine``'s choice), each micro-batch's loss and the
    adapters' gradients come from ``BitNetEngine`` in one submit, the loss scaled as transformers scales
    it (by ``num_items_in_batch``, the labelled tokens of the whole accumulated step). The model's
    adapters are the engine's: the Trainer's optimizer steps them and the engine uploads them before
    its next pass. ``engine="torch"``: transformers' modules, as the Trainer runs them."""

    # Whether the trainer's compute_loss reads the logits of a training pass (TRL's SFTTrainer: token
    # accuracy and entropy), which the engine then reads back in a second submit.
    engine_returns_logits = False

    def __init__(self, *args: Any, engine: str = "torch", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine: BitNetEngine | None = choose_engine(self.model, engine)
        if self.engine is not None and (self.compute_loss_func is not None or self.label_smoother is not None):
            what = "compute_loss_func (or TRL's loss_type='dft')" if self.compute_loss_func is not None \
                else "label_smoothing_factor"
            raise ValueError(f"{what} computes a loss of its own from the logits; BitNetEngine differentiates the "
                             f"causal LM loss alone: {WITHOUT_ENGINE}")

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if self.engine is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        return super().compute_loss(self._engine_forward, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def _engine_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                        use_cache: bool | None = None, num_items_in_batch: Any = None, **other: Any) -> Any:
        if other:
            raise ValueError(f"the batch holds {sorted(other)}, which BitNetEngine does not take (it takes input_ids, "
                             f"attention_mask or position_ids, and labels): {WITHOUT_ENGINE}")
        out = self.engine(input_ids, attention_mask=attention_mask, labels=labels, position_ids=position_ids,
                          use_cache=use_cache, return_logits=self.engine_returns_logits)
        if labels is not None and num_items_in_batch is not None:
            # The engine's loss is the mean over this micro-batch's labelled tokens; transformers' is their
            # sum over the step's (num_items_in_batch), so that accumulated micro-batches weigh per token.
            out.loss = out.loss * (labelled_tokens(labels) / torch.as_tensor(num_items_in_batch).item())
        return out


class SFTTrainer(EngineMixin, trl.SFTTrainer):
    """TRL's ``SFTTrainer`` for a model holding torch_wgpu_lora's adapters, or a model and a
    ``peft_config`` (whose adapters become ours), with ``engine=`` (``EngineMixin``). Arguments as TRL's."""

    engine_returns_logits = True

    def __init__(self, model: Any, *args: Any, peft_config: Any = None, engine: str = "torch", **kwargs: Any) -> None:
        super().__init__(_with_our_adapters(model, peft_config, "SFTTrainer"), *args, engine=engine, **kwargs)

    def _engine_forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._engine_forward(*args, **kwargs)
        labels = kwargs.get("labels")
        if self.args.loss_type != "chunked_nll" or labels is None:
            return out
        # TRL's chunked_nll forward (the default loss_type) returns its token accuracy and entropy sums with
        # the loss; these are the same sums, over the same labelled positions, from the engine's logits.
        with torch.no_grad():
            logits, targets = out.logits[:, :-1], labels[:, 1:].to(out.logits.device)
            mask = targets != IGNORE_INDEX
            return _EngineSFTOutput(loss=out.loss, logits=out.logits, num_valid_tokens=mask.sum(),
                                    num_correct_tokens=((logits.argmax(-1) == targets) & mask).sum(),
                                    entropy_sum=(entropy_from_logits(logits) * mask).sum())


@dataclass
class _EngineSFTOutput(CausalLMOutputWithPast):
    """The engine's output with the sums TRL's chunked_nll forward returns."""

    num_correct_tokens: torch.Tensor | None = None
    entropy_sum: torch.Tensor | None = None
    num_valid_tokens: torch.Tensor | None = None
