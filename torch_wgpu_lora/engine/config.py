"""What the engine needs to know about a transformers ``BitNetForCausalLM``, checked once.

>>> # cfg = EngineConfig.from_model(model)   # raises ValueError naming what it cannot run
>>> # cfg.hidden, cfg.layers, cfg.flavour
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from ..integrations.bitnet import PROJECTIONS, base_layer, projection

FLAVOURS = ("dense", "online", "packed", "packed-autobitlinear")
# What the engine's refusals offer instead: the model without the engine, by the options that choose it.
WITHOUT_ENGINE = ("run the transformers model itself, without the engine (an engine's is engine.model; train, "
                  "Trainer and the TRL trainers' SFTTrainer take engine='torch', the CLI's commands --engine torch)")


def pad(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and flavour of a BitNet model, as the engine's kernels use them."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    rms_eps: float
    tied: bool
    flavour: str
    projection_norm_eps: float | None  # BitLinear's own RMSNorm before quantisation (use_rms_norm), else None
    dtype: torch.dtype  # of the embedding and float weights

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def quantised(self) -> bool:
        return self.flavour != "dense"

    @classmethod
    def from_model(cls, model: nn.Module) -> "EngineConfig":
        """Read and check ``model`` (a ``BitNetForCausalLM``, adapters applied or not)."""
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) != "bitnet" or not hasattr(model, "model"):
            name = type(model).__name__
            kind = getattr(config, "model_type", None)
            raise ValueError(f"BitNetEngine runs transformers' BitNetForCausalLM; got a {name}"
                             f"{f' (model_type {kind!r})' if kind else ''}")
        if config.hidden_act != "relu2":
            raise ValueError(f"BitNetEngine implements the relu2 FFN; this model's hidden_act is {config.hidden_act!r}")
        if getattr(config, "attention_bias", False):
            raise ValueError("BitNetEngine runs projections without bias; this model has attention_bias=True")
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type in ("dynamic", "longrope"):  # their frequencies depend on the sequence length
            raise ValueError(f"BitNetEngine precomputes RoPE tables; rope_type {rope_type!r} changes with the "
                             "sequence length and is not supported")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({config.num_key_value_heads})")
        if head_dim % 4:  # RoPE pairs halves; the attention kernels load vec4s
            raise ValueError(f"BitNetEngine needs head_dim to be a multiple of 4, got {head_dim}")
        flavour, norm_eps = _flavour(model)
        layers = model.model.layers
        if len(layers) < config.num_hidden_layers:
            raise ValueError(f"the model has {len(layers)} decoder layers, its config says {config.num_hidden_layers}")
        embed = model.model.embed_tokens.weight
        return cls(
            hidden=config.hidden_size, intermediate=config.intermediate_size, layers=config.num_hidden_layers,
            heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=head_dim,
            vocab=config.vocab_size, max_positions=config.max_position_embeddings, rms_eps=float(config.rms_norm_eps),
            tied=model.lm_head.weight is embed if hasattr(model, "lm_head") else True, flavour=flavour,
            projection_norm_eps=norm_eps, dtype=embed.dtype,
        )


def _flavour(model: nn.Module) -> tuple[str, float | None]:
    """The checkpoint flavour shared by every projection, and BitLinear's own norm eps if any."""
    bitnet = sys.modules.get("transformers.integrations.bitnet")
    found = set()
    eps = set()
    for layer in model.model.layers:
        for name in PROJECTIONS:
            base = base_layer(projection(layer, name))
            kind = type(base).__name__
            if bitnet is not None and isinstance(base, bitnet.BitLinear):
                found.add("packed")
            elif bitnet is not None and isinstance(base, bitnet.AutoBitLinear):
                found.add("online" if base.online_quant else "packed-autobitlinear")
            elif type(base) is nn.Linear:
                found.add("dense")
            else:
                raise ValueError(f"BitNetEngine cannot run a {kind} projection ({name})")
            if getattr(base, "bias", None) is not None:
                raise ValueError(f"BitNetEngine runs projections without bias; {name} has one")
            norm = getattr(base, "rms_norm", None)
            eps.add(None if norm is None else float(norm.variance_epsilon))
    if len(found) != 1:
        raise ValueError(f"the model mixes projection flavours {sorted(found)}; BitNetEngine needs one")
    if len(eps) != 1:
        raise ValueError("some projections have their own RMSNorm and some do not; BitNetEngine needs one rule")
    return found.pop(), eps.pop()
