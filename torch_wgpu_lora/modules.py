"""``LoRALinear``: a frozen base layer plus a trainable low-rank update.

>>> import torch.nn as nn
>>> layer = LoRALinear(nn.Linear(64, 32), r=8, lora_alpha=16)
>>> layer(torch.randn(3, 64)).shape
torch.Size([3, 32])
>>> layer.lora_A.shape, layer.lora_B.shape, layer.scaling
(torch.Size([8, 64]), torch.Size([32, 8]), 2.0)

output = base_layer(x) + scaling · lora_B(lora_A(dropout(x))), scaling = lora_alpha / r
(lora_alpha / sqrt(r) with ``use_rslora``). While ``disabled`` is set, output = base_layer(x).
Naming follows PEFT (``lora_A`` [r, in], ``lora_B`` [out, r]); they are Parameters
rather than Linear modules, and adapter files map them to PEFT's ``lora_A.weight``.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import BACKENDS, LoraConfig
from .init import init_lora_A
from .ops.lora import base_plus_lora, lora, lora_reference


class LoRALinear(nn.Module):
    """Wraps a linear layer (``nn.Linear``, transformers' ``AutoBitLinear`` or packed
    ``BitLinear``: anything with ``in_features``/``out_features``) with a LoRA adapter.

    ``backend="wgpu"`` computes the adapter with the WebGPU kernels, in flight while the CPU
    computes the base layer, forward and backward (``ops.lora.base_plus_lora``); ``"torch"``
    with plain torch ops (the reference). The adapter's parameters are float32 whatever the
    base layer's dtype; its output is cast to the base output's dtype.
    """

    def __init__(self, base_layer: nn.Module, r: int = 8, lora_alpha: float = 8.0, lora_dropout: float = 0.0,
                 init: str = "hesper", seed: int = 42, backend: str = "wgpu", use_rslora: bool = False) -> None:
        super().__init__()
        in_features = getattr(base_layer, "in_features", None)
        out_features = getattr(base_layer, "out_features", None)
        if not isinstance(in_features, int) or not isinstance(out_features, int):
            raise TypeError(f"LoRALinear wraps layers with integer in_features/out_features; "
                            f"{type(base_layer).__name__} has none")
        config = LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, init=init, seed=seed,
                            backend=backend, use_rslora=use_rslora)  # one check of every setting, naming the bad field
        self.base_layer = base_layer.requires_grad_(False)
        self.in_features, self.out_features = in_features, out_features
        self.r, self.lora_alpha, self.scaling = config.r, config.lora_alpha, config.scaling
        self.use_rslora = config.use_rslora
        self.backend = config.backend
        self.lora_dropout = nn.Dropout(config.lora_dropout) if config.lora_dropout > 0 else nn.Identity()
        self.lora_A = nn.Parameter(init_lora_A((config.r, in_features), config.init, config.seed))
        self.lora_B = nn.Parameter(torch.zeros(out_features, config.r))
        self.merged = False
        self.disabled = False  # the adapter adds nothing (PEFT's disable_adapter)

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        if value not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {value!r}")
        self._backend = value

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight (what code that inspects ``proj.weight`` expects)."""
        return self.base_layer.weight

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution alone: scaling · (dropout(x)·Aᵀ)·Bᵀ, in float32."""
        x = self.lora_dropout(x)
        if self._backend == "wgpu":
            return lora(x.float(), self.lora_A, self.lora_B, self.scaling)
        return lora_reference(x.to(self.lora_A.dtype), self.lora_A, self.lora_B, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged or self.disabled:
            return self.base_layer(x)
        if self._backend == "wgpu":  # the adapter's GPU work runs while the CPU computes the base
            return base_plus_lora(lambda: self.base_layer(x), self.lora_dropout(x).float(), self.lora_A,
                                  self.lora_B, self.scaling)
        result = self.base_layer(x)
        return result + self.delta(x).to(result.dtype)

    def _plain_linear_weight(self) -> torch.Tensor:
        if type(self.base_layer) is not nn.Linear:
            raise TypeError(f"merge()/unmerge() need a plain nn.Linear base layer; this one is "
                            f"{type(self.base_layer).__name__}, whose weights are quantised and "
                            "cannot absorb the adapter")
        return self.base_layer.weight

    @torch.no_grad()
    def merge(self) -> None:
        """Fold scaling·B·A into the base weight; forward then skips the adapter."""
        weight = self._plain_linear_weight()
        if self.merged:
            raise RuntimeError("adapter is already merged")
        weight += (self.scaling * self.lora_B @ self.lora_A).to(weight.dtype)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo ``merge()`` (up to float rounding)."""
        weight = self._plain_linear_weight()
        if not self.merged:
            raise RuntimeError("adapter is not merged")
        weight -= (self.scaling * self.lora_B @ self.lora_A).to(weight.dtype)
        self.merged = False

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
                f"lora_alpha={self.lora_alpha}, backend={self._backend!r}")
