"""Adapter files against the real ``peft`` package, both directions; Hesper's binary format;
atomic writes; every refusal.

Models are tiny BitNets (hidden 64, 2 layers) with GQA: 4 query heads, 2 KV heads, so
v_proj is 64 -> 32 and its adapter sizes differ from q_proj's.

Tolerances, as max |ours - peft| <= TOL * max |peft logits|:
* torch backend, 1e-6: the same float32 math (peft: B(A x)·s, ours: s·(x Aᵀ) Bᵀ); with a
  power-of-two scaling the two orders round identically, so a difference of a few ulps
  would already be unexpected, and any wrong key, shape or scaling moves logits by O(1).
* wgpu backend, 1e-4: float32 kernels summing in another order than torch (as in
  test_ops_lora.py), amplified a little through two decoder layers.
Each comparison also checks that the adapter moves the logits by far more than TOL.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import pickle
import re
import struct
import threading
import warnings
import zlib

import numpy as np
import peft
import pytest
import safetensors.torch
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import BitNetForCausalLM

from torch_wgpu_lora import load_adapter, save_adapter
from torch_wgpu_lora.integrations.bitnet import add_lora_layers, lora_modules, set_backend
from torch_wgpu_lora.integrations.tiny import build_tiny_bitnet

from .helpers import (RACE_LIMIT, RACE_LOADS, RACE_SAVES, SAVES, adapter_of, load_in_turns, logits, randomize,
                      save_in_turns)

TOL = {"torch": 1e-6, "wgpu": 1e-4}  # relative to max |logit|; see module docstring
R, ALPHA = 4, 8.0  # scaling 2.0, a power of two (see module docstring)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Same architecture, hidden 32: adapters of another model size."""
    return build_tiny_bitnet(tmp_path_factory.mktemp("small"), flavour="dense", seed=0,
                             hidden_size=32, intermediate_size=48)


def with_adapter(model, r=R, lora_alpha=ALPHA, seed=1, **kwargs):
    add_lora_layers(model, r=r, lora_alpha=lora_alpha, backend="torch", **kwargs)
    return randomize(model, seed)


def assert_matches(ours, theirs, base_logits, backend):
    scale = theirs.abs().max().item()
    err = (ours - theirs).abs().max().item()
    assert err <= TOL[backend] * scale, f"{backend}: max |ours - peft| = {err:.3g} vs scale {scale:.3g}"
    effect = (theirs - base_logits).abs().max().item()
    assert effect > 1000 * TOL[backend] * scale, f"the adapter barely changes the logits ({effect:.3g})"


def adapter_tensors(model):
    return {name: (m.lora_A.detach().clone(), m.lora_B.detach().clone(), m.lora_alpha)
            for name, m in lora_modules(model).items()}


def peft_from_pretrained(checkpoint, adapter):
    """PeftModel.from_pretrained on a fresh base; fails on any warning peft itself raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(BitNetForCausalLM.from_pretrained(checkpoint), str(adapter)).eval()
    from_peft = [str(w.message) for w in caught if os.sep + "peft" + os.sep in w.filename]
    assert not from_peft, from_peft
    return model


# -- ours -> peft ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "wgpu"])
def test_peft_loads_our_adapter_with_the_same_logits(dense, tmp_path, backend):
    model = with_adapter(BitNetForCausalLM.from_pretrained(dense).eval())
    set_backend(model, backend)
    path = save_adapter(model, tmp_path / "adapter")
    assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors"]
    theirs = peft_from_pretrained(dense, path)
    assert_matches(logits(model), logits(theirs), logits(BitNetForCausalLM.from_pretrained(dense)), backend)


def test_our_files_have_peft_keys_shapes_and_config(dense, tmp_path):
    model = with_adapter(BitNetForCausalLM.from_pretrained(dense))
    ours = save_adapter(model, tmp_path / "ours")
    reference = get_peft_model(BitNetForCausalLM.from_pretrained(dense),
                               LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"],
                                          task_type="CAUSAL_LM"))
    reference.save_pretrained(tmp_path / "peft")
    ours_tensors = load_file(ours / "adapter_model.safetensors")
    peft_tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in ours_tensors.items()} == {k: v.shape for k, v in peft_tensors.items()}
    assert ours_tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (R, 64)
    assert ours_tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (32, R)  # GQA
    assert all(v.dtype == torch.float32 for v in ours_tensors.values())

    config = json.loads((ours / "adapter_config.json").read_text())
    assert set(config) <= set(LoraConfig().to_dict()), "every key is a LoraConfig field"
    assert config["base_model_name_or_path"] == str(dense)  # from model.config._name_or_path
    loaded = peft.PeftConfig.from_pretrained(str(ours))
    assert (loaded.peft_type, loaded.task_type, loaded.r, loaded.lora_alpha) == ("LORA", "CAUSAL_LM", R, ALPHA)
    assert set(loaded.target_modules) == {"q_proj", "v_proj"}
    assert (loaded.bias, loaded.use_dora, loaded.use_rslora, loaded.inference_mode) == ("none", False, False, True)

    save_adapter(model, tmp_path / "named", base_model_name_or_path="microsoft/bitnet-b1.58-2B-4T")
    assert json.loads((tmp_path / "named" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "microsoft/bitnet-b1.58-2B-4T"


def test_peft_loads_our_adapter_on_autobitlinear(tmp_path):
    online = build_tiny_bitnet(tmp_path / "online", flavour="online", seed=0)
    model = BitNetForCausalLM.from_pretrained(online).eval()
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "AutoBitLinear"
    with_adapter(model)
    theirs = peft_from_pretrained(online, save_adapter(model, tmp_path / "adapter"))
    assert type(theirs.base_model.model.model.layers[0].self_attn.q_proj.base_layer).__name__ == "AutoBitLinear"
    assert_matches(logits(model), logits(theirs), logits(BitNetForCausalLM.from_pretrained(online)), "torch")


# -- peft -> ours ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def peft_trained(dense, tmp_path_factory):
    """An adapter made and saved by peft itself (random weights stand in for training), and its logits."""
    model = get_peft_model(BitNetForCausalLM.from_pretrained(dense),
                           LoraConfig(r=R, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"],
                                      task_type="CAUSAL_LM"))
    randomize(model, seed=7).eval()
    path = tmp_path_factory.mktemp("peft") / "adapter"
    model.save_pretrained(path)
    return path, logits(model)


@pytest.mark.parametrize("backend", ["torch", "wgpu"])
def test_we_load_an_adapter_peft_trained(peft_trained, base, pristine, backend):
    path, theirs = peft_trained
    load_adapter(base, path)
    modules = lora_modules(base)
    assert sorted(modules) == [f"model.layers.{i}.self_attn.{t}" for i in range(2) for t in ("q_proj", "v_proj")]
    m = modules["model.layers.0.self_attn.v_proj"]
    assert (m.r, m.lora_alpha, m.scaling, m.lora_dropout.p, m.backend) == (R, 16.0, 4.0, 0.1, "wgpu")
    set_backend(base, backend)
    assert_matches(logits(base), theirs, logits(pristine), backend)


def test_loading_into_matching_adapters_replaces_their_weights_and_alpha(peft_trained, base, pristine):
    path, theirs = peft_trained
    with_adapter(base, r=R, lora_alpha=1.0)
    load_adapter(base, path)
    assert all(m.lora_alpha == 16.0 and m.scaling == 4.0 for m in lora_modules(base).values())
    assert_matches(logits(base), theirs, logits(pristine), "torch")


def test_peft_format_round_trip_is_bit_exact(base, pristine, tmp_path):
    with_adapter(base, r=3, lora_alpha=5.5, lora_dropout=0.05)
    path = save_adapter(base, tmp_path / "adapter")
    again = load_adapter(copy.deepcopy(pristine), path)
    assert adapter_tensors(again).keys() == adapter_tensors(base).keys()
    for name, (A, B, alpha) in adapter_tensors(base).items():
        A2, B2, alpha2 = adapter_tensors(again)[name]
        assert torch.equal(A, A2) and torch.equal(B, B2) and alpha == alpha2 == 5.5
    assert all(m.lora_dropout.p == 0.05 and m.r == 3 for m in lora_modules(again).values())


def test_applied_adapters_follow_the_models_training_mode(peft_trained, pristine):
    path, _ = peft_trained
    evaluating = load_adapter(copy.deepcopy(pristine).eval(), path)
    training = load_adapter(copy.deepcopy(pristine).train(), path)
    assert not any(m.training for m in lora_modules(evaluating).values())  # dropout off, as in peft's eval model
    assert all(m.training for m in lora_modules(training).values())


# -- Hesper ------------------------------------------------------------------------------------

def test_hesper_layout_and_bit_exact_round_trip(base, pristine, tmp_path):
    with_adapter(base, r=R, lora_alpha=ALPHA)
    path = save_adapter(base, tmp_path / "adapter.lora", format="hesper")
    data = path.read_bytes()
    dim, kv = 64, 32
    per_layer = R * dim + dim * R + R * dim + kv * R
    assert len(data) == 24 + 4 * 2 * per_layer
    assert struct.unpack("<IIIfI", data[:20]) == (0x4C4F5241, 1, R, ALPHA, 2)
    # The reserved field, which Hesper writes as 0 and never reads, holds our CRC-32 of all other bytes.
    assert struct.unpack("<I", data[20:24])[0] == zlib.crc32(data[:20] + data[24:])
    floats = np.frombuffer(data[24:], dtype="<f4")
    modules = lora_modules(base)
    for layer in range(2):
        q, v = (modules[f"model.layers.{layer}.self_attn.{t}"] for t in ("q_proj", "v_proj"))
        expected = torch.cat([q.lora_A.flatten(), q.lora_B.flatten(), v.lora_A.flatten(), v.lora_B.flatten()])
        got = floats[layer * per_layer:(layer + 1) * per_layer]
        assert np.array_equal(got, expected.detach().numpy()), f"layer {layer}: Q_A, Q_B, V_A, V_B row-major"

    again = load_adapter(copy.deepcopy(pristine), path)  # format detected from the magic
    for name, (A, B, alpha) in adapter_tensors(base).items():
        A2, B2, alpha2 = adapter_tensors(again)[name]
        assert torch.equal(A, A2) and torch.equal(B, B2) and alpha2 == alpha
    assert save_adapter(again, tmp_path / "again.lora", format="hesper").read_bytes() == data
    set_backend(again, "torch")
    assert torch.equal(logits(again), logits(base))


def hesper_file(tmp_path, pristine, r=R):
    model = with_adapter(copy.deepcopy(pristine), r=r)
    return save_adapter(model, tmp_path / "adapter.lora", format="hesper")


def rewrite_header(path, **fields):
    names = ("magic", "version", "rank", "alpha", "layers", "reserved")
    data = bytearray(path.read_bytes())
    values = dict(zip(names, struct.unpack("<IIIfII", data[:24])))
    values.update(fields)
    data[:24] = struct.pack("<IIIfII", *(values[n] for n in names))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fields, message", [
    (dict(magic=0x12345678), "magic is 0x12345678, not Hesper's 0x4C4F5241"),
    (dict(version=2), "Hesper format version 2; only version 1 is supported"),
    (dict(reserved=5), "the contents differ from when the file was written (CRC-32 mismatch)"),
    (dict(rank=0), "rank is 0; it must be at least 1"),
    (dict(alpha=float("nan")), "alpha is nan, not a finite number"),
    (dict(layers=3), "the adapter has 3 layers, this model has 2"),
    (dict(rank=R + 1), "bytes short); a rank-5 Hesper adapter for this model (2 layers, dim=64, kvDim=32)"),
])
def test_hesper_header_errors(tmp_path, pristine, base, fields, message):
    path = hesper_file(tmp_path, pristine)
    rewrite_header(path, **fields)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_adapter(base, path, format="hesper")
    assert not lora_modules(base), "nothing applied before the checks passed"


@pytest.mark.parametrize("change, message", [
    (lambda d: d[:-4], "4 bytes short"),
    (lambda d: d + bytes(8), "8 bytes too many"),
    (lambda d: d[:10], "10 bytes, shorter than the 24-byte Hesper header"),
])
def test_hesper_size_errors(tmp_path, pristine, base, change, message):
    path = hesper_file(tmp_path, pristine)
    path.write_bytes(change(path.read_bytes()))
    with pytest.raises(ValueError, match=re.escape(message)):
        load_adapter(base, path, format="hesper")
    assert not lora_modules(base)


def test_hesper_from_a_model_of_other_dimensions_is_refused(tmp_path, small, base):
    path = save_adapter(with_adapter(BitNetForCausalLM.from_pretrained(small)), tmp_path / "small.lora",
                        format="hesper")
    with pytest.raises(ValueError, match=r"dim=64, kvDim=32\) is \d+ bytes: the file is truncated, or was made "
                                         r"for a model with other dimensions"):
        load_adapter(base, path)


def test_a_hesper_save_creates_missing_parent_folders(base, pristine, tmp_path):
    path = save_adapter(with_adapter(base), tmp_path / "new" / "deeper" / "adapter.lora", format="hesper")
    again = load_adapter(copy.deepcopy(pristine), path)
    assert all(torch.equal(m.lora_B, lora_modules(base)[n].lora_B) for n, m in lora_modules(again).items())


def test_hesper_rank_mismatch_with_existing_adapters_changes_nothing(tmp_path, pristine, base):
    path = hesper_file(tmp_path, pristine, r=R)
    with_adapter(base, r=2)
    before = adapter_tensors(base)
    with pytest.raises(ValueError, match="the model's adapter model.layers.0.self_attn.q_proj has rank 2, "
                                         "the file's has rank 4"):
        load_adapter(base, path)
    after = adapter_tensors(base)
    assert all(torch.equal(before[n][0], after[n][0]) and torch.equal(before[n][1], after[n][1]) for n in before)


def test_hesper_save_errors(base, tmp_path):
    with_adapter(base, target_modules=("q_proj", "k_proj", "v_proj"))
    with pytest.raises(ValueError, match=r"exactly the q_proj and v_proj adapters of every layer; this model has "
                                         r"adapters on \['model.layers.0.self_attn.k_proj'"):
        save_adapter(base, tmp_path / "a.lora", format="hesper")


def test_hesper_save_refuses_an_alpha_float32_cannot_hold(base, tmp_path):
    with_adapter(base, lora_alpha=0.1)
    with pytest.raises(ValueError, match=r"lora_alpha=0.1 is not exactly a float32"):
        save_adapter(base, tmp_path / "a.lora", format="hesper")
    assert not (tmp_path / "a.lora").exists()


# -- refusals when reading PEFT folders --------------------------------------------------------

@pytest.fixture
def peft_folder(tmp_path, pristine):
    """A valid adapter folder of ours, to break in each test."""
    return save_adapter(with_adapter(copy.deepcopy(pristine)), tmp_path / "adapter")


def edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_tensors(folder, change):
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize("key, value, feature", [
    ("use_dora", True, "DoRA"),
    ("bias", "all", "trained biases"),
    ("lora_bias", True, "a bias on lora_B"),
    ("fan_in_fan_out", True, "transposed (Conv1D) base weights"),
    ("modules_to_save", ["lm_head"], "fully trained extra modules"),
    ("target_parameters", ["mlp.experts.gate_up_proj"], "adapters on raw parameters"),
    ("trainable_token_indices", [5, 6], "trainable token embeddings"),
    ("layer_replication", [[0, 2]], "replicated layers"),
    ("use_qalora", True, "QA-LoRA"),
])
def test_peft_features_we_cannot_honour_are_refused_by_name(peft_folder, base, key, value, feature):
    edit_config(peft_folder, **{key: value})
    with pytest.raises(ValueError, match=re.escape(f"{key}={value!r} asks for {feature}") + ".*does not implement"):
        load_adapter(base, peft_folder)
    assert not lora_modules(base)


def test_unknown_peft_options_are_refused_unless_off(peft_folder, base):
    edit_config(peft_folder, future_option=None, future_flag=False)
    load_adapter(copy.deepcopy(base), peft_folder)  # off: fine
    edit_config(peft_folder, future_flag=True)
    with pytest.raises(ValueError, match=r"unknown option future_flag=True \(from a newer peft\?\)"):
        load_adapter(base, peft_folder)


@pytest.mark.parametrize("changes, message", [
    (dict(peft_type="IA3"), "peft_type is 'IA3'; only LoRA adapters"),
    (dict(r=0), "r must be a positive integer, got 0"),
    (dict(lora_alpha="8"), "lora_alpha must be a finite number > 0, got '8'"),
    (dict(lora_alpha=float("nan")), "lora_alpha must be a finite number > 0, got nan"),
    (dict(lora_alpha=0), "lora_alpha must be a finite number > 0, got 0"),
    (dict(lora_dropout=1.0), "lora_dropout must be a number in [0, 1), got 1.0"),
    (dict(r=8), "has lora_A [4, 64] and lora_B [64, 4], which is not rank r=8 from adapter_config.json"),
    (dict(target_modules=["q_proj"]), "target_modules ('q_proj',) disagree with the file's tensors, which adapt "
     "['q_proj', 'v_proj']: they hold weights for ['model.layers.0.self_attn.v_proj', "
     "'model.layers.1.self_attn.v_proj'], which target_modules does not select (peft would leave them unused)"),
    (dict(target_modules=["q_proj", "v_proj", "k_proj"]), "target_modules ('q_proj', 'v_proj', 'k_proj') disagree "
     "with the file's tensors, which adapt ['q_proj', 'v_proj']: target_modules selects "
     "['model.layers.0.self_attn.k_proj', 'model.layers.1.self_attn.k_proj'], which they hold no weights for"),
    (dict(target_modules=r".*\.q_proj"), "target_modules '.*\\\\.q_proj' disagree with the file's tensors"),
    (dict(target_modules=7), "target_modules must be module names such as ('q_proj', 'v_proj'), 'all-linear' or a "
     "regular expression, got 7"),
    (dict(rank_pattern={"v_proj": 8}), "v_proj has lora_A [4, 64] and lora_B [32, 4], which is not rank r=8"),
    (dict(init_lora_weights="pissa"), "init_lora_weights='pissa' (pissa) starts the adapter from the base weights"),
    (dict(init_lora_weights="olora"), "init_lora_weights='olora' (olora) starts the adapter from the base weights"),
    (dict(target_modules=["k_proj"]), "they hold weights for ['model.layers.0.self_attn.q_proj'"),
    (dict(layers_to_transform=[0]), "layers_to_transform=(0,) disagree with the file's tensors, which adapt "
     "['q_proj', 'v_proj']: they hold weights for ['model.layers.1.self_attn.q_proj'"),
])
def test_bad_peft_config_values(peft_folder, base, changes, message):
    edit_config(peft_folder, **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_adapter(base, peft_folder)


def test_pickled_weights_are_never_unpickled(peft_folder, base):
    (peft_folder / "adapter_model.safetensors").unlink()
    marker = peft_folder.parent / "unpickled"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (peft_folder / "adapter_model.bin").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(ValueError, match=r"holds adapter_model.bin, a pickle, and no adapter_model.safetensors\. "
                                         r"Unpickling can run arbitrary code, so torch_wgpu_lora never does"):
        load_adapter(base, peft_folder)
    assert not marker.exists()


@pytest.mark.parametrize("remove, message", [
    ("adapter_config.json", "has no adapter_config.json: not a PEFT adapter folder"),
    ("adapter_model.safetensors", "has no adapter_model.safetensors: not a PEFT adapter folder"),
])
def test_incomplete_peft_folders(peft_folder, base, remove, message):
    (peft_folder / remove).unlink()
    with pytest.raises(ValueError, match=re.escape(message)):
        load_adapter(base, peft_folder)


def test_broken_peft_files(peft_folder, base):
    (peft_folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json is not valid JSON"):
        load_adapter(base, peft_folder)
    (peft_folder / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="adapter_config.json holds a JSON list, not an object"):
        load_adapter(base, peft_folder)


def test_corrupt_safetensors(peft_folder, base):
    (peft_folder / "adapter_model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!")
    with pytest.raises(ValueError, match="adapter_model.safetensors is not a valid safetensors file"):
        load_adapter(base, peft_folder)


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({f"{Q0}.lora_magnitude_vector": torch.ones(64)}),
     f"tensor '{Q0}.lora_magnitude_vector' is not a lora_A/lora_B weight; extra tensors (DoRA magnitudes"),
    (lambda t: t.pop(f"{Q0}.lora_B.weight"), "model.layers.0.self_attn.q_proj has no lora_B weight"),
    (lambda t: t.update({f"{Q0}.lora_A.weight": torch.ones(R, 64, dtype=torch.int32)}),
     f"tensor '{Q0}.lora_A.weight' has dtype I32"),
    (lambda t: t.update({k.replace("layers.1.", "layers.7."): t.pop(k) for k in list(t) if "layers.1." in k}),
     "the adapter targets 'model.layers.7.self_attn.q_proj', but this model has no linear module of that name"),
    (lambda t: [t.pop(k) for k in list(t) if "layers.1." in k],
     "target_modules selects ['model.layers.1.self_attn.q_proj', 'model.layers.1.self_attn.v_proj'], which they "
     "hold no weights for"),
])
def test_bad_peft_tensors(peft_folder, base, change, message):
    edit_tensors(peft_folder, change)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_adapter(base, peft_folder)
    assert not lora_modules(base)


def test_peft_adapter_of_another_model_size_is_refused(small, base, tmp_path):
    path = save_adapter(with_adapter(BitNetForCausalLM.from_pretrained(small)), tmp_path / "small")
    with pytest.raises(ValueError, match=re.escape(
            "model.layers.0.self_attn.q_proj has lora_A [4, 32] and lora_B [32, 4], but this model's "
            "model.layers.0.self_attn.q_proj (64 -> 64) needs lora_A [4, 64] and lora_B [64, 4]")):
        load_adapter(base, path)
    assert not lora_modules(base)


def test_existing_adapters_must_match_the_file(peft_folder, pristine):
    only_q = with_adapter(copy.deepcopy(pristine), target_modules=("q_proj",))
    with pytest.raises(ValueError, match=re.escape("the model's adapters do not match the file's: only in the model "
                                                   "[], only in the file ['model.layers.0.self_attn.v_proj'")):
        load_adapter(only_q, peft_folder)
    other_rank = with_adapter(copy.deepcopy(pristine), r=2)
    with pytest.raises(ValueError, match="has rank 2, the file's has rank 4"):
        load_adapter(other_rank, peft_folder)
    merged = with_adapter(copy.deepcopy(pristine))
    lora_modules(merged)["model.layers.1.self_attn.v_proj"].merge()
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.v_proj is merged into its base weight; unmerge\(\)"):
        load_adapter(merged, peft_folder)


# -- format detection and arguments ------------------------------------------------------------

def test_format_detection_and_arguments(peft_folder, base, tmp_path):
    with pytest.raises(FileNotFoundError, match="no adapter at"):
        load_adapter(base, tmp_path / "missing")
    (tmp_path / "junk.bin").write_bytes(b"PK\x03\x04 not an adapter")
    with pytest.raises(ValueError, match="neither a PEFT adapter folder .* nor a Hesper adapter file"):
        load_adapter(base, tmp_path / "junk.bin")
    with pytest.raises(ValueError, match="format must be one of \\('peft', 'hesper'\\) or None, got 'gguf'"):
        load_adapter(base, peft_folder, format="gguf")
    with pytest.raises(ValueError, match="is not a folder; a PEFT adapter is a folder"):
        load_adapter(base, tmp_path / "junk.bin", format="peft")
    with pytest.raises(ValueError, match="is not a file; a Hesper adapter is one binary file"):
        load_adapter(base, peft_folder, format="hesper")
    assert not lora_modules(base)


# -- integrity: checksums, non-finite values, what is not an adapter ----------------------------

def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor: a lowest mantissa bit, still a finite float
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_our_peft_weights_is_refused(peft_folder, base):
    weights = peft_folder / "adapter_model.safetensors"
    with safetensors.safe_open(str(weights), "pt") as f:
        assert re.fullmatch(r"[0-9a-f]{64}", f.metadata()["torch_wgpu_lora_sha256"])
    flip_last_byte(weights)
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: the tensors differ from when the file was "
                                         r"written \(checksum mismatch\): the file is damaged"):
        load_adapter(base, peft_folder)
    assert not lora_modules(base)


def test_a_flipped_bit_in_our_hesper_file_is_refused(tmp_path, pristine, base):
    path = hesper_file(tmp_path, pristine)
    flip_last_byte(path)
    with pytest.raises(ValueError, match=r"the contents differ from when the file was written \(CRC-32 mismatch\)"):
        load_adapter(base, path)
    assert not lora_modules(base)


def test_files_without_our_checksum_still_load(tmp_path, pristine, base, peft_trained):
    peft_path, theirs = peft_trained
    with safetensors.safe_open(str(peft_path / "adapter_model.safetensors"), "pt") as f:
        assert "torch_wgpu_lora_sha256" not in (f.metadata() or {})  # written by real peft
    assert_matches(logits(set_backend(load_adapter(copy.deepcopy(pristine), peft_path), "torch")), theirs,
                   logits(pristine), "torch")
    model = with_adapter(copy.deepcopy(pristine))
    path = save_adapter(model, tmp_path / "adapter.lora", format="hesper")
    rewrite_header(path, reserved=0)  # as Hesper writes it
    assert torch.equal(logits(set_backend(load_adapter(base, path), "torch")), logits(model))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_peft_weights_are_refused(peft_folder, base, value):
    def poison(tensors):  # rewritten without our checksum, as another tool would write it
        tensors[f"{Q0}.lora_B.weight"][3, 1] = value

    edit_tensors(peft_folder, poison)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.lora_B holds 1 NaN or infinite values; "
                                         r"the adapter is broken"):
        load_adapter(base, peft_folder)
    assert not lora_modules(base)


def test_non_finite_hesper_weights_are_refused(tmp_path, pristine, base):
    path = hesper_file(tmp_path, pristine)
    data = bytearray(path.read_bytes())
    data[24:28] = struct.pack("<f", float("-inf"))  # layer 0's Q_A[0, 0]
    path.write_bytes(bytes(data))
    rewrite_header(path, reserved=0)  # no checksum: the value check alone must catch it
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.lora_A holds 1 NaN or infinite values"):
        load_adapter(base, path)
    assert not lora_modules(base)


def test_a_fifo_is_refused_without_being_opened(tmp_path, base):
    fifo = tmp_path / "adapter.lora"
    os.mkfifo(fifo)
    outcome = []

    def load():  # opening a FIFO for reading blocks until a writer comes: run it where it cannot hang the suite
        try:
            load_adapter(base, fifo)
        except Exception as err:
            outcome.append(err)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "load_adapter blocked on the FIFO"
    assert isinstance(outcome[0], ValueError)
    assert "is neither a regular file nor a folder (a FIFO, socket or device?)" in str(outcome[0])


def test_a_training_checkpoint_points_to_its_adapter(peft_folder, base, tmp_path):
    checkpoint = tmp_path / "step-000010"
    checkpoint.mkdir()
    os.rename(peft_folder, checkpoint / "adapter")
    with pytest.raises(ValueError, match=re.escape(f"{checkpoint} is not an adapter folder but holds one (a training "
                                                   f"checkpoint or output folder?): pass {checkpoint / 'adapter'}")):
        load_adapter(base, checkpoint)


def test_saved_files_get_the_mode_the_umask_gives(pristine, tmp_path):
    model = with_adapter(copy.deepcopy(pristine))
    old = os.umask(0o027)
    try:
        folder = save_adapter(model, tmp_path / "adapter")
        hesper = save_adapter(model, tmp_path / "adapter.lora", format="hesper")
    finally:
        os.umask(old)
    modes = {p.name: os.stat(p).st_mode & 0o777 for p in (folder, hesper, *folder.iterdir())}
    assert modes == {"adapter": 0o750, "adapter.lora": 0o640, "adapter_config.json": 0o640,
                     "adapter_model.safetensors": 0o640}  # readable by the group, as open() would make them


# -- refusals when saving ----------------------------------------------------------------------

def test_save_errors(pristine, tmp_path):
    with pytest.raises(ValueError, match=r"the model has no LoRA adapters to save \(call apply_lora first\)"):
        save_adapter(copy.deepcopy(pristine), tmp_path / "a")
    model = with_adapter(copy.deepcopy(pristine))
    with pytest.raises(ValueError, match="format must be one of \\('peft', 'hesper', 'gguf'\\), got 'bin'"):
        save_adapter(model, tmp_path / "a", format="bin")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file; format='peft' writes a folder"):
        save_adapter(model, tmp_path / "file")
    with pytest.raises(ValueError, match="is a folder; format='hesper' writes one file"):
        save_adapter(model, tmp_path, format="hesper")

    name = "model.layers.1.self_attn.v_proj"
    mixed = copy.deepcopy(model)
    lora_modules(mixed)[name].use_rslora = True
    lora_modules(mixed)[name].scaling = ALPHA / R ** 0.5
    with pytest.raises(ValueError, match=re.escape("the adapters do not share one scaling rule (use_rslora): "
                                                   "model.layers.0.self_attn.q_proj has False, "
                                                   f"{name} has True; a PEFT config has one use_rslora")):
        save_adapter(mixed, tmp_path / "a")

    rescaled = copy.deepcopy(model)
    lora_modules(rescaled)[name].scaling = 3.0
    with pytest.raises(ValueError, match=re.escape(f"{name}.scaling is 3.0, not lora_alpha / r = 2.0")):
        save_adapter(rescaled, tmp_path / "a")
    assert sorted(os.listdir(tmp_path)) == ["file"], "failed saves leave nothing behind"


# -- atomic writes ----------------------------------------------------------------------------

def boom(*args, **kwargs):
    raise OSError(28, "No space left on device (simulated)")


def fail_on_call(n, real):
    """A stand-in for ``real`` that raises on its n-th call (1-based)."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            boom()
        return real(*args, **kwargs)

    return wrapper


CRASHES = {
    "serialising the weights": (safetensors.torch, "save", lambda real: boom),
    "serialising the config": (json, "dumps", lambda real: boom),
    "syncing the weights": (os, "fsync", lambda real: fail_on_call(1, real)),
    "syncing the config": (os, "fsync", lambda real: fail_on_call(2, real)),
}


@pytest.mark.parametrize("crash", list(CRASHES))
def test_a_failed_peft_save_leaves_the_previous_adapter_intact(pristine, tmp_path, monkeypatch, crash):
    first = with_adapter(copy.deepcopy(pristine), seed=1)
    path = save_adapter(first, tmp_path / "adapter")
    before = {name: (path / name).read_bytes() for name in os.listdir(path)}
    second = with_adapter(copy.deepcopy(pristine), r=2, seed=2)
    module, attr, make = CRASHES[crash]
    for target in (path, tmp_path / "new"):  # over the previous adapter, and into a folder it would create
        monkeypatch.setattr(module, attr, make(getattr(module, attr)))
        with pytest.raises(OSError, match="simulated"):
            save_adapter(second, target)
        monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["adapter"], "no temporary or half-made folders"
    assert {name: (path / name).read_bytes() for name in os.listdir(path)} == before, "no temporary files"
    loaded = load_adapter(copy.deepcopy(pristine), path)
    assert all(torch.equal(m.lora_B, lora_modules(first)[n].lora_B) for n, m in lora_modules(loaded).items())


def test_two_saves_creating_one_new_folder_at_once_leave_one_whole_save(pristine, tmp_path, monkeypatch):
    # The second save finds the folder made by the first when it renames its own into place.
    first, second = (with_adapter(copy.deepcopy(pristine), lora_alpha=alpha, seed=seed)
                     for alpha, seed in ((8.0, 1), (16.0, 2)))
    path = tmp_path / "adapter"
    rename = os.rename

    def first_save_wins(src, dst):
        monkeypatch.setattr(os, "rename", rename)
        save_adapter(first, path)
        rename(src, dst)

    monkeypatch.setattr(os, "rename", first_save_wins)
    save_adapter(second, path)
    assert sorted(os.listdir(tmp_path)) == ["adapter"] and sorted(os.listdir(path)) == [
        "adapter_config.json", "adapter_model.safetensors"]
    loaded = load_adapter(copy.deepcopy(pristine), path)
    assert all(m.lora_alpha == 16.0 and torch.equal(m.lora_B, lora_modules(second)[n].lora_B)
               for n, m in lora_modules(loaded).items())


def test_a_crash_inside_the_commit_leaves_an_unloadable_folder_not_a_mix(pristine, tmp_path, monkeypatch):
    path = save_adapter(with_adapter(copy.deepcopy(pristine), seed=1), tmp_path / "adapter")
    new = with_adapter(copy.deepcopy(pristine), r=2, seed=2)
    # The first os.replace swaps in the weights; failing the second stops just before the config returns.
    monkeypatch.setattr(os, "replace", fail_on_call(2, os.replace))
    with pytest.raises(OSError, match="simulated"):
        save_adapter(new, path)
    monkeypatch.undo()
    assert sorted(os.listdir(path)) == ["adapter_model.safetensors"]
    with pytest.raises(ValueError, match="has no adapter_config.json: not a PEFT adapter folder \\(or a save into "
                                         "it was interrupted, or was being written while it was read\\)"):
        load_adapter(copy.deepcopy(pristine), path)
    save_adapter(new, path)  # saving again repairs it
    assert lora_modules(load_adapter(copy.deepcopy(pristine), path))["model.layers.0.self_attn.q_proj"].r == 2


@pytest.mark.parametrize("attr", ["fsync", "replace"])
def test_a_failed_hesper_save_leaves_the_previous_file_intact(pristine, tmp_path, monkeypatch, attr):
    path = hesper_file(tmp_path, pristine)
    before = path.read_bytes()
    second = with_adapter(copy.deepcopy(pristine), r=2, seed=2)
    monkeypatch.setattr(os, attr, boom)  # fails writing the temporary file, or renaming it over the old one
    with pytest.raises(OSError, match="simulated"):
        save_adapter(second, path, format="hesper")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["adapter.lora"] and path.read_bytes() == before
    assert lora_modules(load_adapter(copy.deepcopy(pristine), path))["model.layers.0.self_attn.q_proj"].r == R


def test_a_config_from_another_save_is_refused_naming_both(pristine, tmp_path):
    # What a read between a save's two renames meets where folders cannot be locked.
    path = save_adapter(with_adapter(copy.deepcopy(pristine), lora_alpha=8.0), tmp_path / "adapter")
    other = save_adapter(with_adapter(copy.deepcopy(pristine), lora_alpha=16.0), tmp_path / "other")
    (path / "adapter_config.json").write_bytes((other / "adapter_config.json").read_bytes())
    with pytest.raises(ValueError, match=re.escape(
            "adapter_config.json is not the config adapter_model.safetensors was saved with (lora_alpha=16 in the "
            "config, 8 with the weights): the folder was being written while it was read (load it again), or it "
            "was edited since (save the adapter again)")):
        load_adapter(copy.deepcopy(pristine), path)



def test_a_config_from_another_save_differing_in_a_pattern_is_refused(pristine, tmp_path):
    # Per-module alphas change the model as much as lora_alpha does: the weights record them too.
    path = save_adapter(with_adapter(copy.deepcopy(pristine)), tmp_path / "adapter")
    other = save_adapter(with_adapter(copy.deepcopy(pristine), alpha_pattern={"v_proj": 16.0}), tmp_path / "other")
    (path / "adapter_config.json").write_bytes((other / "adapter_config.json").read_bytes())
    with pytest.raises(ValueError, match=re.escape(
            "adapter_config.json is not the config adapter_model.safetensors was saved with (alpha_pattern="
            "{'v_proj': 16} in the config, {} with the weights): the folder was being written")):
        load_adapter(copy.deepcopy(pristine), path)


@pytest.mark.parametrize("locks", [True, False])
def test_a_folder_read_while_two_processes_save_into_it_gives_one_whole_save_or_says_so(dense, tmp_path, locks):
    # Two writers alternate saves of lora_alpha 4 (weights 1.0) and 16 (weights 2.0) into one folder
    # while a third process loads it over and over: each load must be one save whole, or the error
    # saying the folder was being written; never a mix, a false "damaged", or a FileNotFoundError.
    # Without locks (as where folders cannot be locked) the weights' record of their config is what
    # catches a read between a save's two renames.
    folder = save_adapter(adapter_of(dense, *SAVES[0]), tmp_path / "adapter")
    ctx = multiprocessing.get_context("spawn")
    results, go = ctx.Queue(), ctx.Event()
    saves_made, whole_loads = ctx.Value("i", 0), ctx.Value("i", 0)
    processes, ready = [], []
    for target in (save_in_turns, save_in_turns, load_in_turns):
        ready.append(ctx.Event())
        processes.append(ctx.Process(target=target, args=(str(dense), str(folder), locks, ready[-1], go, saves_made,
                                                          whole_loads, results)))
        processes[-1].start()
    try:
        assert all(event.wait(timeout=300) for event in ready), "a process did not start"
        go.set()
        reports = [results.get(timeout=RACE_LIMIT + 120) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    saves = sum(report[1] for report in reports if report[0] == "saves")
    (_, outcomes, others), = [report for report in reports if report[0] == "loads"]
    assert not others, f"{len(others)} bad loads of {sum(outcomes.values()) + len(others)}, e.g. {others[:3]}"
    # the two really ran at once (short of these counts, the time limit stopped them)
    assert saves >= RACE_SAVES and outcomes["whole"] >= RACE_LOADS, (saves, outcomes)
    if locks:  # a read under the lock meets no save half done
        assert outcomes["being written"] == 0, outcomes
