"""Benchmarks of the WebGPU LoRA op and of a training step, against torch; one concern per module.

* ``timing``: how a time is taken (GPU time from timestamp queries, wall time, copy bandwidth).
* ``lora_op``: the op benchmark (cases, inputs, ``measure`` against torch, ``run``, ``breakdown``).
* ``sweep``: the op's GPU time under launch-shape and shader-check variants.
* ``training_step``: one training step of the demo model, LoRA on WebGPU vs in torch.
* ``engine``: the whole model (``BitNetEngine``) at BitNet-2B shapes against HF transformers + PEFT.
* ``launches``: per-launch GPU time of the decode-shaped kernels, per launch shape.
* ``decode_chain``: each kind of launch's marginal cost inside a decoded token's chain.
* ``distributed``: data-parallel training over processes.
* ``report``: the outputs (JSON written atomically, markdown table, PNG chart).
* ``tables``: the tables of ``benchmarks/RESULTS.md`` and the README, rendered from the results' JSON.
* ``cli``: the command line (``torch-wgpu-lora bench``, ``python -m benchmarks.lora_op``).

>>> # from torch_wgpu_lora.benchmarks.lora_op import Case, measure
>>> # measure(Case(n=2048, in_features=2560, out_features=2560, rank=16, backward=True))
"""
