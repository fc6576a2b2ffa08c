"""Shared by the integration tests: random adapter values and the logits of one fixed batch; tiny
BitNets written as GGUF files with ``gguf``'s own writer, under llama.cpp's tensor names and metadata
keys (``gguf``'s constants), and a Llama-3 style tokenizer; and processes that save into, and load
from, one PEFT folder at once.

The i2_s bytes are made here from bitnet.cpp's layout (microsoft/BitNet, src/ggml-bitnet-mad.cpp,
``quantize_i2_s`` on x86), not by the loader's code: blocks of 128 weights in 32 bytes, weight
32·g + p of a block in the bit pair at shift 6 − 2g of byte p, code value + 1, then the float32 scale
and 28 bytes of padding.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import BitNetForCausalLM, PreTrainedTokenizerFast

from torch_wgpu_lora import load_adapter, save_adapter
from torch_wgpu_lora.integrations import adapter_files
from torch_wgpu_lora.integrations.bitnet import add_lora_layers, load_bitnet, lora_modules
from torch_wgpu_lora.integrations.tiny import build_tiny_bitnet

# Rows of whole TQ blocks (256 weights) in every projection: q/k/v/gate/up read 256, o 256, down 512.
GGUF_SIZES = dict(hidden_size=256, intermediate_size=512)
I2_S = 36  # bitnet.cpp's ggml type id

PROJECTION_TENSORS = {
    "self_attn.q_proj": MODEL_TENSOR.ATTN_Q, "self_attn.k_proj": MODEL_TENSOR.ATTN_K,
    "self_attn.v_proj": MODEL_TENSOR.ATTN_V, "self_attn.o_proj": MODEL_TENSOR.ATTN_OUT,
    "mlp.gate_proj": MODEL_TENSOR.FFN_GATE, "mlp.up_proj": MODEL_TENSOR.FFN_UP, "mlp.down_proj": MODEL_TENSOR.FFN_DOWN,
}
NORM_TENSORS = {
    "input_layernorm": MODEL_TENSOR.ATTN_NORM, "post_attention_layernorm": MODEL_TENSOR.FFN_NORM,
    "self_attn.attn_sub_norm": MODEL_TENSOR.ATTN_SUB_NORM, "mlp.ffn_sub_norm": MODEL_TENSOR.FFN_SUB_NORM,
}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def tensor_name(kind: MODEL_TENSOR, layer: int | None = None, suffix: str = "weight") -> str:
    """llama.cpp's name of a tensor, e.g. ``blk.0.attn_q.weight``."""
    return f"{TENSOR_NAMES[kind].format(bid=layer)}.{suffix}"


def gguf_source(folder: Path, float_type: str = "F32", f16_scales: bool = False, seed: int = 0,
                **config: Any) -> torch.nn.Module:
    """A tiny packed (scale-multiplying) BitNet whose float tensors a GGUF of ``float_type`` holds
    exactly: embeddings (and LM head) rounded to that type, norms randomised (so that a norm read
    into the wrong place shows), scales rounded to f16 for TQ1_0 / TQ2_0 (whose block scale is f16)."""
    model = load_bitnet(build_tiny_bitnet(folder, flavour="packed-autobitlinear", seed=seed,
                                          **{**GGUF_SIZES, **config}))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(p.to(FLOAT_TYPES[float_type]).float())
        if f16_scales:
            for name, b in model.named_buffers():
                if name.endswith("weight_scale"):
                    b.copy_(b.half().float())
    return model.eval()


def i2s_bytes(values: torch.Tensor, scale: float) -> np.ndarray:
    """bitnet.cpp's i2_s bytes of ternary ``values`` [rows, cols] (cols a multiple of 128)."""
    codes = (values.to(torch.int64).reshape(-1, 4, 32) + 1).numpy().astype(np.uint8)  # [block, group, position]
    packed = (codes[:, 0] << 6) | (codes[:, 1] << 4) | (codes[:, 2] << 2) | codes[:, 3]
    tail = np.zeros(32, dtype=np.uint8)
    tail[:4] = np.frombuffer(np.float32(scale).tobytes(), dtype=np.uint8)
    return np.concatenate([packed.reshape(-1), tail])


def float_array(tensor: torch.Tensor, float_type: str) -> tuple[np.ndarray, Any]:
    """(array, raw ggml type or None) for ``gguf``'s writer."""
    if float_type == "BF16":
        return tensor.to(torch.bfloat16).view(torch.int16).numpy(), gguf.GGMLQuantizationType.BF16
    return tensor.to(FLOAT_TYPES[float_type]).numpy(), None


def ternary_array(values: torch.Tensor, scale: float, ternary_type: str) -> tuple[np.ndarray, Any]:
    """The bytes of a projection in ``ternary_type``: "i2_s", "TQ1_0", "TQ2_0", or "TQ2_0-unit"
    (TQ2_0 blocks with scale 1, the scale going into a separate ``.scale`` tensor)."""
    if ternary_type == "i2_s":
        return i2s_bytes(values, scale).view(np.int8), I2_S  # int8: gguf's writer leaves the shape alone
    qtype = gguf.GGMLQuantizationType[ternary_type.removesuffix("-unit")]
    weights = values.float() if ternary_type.endswith("-unit") else values.float() * scale
    return gguf.quants.quantize(weights.numpy(), qtype), qtype


def gguf_tensors(model: torch.nn.Module, ternary_type: str, float_type: str) -> dict[str, tuple[np.ndarray, Any, tuple]]:
    """name → (array, raw ggml type or None, torch shape) of every tensor of ``model``'s GGUF."""
    out = {}

    def put(name: str, array: np.ndarray, raw: Any, shape: tuple) -> None:
        out[name] = (array, raw, tuple(shape))

    embed = model.model.embed_tokens.weight.detach()
    put(tensor_name(MODEL_TENSOR.TOKEN_EMBD), *float_array(embed, float_type), embed.shape)
    put(tensor_name(MODEL_TENSOR.OUTPUT_NORM), model.model.norm.weight.detach().numpy(), None, model.model.norm.weight.shape)
    if not model.config.tie_word_embeddings:
        put(tensor_name(MODEL_TENSOR.OUTPUT), *float_array(model.lm_head.weight.detach(), float_type),
            model.lm_head.weight.shape)
    for i, layer in enumerate(model.model.layers):
        for module, kind in NORM_TENSORS.items():
            weight = layer.get_submodule(module).weight.detach()
            put(tensor_name(kind, i), weight.numpy(), None, weight.shape)
        for module, kind in PROJECTION_TENSORS.items():
            projection = layer.get_submodule(module)
            values, scale = projection.weight.detach(), float(projection.weight_scale)
            put(tensor_name(kind, i), *ternary_array(values, scale, ternary_type), values.shape)
            if ternary_type.endswith("-unit"):
                put(tensor_name(kind, i, "scale"), np.array([scale], dtype=np.float32), None, (1,))
    return out


def gguf_metadata(model: torch.nn.Module, arch: str) -> dict[str, Any]:
    """llama.cpp's metadata of ``model`` (``gguf.Keys``) under architecture ``arch``."""
    c, K = model.config, gguf.Keys.LLM
    meta = {
        K.CONTEXT_LENGTH: c.max_position_embeddings, K.EMBEDDING_LENGTH: c.hidden_size,
        K.BLOCK_COUNT: c.num_hidden_layers, K.FEED_FORWARD_LENGTH: c.intermediate_size,
        K.VOCAB_SIZE: c.vocab_size, gguf.Keys.Attention.HEAD_COUNT: c.num_attention_heads,
        gguf.Keys.Attention.HEAD_COUNT_KV: c.num_key_value_heads,
        gguf.Keys.Attention.LAYERNORM_RMS_EPS: float(c.rms_norm_eps),
        gguf.Keys.Rope.DIMENSION_COUNT: c.hidden_size // c.num_attention_heads,
        gguf.Keys.Rope.FREQ_BASE: float(c.rope_parameters["rope_theta"]),
        gguf.Keys.Rope.SCALING_TYPE: "linear", gguf.Keys.Rope.SCALING_FACTOR: 1.0,  # as convert_hf_to_gguf writes
    }
    meta = {key.format(arch=arch): value for key, value in meta.items()}
    if arch == "bitnet":
        meta[f"{arch}.hidden_activation"] = c.hidden_act  # llama.cpp's LLM_KV_HIDDEN_ACT
    meta.update({gguf.Keys.Tokenizer.BOS_ID: c.bos_token_id, gguf.Keys.Tokenizer.EOS_ID: c.eos_token_id,
                 gguf.Keys.Tokenizer.PAD_ID: c.pad_token_id})
    return meta


def write_gguf(path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, tuple]) -> Path:
    """A GGUF file written by ``gguf``'s writer: metadata values by Python type (int: u32, float: f32,
    str, list: array) or as the ``gguf.GGUFValue`` given (its type), tensors as ``gguf_tensors`` gives them."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in metadata.items():
        if key == gguf.Keys.General.ARCHITECTURE:
            continue  # the writer's own
        if isinstance(value, gguf.GGUFValue):
            writer.add_key_value(key, value.value, value.type, value.sub_type)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (array, raw, shape) in tensors.items():
        # gguf's writer derives the shape from the array, and from a uint8 array's bytes for a type it
        # knows; bytes of a type it does not know (i2_s) are given theirs
        raw_shape = shape if raw is not None and array.dtype != np.uint8 else None
        writer.add_tensor(name, array, raw_shape=raw_shape, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_model_gguf(path: Path, model: torch.nn.Module, ternary_type: str, float_type: str, arch: str,
                     tokenizer: PreTrainedTokenizerFast | None = None) -> Path:
    """``model`` as a GGUF of the given types and architecture, with ``tokenizer``'s metadata if given."""
    metadata = gguf_metadata(model, arch)
    if tokenizer is not None:
        metadata.update(tokenizer_metadata(tokenizer))
    return write_gguf(path, arch, metadata, gguf_tensors(model, ternary_type, float_type))


# -- a Llama-3 style tokenizer -------------------------------------------------------------------------

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|eot_id|>"]  # ids 0..3: TINY_CONFIG's bos, eos, pad
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eot_id|>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def llama3_tokenizer(texts: list[str], vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``texts`` with Llama-3's pre-tokenizer split, BOS added to every
    text, and a chat template (BitNet-2B-4T's tokenizer, in small)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single=f"{SPECIALS[0]} $A", special_tokens=[(SPECIALS[0], 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1],
                                   pad_token=SPECIALS[2], chat_template=CHAT_TEMPLATE)


def tokenizer_metadata(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    """The tokenizer.ggml.* metadata of a byte-level BPE tokenizer, as llama.cpp's converter writes it
    (``_set_vocab_gpt2``): tokens by id, control tokens marked, merges as "a b" strings."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    special = set(tokenizer.all_special_tokens) | set(SPECIALS)
    T = gguf.Keys.Tokenizer
    return {
        T.MODEL: "gpt2", T.PRE: "llama-bpe", T.LIST: tokens,
        T.TOKEN_TYPE: [int(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL) for t in tokens],
        T.MERGES: [m if isinstance(m, str) else " ".join(m) for m in model["merges"]],
        T.ADD_BOS: True, T.EOT_ID: tokens.index("<|eot_id|>"), T.CHAT_TEMPLATE: tokenizer.chat_template,
    }


# -- one PEFT folder saved and loaded by several processes at once ----------------------------------------

# Each save is one of these: (lora_alpha, the value of every lora_A and lora_B element).
SAVES = ((4.0, 1.0), (16.0, 2.0))


def adapter_of(checkpoint: str | Path, alpha: float, value: float) -> torch.nn.Module:
    """The checkpoint with r=4 Q/V adapters of ``lora_alpha=alpha`` whose every weight is ``value``."""
    model = add_lora_layers(BitNetForCausalLM.from_pretrained(checkpoint), r=4, lora_alpha=alpha, backend="torch")
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_A.fill_(value)
            m.lora_B.fill_(value)
    return model


def _without_locks() -> None:
    """As where folders cannot be locked: saves and loads take no lock (the readers' pairing check is left)."""
    adapter_files.locked_dir = lambda *args, **kwargs: contextlib.nullcontext()


# A race goes on until the savers have saved RACE_SAVES times and the loader has loaded RACE_LOADS
# whole saves, each side going on until both have: every counted load ran while saves went on, on any
# machine however slow. RACE_LIMIT seconds stop a race that cannot get there (the test then fails on
# the counts).
RACE_SAVES, RACE_LOADS, RACE_LIMIT = 20, 20, 120.0


def _racing(ready: multiprocessing.Event, go: multiprocessing.Event, saves: Any, loads: Any) -> Callable[[], bool]:
    """Say this process is ready and wait for the start; then whether the race goes on."""
    ready.set()
    go.wait(timeout=300)
    until = time.monotonic() + RACE_LIMIT
    return lambda: (saves.value < RACE_SAVES or loads.value < RACE_LOADS) and time.monotonic() < until


def save_in_turns(checkpoint: str, folder: str, locks: bool, ready, go, saves, loads, results) -> None:
    """Save SAVES[0], SAVES[1], SAVES[0], ... into ``folder`` while the race goes on, counting each
    save in ``saves``; put the number of saves."""
    if not locks:
        _without_locks()
    models = [adapter_of(checkpoint, alpha, value) for alpha, value in SAVES]
    going, done = _racing(ready, go, saves, loads), 0
    while going():
        save_adapter(models[done % 2], folder)
        done += 1
        with saves.get_lock():
            saves.value += 1
    results.put(("saves", done))


def load_in_turns(checkpoint: str, folder: str, locks: bool, ready, go, saves, loads, results) -> None:
    """Load ``folder`` again and again while the race goes on, counting whole loads in ``loads``; put
    what each load gave: a whole save, a mixed one, the refusal that says the folder was being
    written, or any other error."""
    if not locks:
        _without_locks()
    model = adapter_of(checkpoint, *SAVES[0])
    outcomes: dict[str, int] = {"whole": 0, "being written": 0}
    others: list[str] = []
    going = _racing(ready, go, saves, loads)
    while going():
        try:
            load_adapter(model, folder)
        except ValueError as err:
            if "was being written while it was read" not in str(err):
                others.append(f"ValueError: {err}")
            else:
                outcomes["being written"] += 1
            continue
        except Exception as err:  # reported to the test, which fails naming it
            others.append(f"{type(err).__name__}: {err}")
            continue
        modules = lora_modules(model).values()
        got = {(m.lora_alpha, m.scaling, *torch.unique(torch.cat([m.lora_A.flatten(), m.lora_B.flatten()])).tolist())
               for m in modules}
        whole = [{(alpha, alpha / 4, value)} for alpha, value in SAVES]
        if got in whole:
            outcomes["whole"] += 1
            loads.value += 1  # this process alone writes it
        else:
            others.append(f"mixed: {sorted(got)}")
    results.put(("loads", outcomes, others))


# -- random adapters and the logits of one batch ----------------------------------------------------

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
