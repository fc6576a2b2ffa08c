"""Shared by the integrations' tests: random adapter values and the logits of one fixed batch."""

from __future__ import annotations

import torch

IDS = torch.tensor([[0, 5, 17, 42, 99, 200, 7, 3]])  # one shape everywhere: AutoBitLinear compiles once per shape


def randomize(model: torch.nn.Module, seed: int, scale: float = 0.3) -> torch.nn.Module:
    """Random lora_A and lora_B (B starts at zero) so that the adapter changes every logit; works on
    torch_wgpu_lora's adapters and on PEFT's (their Parameters' names hold lora_A / lora_B)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits
