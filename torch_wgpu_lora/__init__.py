"""torch_wgpu_lora: finetune LoRA adapters of BitNet b1.58 models with WebGPU kernels."""

from .ops import LoRAFunction, lora, lora_reference
from .runtime import device_info

__version__ = "0.1.0"

__all__ = ["LoRAFunction", "device_info", "lora", "lora_reference"]
