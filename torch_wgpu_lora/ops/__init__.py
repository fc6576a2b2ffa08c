"""Ops: autograd Functions over the runtime's kernels, one module per kernel family,
each with its torch reference beside it (``ops.lora``: ``LoRAFunction``, ``lora``,
``lora_reference``)."""
