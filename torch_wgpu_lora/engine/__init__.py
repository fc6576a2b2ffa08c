"""The engine: a whole BitNet model's forward, backward and generation on WebGPU.

``BitNetEngine(model)`` uploads a transformers ``BitNetForCausalLM``'s weights once and runs
it as an ``nn.Module``. Modules: ``config`` (what the engine reads of the model), ``weights``
(frozen weights on the GPU, packed ternary), ``adapters`` (the LoRA Parameters, synced),
``kernels/`` (one module per kernel family or algorithm, each with its torch reference),
``workspace`` (where every plan's memory goes, by role), ``program`` (the one emitter of a
layer's forward and of the LM head), ``plan`` (a forward pass, built once per shape),
``train_plan`` (forward, loss and backward of a training pass), ``step`` (the optimizer step:
clip and AdamW on the GPU, the gradient exchange), ``inputs`` (the checks of what the engine is
given: batches, position ids, a step's micro-batches, prompts), ``generate`` (batched decoding: a
``GenerationRequest`` and the ``DecodeSession`` that runs it with the KV cache and sampling on the
GPU, a finished row taking the next prompt), ``generate_api`` (transformers' ``generate`` arguments
translated into a request, its result into transformers' layout), ``model`` (the nn.Module, its
autograd loss, the plan cache, batched generation as ``BitNetEngine.generate_batch``, the memory
report).
"""

from .generate import TOKENS_PER_SUBMIT, GenerationRequest, Generated
from .model import ENGINES, BitNetEngine, choose_engine

__all__ = ["ENGINES", "TOKENS_PER_SUBMIT", "BitNetEngine", "GenerationRequest", "Generated", "choose_engine"]
