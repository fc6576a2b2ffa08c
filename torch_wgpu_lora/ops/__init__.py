"""Ops: autograd Functions over the runtime's kernels, each beside its torch reference."""

from .lora import LoRAFunction, LoRAWeights, lora, lora_reference, resident_weights

__all__ = ["LoRAFunction", "LoRAWeights", "lora", "lora_reference", "resident_weights"]
