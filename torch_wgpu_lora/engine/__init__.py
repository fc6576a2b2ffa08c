"""The engine: a whole BitNet model's forward, backward and generation on WebGPU.

``BitNetEngine(model)`` uploads a transformers ``BitNetForCausalLM``'s weights once and runs
it as an ``nn.Module``. Layers: ``config`` (what the engine reads of the model), ``weights``
(frozen weights on the GPU, packed ternary), ``adapters`` (the LoRA Parameters, synced),
``kernels/`` (one module per WGSL family, each with its torch reference), ``plan`` (buffers and
launches of a forward pass, built once per shape), ``train_plan`` (forward, loss and backward
of a training pass), ``generate`` (decoding with the KV cache and sampling on the GPU),
``model`` (the nn.Module, its autograd loss and the one-submit optimizer step).
"""

from .model import ENGINES, BitNetEngine, choose_engine

__all__ = ["ENGINES", "BitNetEngine", "choose_engine"]
