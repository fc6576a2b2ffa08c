"""torch_wgpu_lora: finetune LoRA adapters of BitNet b1.58 models with WebGPU kernels.

>>> import torch, torch_wgpu_lora as twl
>>> layer = twl.LoRALinear(torch.nn.Linear(64, 64), r=8)
>>> layer(torch.randn(2, 64)).shape
torch.Size([2, 64])

Public names load lazily, so ``import torch_wgpu_lora`` stays cheap (transformers and
the training stack load when first used).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "lora": "ops.lora",
    "lora_reference": "ops.lora",
    "LoRALinear": "modules",
    "LoraConfig": "config",
    "device_info": "runtime",
    "apply_lora": "integrations.peft",
    "lora_parameters": "integrations.bitnet",
    "lora_state_dict": "integrations.bitnet",
    "load_bitnet": "integrations.bitnet",
    "save_adapter": "integrations.adapter_files",
    "load_adapter": "integrations.peft",
    "from_peft": "integrations.peft",
    "compare_gradients": "integrations.gradcheck",
    "WgpuAdamW": "ops.optimizer",
    "Trainer": "training.trainer",
    "TrainerCallback": "training.trainer",
    "train": "training.trainer",
    "SFTTrainer": "training.hf_trainers",
    "DPOTrainer": "training.hf_trainers",
    "generate": "generation",
    "BitNetEngine": "engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_wgpu_lora' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
