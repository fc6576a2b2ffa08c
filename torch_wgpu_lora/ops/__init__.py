"""Ops: torch ops over the runtime's kernels, one module per kernel family, each with its torch
reference beside it (``ops.lora``: ``lora``, ``base_plus_lora``, ``lora_reference``;
``ops.lora_gpu``: the same kernels on GPU buffers; ``ops.optimizer``: the global-norm clip and
AdamW, ``clip_launches``/``clip_reference``, ``adamw_step``/``adamw_reference``, and ``WgpuAdamW``,
the torch optimizer built on them)."""
