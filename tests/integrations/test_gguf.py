"""Models from GGUF files: each tensor type (bitnet.cpp's i2_s, llama.cpp's TQ1_0 and TQ2_0, F32 / F16 /
BF16 float tensors), written by ``gguf``'s writer from tiny random BitNets, loads back as the same
model (codes, scales, float tensors, logits on the torch path and the engine, greedy generation,
training); the file's tokenizer round-trips; adapters go out as llama.cpp LoRA GGUFs with PEFT's
tensors; bad files (tensors, and every metadata value read: its stored type, its range, its agreement
with the tensors) and malformed tokenizers are refused by name before any model or tokenizer is built.

The GGUF model and its source are the same transformers modules holding the same values, so their
torch logits, generations and training steps are compared bitwise: the same computation, not two
different ones. The engine is held to transformers fed its int8 codes, as in tests/engine/test_model.py.
"""

from __future__ import annotations

import copy
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import MODEL_TENSOR
from safetensors.torch import load_file

from torch_wgpu_lora import BitNetEngine
from torch_wgpu_lora.generation import generate
from torch_wgpu_lora.integrations.adapter_files import save_adapter
from torch_wgpu_lora.integrations.bitnet import add_lora_layers, load_bitnet, load_model_and_tokenizer, lora_parameters
from torch_wgpu_lora.integrations.gguf import load_gguf_tokenizer
from torch_wgpu_lora.integrations.quantisation import FLIP_SHARE, FeedStats, feeding_codes
from torch_wgpu_lora.integrations.tiny import build_tiny_tokenizer

from ..engine.helpers import forward_with_codes
from .helpers import (CHAT_TEMPLATE, I2_S, PROJECTION_TENSORS, gguf_metadata, gguf_source, gguf_tensors,
                      llama3_tokenizer, tensor_name, tokenizer_metadata, write_gguf, write_model_gguf)

TEXTS = ["Name a primary colour. Red is one!", "Hello world, this is a tokenizer test.",
         "numbers 12345 and 678 go here", "Über naïve café: ünïcödé text."] * 8
LOGIT_RTOL = 1e-4  # as tests/engine/test_model.py: float32 sums in other orders, ~1e-6 of the scale

# (ternary type, float type, architecture, config): every type at least once; the published 2B-4T
# file is i2_s with an F16 embedding under bitnet-b1.58. llama.cpp's bitnet is SiLU-gated (bitnet.cpp's
# two architectures ReLU²), so its cases are SiLU models, which the engine (ReLU² only) does not run.
CASES = {
    "i2_s-F16-bitnet-b1.58": ("i2_s", "F16", "bitnet-b1.58", {}),
    "TQ1_0-F32-bitnet-untied": ("TQ1_0", "F32", "bitnet", dict(tie_word_embeddings=False, hidden_act="silu")),
    "TQ2_0-BF16-bitnet-25": ("TQ2_0", "BF16", "bitnet-25", {}),
    "TQ2_0-with-scale-tensors": ("TQ2_0-unit", "F32", "bitnet", dict(hidden_act="silu")),
}
ENGINE_CASES = [name for name, (_, _, arch, _) in CASES.items() if arch != "bitnet"]


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return llama3_tokenizer(TEXTS)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, tokenizer) -> dict:
    """The source model, its GGUF file (with the tokenizer) and the model loaded from it."""
    ternary, float_type, arch, config = CASES[request.param]
    root = tmp_path_factory.mktemp("gguf")
    source = gguf_source(root / "source", float_type, f16_scales=ternary in ("TQ1_0", "TQ2_0"), **config)
    path = write_model_gguf(root / "model.gguf", source, ternary, float_type, arch, tokenizer)
    return {"source": source, "path": path, "model": load_bitnet(path), "arch": arch}


def ids_and_mask(vocab: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=g)
    mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def torch_logits(model, ids, mask):
    with torch.compiler.set_stance("force_eager"), torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


# -- loading each tensor type ----------------------------------------------------------------------------

def test_codes_scales_and_float_tensors_equal_the_source(case):
    source, model = case["source"], case["model"]
    assert type(model).__name__ == "BitNetForCausalLM"
    ours, theirs = model.state_dict(), source.state_dict()
    assert set(ours) == set(theirs)
    differing = [key for key in theirs if not torch.equal(ours[key], theirs[key])]
    assert not differing, differing[:4]
    q = model.model.layers[0].self_attn.q_proj  # packed, scale-multiplying flavour, unpacked on load
    assert type(q).__name__ == "AutoBitLinear" and not q.online_quant
    assert set(q.weight.unique().tolist()) == {-1.0, 0.0, 1.0}
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                  "hidden_act", "bos_token_id", "pad_token_id", "rope_parameters"):
        assert getattr(model.config, field) == getattr(source.config, field), field
    assert model.config.eos_token_id == [source.config.eos_token_id, 3]  # eos, and the file's eot
    assert model.config.gguf_architecture == case["arch"]
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == \
        source.config.tie_word_embeddings


def test_torch_logits_equal_the_source(case):
    ids, mask = ids_and_mask(case["source"].config.vocab_size, [14, 9])
    assert torch.equal(torch_logits(case["model"], ids, mask), torch_logits(case["source"], ids, mask))


@pytest.mark.parametrize("case", ENGINE_CASES, indirect=True)
def test_engine_logits_match_transformers_fed_the_engines_codes(case):
    model = case["model"]
    ids, mask = ids_and_mask(model.config.vocab_size, [12, 7])
    logits, codes = forward_with_codes(BitNetEngine(model), ids, mask.sum(1).tolist())
    stats = FeedStats()
    with feeding_codes(model, codes, stats):
        ref = torch_logits(model, ids, mask)
    layers = model.config.num_hidden_layers
    assert len(stats.sites) == 4 * layers and stats.calls == 7 * layers  # every quantisation point fed
    assert stats.nonzero > stats.codes // 2
    assert stats.flips <= FLIP_SHARE * stats.codes, f"{stats.flips} flips in {stats.codes} codes"
    err, scale = (logits - ref).abs().max().item(), ref.abs().max().item()
    assert err <= LOGIT_RTOL * scale, f"max |logit error| {err:.3g} vs largest |logit| {scale:.3g}"


def test_greedy_generation_matches_the_source(case, tokenizer):
    engine = [BitNetEngine] if case["arch"] != "bitnet" else []
    for runner in (lambda m: m, *engine):  # transformers' modules, then the engine (ReLU² models)
        ours, theirs = (generate(runner(m), tokenizer, "Name a primary colour.", max_new_tokens=10,
                                 return_ids=True) for m in (case["model"], case["source"]))
        assert ours.token_ids == theirs.token_ids and ours.prompt_ids == theirs.prompt_ids
        assert len(ours.token_ids) > 0


def test_a_training_step_matches_the_source(case, tmp_path):
    ids, mask = ids_and_mask(case["source"].config.vocab_size, [10, 6], seed=3)
    trained = []
    for model in (case["model"], case["source"]):
        model = add_lora_layers(copy.deepcopy(model), r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down_proj"),
                           init="hesper")
        optimizer = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
        for _ in range(2):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        trained.append(model)
    ours, theirs = (torch.cat([p.detach().flatten() for p in lora_parameters(m)]) for m in trained)
    assert torch.equal(ours, theirs) and ours.abs().sum() > 0
    # and the adapter trained on the GGUF model saves and loads like any other
    save_adapter(trained[0], tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


# -- the tokenizer ---------------------------------------------------------------------------------------

STRINGS = ["Hello world!", "  spaced   out\n\nlines\twith tabs", "Red is 12345 <|eot_id|> x", "ünïcödé café",
           "<|begin_of_text|>already there", ""]


@pytest.mark.parametrize("case", ["i2_s-F16-bitnet-b1.58"], indirect=True)  # the tensor types do not matter here
def test_tokenizer_round_trips_against_the_one_the_file_was_made_from(case, tokenizer):
    # Another tokenizer lying beside the file must not be picked up instead of the file's own.
    build_tiny_tokenizer(case["path"].parent, ["entirely different words"] * 4)
    ours = load_gguf_tokenizer(case["path"])
    for text in STRINGS:
        ids = tokenizer(text).input_ids
        assert ours(text).input_ids == ids, text
        assert ours.decode(ids) == tokenizer.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (tokenizer.bos_token, tokenizer.eos_token,
                                                                tokenizer.pad_token)
    assert ours.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Red."}]
    assert ours.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(messages, tokenize=False)
    model, with_model = load_model_and_tokenizer(case["path"])
    assert with_model("Hello world!").input_ids == tokenizer("Hello world!").input_ids
    assert model.config.gguf_architecture == "bitnet-b1.58"


def test_a_file_without_a_tokenizer_loads_and_says_so_when_one_is_needed(tmp_path):
    source = gguf_source(tmp_path / "source", hidden_act="silu")
    path = write_model_gguf(tmp_path / "model.gguf", source, "TQ2_0-unit", "F32", "bitnet")
    model = load_bitnet(path)
    assert torch.equal(model.model.embed_tokens.weight, source.model.embed_tokens.weight)
    message = r"holds no tokenizer \(no tokenizer.ggml.tokens in its metadata\)"
    with pytest.raises(ValueError, match=message):
        load_gguf_tokenizer(path)
    with pytest.raises(ValueError, match=message):
        load_model_and_tokenizer(path)


def test_a_tokenizer_transformers_cannot_build_is_named(tmp_path, tokenizer):
    source = gguf_source(tmp_path / "source")
    metadata = {**gguf_metadata(source, "bitnet"), **tokenizer_metadata(tokenizer),
                gguf.Keys.Tokenizer.MODEL: "bert"}  # WordPiece: no GGUF conversion in transformers
    path = write_gguf(tmp_path / "m.gguf", "bitnet", metadata, gguf_tensors(source, "TQ2_0-unit", "F32"))
    with pytest.raises(ValueError, match=r"m.gguf: transformers \S+ cannot build a tokenizer from its metadata: "
                                         ".*'bert'"):
        load_gguf_tokenizer(path)


T = "tokenizer.ggml."
A = gguf.GGUFValueType
# (the change to a good tokenizer's metadata, the refusal)
BAD_TOKENIZERS = {
    "tokens as integers": ({f"{T}tokens": list(range(320))},
                           r"tokenizer.ggml.tokens \(the vocabulary\) is stored as an array of int32; it must be an "
                           "array of strings"),
    "tokens as one string": ({f"{T}tokens": "abc"}, r"tokenizer.ggml.tokens is 'abc'; the vocabulary must be stored "
                                                    "as an array of strings, not as string"),
    "a merge of three parts": ({f"{T}merges": ["a b c"]},
                               r"tokenizer.ggml.merges\[0\] is 'a b c'; a merge is two tokens joined by one space"),
    "a merge of a token the vocabulary lacks": (
        {f"{T}merges": ["\u2603 \u2603"]},
        r"tokenizer.ggml.merges\[0\] is '\u2603 \u2603', but '\u2603' is not one of tokenizer.ggml.tokens"),
    "merges as integers": ({f"{T}merges": [1, 2]}, r"tokenizer.ggml.merges \(the BPE merges\) is stored as an "
                                                   "array of int32"),
    "scores of another length": ({f"{T}scores": [0.0] * 5}, "tokenizer.ggml.scores holds 5 scores for 320 tokens"),
    "a score that is not a number": ({f"{T}scores": [0.0] * 9 + [float("nan")] + [0.0] * 310},
                                     "tokenizer.ggml.scores gives token 9 the score nan, not a finite number"),
    "token types of another length": ({f"{T}token_type": [1] * 319},
                                      "tokenizer.ggml.token_type holds 319 types for 320 tokens"),
    "a token type out of range": ({f"{T}token_type": [1] * 4 + [7] + [1] * 315},
                                  r"tokenizer.ggml.token_type gives token 4 the type 7; the types are 1 to 6"),
    "token types as floats": ({f"{T}token_type": [1.0] * 320}, r"tokenizer.ggml.token_type \(the tokens' types\) "
                                                               "is stored as an array of float32"),
    "an unknown-token id past the tokens": ({f"{T}unknown_token_id": 999}, r"tokenizer.ggml.unknown_token_id is "
                                            "999; a special token id must be an integer from 0 to 319"),
    "a separator id stored as a float": ({f"{T}seperator_token_id": 1.0}, r"tokenizer.ggml.seperator_token_id is "
                                         "1.0; a special token id must be stored as an integer, not as float32"),
    "a BOS id of -1": ({f"{T}bos_token_id": gguf.GGUFValue(-1, A.INT32)},
                       "tokenizer.ggml.bos_token_id is -1; a special token id must be an integer from 0 to 319"),
    "a flag as an integer": ({f"{T}add_bos_token": 1}, r"tokenizer.ggml.add_bos_token is 1; a flag must be stored "
                                                       "as a bool, not as uint32"),
    "a chat template as a list": ({"tokenizer.chat_template": ["{{ bos_token }}"]},
                                  r"tokenizer.chat_template is \['{{ bos_token }}'\]; a chat template must be "
                                  "stored as a string, not as an array of string"),
    "a named chat template as a number": ({"tokenizer.chat_template.tool_use": 5},
                                          r"tokenizer.chat_template.tool_use is 5; a chat template must be stored as "
                                          "a string"),
    "the tokenizer's kind as a number": ({f"{T}model": 2}, r"tokenizer.ggml.model is 2; the tokenizer's kind must "
                                                           "be stored as a string"),
}


@pytest.mark.parametrize("bad", list(BAD_TOKENIZERS))
def test_malformed_tokenizers_are_refused_naming_the_file_and_what_is_wrong(bad, tmp_path, tokenizer):
    change, message = BAD_TOKENIZERS[bad]
    source = gguf_source(tmp_path / "source")
    metadata = {**gguf_metadata(source, "bitnet"), **tokenizer_metadata(tokenizer), **change}
    path = write_gguf(tmp_path / "m.gguf", "bitnet", metadata, gguf_tensors(source, "TQ2_0-unit", "F32"))
    with pytest.raises(ValueError, match=message) as error:
        load_gguf_tokenizer(path)
    assert str(error.value).startswith(str(path))


# -- configuration rules ---------------------------------------------------------------------------------

def test_llama_cpps_bitnet_without_an_activation_is_silu(tmp_path):
    source = gguf_source(tmp_path / "source")
    metadata = gguf_metadata(source, "bitnet")
    del metadata["bitnet.hidden_activation"]
    model = load_bitnet(write_gguf(tmp_path / "m.gguf", "bitnet", metadata, gguf_tensors(source, "TQ2_0-unit", "F32")))
    assert model.config.hidden_act == "silu"  # what llama.cpp's bitnet graph computes
    with pytest.raises(ValueError, match="relu2 FFN; this model's hidden_act is 'silu'"):
        BitNetEngine(model)


def test_a_bitnet_file_naming_another_activation_than_llama_cpps_is_refused(tmp_path):
    """llama.cpp runs every bitnet file SiLU-gated (tests/integrations/test_llama_cpp.py checks that it
    does); a file saying relu2 would mean one model here and another there."""
    source = gguf_source(tmp_path / "source")  # a ReLU² BitNet, as bitnet-b1.58-2B-4T
    path = write_model_gguf(tmp_path / "m.gguf", source, "TQ2_0", "F32", "bitnet")
    with pytest.raises(ValueError, match=r"bitnet.hidden_activation is 'relu2'; llama.cpp computes the bitnet "
                                         r"architecture's FFN with SiLU and ignores this key.*bitnet-b1.58 or "
                                         r"bitnet-25 \(general.architecture\)"):
        load_bitnet(path)


@pytest.mark.parametrize("case", ["TQ2_0-BF16-bitnet-25"], indirect=True)
def test_a_bfloat16_model_loads_from_the_same_file(case):
    model = load_bitnet(case["path"], dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.embed_tokens.weight.float(), case["source"].model.embed_tokens.weight)


# -- bad files --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> tuple:
    source = gguf_source(tmp_path_factory.mktemp("bad") / "source", f16_scales=True)
    return source, gguf_metadata(source, "bitnet-b1.58"), gguf_tensors(source, "i2_s", "F32")


def q_name(layer: int = 0) -> str:
    return tensor_name(MODEL_TENSOR.ATTN_Q, layer)


def with_tensor(tensors: dict, name: str, array: np.ndarray, raw, shape: tuple | None = None) -> dict:
    return {**tensors, name: (array, raw, shape or tensors[name][2])}


def two_scales(source) -> tuple:
    """attn_q of layer 0 as TQ2_0 blocks whose scales differ: not one BitNet scale."""
    values = source.model.layers[0].self_attn.q_proj.weight.detach().float()
    weights = values * torch.linspace(0.01, 0.02, values.shape[0])[:, None]
    return gguf.quants.quantize(weights.numpy(), gguf.GGMLQuantizationType.TQ2_0), gguf.GGMLQuantizationType.TQ2_0


def tq2_blocks(source, layer: int = 0) -> np.ndarray:
    """attn_q of ``layer`` as TQ2_0 blocks [block, 66 bytes] (its scale in each block's last two bytes)."""
    q = source.model.layers[layer].self_attn.q_proj
    weights = q.weight.detach().float() * float(q.weight_scale)
    return gguf.quants.quantize(weights.numpy(), gguf.GGMLQuantizationType.TQ2_0).reshape(-1, 66).copy()


def with_block_scale(source, scale: float, blocks: slice = slice(0, 1)) -> tuple:
    data = tq2_blocks(source)
    data[blocks, -2:] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    return data.reshape(256, -1), gguf.GGMLQuantizationType.TQ2_0


def code_three(tensors: dict) -> tuple:
    array, raw, _ = tensors[q_name()]
    damaged = array.copy()
    damaged[5] = np.int8(-1)  # 0xFF: four codes 3
    return damaged, raw


BAD_FILES = {
    "other architecture": (lambda s, m, t: ("llama", {k.replace("bitnet-b1.58", "llama"): v for k, v in m.items()}, t),
                           r"holds a 'llama' model \(general.architecture\)"),
    "an adapter, not a model": (lambda s, m, t: ("bitnet-b1.58", {**m, "general.type": "adapter"}, t),
                                r"is a GGUF adapter \(general.type\), not a model"),
    "missing metadata": (lambda s, m, t: ("bitnet-b1.58", {k: v for k, v in m.items() if "block_count" not in k}, t),
                         r"has no bitnet-b1.58.block_count \(the number of layers\) in its metadata"),
    "ffn size unlike the tensors": (lambda s, m, t: ("bitnet-b1.58", {**m, "bitnet-b1.58.feed_forward_length": 384}, t),
                                    r"bitnet-b1.58.feed_forward_length is 384; blk.0.ffn_up.weight is \[512, 256\]"),
    "vocabulary unlike the embedding": (lambda s, m, t: ("bitnet-b1.58", {**m, "bitnet-b1.58.vocab_size": 321}, t),
                                       "bitnet-b1.58.vocab_size is 321; token_embd.weight has 320 rows"),
    "heads unlike the tensors": (lambda s, m, t: ("bitnet-b1.58", {**m, "bitnet-b1.58.attention.head_count_kv": 4,
                                                                   }, t),
                                 r"head_count_kv is 4; blk.0.attn_k.weight is \[128, 256\], the keys of 2 heads of 64"),
    "rope scaling": (lambda s, m, t: ("bitnet-b1.58", {**m, "bitnet-b1.58.rope.scaling.type": "yarn"}, t),
                     "RoPE scaling 'yarn' by 1.0"),
    "a missing tensor": (lambda s, m, t: ("bitnet-b1.58", m, {k: v for k, v in t.items() if k != "blk.1.ffn_down.weight"}),
                         r"lacks tensors its metadata describes, e.g. blk.1.ffn_down.weight \(1 missing\)"),
    "an extra tensor": (lambda s, m, t: ("bitnet-b1.58", m, {**t, "rope_freqs.weight": (np.ones(32, np.float32), None,
                                                                                         (32,))}),
                        r"holds tensors a BitNet does not have, e.g. rope_freqs.weight"),
    "a quantised type not read here": (
        lambda s, m, t: ("bitnet-b1.58", m, with_tensor(t, q_name(), gguf.quants.quantize(
            s.model.layers[0].self_attn.q_proj.weight.detach().numpy(), gguf.GGMLQuantizationType.Q8_0),
            gguf.GGMLQuantizationType.Q8_0)),
        "blk.0.attn_q.weight is stored as Q8_0; torch_wgpu_lora reads it from TQ1_0, TQ2_0, i2_s"),
    "a type id ggml does not have": (
        lambda s, m, t: ("bitnet-b1.58", m, with_tensor(t, q_name(), t[q_name()][0], 99)),
        "blk.0.attn_q.weight is stored as type 99"),
    "a float projection": (
        lambda s, m, t: ("bitnet-b1.58", m, with_tensor(t, q_name(), s.model.layers[0].self_attn.q_proj.weight.detach()
                                                        .numpy(), None)),
        r"blk.0.attn_q.weight is stored as F32; .* \(a float projection: quantise the file to TQ1_0 or TQ2_0"),
    "a quantised embedding": (
        lambda s, m, t: ("bitnet-b1.58", m, with_tensor(t, "token_embd.weight", gguf.quants.quantize(
            s.model.embed_tokens.weight.detach().numpy(), gguf.GGMLQuantizationType.Q8_0),
            gguf.GGMLQuantizationType.Q8_0)),
        "token_embd.weight is stored as Q8_0; torch_wgpu_lora reads it from F32, F16, BF16"),
    "an i2_s code 3": (lambda s, m, t: ("bitnet-b1.58", m, with_tensor(t, q_name(), *code_three(t))),
                       "blk.0.attn_q.weight holds the i2_s code 3"),
    "per-layer head counts": (lambda s, m, t: ("bitnet-b1.58", {**m, "bitnet-b1.58.attention.head_count": [4, 4]}, t),
                              r"attention.head_count is \[4, 4\]; the attention heads must be stored as an integer, "
                              "not as an array of int32"),
    "heads that do not divide the width": (lambda s, m, t: ("bitnet-b1.58", {**m, "bitnet-b1.58.attention.head_count": 3}, t),
                                           "do not divide into whole heads"),
    "RoPE over part of a head": (lambda s, m, t: ("bitnet-b1.58", {**m, "bitnet-b1.58.rope.dimension_count": 32}, t),
                                 "rope.dimension_count is 32, but transformers' BitNet rotates and attends over whole "
                                 "heads of embedding_length / head_count = 64"),
    "an i2_s scale that is not a number": (
        lambda s, m, t: ("bitnet-b1.58", m, with_tensor(t, q_name(), np.concatenate(
            [t[q_name()][0][:-32], np.frombuffer(np.float32("nan").tobytes(), np.int8), t[q_name()][0][-28:]]), I2_S)),
        "blk.0.attn_q.weight's scale is nan, not a finite number"),
    "a TQ2_0 block scale that is infinite": (lambda s, m, t: ("bitnet-b1.58", m, with_tensor(
        t, q_name(), *with_block_scale(s, float("inf")))), "blk.0.attn_q.weight has a block scale that is not a finite"),
    "TQ2_0 blocks with different scales": (lambda s, m, t: ("bitnet-b1.58", m, with_tensor(t, q_name(), *two_scales(s))),
                                           r"blk.0.attn_q.weight's TQ2_0 blocks carry \d+ different scales"),
    **{f"{what}: {shown}": (lambda s, m, t, key=key, value=value: ("bitnet-b1.58", {**m, key: value}, t), message)
       for what, key, shown, value, message in [
           ("RoPE base", "bitnet-b1.58.rope.freq_base", "0", 0.0,
            r"bitnet-b1.58.rope.freq_base is 0.0; the RoPE base must be above 1"),
           ("RoPE base", "bitnet-b1.58.rope.freq_base", "inf", float("inf"),
            r"bitnet-b1.58.rope.freq_base is inf; the RoPE base must be a finite number"),
           ("RoPE base", "bitnet-b1.58.rope.freq_base", "nan", float("nan"), r"freq_base is nan; .* a finite number"),
           ("RoPE scaling factor", "bitnet-b1.58.rope.scaling.factor", "nan", float("nan"),
            r"rope.scaling.factor is nan; the RoPE scaling factor must be a finite number"),
           ("RMSNorm epsilon", "bitnet-b1.58.attention.layer_norm_rms_epsilon", "negative", -1e-5,
            r"layer_norm_rms_epsilon is -1e-05; the RMSNorm epsilon must be above 0 and below 1"),
           ("RMSNorm epsilon", "bitnet-b1.58.attention.layer_norm_rms_epsilon", "nan", float("nan"),
            r"layer_norm_rms_epsilon is nan; the RMSNorm epsilon must be a finite number"),
           ("RMSNorm epsilon", "bitnet-b1.58.attention.layer_norm_rms_epsilon", "zero", 0.0,
            r"layer_norm_rms_epsilon is 0.0; the RMSNorm epsilon must be above 0"),
           ("bos id", "tokenizer.ggml.bos_token_id", "stored as a float", 1.7,
            r"tokenizer.ggml.bos_token_id is 1.7\d*; a token id must be stored as an integer, not as float32"),
           ("eos id", "tokenizer.ggml.eos_token_id", "past the vocabulary", 320,
            r"tokenizer.ggml.eos_token_id is 320; a token id must be an integer from 0 to 319"),
           ("padding id", "tokenizer.ggml.padding_token_id", "-1", gguf.GGUFValue(-1, gguf.GGUFValueType.INT32),
            r"tokenizer.ggml.padding_token_id is -1; a token id must be an integer from 0 to 319"),
           ("eot id", "tokenizer.ggml.eot_token_id", "a string", "1",
            r"tokenizer.ggml.eot_token_id is '1'; a token id must be stored as an integer, not as string"),
           ("block count", "bitnet-b1.58.block_count", "huge", 4_000_000_000,
            r"block_count is 4000000000; the file's tensors are those of 2 layers \(blk.0 to blk.1\)"),
           ("block count", "bitnet-b1.58.block_count", "one less than the tensors", 1,
            r"block_count is 1; the file's tensors are those of 2 layers"),
           ("block count", "bitnet-b1.58.block_count", "stored as a float", 2.0,
            r"block_count is 2.0; the number of layers must be stored as an integer, not as float32"),
           ("context length", "bitnet-b1.58.context_length", "0", 0,
            r"context_length is 0; the context length must be an integer from 1 to 16777216"),
           ("context length", "bitnet-b1.58.context_length", "past 2^24", 2 ** 24 + 1,
            r"context_length is 16777217; the context length must be an integer from 1 to 16777216"),
           ("context length", "bitnet-b1.58.context_length", "a string", "256",
            r"context_length is '256'; the context length must be stored as an integer, not as string"),
           ("hidden size", "bitnet-b1.58.embedding_length", "unlike the embedding", 128,
            r"embedding_length is 128; token_embd.weight has rows of 256"),
           ("heads", "bitnet-b1.58.attention.head_count", "0", 0,
            r"attention.head_count is 0; the attention heads must be an integer from 1 to 256"),
           ("heads", "bitnet-b1.58.attention.head_count", "of an odd size", 256,
            r"heads of embedding_length / head_count = 256 / 256 = 1 dimensions; RoPE rotates pairs"),
           ("key/value heads", "bitnet-b1.58.attention.head_count_kv", "more than the heads", 8,
            r"head_count_kv is 8; the key/value heads must be an integer from 1 to 4"),
           ("vocabulary size", "bitnet-b1.58.vocab_size", "stored as a float", 320.0,
            r"vocab_size is 320.0; the vocabulary size must be stored as an integer, not as float32"),
           ("tokens", "tokenizer.ggml.tokens", "fewer than the embedding's rows", ["a", "b", "c"],
            r"tokenizer.ggml.tokens holds 3 tokens, but token_embd.weight has 320 rows"),
           ("tokens", "tokenizer.ggml.tokens", "one string", "abc",
            r"tokenizer.ggml.tokens is 'abc'; the vocabulary must be stored as an array, not as string"),
           ("what the file holds", "general.type", "not a string", 3,
            r"general.type is 3; what the file holds must be stored as a string, not as uint32"),
       ]},
    "an activation llama.cpp's bitnet does not compute": (
        lambda s, m, t: ("bitnet", {**as_architecture(m, "bitnet"), "bitnet.hidden_activation": "swishy"}, t),
        r"bitnet.hidden_activation is 'swishy'; llama.cpp computes the bitnet architecture's FFN with SiLU"),
    "layers numbered with a gap": (
        lambda s, m, t: ("bitnet-b1.58", m, {k.replace("blk.1.", "blk.2."): v for k, v in t.items()}),
        r"holds tensors of layer blk.2 but none of blk.1"),
    "a norm holding a NaN": (
        lambda s, m, t: ("bitnet-b1.58", m, with_tensor(t, "blk.1.attn_norm.weight", np.where(
            np.arange(256) == 7, np.float32("nan"), t["blk.1.attn_norm.weight"][0]).astype(np.float32), None)),
        r"blk.1.attn_norm.weight holds nan at element 7, not a finite number"),
}


def as_architecture(metadata: dict, arch: str) -> dict:
    """``metadata`` of bitnet-b1.58 under the keys of another architecture."""
    return {key.replace("bitnet-b1.58.", f"{arch}."): value for key, value in metadata.items()}


@pytest.mark.parametrize("bad", list(BAD_FILES))
def test_bad_files_are_refused_by_name_before_a_model_is_built(bad, parts, tmp_path, monkeypatch):
    import transformers

    arch, metadata, tensors = BAD_FILES[bad][0](*parts)
    path = write_gguf(tmp_path / "bad.gguf", arch, metadata, tensors)
    monkeypatch.setattr(transformers.BitNetForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("a model was built from a bad file"))
    with pytest.raises(ValueError, match=BAD_FILES[bad][1]) as error:
        load_bitnet(path)
    assert str(path) in str(error.value)


def test_tq_blocks_with_scale_zero_hold_zeros_and_a_zero_tensor_takes_scale_one(parts, tmp_path):
    source, metadata, tensors = parts
    k_name = tensor_name(MODEL_TENSOR.ATTN_K, 0)
    k_blocks = gguf.quants.quantize(source.model.layers[0].self_attn.k_proj.weight.detach().numpy(),
                                    gguf.GGMLQuantizationType.TQ2_0).reshape(-1, 66).copy()
    k_blocks[:, -2:] = 0  # every block: codes kept, scale 0
    tensors = with_tensor(with_tensor(tensors, q_name(), *with_block_scale(source, 0.0, slice(3, 4))), k_name,
                          k_blocks.reshape(128, -1), gguf.GGMLQuantizationType.TQ2_0)
    model = load_bitnet(write_gguf(tmp_path / "zeros.gguf", "bitnet-b1.58", metadata, tensors))
    q, source_q = model.model.layers[0].self_attn.q_proj, source.model.layers[0].self_attn.q_proj
    assert source_q.weight[3].abs().sum() > 0 and not q.weight[3].any()  # block 3 is row 3 (rows of 256)
    keep = torch.arange(256) != 3
    assert torch.equal(q.weight[keep], source_q.weight[keep]) and torch.equal(q.weight_scale, source_q.weight_scale)
    k = model.model.layers[0].self_attn.k_proj
    assert not k.weight.any() and k.weight_scale.item() == 1.0


def test_i2s_rows_must_be_whole_blocks(tmp_path):
    source = gguf_source(tmp_path / "source", hidden_size=64, intermediate_size=128)
    path = write_model_gguf(tmp_path / "narrow.gguf", source, "i2_s", "F32", "bitnet-b1.58")
    with pytest.raises(ValueError, match="blk.0.attn_q.weight has rows of 64 weights, not a multiple of i2_s's 128"):
        load_bitnet(path)


def test_a_tensor_transformers_leaves_unloaded_is_an_error(parts, tmp_path, monkeypatch):
    import transformers

    path = write_gguf(tmp_path / "m.gguf", "bitnet-b1.58", parts[1], parts[2])
    original = transformers.BitNetForCausalLM.from_pretrained

    def dropping(*args, state_dict, **kwargs):  # a transformers that does not place one of the tensors
        state_dict.pop("model.layers.1.mlp.ffn_sub_norm.weight")
        return original(*args, state_dict=state_dict, **kwargs)

    monkeypatch.setattr(transformers.BitNetForCausalLM, "from_pretrained", dropping)
    with pytest.raises(RuntimeError, match=r"did not load \['model.layers.1.mlp.ffn_sub_norm.weight'\]"):
        load_bitnet(path)


@pytest.mark.parametrize("cut", ["data", "header", "magic"])
def test_truncated_and_foreign_files_are_named(cut, parts, tmp_path):
    data = write_gguf(tmp_path / "whole.gguf", "bitnet-b1.58", parts[1], parts[2]).read_bytes()
    path = tmp_path / "cut.gguf"
    if cut == "data":
        path.write_bytes(data[:-1000])
        message = r"is truncated: tensor blk.1.ffn_down.weight needs bytes \d+..\d+ but the file ends at byte"
    elif cut == "header":
        path.write_bytes(data[:300])
        message = "is not a readable GGUF file"
    else:
        path.write_bytes(b"PK\x03\x04" + data[4:])  # a zip, say
        message = r"is not a readable GGUF file \(GGUF magic invalid\)"
    with pytest.raises(ValueError, match=message):
        load_bitnet(path)


def test_a_tensor_named_twice_and_the_other_byte_order_are_refused(parts, tmp_path):
    data = write_gguf(tmp_path / "whole.gguf", "bitnet-b1.58", parts[1], parts[2]).read_bytes()
    twice = tmp_path / "twice.gguf"
    twice.write_bytes(data.replace(b"blk.1.attn_q.weight", b"blk.0.attn_q.weight", 1))
    with pytest.raises(ValueError, match="holds tensor blk.0.attn_q.weight twice"):
        load_bitnet(twice)
    writer = gguf.GGUFWriter(tmp_path / "big.gguf", "bitnet-b1.58", endianess=gguf.GGUFEndian.BIG)
    writer.add_uint32("bitnet-b1.58.block_count", 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="is a GGUF of the other byte order"):
        load_bitnet(tmp_path / "big.gguf")


def test_missing_paths_and_folders_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file .*none.gguf' does not exist"):
        load_bitnet(tmp_path / "none.gguf")
    (tmp_path / "folder.gguf").mkdir()
    with pytest.raises(ValueError, match="is not a file"):
        load_bitnet(tmp_path / "folder.gguf")


# -- adapters out as GGUF -----------------------------------------------------------------------------------

def adapted(model: torch.nn.Module, seed: int = 5) -> torch.nn.Module:
    model = add_lora_layers(copy.deepcopy(model), r=4, lora_alpha=12, target_modules=tuple(
        m.rsplit(".", 1)[-1] for m in PROJECTION_TENSORS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("case", ["i2_s-F16-bitnet-b1.58"], indirect=True)
def test_gguf_adapter_holds_peft_tensors_under_llama_cpp_names(case, tmp_path):
    model = adapted(case["model"])
    save_adapter(model, tmp_path / "peft")
    path = save_adapter(model, tmp_path / "adapter.gguf", format="gguf")
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")

    reader = gguf.GGUFReader(path)  # gguf's own reader
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "bitnet-b1.58"  # the base GGUF's, which llama.cpp checks
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora"
    assert fields["adapter.lora.alpha"] == 12.0
    # llama.cpp's convert_lora_to_gguf.py names: the base tensor's (gguf's map of HF names) + .lora_a / .lora_b
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BITNET, model.config.num_hidden_layers)
    expected = {}
    for key, tensor in peft.items():
        module = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        which = "a" if ".lora_A." in key else "b"
        expected[f"{names.get_name(module)}.weight.lora_{which}"] = tensor
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(expected) and len(expected) == 2 * 7 * model.config.num_hidden_layers
    for name, tensor in tensors.items():
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(torch.from_numpy(np.array(tensor.data)), expected[name]), name
        # ggml dimensions (innermost first): lora_a [in, r] and lora_b [r, out], as llama.cpp checks them
        assert list(tensor.shape) == list(reversed(expected[name].shape))


def test_gguf_adapters_from_a_folder_model_name_llama_cpps_bitnet(tmp_path):
    model = adapted(gguf_source(tmp_path / "source"))
    reader = gguf.GGUFReader(save_adapter(model, tmp_path / "a.gguf", format="gguf"))
    assert reader.fields["general.architecture"].contents() == "bitnet"


def test_gguf_adapter_errors(tmp_path):
    model = adapted(gguf_source(tmp_path / "source"))
    modules = dict(model.named_modules())
    modules["model.layers.1.mlp.up_proj"].lora_alpha = 6.0
    modules["model.layers.1.mlp.up_proj"].scaling = 6.0 / 4
    with pytest.raises(ValueError, match=r"do not share one llama.cpp alpha \(lora_alpha, or lora_alpha·√r under "
                                         r"rsLoRA\): .* a GGUF adapter has one alpha \(adapter.lora.alpha\)"):
        save_adapter(model, tmp_path / "a.gguf", format="gguf")
    with pytest.raises(ValueError, match="is a folder; format='gguf' writes one file"):
        save_adapter(adapted(gguf_source(tmp_path / "other")), tmp_path, format="gguf")
    head = add_lora_layers(gguf_source(tmp_path / "head"), target_modules=("lm_head",))
    with pytest.raises(ValueError, match="llama.cpp's BitNet has no tensor for 'lm_head'"):
        save_adapter(head, tmp_path / "head.gguf", format="gguf")
    odd = add_lora_layers(gguf_source(tmp_path / "odd"), r=4, lora_alpha=0.1)
    with pytest.raises(ValueError, match="lora_alpha=0.1 is not exactly a float32"):
        save_adapter(odd, tmp_path / "odd.gguf", format="gguf")
    assert not list(tmp_path.glob("*.gguf"))  # nothing written on error


def test_gguf_adapters_llama_cpp_cannot_scale_as_we_do_are_refused(tmp_path):
    """llama.cpp scales by one alpha / each tensor's rank (tests/integrations/test_llama_cpp.py runs the
    adapters it can): rsLoRA at two ranks needs two alphas, and a gate/up .scale of 0 zeroes any adapter."""
    mixed = add_lora_layers(gguf_source(tmp_path / "mixed"), r=4, lora_alpha=8, use_rslora=True,
                            rank_pattern={"v_proj": 16})
    with pytest.raises(ValueError, match=r"do not share one llama.cpp alpha .*q_proj has 16.0.*v_proj has 32.0"):
        save_adapter(mixed, tmp_path / "mixed.gguf", format="gguf")
    source = gguf_source(tmp_path / "source", hidden_act="silu")
    tensors = gguf_tensors(source, "TQ2_0-unit", "F32")
    tensors["blk.1.ffn_up.scale"] = (np.zeros(1, dtype=np.float32), None, (1,))
    model = load_bitnet(write_gguf(tmp_path / "m.gguf", "bitnet", gguf_metadata(source, "bitnet"), tensors))
    assert model.config.gguf_gate_up_scales["model.layers.1.mlp.up_proj"] == 0.0
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj: the base GGUF's .scale of this projection is "
                                         r"0, and llama.cpp multiplies the adapter's term by it"):
        save_adapter(adapted(model), tmp_path / "zero.gguf", format="gguf")
    assert [path.name for path in tmp_path.glob("*.gguf")] == ["m.gguf"]  # no adapter written


def test_without_the_gguf_package_the_error_names_the_install(tmp_path, monkeypatch):
    model = adapted(gguf_source(tmp_path / "source"))
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(ImportError, match=r"needs the gguf package: pip install 'torch_wgpu_lora\[gguf\]'"):
        save_adapter(model, tmp_path / "a.gguf", format="gguf")


def test_i2s_helper_follows_the_documented_layout():
    """The test's own i2_s encoder against a hand-worked block: weight 32·g + p at shift 6 − 2g of byte p."""
    from .helpers import i2s_bytes

    values = torch.zeros(1, 128, dtype=torch.int8)
    values[0, 0], values[0, 32], values[0, 97] = 1, -1, 1  # g0 p0: +1; g1 p0: -1; g3 p1: +1
    data = i2s_bytes(values, 0.5)
    assert data.size == 128 // 4 + 32
    assert data[0] == (2 << 6) | (0 << 4) | (1 << 2) | 1  # p0: g0 code 2, g1 code 0, g2 and g3 code 1
    assert data[1] == (1 << 6) | (1 << 4) | (1 << 2) | 2  # p1: g3 code 2
    assert np.frombuffer(data[32:36].tobytes(), "<f4")[0] == 0.5 and not data[36:].any()
    assert I2_S == 36
