"""Tiny BitNet checkpoints and tokenizers, built offline in the real file formats.

Nothing can be downloaded at run time, so tests and the demo make their own models:
random weights in transformers' ``BitNetForCausalLM``, written with
``save_pretrained`` (config.json + model.safetensors) and read back with
``from_pretrained`` like any checkpoint.

Flavours (``FLAVOURS``):

* ``dense``: no ``quantization_config``; projections are ``nn.Linear``.
* ``online``: ``{"quant_method": "bitnet", "linear_class": "autobitlinear",
  "quantization_mode": "online"}`` (as microsoft/bitnet-b1.58-2B-4T-bf16): full-precision
  weights, ternarised on the fly by ``AutoBitLinear``.
* ``packed``: ``linear_class "bitlinear"``, ``quantization_mode "offline"``: uint8
  weights [out/4, in] (four 2-bit codes per byte, code slot i of byte row r is output
  row i*out/4 + r, value+1) and ``weight_scale``, which ``BitLinear`` divides by.
* ``packed-autobitlinear``: the same packing with ``linear_class "autobitlinear"``
  (as microsoft/bitnet-b1.58-2B-4T); ``AutoBitLinear`` unpacks on load and multiplies
  by ``weight_scale``, so the stored scale is the reciprocal of ``packed``'s.

>>> import tempfile
>>> path = build_tiny_bitnet(tempfile.mkdtemp(), flavour="dense")
>>> (path / "config.json").is_file()
True
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import torch

from ..files import write_atomic

FLAVOURS = ("dense", "online", "packed", "packed-autobitlinear")

_QUANT = {
    "online": {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"},
    "packed": {"quant_method": "bitnet", "linear_class": "bitlinear", "quantization_mode": "offline"},
    "packed-autobitlinear": {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "offline"},
}

TINY_CONFIG = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    bos_token_id=0, eos_token_id=1, pad_token_id=2, rms_norm_eps=1e-5,
)


def tiny_config(**overrides: Any) -> Any:
    """A small BitNetConfig with GQA (4 heads, 2 KV heads) and tied embeddings."""
    from transformers import BitNetConfig

    return BitNetConfig(**{**TINY_CONFIG, **overrides})


def ternarize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BitNet b1.58's absmean rule: (values in {-1, 0, 1}, scale) with weight ≈ values / scale."""
    scale = 1.0 / weight.abs().mean().clamp(min=1e-5)
    return (weight * scale).round().clamp(-1, 1), scale


def _packed_state_dict(state: dict[str, torch.Tensor], flavour: str) -> dict[str, torch.Tensor]:
    from transformers.integrations.bitnet import pack_weights

    out = {}
    for key, value in state.items():
        if ".layers." in key and key.endswith("_proj.weight"):
            values, scale = ternarize(value.float())
            out[key] = pack_weights(values.clone())
            stored = scale if flavour == "packed" else 1.0 / scale
            out[key[: -len("weight")] + "weight_scale"] = stored.reshape(1).to(value.dtype)
        else:
            out[key] = value
    return out


def build_tiny_bitnet(path: str | os.PathLike, flavour: str = "dense", seed: int = 0, **config: Any) -> Path:
    """Write a randomly initialised BitNetForCausalLM checkpoint of ``flavour`` to ``path``."""
    from safetensors.torch import save as safetensors_bytes
    from transformers import BitNetForCausalLM

    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(**config)
    torch.manual_seed(seed)
    model = BitNetForCausalLM(cfg).float()
    state = {k: v for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if flavour in ("packed", "packed-autobitlinear"):
        state = _packed_state_dict(state, flavour)
    if flavour != "dense":
        cfg.quantization_config = dict(_QUANT[flavour])
    cfg.save_pretrained(path)
    write_atomic(path / "model.safetensors",
                 safetensors_bytes({k: v.contiguous() for k, v in state.items()}, metadata={"format": "pt"}))
    return path


SPECIAL_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"}
# A chat template in microsoft/bitnet-b1.58-2B-4T's format ("Role: content" turns, each ended by the end
# token; "Assistant: " prompts a reply), with transformers' generation markers around the assistant's part.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ 'Assistant: ' }}{% generation %}"
    "{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['role'] | capitalize + ': ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)


def build_tiny_tokenizer(path: str | os.PathLike, texts: Iterable[str], vocab_size: int = 320,
                         chat_template: str | None = None) -> Path:
    """Train a byte-level BPE tokenizer on ``texts`` and save it for ``AutoTokenizer``, with
    ``chat_template`` (e.g. ``CHAT_TEMPLATE``) if given.

    Special tokens take ids 0, 1, 2 (bos, eos, pad), matching ``TINY_CONFIG``.
    Deterministic for the same texts.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return path

