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

Several adapters of one base layer (each a ``LoRALinear`` wrapping the same module) run together
as PEFT runs them: ``LoRASum`` adds their effects (PEFT's several active adapters), and
``PerRowLoRA`` gives each row of a batch its own adapter or none (PEFT's ``adapter_names``).
"""

from __future__ import annotations

from collections.abc import Sequence

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
                            f"{type(self.base_layer).__name__}, whose weights are quantised: W + scaling·B·A is "
                            "not ternary, so quantising it again would change what the layer computes")
        return self.base_layer.weight

    @torch.no_grad()
    def merge(self) -> None:
        """Fold scaling·B·A into the base weight; forward then skips the adapter. A merge that would
        leave non-finite values in the weight (a broken adapter) is refused before anything is written."""
        weight = self._plain_linear_weight()
        if self.merged:
            raise RuntimeError("adapter is already merged")
        merged = weight + (self.scaling * self.lora_B @ self.lora_A).to(weight.dtype)
        if not torch.isfinite(merged).all():
            raise ValueError(f"merging this adapter ({self.extra_repr()}) would put non-finite values into the base "
                             "weight: its lora_A / lora_B are broken (NaN, infinite or overflowing)")
        weight.copy_(merged)
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


def _shared_base(adapters: Sequence[LoRALinear]) -> nn.Module:
    """The one base layer every adapter in ``adapters`` wraps (ValueError if they wrap different ones)."""
    if not adapters or not all(isinstance(a, LoRALinear) for a in adapters):
        raise TypeError("expected one or more LoRALinear adapters")
    base = adapters[0].base_layer
    if any(a.base_layer is not base for a in adapters):
        raise ValueError("the adapters wrap different base layers; several adapters run together on one base layer")
    return base


class LoRASum(nn.Module):
    """Several adapters of one base layer active at once, as PEFT runs its several active adapters:
    output = base_layer(x) + the sum of each adapter's ``delta(x)`` (a disabled or merged adapter adds
    nothing). ``adapters``: name -> ``LoRALinear``, each wrapping the same base layer; ``names``
    keeps the names (``adapters``, a ModuleList, holds the modules in that order)."""

    def __init__(self, adapters: dict[str, LoRALinear]) -> None:
        super().__init__()
        base = _shared_base(list(adapters.values()))
        self.names = tuple(adapters)
        self.adapters = nn.ModuleList(adapters.values())
        self.in_features, self.out_features = base.in_features, base.out_features

    @property
    def base_layer(self) -> nn.Module:
        return self.adapters[0].base_layer

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight (what code that inspects ``proj.weight`` expects)."""
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        for adapter in self.adapters:
            if not (adapter.disabled or adapter.merged):
                result = result + adapter.delta(x).to(result.dtype)
        return result

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, adapters={list(self.names)}"


class PerRowLoRA(nn.Module):
    """A base layer whose batch rows each take their own adapter, as PEFT's ``adapter_names``
    mixed batches do: row i of the output is base_layer(x)[i] + ``rows[i].delta(x[i])``, or
    base_layer(x)[i] where ``rows[i]`` is None. The rows' adapters are used, not owned: they are
    not submodules (their Parameters stay where they belong). For inference: the adapters'
    dropout runs as their ``training`` flags say."""

    def __init__(self, base_layer: nn.Module, rows: Sequence[LoRALinear | None]) -> None:
        super().__init__()
        adapters = [a for a in rows if a is not None]
        if adapters and _shared_base(adapters) is not base_layer:
            raise ValueError("the rows' adapters wrap another base layer than the one given")
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self._groups: dict[int, tuple[LoRALinear, list[int]]] = {}
        for i, adapter in enumerate(rows):
            if adapter is not None:
                self._groups.setdefault(id(adapter), (adapter, []))[1].append(i)
        self._rows = len(rows)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[0] != self._rows:
            raise ValueError(f"this layer's adapters are given for a batch of {self._rows} rows (one adapter name a "
                             f"row), but its input has shape {list(x.shape)}")
        result = self.base_layer(x)
        for adapter, rows in self._groups.values():
            index = torch.tensor(rows, device=x.device)
            result = result.index_add(0, index, adapter.delta(x.index_select(0, index)).to(result.dtype))
        return result

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={self._rows}"
