"""The benchmark harness: the WebGPU LoRA op against torch, the whole model against HF transformers +
PEFT, decoding's launches, data-parallel training; one concern per module. Each benchmark runs one
way, ``python -m torch_wgpu_lora.benchmarks.MODULE --out DIR`` (the op's ``MODULE`` is ``cli``, the
same as ``torch-wgpu-lora bench``), and writes its results' JSON there; ``benchmarks/RESULTS.md``
gives the commands of its runs and the figures, rendered from those files by ``tables``.

* ``timing``: how a time is taken (GPU time from timestamp queries, wall time, copy bandwidth).
* ``lora_op``: the op benchmark (cases, inputs, ``measure`` against torch, ``run``, ``breakdown``, its
  markdown table and PNG chart).
* ``sweep``: the op's GPU time under launch-shape and shader-check variants.
* ``training_step``: one training step of the demo model, LoRA on WebGPU vs in torch.
* ``engine``: the whole model (``BitNetEngine``) at BitNet-2B shapes against HF transformers + PEFT.
* ``launches``: per-launch GPU time of the decode-shaped kernels, per launch shape.
* ``decode_chain``: each kind of launch's marginal cost inside a decoded token's chain.
* ``matrix_units``: the matrix units' ceiling and each GEMM kind of ``engine/kernels/gemms.py``
  beside torch's GEMMs.
* ``distributed``: data-parallel training over processes.
* ``report``: the files under ``--out``, written atomically (text, JSON).
* ``tables``: the tables of ``benchmarks/RESULTS.md`` and the README, rendered from the results' JSON.
* ``cli``: the op benchmark's command line (``torch-wgpu-lora bench``).

>>> # from torch_wgpu_lora.benchmarks.lora_op import Case, measure
>>> # measure(Case(n=2048, in_features=2560, out_features=2560, rank=16, backward=True))
"""
