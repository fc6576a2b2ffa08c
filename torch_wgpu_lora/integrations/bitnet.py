"""Hugging Face BitNet models with LoRA adapters on their projections.

>>> # model = BitNetForCausalLM.from_pretrained(path)
>>> # apply_lora(model, r=8, target_modules=("q_proj", "v_proj"))
>>> # optimizer = torch.optim.AdamW(lora_parameters(model))
"""

from __future__ import annotations

import re
from collections import OrderedDict

import torch
from torch import nn

from ..modules import LoRALinear

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _linear_like(module: nn.Module) -> bool:
    return isinstance(getattr(module, "in_features", None), int) and isinstance(getattr(module, "out_features", None), int)


def apply_lora(model: nn.Module, r: int = 8, lora_alpha: float = 8.0,
               target_modules: tuple[str, ...] = ("q_proj", "v_proj"), lora_dropout: float = 0.0,
               init: str = "hesper", seed: int = 42, backend: str = "wgpu") -> nn.Module:
    """Replace every module named in ``target_modules`` with a ``LoRALinear`` wrapping it.

    Every other parameter is frozen. With ``init="hesper"``, the adapter of target t (its
    position in ``target_modules``) in layer i is seeded ``seed + len(target_modules)*i + t``:
    for the default Q/V targets, ``seed + 2i`` and ``seed + 2i + 1`` as in Hesper.
    Returns ``model`` (changed in place).
    """
    if isinstance(target_modules, str):
        target_modules = (target_modules,)
    target_modules = tuple(target_modules)
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("this model already has LoRA adapters (apply_lora was called before)")
    existing = OrderedDict()
    for name, module in model.named_modules():
        if name and _linear_like(module):
            existing.setdefault(name.rsplit(".", 1)[-1], []).append((name, module))
    unknown = [t for t in target_modules if t not in existing]
    if unknown:
        raise ValueError(f"target_modules {unknown} match no module; linear modules in this model: "
                         f"{sorted(existing)}")
    model.requires_grad_(False)
    for t_index, target in enumerate(target_modules):
        for name, module in existing[target]:
            match = _LAYER_INDEX.search(name + ".")
            layer = int(match.group(1)) if match else 0
            wrapped = LoRALinear(module, r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, init=init,
                                 seed=seed + len(target_modules) * layer + t_index, backend=backend)
            model.set_submodule(name, wrapped)
    return model


def lora_modules(model: nn.Module) -> "OrderedDict[str, LoRALinear]":
    """The model's LoRALinear modules by qualified name, in model order."""
    return OrderedDict((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear))


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every adapter parameter (lora_A, lora_B of each LoRALinear), in model order."""
    return [p for m in lora_modules(model).values() for p in (m.lora_A, m.lora_B)]


def lora_state_dict(model: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """Adapter tensors keyed like ``model.layers.0.self_attn.q_proj.lora_A`` (detached)."""
    out = OrderedDict()
    for name, m in lora_modules(model).items():
        out[f"{name}.lora_A"] = m.lora_A.detach()
        out[f"{name}.lora_B"] = m.lora_B.detach()
    return out


def set_backend(model: nn.Module, backend: str) -> nn.Module:
    """Switch every adapter of ``model`` to ``backend`` ("wgpu" or "torch")."""
    for m in lora_modules(model).values():
        m.backend = backend
    return model
