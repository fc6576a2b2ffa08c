"""One training step of the demo model, LoRA on WebGPU vs LoRA in torch (``--training-step``)."""

from __future__ import annotations

from typing import Any

import torch

from ..demo import build_demo_checkpoint, demo_records
from ..integrations.bitnet import add_lora_layers, load_model_and_tokenizer, lora_parameters, set_backend
from ..ops.optimizer import WgpuAdamW
from ..training.data import collate, encode_records
from ..training.trainer import accumulate_gradients
from .timing import median_wall


def training_step(steps: int = 10, batch_size: int = 8, rank: int = 8) -> dict[str, Any]:
    """Wall time of one training step of the demo model: LoRA on WebGPU vs LoRA in torch.

    ``wgpu``: adapters through the WGSL kernels and ``WgpuAdamW``. ``torch``: the same
    model with ``backend="torch"`` adapters and ``torch.optim.AdamW``. The frozen base model
    runs in torch on the CPU in both (it is not part of this library's kernels). A step is
    forward, loss, backward, optimiser step, zeroing the gradients; median over ``steps``
    after two warm-up steps.
    """

    with torch.compiler.set_stance("force_eager"):  # as the CLI and the demo run (see cli.py)
        model, tokenizer = load_model_and_tokenizer(build_demo_checkpoint())
        add_lora_layers(model, r=rank)
        examples = encode_records(tokenizer, demo_records())[:batch_size]
        batch = collate(examples, tokenizer.pad_token_id)
        out: dict[str, Any] = {"tokens": int(batch["attention_mask"].sum()), "batch": list(batch["input_ids"].shape),
                               "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size,
                               "rank": rank}
        for backend in ("wgpu", "torch"):
            set_backend(model, backend)
            params = lora_parameters(model)
            optimizer = WgpuAdamW(params) if backend == "wgpu" else torch.optim.AdamW(params, lr=2e-4, eps=1e-7)

            def step() -> None:
                accumulate_gradients(model, [batch])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            out[f"{backend}_ms"] = median_wall(step, steps, warmup=2) * 1e3
    out["ratio"] = out["wgpu_ms"] / out["torch_ms"]
    return out
