"""A BitNet model's frozen weights on the GPU, uploaded once, in the layouts the kernels read.

Ternary projections stay packed: 2 bits a weight, sixteen to a u32, in an interleaved order
that lets one shift and mask yield four int8 lanes for ``dot4I8Packed``:

    weight k of a row (k < K, K padded to a multiple of 64) lives in word k // 16, byte lane
    (k % 16) % 4, bit pair (k % 16) // 4, as the code t + 1 ∈ {0, 1, 2}

so ``(word >> 2j) & 0x03030303`` holds the codes of k = 16u + 4j + 0..3: the four int8
activations of activation word 4u + j. Σ x·(t+1) − Σ x = Σ x·t, exact integer arithmetic.

Each flavour keeps its own arithmetic (``bitlinear.wgsl`` applies it per output row):

* ``packed`` (``BitLinear``): y = dot / (weight_scale · s_x)           — divides by its scale
* ``packed-autobitlinear``:   y = dot / s_x · weight_scale             — multiplies by it
* ``online`` (``AutoBitLinear`` ternarising on the fly): the absmean rule of transformers'
  ``WeightQuant`` applied once here (the base is frozen), then y = dot / (scale · s_x)
* ``dense`` (``nn.Linear``): float weights, float matmul (``matmul.wgsl``)

The projections reading the same input are fused: q, k, v into one matrix (rows in that
order) and gate, up into one with their rows interleaved (gate j, up j), so one launch
computes both and its epilogue forms relu(gate)²·up.

>>> values = torch.tensor([[1, 0, -1] * 6], dtype=torch.int8)[:, :16]
>>> torch.equal(unpack_ternary(pack_ternary(values), 16), values)
True
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..runtime import Arena, Buffer, Device, write
from ..integrations.bitnet import base_layer, projection
from .config import EngineConfig, pad

K_ALIGN = 64  # every row along K (weights, activations, codes) is padded with zeros to whole 64-wide tiles


def pack_ternary(values: torch.Tensor) -> np.ndarray:
    """Ternary values [rows, K] (int8 in {-1, 0, 1}) → u32 [rows, pad(K, 64) / 16] in the
    interleaved layout above (padding weights are 0)."""
    rows, k = values.shape
    codes = torch.ones(rows, pad(k, K_ALIGN), dtype=torch.uint8)  # code 1 is the value 0
    codes[:, :k] = (values.to(torch.int16) + 1).to(torch.uint8)
    codes = codes.reshape(rows, -1, 4, 4)  # [row, word, bit pair (k16 // 4), byte lane (k16 % 4)]
    lanes = codes[:, :, 0] | (codes[:, :, 1] << 2) | (codes[:, :, 2] << 4) | (codes[:, :, 3] << 6)
    return lanes.contiguous().numpy().view(np.uint32).reshape(rows, -1)  # four byte lanes, little-endian


def unpack_ternary(packed: np.ndarray, k: int) -> torch.Tensor:
    """The inverse of ``pack_ternary``: int8 values [rows, k]."""
    packed = np.asarray(packed, np.uint32)
    shifts = (8 * np.arange(4)[None, None, None, :] + 2 * np.arange(4)[None, None, :, None]).astype(np.uint32)
    codes = (packed[:, :, None, None] >> shifts) & 3
    return torch.from_numpy(codes.reshape(packed.shape[0], -1)[:, :k].astype(np.int8) - 1)


def unpack_hf(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """transformers' packed ``BitLinear`` weight (uint8 [out/4, in]; code slot i of byte row r is
    output row i·out/4 + r, stored as value + 1) → int8 values [out, in]."""
    slots = [((packed.to(torch.int16) >> (2 * i)) & 3) - 1 for i in range(4)]
    return torch.cat(slots, dim=0)[:out_features].to(torch.int8)


@dataclass(frozen=True)
class Ternary:
    """One projection's ternary weights and the factor its flavour applies to ``dot / s_x``."""

    values: torch.Tensor  # int8 [out, in]
    scale: float
    divide: bool  # y = dot / (scale · s_x) when True, else dot / s_x · scale


def ternary(module: nn.Module) -> Ternary:
    """The ternary form of a quantised projection (any of the three quantised flavours)."""
    bitnet = sys.modules["transformers.integrations.bitnet"]
    base = base_layer(module)
    if isinstance(base, bitnet.BitLinear):
        return Ternary(unpack_hf(base.weight, base.out_features), float(base.weight_scale.float()), True)
    if base.online_quant:  # transformers' WeightQuant, op for op, once
        weight = base.weight.detach().float()
        scale = 1.0 / weight.abs().mean().clamp_(min=1e-5)
        return Ternary((weight * scale).round().clamp(-1, 1).to(torch.int8), float(scale), True)
    values = base.weight.detach()
    if not torch.equal(values.abs().clamp(max=1), values.abs()) or not torch.equal(values, values.round()):
        raise ValueError("an offline AutoBitLinear holds weights outside {-1, 0, 1}: not a packed checkpoint")
    return Ternary(values.to(torch.int8), float(base.weight_scale.float()), False)


def float_rows(tensor: torch.Tensor, bf16: bool) -> np.ndarray:
    """Float weights [rows, K] for ``matmul.wgsl``, K padded to a multiple of 64: float32, or, for
    bfloat16 models, the raw bf16 bits two to a u32 (exact, half the bytes)."""
    rows, k = tensor.shape
    if bf16:
        bits = torch.zeros(rows, pad(k, K_ALIGN), dtype=torch.bfloat16)
        bits[:, :k] = tensor.detach()
        return bits.view(torch.int16).numpy().view(np.uint32)
    out = np.zeros((rows, pad(k, K_ALIGN)), np.float32)
    out[:, :k] = tensor.detach().float().numpy()
    return out


@dataclass
class Projection:
    """A (possibly fused) projection on the GPU: ``weight`` rows × K, per-row ``scale`` (ternary)."""

    weight: Buffer
    scale: Buffer | None
    rows: int
    k: int
    divide: bool = True


@dataclass
class LayerWeights:
    input_norm: Buffer
    post_norm: Buffer
    attn_sub_norm: Buffer
    ffn_sub_norm: Buffer
    qkv: Projection
    o: Projection
    gate_up: Projection  # rows interleaved: gate j at 2j, up j at 2j + 1
    down: Projection
    projection_norms: dict[str, Buffer]  # BitLinear's own RMSNorm weights (use_rms_norm), by projection name


@dataclass
class EngineWeights:
    """Every frozen weight of the model on the GPU, in one arena."""

    config: EngineConfig
    arena: Arena
    embedding: list[Buffer]  # vocabulary chunks [rows, H]: each fits one storage binding
    embedding_rows: list[int]
    head: list[Buffer]  # the LM head's chunks (the embedding's when tied)
    head_rows: list[int]
    final_norm: Buffer
    layers: list[LayerWeights]
    rope_cos: Buffer  # [max_positions, head_dim / 2]: HF's own cos/sin values
    rope_sin: Buffer
    bf16: bool  # float weights stored as bf16 pairs

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes


def _upload(arena: Arena, array: np.ndarray, dtype: str = "f32") -> Buffer:
    array = np.ascontiguousarray(array)
    buf = arena.alloc(array.shape, dtype)
    write(buf, array)
    return buf


def _norm(arena: Arena, module: nn.Module) -> Buffer:
    return _upload(arena, module.weight.detach().float().numpy())


def _ternary_projection(arena: Arena, parts: list[Ternary], interleave: bool = False) -> Projection:
    if interleave:  # gate, up → rows gate0, up0, gate1, up1, ...
        values = torch.stack([parts[0].values, parts[1].values], dim=1).reshape(-1, parts[0].values.shape[1])
        scales = np.repeat([[parts[0].scale, parts[1].scale]], parts[0].values.shape[0], axis=0).reshape(-1)
    else:
        values = torch.cat([p.values for p in parts])
        scales = np.concatenate([np.full(p.values.shape[0], p.scale) for p in parts])
    if len({p.divide for p in parts}) != 1:
        raise ValueError("fused projections must share their flavour")
    return Projection(_upload(arena, pack_ternary(values), "u32"), _upload(arena, scales.astype(np.float32)),
                      values.shape[0], values.shape[1], parts[0].divide)


def _float_projection(arena: Arena, weights: list[torch.Tensor], bf16: bool, interleave: bool = False) -> Projection:
    if interleave:
        weight = torch.stack(weights, dim=1).reshape(-1, weights[0].shape[1])
    else:
        weight = torch.cat(weights)
    return Projection(_upload(arena, float_rows(weight, bf16), "u32" if bf16 else "f32"), None, weight.shape[0],
                      weight.shape[1])


def _chunks(arena: Arena, weight: torch.Tensor, bf16: bool, device: Device) -> tuple[list[Buffer], list[int]]:
    """A [rows, K] float matrix as row chunks that each fit one storage binding."""
    rows, k = weight.shape
    row_bytes = pad(k, K_ALIGN) * (2 if bf16 else 4)
    per_chunk = max(1, min(rows, device.max_binding // row_bytes))
    buffers, sizes = [], []
    for start in range(0, rows, per_chunk):
        part = weight[start:start + per_chunk]
        buffers.append(_upload(arena, float_rows(part, bf16), "u32" if bf16 else "f32"))
        sizes.append(part.shape[0])
    return buffers, sizes


@torch.no_grad()
def upload_weights(model: nn.Module, config: EngineConfig, device: Device) -> EngineWeights:
    """Read every frozen weight of ``model`` and upload it once."""
    bf16 = config.dtype == torch.bfloat16
    arena = Arena(device)
    embed = model.model.embed_tokens.weight
    embedding, embedding_rows = _chunks(arena, embed, bf16, device)
    if config.tied:
        head, head_rows = embedding, embedding_rows
    else:
        head, head_rows = _chunks(arena, model.lm_head.weight, bf16, device)
    layers = []
    for layer in model.model.layers[: config.layers]:
        attn, mlp = layer.self_attn, layer.mlp
        if config.quantised:
            qkv = _ternary_projection(arena, [ternary(projection(layer, n)) for n in ("q_proj", "k_proj", "v_proj")])
            o = _ternary_projection(arena, [ternary(attn.o_proj)])
            gate_up = _ternary_projection(arena, [ternary(mlp.gate_proj), ternary(mlp.up_proj)], interleave=True)
            down = _ternary_projection(arena, [ternary(mlp.down_proj)])
        else:
            def w(module: nn.Module) -> torch.Tensor:
                return base_layer(module).weight

            qkv = _float_projection(arena, [w(attn.q_proj), w(attn.k_proj), w(attn.v_proj)], bf16)
            o = _float_projection(arena, [w(attn.o_proj)], bf16)
            gate_up = _float_projection(arena, [w(mlp.gate_proj), w(mlp.up_proj)], bf16, interleave=True)
            down = _float_projection(arena, [w(mlp.down_proj)], bf16)
        norms = {}
        if config.projection_norm_eps is not None:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
                norms[name] = _norm(arena, base_layer(projection(layer, name)).rms_norm)
        layers.append(LayerWeights(_norm(arena, layer.input_layernorm), _norm(arena, layer.post_attention_layernorm),
                                   _norm(arena, attn.attn_sub_norm), _norm(arena, mlp.ffn_sub_norm),
                                   qkv, o, gate_up, down, norms))
    positions = torch.arange(config.max_positions)[None]
    probe = torch.zeros(1, dtype=torch.float32)
    cos, sin = model.model.rotary_emb(probe, positions)  # HF's own table: bit-identical angles
    half = config.head_dim // 2
    return EngineWeights(config, arena, embedding, embedding_rows, head, head_rows, _norm(arena, model.model.norm),
                         layers, _upload(arena, cos[0, :, :half].float().numpy()),
                         _upload(arena, sin[0, :, :half].float().numpy()), bf16)
