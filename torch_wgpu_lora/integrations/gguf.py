"""BitNet models from GGUF files (llama.cpp's TQ1_0 and TQ2_0, bitnet.cpp's i2_s), their
tokenizers, and LoRA adapters written as GGUF for llama.cpp.

>>> # model = load_bitnet("ggml-model-i2_s.gguf")        # microsoft/bitnet-b1.58-2B-4T-gguf
>>> # tokenizer = load_gguf_tokenizer("ggml-model-i2_s.gguf")
>>> # save_adapter(model, "adapter.gguf", format="gguf")  # llama-cli -m ggml-model-i2_s.gguf --lora adapter.gguf

GGUF files are read with ``gguf``, llama.cpp's own reader and writer (``pip install
'torch_wgpu_lora[gguf]'``). Everything in a file is checked before the model is built: a
truncated file, another architecture, an unknown tensor type, a tensor whose shape the metadata
does not give it, a missing or extra tensor, a float tensor holding a NaN or an infinity, and every
metadata value read that is stored as the wrong type (a count or an id as a float, say), out of its
range or unlike the tensors are refused with an error naming the file and what is wrong (for a
metadata value: the key and the value; ``integrations.gguf_metadata``).

**Architectures.** ``general.architecture`` is llama.cpp's ``bitnet`` or bitnet.cpp's
``bitnet-b1.58`` (microsoft/bitnet-b1.58-2B-4T-gguf) or ``bitnet-25``; the model's metadata keys
carry it as their prefix (``A.`` below).

**The model** is transformers' ``BitNetForCausalLM`` in the packed flavour whose scale multiplies
(``quantization_config``: ``linear_class "autobitlinear"``, ``quantization_mode "offline"``, as
microsoft/bitnet-b1.58-2B-4T): each projection holds the file's ternary values and one scale,
weight = scale · value, exactly (the scale as float32; a bfloat16 model keeps ``weight_scale`` in
bfloat16, as transformers does). Its config comes from the metadata:

* ``hidden_size`` = ``A.embedding_length`` (the embedding's columns), ``num_hidden_layers`` =
  ``A.block_count`` (the layers whose tensors the file holds, ``blk.0`` on), ``intermediate_size`` =
  ``A.feed_forward_length``, ``num_attention_heads`` = ``A.attention.head_count``,
  ``num_key_value_heads`` = ``A.attention.head_count_kv`` (default: the heads; dividing them, and
  they the hidden size into heads of an even size), ``max_position_embeddings`` =
  ``A.context_length`` (at most 2^24: RoPE's float32 angles hold whole positions exactly up to
  there), ``rms_norm_eps`` = ``A.attention.layer_norm_rms_epsilon`` (above 0, below 1), RoPE theta =
  ``A.rope.freq_base`` (default 10000, llama.cpp's; finite, above 1); counts stored as integers;
* ``vocab_size``: the rows of ``token_embd`` (``A.vocab_size``, and the tokenizer's
  ``tokenizer.ggml.tokens``, if given, must agree, as llama.cpp requires);
* ``hidden_act``: what the reference program computes for the architecture: ``relu2`` for
  bitnet.cpp's ``bitnet-b1.58`` and ``bitnet-25``, ``silu`` for llama.cpp's ``bitnet`` (its graph,
  src/models/bitnet.cpp, gates the FFN with SiLU and reads no activation key). A ``bitnet`` file
  whose ``A.hidden_activation`` names another activation is refused: llama.cpp would run it as SiLU;
* ``bos_token_id``, ``pad_token_id``: ``tokenizer.ggml.bos_token_id``, ``...padding_token_id``;
  ``eos_token_id``: ``tokenizer.ggml.eos_token_id``, with ``...eot_token_id`` when that differs
  (llama.cpp ends generation at both); each, where given, an integer in [0, vocab) (llama.cpp
  ignores one outside with a warning; here it is refused: leave the key out instead);
* ``tie_word_embeddings``: whether ``output.weight`` is absent;
* ``A.rope.dimension_count``, ``A.attention.key_length`` and ``...value_length`` must equal the
  head size, and RoPE scaling must be none (or linear by 1, what llama.cpp's converter writes).

``model.config.gguf_architecture`` keeps the file's architecture, for the adapters saved from it.

**Tensors** (GGUF name → transformers name, layer ``i``; ggml lists dimensions innermost first,
so ggml [in, out] is torch [out, in]):

* ``token_embd.weight`` → ``model.embed_tokens.weight``; ``output_norm.weight`` →
  ``model.norm.weight``; ``output.weight`` → ``lm_head.weight`` (absent when tied);
* ``blk.i.attn_norm`` → ``input_layernorm``, ``blk.i.ffn_norm`` → ``post_attention_layernorm``,
  ``blk.i.attn_sub_norm`` → ``self_attn.attn_sub_norm``, ``blk.i.ffn_sub_norm`` →
  ``mlp.ffn_sub_norm``: F32, F16 or BF16, like the embedding and the LM head;
* ``blk.i.attn_q`` / ``attn_k`` / ``attn_v`` / ``attn_output`` → ``self_attn.q_proj`` / ``k_proj`` /
  ``v_proj`` / ``o_proj``, ``blk.i.ffn_gate`` / ``ffn_up`` / ``ffn_down`` → ``mlp.gate_proj`` /
  ``up_proj`` / ``down_proj``: ternary (below), in transformers' row order: llama.cpp runs its BitNet
  architectures with NeoX RoPE (``rotate_half``, as transformers), so its converters do not permute
  Q and K (llama.cpp: conversion/bitnet.py; microsoft/BitNet: utils/convert-ms-to-gguf-bitnet.py);
* ``blk.i.<projection>.scale`` (optional, one float): llama.cpp multiplies that projection's output
  by it (src/models/bitnet.cpp), so it multiplies the projection's scale here. Those of ``ffn_gate``
  and ``ffn_up`` are kept as ``model.config.gguf_gate_up_scales`` (module name → scale), for the
  adapters saved from the model (below).

**Ternary types.** A BitNet projection has one scale per tensor.

* TQ2_0 (ggml type 35) and TQ1_0 (34), llama.cpp's: blocks of 256 weights along a row, each ending
  with its f16 scale d (66 and 54 bytes); weight = d · value. ``gguf``'s own numpy decoder reads the
  values (TQ2_0: 2-bit codes, value + 1; TQ1_0: base-3 digits). llama.cpp's quantiser sets each
  block's d to its largest |weight|, which for a BitNet is the tensor's scale; so every block that
  holds a nonzero weight must carry the same d (a block with d = 0 holds zeros). A TQ2_0 code 3
  (value 2) is not ternary and is refused.
* I2_S (bitnet.cpp's ggml type 36, which ``gguf`` does not know), read here from its layout. A
  tensor of n = rows · cols weights (cols, the row length, a multiple of 128) takes n/4 + 32 bytes:

  - bytes [0, n/4): 2-bit codes in blocks of 128 consecutive weights of the row-major tensor, 32
    bytes a block: weight j = 32·g + p of block b (group g = 0..3, position p = 0..31) is the
    bit pair at shift 6 − 2g of byte 32·b + p (group 0 in the high bits);
  - code 0 → −1, 1 → 0, 2 → +1 (3 is never written and is refused);
  - bytes [n/4, n/4 + 4): the scale, float32, weight = scale · value (bitnet.cpp's quantiser
    writes max |weight|, and its matmul multiplies its integer dot product by it); 28 bytes of
    padding follow.

  Source: microsoft/BitNet, src/ggml-bitnet-mad.cpp (``quantize_i2_s``, the x86 build: QK_I2_S =
  128, with include/gemm-config.h's default ACT_PARALLEL) and utils/convert-hf-to-gguf-bitnet.py
  (``quantize_to_i2_s``, the same layout in numpy); the size and the scale's place from its
  llama.cpp fork (Eddie-Wang1120/llama.cpp, ggml/src/ggml.c: ``ggml_nbytes``, and the matmul reading
  the scale at byte ne00·ne01/4). bitnet.cpp's ARM build quantises with QK_I2_S = 64 (16-byte
  blocks) under the same type id; nothing in a file tells the two apart, and such a file reads
  as wrong weights here (bitnet.cpp on x86 reads it wrongly too).

**Adapters** (``save_gguf_adapter``, through ``save_adapter(..., format="gguf")``): a GGUF that
llama.cpp loads with ``--lora``, as its convert_lora_to_gguf.py writes one: ``general.type``
``adapter``, ``general.architecture`` the base model's, ``adapter.type`` ``lora``,
``adapter.lora.alpha``, and for each adapted projection ``<tensor>.weight.lora_a`` = lora_A
[r, in] and ``<tensor>.weight.lora_b`` = lora_B [out, r] as F32 (``blk.3.attn_q.weight.lora_a``).
What llama.cpp computes with it (src/llama-graph.cpp, ``build_lora_mm`` and ``build_ffn``;
src/llama-adapter.h, ``get_scale``), and what is written so that it computes our adapters:

* it scales each adapter by alpha / r, r the rank of that tensor pair: ``adapter.lora.alpha`` is
  ``llama_cpp_alpha``, lora_alpha (lora_alpha · √r under rsLoRA, whose scale is lora_alpha / √r;
  the float32 nearest it, so llama.cpp's factor is ours to float32 rounding). It is one value for
  the file, so adapters needing different ones (different lora_alpha, or rsLoRA at different
  ranks) are refused;
* for q/k/v/o/down it multiplies the base product by the projection's ``.scale`` tensor before
  adding the adapter's term, as we do; for gate and up (``build_ffn``) it adds the term first and
  multiplies the sum by ``ffn_gate_s`` / ``ffn_up_s``. So for a model loaded from a file with those
  tensors (``gguf_gate_up_scales``), gate and up adapters are written with lora_B divided by that
  scale (float32), which llama.cpp's multiplication undoes. Serve such an adapter with that
  base file; a scale of 0 leaves no adapter llama.cpp can apply, and is refused.
"""

from __future__ import annotations

import functools
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..files import write_atomic
from ..modules import LoRALinear
from .gguf_metadata import Metadata, check_tokenizer

ARCHITECTURES = ("bitnet", "bitnet-b1.58", "bitnet-25")
RELU2_ARCHITECTURES = ("bitnet-b1.58", "bitnet-25")  # bitnet.cpp's: squared-ReLU FFN
DEFAULT_ADAPTER_ARCHITECTURE = "bitnet"  # llama.cpp's, for models not loaded from a GGUF

GGUF_PROJECTIONS = {  # GGUF tensor (blk.i.<name>.weight) → transformers module in layer i
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_LAYER_NORMS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_sub_norm": "self_attn.attn_sub_norm", "ffn_sub_norm": "mlp.ffn_sub_norm",
}

# ggml type ids
F32, F16, BF16, TQ1_0, TQ2_0, I2_S = 0, 1, 30, 34, 35, 36
FLOAT_TYPES = {F32: "F32", F16: "F16", BF16: "BF16"}
TERNARY_TYPES = {TQ1_0: "TQ1_0", TQ2_0: "TQ2_0", I2_S: "i2_s"}
TQ_BLOCK = 256  # weights per TQ1_0 / TQ2_0 block
TQ_BLOCK_BYTES = {TQ1_0: 54, TQ2_0: 66}  # ending with the block's f16 scale
I2S_BLOCK = 128  # weights per i2_s block (bitnet.cpp's x86 QK_I2_S)
I2S_TAIL = 32  # bytes after the codes: the float32 scale and padding
_F16_ONE = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)

_ADAPTED_MODULE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")
# positions: RoPE's angles are float32 position × frequency (transformers and the engine), exact for
# whole positions up to 2^24
MAX_CONTEXT = 2 ** 24


def is_gguf_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file: its name ends in ``.gguf``.

    >>> is_gguf_path("ggml-model-i2_s.gguf"), is_gguf_path("bitnet-bf16")
    (True, False)
    """
    return Path(path).suffix.lower() == ".gguf"


def _gguf() -> Any:
    """The ``gguf`` package, or an ImportError saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise ImportError("reading and writing GGUF files needs the gguf package: "
                          "pip install 'torch_wgpu_lora[gguf]'") from None
    return gguf


@functools.cache
def _table_reader() -> type:
    class TableReader(_gguf().GGUFReader):
        """``gguf``'s reader, keeping the tensor table as the file states it, as ``table``:
        (name, torch shape, ggml type id, absolute byte offset). ``gguf`` builds tensor views of
        upstream ggml's types only, and i2_s is bitnet.cpp's."""

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            self.table = [(str(bytes(name), encoding="utf-8"), tuple(int(d) for d in reversed(dims.tolist())),
                           int(dtype[0]), start_offs + int(offset[0]))
                          for _, name, _, dims, dtype, offset in (field.parts for field in fields)]

    return TableReader


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: int
    start: int  # absolute byte offset in the file
    nbytes: int


def _type_name(ggml_type: int) -> str:
    names = {**FLOAT_TYPES, **TERNARY_TYPES}
    if ggml_type in names:
        return names[ggml_type]
    try:
        return _gguf().GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def _nbytes(tensor_shape: tuple[int, ...], ggml_type: int) -> int | None:
    """The bytes a tensor of the types read here takes (None for other types)."""
    count = math.prod(tensor_shape)
    if ggml_type in FLOAT_TYPES:
        return count * (4 if ggml_type == F32 else 2)
    if ggml_type in TQ_BLOCK_BYTES:
        return count // TQ_BLOCK * TQ_BLOCK_BYTES[ggml_type]
    if ggml_type == I2_S:
        return count // 4 + I2S_TAIL
    return None


class _File:
    """A GGUF file's metadata and tensor table, checked: a BitNet architecture, the host's byte
    order, every tensor of a known size inside the file, no name twice."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"GGUF file {str(self.path)!r} does not exist")
        if not self.path.is_file():
            raise ValueError(f"{str(self.path)!r} is not a file; a .gguf path names one GGUF file")
        try:
            reader = _table_reader()(self.path)
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as err:
            raise ValueError(f"{self.path} is not a readable GGUF file ({err}): truncated, damaged, or "
                             "not GGUF") from None
        if reader.byte_order != "I":
            raise ValueError(f"{self.path} is a GGUF of the other byte order (big-endian); convert it on a "
                             "little-endian machine")
        self.meta = Metadata(self.path, {name: field for name, field in reader.fields.items()
                                         if not name.startswith("GGUF.")})
        self.data = reader.data
        kind = self.meta.string("general.type", "what the file holds", "model")
        if kind != "model":
            raise ValueError(f"{self.path} is a GGUF {kind} (general.type), not a model")
        self.architecture = self.meta.string("general.architecture", "the model's architecture")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"{self.path} holds a {self.architecture!r} model (general.architecture); "
                             f"torch_wgpu_lora loads BitNet GGUF files: {', '.join(ARCHITECTURES)}")
        self.tensors: dict[str, _Tensor] = {}
        for name, shape, ggml_type, start in reader.table:
            if name in self.tensors:
                raise ValueError(f"{self.path} holds tensor {name} twice")
            nbytes = _nbytes(shape, ggml_type)
            if nbytes is not None and start + nbytes > len(self.data):
                raise ValueError(f"{self.path} is truncated: tensor {name} needs bytes {start}..{start + nbytes} "
                                 f"but the file ends at byte {len(self.data)}; download or convert it again")
            self.tensors[name] = _Tensor(name, shape, ggml_type, start, nbytes or 0)

    def vocabulary(self) -> int:
        """The rows of ``token_embd.weight`` (the vocabulary), after checking that ``A.vocab_size`` and
        the tokenizer's tokens, where given, are as many."""
        embedding = self.tensors.get("token_embd.weight")
        if embedding is None or len(embedding.shape) != 2:
            raise ValueError(f"{self.path} has no token_embd.weight matrix: not a complete model file")
        vocab = embedding.shape[0]
        key = f"{self.architecture}.vocab_size"
        size = self.meta.integer(key, "the vocabulary size", least=1, default=vocab)
        if size != vocab:
            raise self.meta.refuse(key, size, f"token_embd.weight has {vocab} rows")
        tokens = (self.meta.length("tokenizer.ggml.tokens", "the vocabulary") if "tokenizer.ggml.tokens" in self.meta
                  else vocab)
        if tokens != vocab:
            raise ValueError(f"{self.path}: tokenizer.ggml.tokens holds {tokens} tokens, but token_embd.weight has "
                             f"{vocab} rows (one a token); the tokenizer is not this model's")
        return vocab

    def raw(self, tensor: _Tensor) -> np.ndarray:
        return self.data[tensor.start:tensor.start + tensor.nbytes]


# -- the config -------------------------------------------------------------------------------------

def _config(file: _File) -> Any:
    """The BitNetConfig the file's metadata and tensor table describe, every value read checked for
    its type, its range and its agreement with the tensors before anything is built."""
    from transformers import BitNetConfig

    arch, meta = file.architecture, file.meta
    vocab = file.vocabulary()
    key = f"{arch}.embedding_length"
    hidden = meta.integer(key, "the hidden size", least=1)
    if file.tensors["token_embd.weight"].shape[1] != hidden:
        raise meta.refuse(key, hidden, f"token_embd.weight has rows of {file.tensors['token_embd.weight'].shape[1]}")
    key = f"{arch}.block_count"
    layers = meta.integer(key, "the number of layers", least=1)
    present = _layers_present(file)
    if layers != present:  # checked before any loop over the layers: a count no tensors back is refused
        raise meta.refuse(key, layers, f"the file's tensors are those of {present} layers (blk.0 to "
                                       f"blk.{present - 1})" if present else "the file holds no layer tensors")
    heads = meta.integer(f"{arch}.attention.head_count", "the attention heads", least=1, most=hidden)
    kv_heads = meta.integer(f"{arch}.attention.head_count_kv", "the key/value heads", least=1, most=heads,
                            default=heads)
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"{file.path}: {arch}.embedding_length {hidden}, {arch}.attention.head_count {heads} "
                         f"and head_count_kv {kv_heads} do not divide into whole heads")
    head_dim = hidden // heads
    if head_dim % 2:
        raise ValueError(f"{file.path}: heads of embedding_length / head_count = {hidden} / {heads} = {head_dim} "
                         "dimensions; RoPE rotates pairs of dimensions, so a head's size is even")
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        size = meta.integer(f"{arch}.{key}", "the head size", least=1, default=head_dim)
        if size != head_dim:
            raise ValueError(f"{file.path}: {arch}.{key} is {size}, but transformers' BitNet rotates and attends "
                             f"over whole heads of embedding_length / head_count = {head_dim}")
    scaling = meta.string(f"{arch}.rope.scaling.type", "the RoPE scaling", "none")
    factor = meta.real(f"{arch}.rope.scaling.factor", "the RoPE scaling factor", 1.0)
    if scaling not in ("none", "linear") or factor != 1.0:
        raise ValueError(f"{file.path}: RoPE scaling {scaling!r} by {factor} ({arch}.rope.scaling.*) is not "
                         "supported; transformers' BitNet uses plain RoPE")
    key = f"{arch}.rope.freq_base"
    theta = meta.real(key, "the RoPE base", 10000.0)
    if theta <= 1.0:  # each pair of dimensions turns at base^(-2i/d) of the first's rate: slower, for a base above 1
        raise meta.refuse(key, theta, "the RoPE base must be above 1")
    key = f"{arch}.attention.layer_norm_rms_epsilon"
    eps = meta.real(key, "the RMSNorm epsilon")
    if not 0.0 < eps < 1.0:  # a guard against dividing by a zero mean square, not a term of its size
        raise meta.refuse(key, eps, "the RMSNorm epsilon must be above 0 and below 1")
    key = f"{arch}.feed_forward_length"
    intermediate = meta.integer(key, "the FFN size", least=1)
    up = file.tensors.get("blk.0.ffn_up.weight")
    if up is not None and up.shape[:1] != (intermediate,):
        raise meta.refuse(key, intermediate, f"blk.0.ffn_up.weight is {list(up.shape)}")
    key = f"{arch}.attention.head_count_kv"
    k_proj = file.tensors.get("blk.0.attn_k.weight")
    if k_proj is not None and k_proj.shape[:1] != (kv_heads * head_dim,):
        raise meta.refuse(key, kv_heads, f"blk.0.attn_k.weight is {list(k_proj.shape)}, the keys of "
                                         f"{k_proj.shape[0] / head_dim:g} heads of {head_dim}")
    context = meta.integer(f"{arch}.context_length", "the context length", least=1, most=MAX_CONTEXT)
    if arch in RELU2_ARCHITECTURES:
        activation = "relu2"
    else:
        # llama.cpp's bitnet graph (src/models/bitnet.cpp) gates its FFN with SiLU whatever this key says;
        # a file claiming another activation would give other logits there than here
        key = f"{arch}.hidden_activation"
        activation = meta.string(key, "the FFN activation", "silu")
        if activation != "silu":
            raise meta.refuse(key, activation, f"llama.cpp computes the {arch} architecture's FFN with SiLU and "
                                               "ignores this key, so the file would mean another model there; a "
                                               "squared-ReLU BitNet (bitnet-b1.58-2B-4T) is bitnet.cpp's "
                                               f"{' or '.join(RELU2_ARCHITECTURES)} (general.architecture)")
    ids = {kind: meta.token_id(f"tokenizer.ggml.{kind}_token_id", vocab) for kind in ("bos", "eos", "eot", "padding")}
    eos_ids = [i for i in dict.fromkeys((ids["eos"], ids["eot"])) if i is not None]
    return BitNetConfig(
        vocab_size=vocab, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        num_hidden_layers=layers, intermediate_size=intermediate, max_position_embeddings=context, rms_norm_eps=eps,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        hidden_act=activation, tie_word_embeddings="output.weight" not in file.tensors,
        bos_token_id=ids["bos"], pad_token_id=ids["padding"],
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        quantization_config={"quant_method": "bitnet", "linear_class": "autobitlinear",
                             "quantization_mode": "offline"},
        gguf_architecture=arch,
    )


def _layers_present(file: _File) -> int:
    """The layers the tensor table holds, numbered 0 to n - 1 (``blk.i.*``); n."""
    indices = sorted({int(match[1]) for match in map(_LAYER_TENSOR.match, file.tensors) if match})
    if indices != list(range(len(indices))):
        gap = next(i for i, index in enumerate(indices) if i != index)
        raise ValueError(f"{file.path} holds tensors of layer blk.{indices[gap]} but none of blk.{gap}: its layers "
                         "are not numbered from 0 without gaps")
    return len(indices)


# -- tensors ---------------------------------------------------------------------------------------

def _expected_shapes(config: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor a file of ``config`` holds: GGUF name → (torch shape, 'float' or 'ternary')."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"token_embd.weight": ((config.vocab_size, hidden), "float"), "output_norm.weight": ((hidden,), "float")}
    if not config.tie_word_embeddings:
        shapes["output.weight"] = ((config.vocab_size, hidden), "float")
    projection_shapes = {"attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
                         "attn_output": (hidden, q), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
                         "ffn_down": (hidden, inter)}
    norm_sizes = {"attn_norm": hidden, "ffn_norm": hidden, "attn_sub_norm": hidden, "ffn_sub_norm": inter}
    for i in range(config.num_hidden_layers):
        for name, size in norm_sizes.items():
            shapes[f"blk.{i}.{name}.weight"] = ((size,), "float")
        for name, shape in projection_shapes.items():
            shapes[f"blk.{i}.{name}.weight"] = (shape, "ternary")
    return shapes


def _check_tensors(file: _File, config: Any) -> None:
    """Refuse a tensor table that does not hold exactly the tensors ``config`` describes, in the
    shapes and types read here (optional per-projection scales aside)."""
    expected = _expected_shapes(config)
    scales = {f"{name[:-len('weight')]}scale" for name, (_, kind) in expected.items() if kind == "ternary"}
    missing = [name for name in expected if name not in file.tensors]
    if missing:
        raise ValueError(f"{file.path} lacks tensors its metadata describes, e.g. {missing[0]} ({len(missing)} "
                         f"missing); is the file complete, and from a {config.num_hidden_layers}-layer model?")
    extra = [name for name in file.tensors if name not in expected and name not in scales]
    if extra:
        raise ValueError(f"{file.path} holds tensors a BitNet does not have, e.g. {extra[0]} ({len(extra)} extra); "
                         "torch_wgpu_lora cannot reproduce what they do")
    arch = file.architecture
    for name, tensor in file.tensors.items():
        shape, kind = expected.get(name, ((1,), "scale"))
        if tensor.shape != shape:
            raise ValueError(f"{file.path}: {name} is {list(tensor.shape)}, but the metadata ({arch}.embedding_length, "
                             f"feed_forward_length, attention.head_count(_kv), block_count) gives it {list(shape)}")
        allowed = TERNARY_TYPES if kind == "ternary" else {F32: "F32"} if kind == "scale" else FLOAT_TYPES
        if tensor.ggml_type not in allowed:
            hint = (" (a float projection: quantise the file to TQ1_0 or TQ2_0 with llama-quantize)"
                    if kind == "ternary" and tensor.ggml_type in FLOAT_TYPES else "")
            raise ValueError(f"{file.path}: {name} is stored as {_type_name(tensor.ggml_type)}; torch_wgpu_lora reads "
                             f"it from {', '.join(allowed.values())}{hint}")
        if kind == "ternary":
            block = I2S_BLOCK if tensor.ggml_type == I2_S else TQ_BLOCK
            if shape[1] % block:
                raise ValueError(f"{file.path}: {name} has rows of {shape[1]} weights, not a multiple of "
                                 f"{_type_name(tensor.ggml_type)}'s {block}")


def _float_tensor(file: _File, tensor: _Tensor, dtype: torch.dtype) -> torch.Tensor:
    raw = np.array(file.raw(tensor))  # a copy out of the memory map
    if tensor.ggml_type == BF16:
        values = torch.from_numpy(raw.view("<i2")).view(torch.bfloat16)
    else:
        values = torch.from_numpy(raw.view("<f4" if tensor.ggml_type == F32 else "<f2"))
    finite = torch.isfinite(values)
    if not finite.all():
        at = int((~finite).nonzero()[0])
        raise ValueError(f"{file.path}: {tensor.name} holds {values[at].item()} at element {at}, not a finite number")
    return values.reshape(tensor.shape).to(dtype)


def _i2s_ternary(file: _File, tensor: _Tensor) -> tuple[np.ndarray, float]:
    rows, cols = tensor.shape
    count = rows * cols
    raw = file.raw(tensor)
    blocks = raw[:count // 4].reshape(-1, 1, I2S_BLOCK // 4)  # [block, ·, position]
    codes = (blocks >> np.array([6, 4, 2, 0], dtype=np.uint8).reshape(1, 4, 1)) & 3  # [block, group, position]
    if (codes == 3).any():
        raise ValueError(f"{file.path}: {tensor.name} holds the i2_s code 3, which no ternary value has: the file "
                         "is damaged, or not in bitnet.cpp's i2_s layout")
    scale = float(raw[count // 4:count // 4 + 4].view("<f4")[0])
    return codes.reshape(rows, cols).astype(np.int8) - 1, scale


def _tq_ternary(file: _File, tensor: _Tensor) -> tuple[np.ndarray, float]:
    gguf = _gguf()
    rows, cols = tensor.shape
    blocks = np.array(file.raw(tensor)).reshape(-1, TQ_BLOCK_BYTES[tensor.ggml_type])
    scales = blocks[:, -2:].copy().view("<f2").reshape(-1).astype(np.float32)
    blocks[:, -2:] = _F16_ONE  # with d = 1, gguf's decoder yields the values themselves
    values = gguf.quants.dequantize(blocks.reshape(rows, -1), gguf.GGMLQuantizationType(tensor.ggml_type))
    if not np.isin(values, (-1.0, 0.0, 1.0)).all():
        raise ValueError(f"{file.path}: {tensor.name} holds values outside -1, 0, 1 (a TQ2_0 code 3): the file is "
                         "damaged or not a ternary model")
    values = values.reshape(-1, TQ_BLOCK)
    values[scales == 0] = 0  # weight = d · value: such a block holds zeros whatever its codes
    live = scales[(values != 0).any(axis=1)]
    if not np.isfinite(live).all():
        raise ValueError(f"{file.path}: {tensor.name} has a block scale that is not a finite number")
    distinct = np.unique(live)
    if distinct.size > 1:
        raise ValueError(f"{file.path}: {tensor.name}'s {_type_name(tensor.ggml_type)} blocks carry {distinct.size} "
                         f"different scales (e.g. {distinct[0]:.6g} and {distinct[-1]:.6g}); a BitNet projection has "
                         "one scale per tensor, so this is not a BitNet's ternary weight")
    scale = float(distinct[0]) if distinct.size else 1.0  # all zeros: any scale gives the same weight
    return values.reshape(rows, cols).astype(np.int8), scale


def _ternary(file: _File, name: str) -> tuple[torch.Tensor, float]:
    """A projection's ternary values (int8 [out, in]) and its scale (weight = scale · value),
    times the optional ``.scale`` tensor llama.cpp multiplies the output by."""
    tensor = file.tensors[name]
    values, scale = (_i2s_ternary if tensor.ggml_type == I2_S else _tq_ternary)(file, tensor)
    extra = file.tensors.get(f"{name[:-len('weight')]}scale")
    if extra is not None:
        scale = float(np.float32(scale) * np.array(file.raw(extra)).view("<f4")[0])
    if not math.isfinite(scale):
        raise ValueError(f"{file.path}: {name}'s scale is {scale}, not a finite number")
    return torch.from_numpy(values), scale


def _state_dict(file: _File, config: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """transformers' state dict of the packed-autobitlinear flavour: packed 2-bit weights
    [out / 4, in] (as microsoft/bitnet-b1.58-2B-4T stores them) and their scales."""
    from transformers.integrations.bitnet import pack_weights

    renames = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
    state = {}
    for name, (_, kind) in _expected_shapes(config).items():
        if name in renames:
            state[renames[name]] = _float_tensor(file, file.tensors[name], dtype)
            continue
        _, layer, tensor_name, _ = name.split(".")
        prefix = f"model.layers.{layer}."
        if kind == "float":
            state[f"{prefix}{GGUF_LAYER_NORMS[tensor_name]}.weight"] = _float_tensor(file, file.tensors[name], dtype)
        else:
            values, scale = _ternary(file, name)
            module = prefix + GGUF_PROJECTIONS[tensor_name]
            state[f"{module}.weight"] = pack_weights(values)
            state[f"{module}.weight_scale"] = torch.tensor([scale], dtype=torch.float32)
    return state


def _gate_up_scales(file: _File, config: Any) -> dict[str, float]:
    """The ``.scale`` tensors of the gate and up projections, by module name: llama.cpp multiplies
    their adapters' terms by them too (``save_gguf_adapter`` undoes that)."""
    scales = {}
    for i in range(config.num_hidden_layers):
        for tensor_name in ("ffn_gate", "ffn_up"):
            extra = file.tensors.get(f"blk.{i}.{tensor_name}.scale")
            if extra is not None:
                scales[f"model.layers.{i}.{GGUF_PROJECTIONS[tensor_name]}"] = float(
                    np.array(file.raw(extra)).view("<f4")[0])
    return scales


# -- public API ------------------------------------------------------------------------------------

def load_gguf_bitnet(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A ``BitNetForCausalLM`` read from the GGUF file ``path`` (the module docstring says which).

    Every check runs before the model is built; ``load_bitnet`` calls this for a ``.gguf`` path.

    >>> # model = load_gguf_bitnet("ggml-model-i2_s.gguf")
    """
    from transformers import BitNetForCausalLM

    file = _File(path)
    config = _config(file)
    _check_tensors(file, config)
    state = _state_dict(file, config, dtype)
    model, info = BitNetForCausalLM.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                                    output_loading_info=True)
    unfilled = sorted(info["missing_keys"]) + sorted(info["unexpected_keys"]) + sorted(info["mismatched_keys"])
    if unfilled:  # transformers decides where the state dict lands; never leave a tensor at its random init
        raise RuntimeError(f"{file.path}: transformers did not load {unfilled[:4]} from the file's tensors")
    model.config.name_or_path = str(file.path)
    model.config.gguf_gate_up_scales = _gate_up_scales(file, config)
    return model


def load_gguf_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer a GGUF file describes (vocabulary, merges, special tokens, chat template), built by
    transformers' own GGUF tokenizer conversion (``PreTrainedTokenizerFast(gguf_file=...)``).

    A file without a tokenizer, a malformed one (``gguf_metadata.check_tokenizer``: tokens, scores, types,
    merges, special token ids, flags, chat templates), one whose tokens are not the embedding's rows, or
    one transformers cannot convert raises ValueError naming the file and what is wrong.
    transformers 5.18 or later builds them for any architecture (earlier, only for those it loads itself).

    >>> # tokenizer = load_gguf_tokenizer("ggml-model-i2_s.gguf")
    """
    import transformers
    from transformers import PreTrainedTokenizerFast

    file = _File(path)
    if "tokenizer.ggml.tokens" not in file.meta:
        raise ValueError(f"{file.path} holds no tokenizer (no tokenizer.ggml.tokens in its metadata); load the "
                         "tokenizer of the model it was made from, e.g. AutoTokenizer.from_pretrained(folder)")
    check_tokenizer(file.meta)
    file.vocabulary()
    try:
        # The file itself, not its folder: from_pretrained(folder, gguf_file=...) would take a tokenizer.json
        # lying beside it instead.
        return PreTrainedTokenizerFast(gguf_file=file.path.name, name_or_path=str(file.path.parent))
    except Exception as err:  # tokenizers' own errors are plain Exceptions
        raise ValueError(f"{file.path}: transformers {transformers.__version__} cannot build a tokenizer from its "
                         f"metadata: {err}") from None


def gguf_tensor_name(module: str) -> str:
    """The GGUF tensor (llama.cpp's name) of a BitNet projection module.

    >>> gguf_tensor_name("model.layers.3.self_attn.q_proj")
    'blk.3.attn_q.weight'
    """
    match = _ADAPTED_MODULE.match(module)
    names = {module_name: tensor for tensor, module_name in GGUF_PROJECTIONS.items()}
    if match is None or match[2] not in names:
        raise ValueError(f"llama.cpp's BitNet has no tensor for {module!r}; GGUF adapters cover the decoder layers' "
                         f"projections ({', '.join(GGUF_PROJECTIONS.values())})")
    return f"blk.{match[1]}.{names[match[2]]}.weight"


def llama_cpp_alpha(module: LoRALinear) -> float:
    """The ``adapter.lora.alpha`` under which llama.cpp, scaling by alpha / r, scales ``module``'s
    adapter as it runs here: lora_alpha, or lora_alpha · √r under rsLoRA (scale lora_alpha / √r).

    >>> from torch import nn
    >>> llama_cpp_alpha(LoRALinear(nn.Linear(8, 8), r=4, lora_alpha=3, use_rslora=True))
    6.0
    """
    return module.lora_alpha * math.sqrt(module.r) if module.use_rslora else module.lora_alpha


def save_gguf_adapter(model: nn.Module, modules: dict[str, LoRALinear], path: str | os.PathLike,
                      alpha: float) -> Path:
    """Write ``modules`` (the model's LoRA adapters, by module name) to ``path`` atomically as a
    llama.cpp LoRA GGUF with ``adapter.lora.alpha`` = ``alpha`` as float32, which must be every
    module's ``llama_cpp_alpha`` (the module docstring says what is written, and why).
    ``general.architecture`` is the base model's: ``model.config.gguf_architecture`` when it was
    loaded from a GGUF, else llama.cpp's ``bitnet``. ``save_adapter(model, path, format="gguf")``
    checks that the adapters share that alpha and calls this.

    >>> # save_gguf_adapter(model, lora_modules(model), "adapter.gguf", alpha=16.0)
    """
    gguf = _gguf()
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; format='gguf' writes one file")
    for name, module in modules.items():
        if float(np.float32(module.lora_alpha)) != module.lora_alpha:
            raise ValueError(f"{name}: lora_alpha={module.lora_alpha!r} is not exactly a float32, in which "
                             "llama.cpp computes its adapter's scale; use a value float32 holds exactly (e.g. an "
                             "integer)")
    names = {name: gguf_tensor_name(name) for name in modules}  # every name checked before anything is written
    architecture = getattr(model.config, "gguf_architecture", DEFAULT_ADAPTER_ARCHITECTURE)
    lora_b = {name: _llama_cpp_lora_b(model, name, module) for name, module in modules.items()}
    with tempfile.TemporaryDirectory() as scratch:
        # gguf writes files, not bytes: build it in scratch space, then replace the target atomically.
        scratch_file = Path(scratch) / "adapter.gguf"
        writer = gguf.GGUFWriter(scratch_file, architecture)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        for module, name in names.items():
            writer.add_tensor(f"{name}.lora_a", modules[module].lora_A.detach().float().numpy())
            writer.add_tensor(f"{name}.lora_b", lora_b[module])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return write_atomic(path, scratch_file.read_bytes())


def _llama_cpp_lora_b(model: nn.Module, name: str, module: LoRALinear) -> np.ndarray:
    """lora_B of ``module`` as written for llama.cpp (float32): divided by the base file's ``.scale``
    of a gate or up projection, which llama.cpp multiplies the adapter's term by (``build_ffn``)."""
    lora_b = module.lora_B.detach().float()
    scale = getattr(model.config, "gguf_gate_up_scales", {}).get(name)
    if scale is None:
        return lora_b.numpy()
    if scale == 0:
        raise ValueError(f"{name}: the base GGUF's .scale of this projection is 0, and llama.cpp multiplies the "
                         "adapter's term by it (build_ffn), so no adapter there can have an effect in llama.cpp; "
                         "leave this module out of the adapter")
    with np.errstate(over="ignore"):
        written = lora_b.numpy() / np.float32(scale)  # one float32 division per element
    if not np.isfinite(written).all():
        raise ValueError(f"{name}: lora_B divided by the base GGUF's .scale {scale:g} of this projection (which "
                         "llama.cpp multiplies the adapter's term by) overflows float32")
    return written
