"""transformers' BitNet models: loading all three checkpoint flavours (and refusing damaged or
mismatched folders), the packed BitLinear's straight-through backward, apply_lora, fresh
adapters, one training step."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers.integrations.bitnet import AutoBitLinear, BitLinear, pack_weights

from torch_wgpu_lora.init import hesper_uniform
from torch_wgpu_lora.integrations.bitnet import (add_lora_layers, load_bitnet, lora_modules, lora_parameters,
                                                 UNPACK_SHAPES, unpack_ternary, use_ste_backward)
from torch_wgpu_lora.integrations.tiny import FLAVOURS, TINY_CONFIG, build_tiny_bitnet, ternarize
from torch_wgpu_lora.modules import LoRALinear

from ..concurrency import in_threads

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYERS = TINY_CONFIG["num_hidden_layers"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per flavour, all from seed 0 (so they share their float weights)."""
    root = tmp_path_factory.mktemp("bitnet")
    return {flavour: build_tiny_bitnet(root / flavour, flavour=flavour, seed=0) for flavour in FLAVOURS}


def token_batch(seed: int, batch: int = 2, length: int = 32) -> torch.Tensor:
    return torch.randint(3, TINY_CONFIG["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """The packed format as the checkpoint spec states it, decoded independently of transformers:
    code slot i (bits 2i..2i+1) of byte row r holds output row i*out/4 + r, stored as value + 1."""
    rows = packed.shape[0]
    out = torch.empty((4 * rows, packed.shape[1]), dtype=torch.float32)
    for slot in range(4):
        out[slot * rows:(slot + 1) * rows] = ((packed.to(torch.int32) >> (2 * slot)) & 3).float() - 1
    return out


def projection(model: nn.Module, index: int, name: str) -> nn.Module:
    block = model.model.layers[index]
    return getattr(block.self_attn if hasattr(block.self_attn, name) else block.mlp, name)


# -- loading -----------------------------------------------------------------------------------

@pytest.mark.parametrize("flavour", FLAVOURS)
def test_load_bitnet_builds_the_layer_class_the_config_names(checkpoints, flavour):
    model = load_bitnet(checkpoints[flavour])
    q, k = projection(model, 0, "q_proj"), projection(model, 0, "k_proj")
    if flavour == "dense":
        assert type(q) is nn.Linear and q.weight.dtype == torch.float32
    elif flavour == "online":
        assert type(q) is AutoBitLinear and q.online_quant
    elif flavour == "packed":
        assert type(q) is BitLinear
        assert q.weight.dtype == torch.uint8 and q.weight.shape == (q.out_features // 4, q.in_features)
        assert q.weight_scale.shape == (1,)
    else:
        assert type(q) is AutoBitLinear and not q.online_quant
        assert set(q.weight.unique().tolist()) <= {-1.0, 0.0, 1.0}  # unpacked on load
    # GQA: 4 query heads share 2 key/value heads; the LM head is the embedding matrix.
    head_dim = TINY_CONFIG["hidden_size"] // TINY_CONFIG["num_attention_heads"]
    assert (q.out_features, k.out_features) == (4 * head_dim, 2 * head_dim)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_packed_checkpoint_matches_the_documented_format(checkpoints):
    """Both packed flavours store the dense weights' ternary codes, slot i of byte row r being
    output row i*out/4 + r; 'packed' stores the absmean scale (BitLinear divides by it),
    'packed-autobitlinear' its reciprocal (AutoBitLinear multiplies)."""
    dense = load_file(checkpoints["dense"] / "model.safetensors")
    packed = load_file(checkpoints["packed"] / "model.safetensors")
    auto = load_file(checkpoints["packed-autobitlinear"] / "model.safetensors")
    auto_model = load_bitnet(checkpoints["packed-autobitlinear"])
    keys = [k for k in dense if k.endswith("_proj.weight")]
    assert len(keys) == len(PROJECTIONS) * LAYERS
    for key in keys:
        values, scale = ternarize(dense[key])
        assert torch.equal(packed[key], auto[key])
        assert torch.equal(decode_packed(packed[key]), values)
        scale_key = key.replace(".weight", ".weight_scale")
        assert torch.equal(packed[scale_key], scale.reshape(1))
        # s · fl(1/s) = 1 + δ with |δ| ≤ 2^-24 (one float32 rounding); exact in float64.
        assert abs(packed[scale_key].double().item() * auto[scale_key].double().item() - 1) <= 2.0 ** -24
        assert torch.equal(auto_model.get_submodule(key[: -len(".weight")]).weight, values)


def test_load_bitnet_reports_bad_folders(tmp_path, checkpoints):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_bitnet(tmp_path / "missing")
    (tmp_path / "file.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is not a folder"):
        load_bitnet(tmp_path / "file.bin")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_bitnet(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="holds a 'llama' model; load_bitnet loads model_type 'bitnet'"):
        load_bitnet(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a JSON object"):
        load_bitnet(tmp_path)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        load_bitnet(checkpoints["dense"], dtype=torch.int8)


def copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


@pytest.mark.parametrize("flavour", ["dense", "packed-autobitlinear"])
def test_a_truncated_weights_file_is_named(checkpoints, tmp_path, flavour):
    folder = copy_checkpoint(checkpoints[flavour], tmp_path / "model")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # the end of the last tensor is missing
    with pytest.raises(ValueError, match=re.escape(f"{weights} is not a complete safetensors file (") +
                       r".*\): truncated or damaged; download it again"):
        load_bitnet(folder)


@pytest.mark.parametrize("flavour", ["dense", "packed-autobitlinear"])
@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 128}, r"the weights do not match config.json: model.embed_tokens.weight is \[320, 64\] in "
                           r"the weights but \[320, 128\] by config.json \(22 tensors differ\)"),
    ({"vocab_size": 400}, r"model.embed_tokens.weight is \[320, 64\] in the weights but \[400, 64\] by config.json"),
    ({"num_hidden_layers": 3}, r"config.json describes tensors the weights lack, e.g. "
                               r"model.layers.2.input_layernorm.weight"),
    ({"num_hidden_layers": 1}, r"the weights hold tensors config.json does not describe, e.g. "
                               r"model.layers.1.input_layernorm.weight"),
])
def test_a_config_that_disagrees_with_the_weights_is_refused(checkpoints, tmp_path, flavour, change, message):
    folder = copy_checkpoint(checkpoints[flavour], tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        load_bitnet(folder)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_tensors_unlike_the_config_are_refused_when_transformers_reports_none(checkpoints, monkeypatch, flavour):
    # transformers 5.17 loads packed AutoBitLinear checkpoints' tensors as they are, whatever config.json
    # says, and reports no mismatch: load_bitnet compares every loaded shape with the config's itself.
    from transformers import BitNetForCausalLM

    loaded = load_bitnet(checkpoints[flavour])  # shapes and config agree (packed codes four rows a byte)
    loaded.config.hidden_size = 128
    silent = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    monkeypatch.setattr(BitNetForCausalLM, "from_pretrained", classmethod(lambda cls, *a, **k: (loaded, silent)))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight is \[320, 64\] in the weights but "
                                         r"\[320, 128\] by config.json"):
        load_bitnet(checkpoints[flavour])


@pytest.mark.parametrize("flavour", ["dense", "packed"])
def test_models_loaded_by_several_threads_at_once_are_whole(checkpoints, flavour):
    # transformers' from_pretrained, run in two threads at once, can leave lm_head untied (and every
    # later load in the process too); load_bitnet's loads take turns.
    expected = load_bitnet(checkpoints[flavour]).state_dict()

    def check(_: int) -> None:
        for _ in range(3):
            model = load_bitnet(checkpoints[flavour])
            assert model.lm_head.weight is model.model.embed_tokens.weight
            loaded = model.state_dict()  # the stored values, copied: equal bit for bit
            assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in loaded)

    in_threads(check, 4)


def test_an_untied_lm_head_is_refused_naming_transformers_leftover_no_op(checkpoints, monkeypatch):
    # What a from_pretrained racing in another thread (outside load_bitnet) leaves behind.
    from transformers import PreTrainedModel

    def empty_func(*args, **kwargs):
        pass

    empty_func.__qualname__ = "no_tie_weights.<locals>.empty_func"  # transformers' stand-in
    monkeypatch.setattr(PreTrainedModel, "tie_weights", empty_func)
    with pytest.raises(ValueError, match=re.escape(
            "lm_head is not tied to the embeddings, as config.json's tie_word_embeddings asks (transformers' "
            "tie_weights is 'no_tie_weights.<locals>.empty_func', the no-op its from_pretrained puts in place while it "
            "builds a model: a from_pretrained that ran at the same time in another thread, outside load_bitnet")):
        load_bitnet(checkpoints["dense"])


def test_a_folder_with_pickled_weights_only_is_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints["dense"], tmp_path / "model")
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"has no \*.safetensors weights \(it holds pytorch_model.bin: pickles, "
                                         r"which can run arbitrary code when loaded\); torch_wgpu_lora reads "
                                         r"safetensors only"):
        load_bitnet(folder)


# -- the packed BitLinear's straight-through backward ------------------------------------------

def test_ste_forward_is_transformers_forward_bit_for_bit(checkpoints):
    """Every projection of every layer in model order: layers of one shape share the unpacking
    buffers, so each must see its own weights."""
    model = load_bitnet(checkpoints["packed"])
    gen = torch.Generator().manual_seed(0)
    inputs = {name: torch.randn(3, 16, projection(model, 0, name).in_features, generator=gen) for name in PROJECTIONS}
    keys = [(index, name) for index in range(LAYERS) for name in PROJECTIONS]
    expected = {key: projection(model, *key)(inputs[key[1]]) for key in keys}
    assert use_ste_backward(model) == len(PROJECTIONS) * LAYERS
    for key in keys:
        assert torch.equal(projection(model, *key)(inputs[key[1]].clone().requires_grad_(True)), expected[key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unpack_ternary_decodes_the_packed_format_into_a_reused_buffer(dtype):
    gen = torch.Generator().manual_seed(4)
    first, second = (torch.randint(0, 256, (6, 10), generator=gen, dtype=torch.uint8) for _ in range(2))
    other_shape = torch.randint(0, 256, (3, 10), generator=gen, dtype=torch.uint8)
    a = unpack_ternary(first, dtype)
    assert a.dtype == dtype and torch.equal(a.float(), decode_packed(first))
    assert torch.equal(unpack_ternary(other_shape, dtype).float(), decode_packed(other_shape))
    b = unpack_ternary(second, dtype)
    assert torch.equal(b.float(), decode_packed(second))
    assert b.data_ptr() == a.data_ptr()  # one buffer a shape: no fresh pages a call
    for rows in range(7, 7 + UNPACK_SHAPES):  # as many other shapes as a thread keeps: the oldest, 6 rows, goes
        unpack_ternary(torch.zeros((rows, 10), dtype=torch.uint8), dtype)
    again = unpack_ternary(first, dtype)
    assert torch.equal(again.float(), decode_packed(first)) and again.data_ptr() != a.data_ptr()


def test_unpack_ternary_buffers_are_per_thread():
    packed = [torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(i), dtype=torch.uint8)
              for i in range(4)]
    expected = [decode_packed(p) for p in packed]

    def check(i: int) -> None:
        for _ in range(200):  # interleaved with the other threads' calls of the same shape
            assert torch.equal(unpack_ternary(packed[i], torch.float32), expected[i])

    in_threads(check, len(packed))


def test_ste_backward_is_dy_over_scale_times_ternary_weight(checkpoints):
    """dx = (dy / weight_scale) · W for BitLinear, the same as AutoBitLinear's autograd with
    the reciprocal scale: the semantics of the two classes, and no factor s² between them."""
    packed_model, auto_model = load_bitnet(checkpoints["packed"]), load_bitnet(checkpoints["packed-autobitlinear"])
    use_ste_backward(packed_model)
    gen = torch.Generator().manual_seed(1)
    for name in ("k_proj", "down_proj"):
        packed, auto = projection(packed_model, 0, name), projection(auto_model, 0, name)
        x = torch.randn(2, 8, packed.in_features, generator=gen)
        dy = torch.randn(2, 8, packed.out_features, generator=gen)
        expected = (dy.double() / packed.weight_scale.double()) @ decode_packed(packed.weight).double()
        grads = []
        for module in (packed, auto):
            xi = x.clone().requires_grad_(True)
            module(xi).backward(dy)
            grads.append(xi.grad)
        scale = expected.abs().max().item()
        for dx in grads:
            # float32 dot products of length ≤ 96 against float64: error ≤ 96·2^-24 ≈ 5.7e-6 of the scale.
            assert (dx.double() - expected).abs().max().item() <= 1e-5 * scale


def test_ste_backward_chains_through_the_optional_rms_norm():
    """BitLinear(use_rms_norm=True) normalises before quantising: dx goes through the norm."""
    gen = torch.Generator().manual_seed(2)
    module = nn.Sequential(BitLinear(64, 32, bias=False, dtype=torch.float32, use_rms_norm=True))
    bitlinear = module[0]
    values = torch.randint(-1, 2, (32, 64), generator=gen).float()
    with torch.no_grad():
        bitlinear.weight.copy_(pack_weights(values.clone()))
        bitlinear.weight_scale.fill_(7.0)
        bitlinear.rms_norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    assert use_ste_backward(module) == 1
    x = torch.randn(5, 64, generator=gen)
    dy = torch.randn(5, 32, generator=gen)
    x_ste = x.clone().requires_grad_(True)
    module(x_ste).backward(dy)
    x_ref = x.clone().requires_grad_(True)
    (bitlinear.rms_norm(x_ref) @ (values / 7.0).T).backward(dy)
    # Same float32 ops up to summation order (length 32): error ≤ 32·2^-24 ≈ 2e-6 of the scale.
    assert (x_ste.grad - x_ref.grad).abs().max().item() <= 1e-5 * x_ref.grad.abs().max().item()


def test_apply_lora_patches_every_packed_layer_wrapped_or_not(checkpoints):
    model = load_bitnet(checkpoints["packed"])
    keys = set(model.state_dict())
    add_lora_layers(model)
    for index in range(LAYERS):
        for name in PROJECTIONS:
            module = projection(model, index, name)
            base = module.base_layer if isinstance(module, LoRALinear) else module
            assert isinstance(base, BitLinear) and type(base) is not BitLinear, (index, name)
    lora_keys = {k for k in model.state_dict() if ".lora_" in k}
    stripped = {k.replace(".base_layer", "") for k in set(model.state_dict()) - lora_keys}
    assert stripped == keys  # buffers and their names are unchanged
    assert use_ste_backward(model) == 0  # already done
    assert use_ste_backward(load_bitnet(checkpoints["packed-autobitlinear"])) == 0  # AutoBitLinear has its own STE


def test_without_the_ste_patch_earlier_layers_get_wrong_gradients(checkpoints):
    """transformers' packed BitLinear casts activations to int8, so autograd's gradient to its
    input is almost nothing; every adapter's gradient flows back through later BitLinears. The
    reference is the same ternary weights as AutoBitLinear (offline), whose backward is STE."""
    ids = token_batch(3)

    def adapter_grads(model: nn.Module) -> list[torch.Tensor]:
        with torch.no_grad():
            for i, m in enumerate(lora_modules(model).values()):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=torch.Generator().manual_seed(i)) * 0.1)
        loss = model(input_ids=ids, labels=ids).loss
        return list(torch.autograd.grad(loss, lora_parameters(model)))

    reference = adapter_grads(add_lora_layers(load_bitnet(checkpoints["packed-autobitlinear"]), backend="torch"))
    patched = add_lora_layers(load_bitnet(checkpoints["packed"]), backend="torch")
    unpatched = add_lora_layers(load_bitnet(checkpoints["packed"]), backend="torch")
    for module in unpatched.modules():
        if isinstance(module, BitLinear):
            module.__class__ = BitLinear  # undo use_ste_backward: transformers' own backward
    cosine = lambda a, b: nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()  # noqa: E731
    with_patch = [cosine(g, r) for g, r in zip(adapter_grads(patched), reference)]
    without_patch = [cosine(g, r) for g, r in zip(adapter_grads(unpatched), reference)]
    # Same direction with the patch (an activation rounding flip between the two models' forwards
    # would cost at most ~1e-3 relative, cos > 0.999); unrelated without (measured |cos| < 0.3).
    assert min(with_patch) > 0.999, with_patch
    assert max(abs(c) for c in without_patch[:4]) < 0.5, without_patch  # layer 0's adapters


# -- apply_lora --------------------------------------------------------------------------------

def test_apply_lora_seeds_hesper_adapters_per_layer_and_freezes_the_rest(checkpoints):
    model = add_lora_layers(load_bitnet(checkpoints["dense"]), r=4, seed=7)
    adapters = lora_modules(model)
    assert list(adapters) == [f"model.layers.{i}.self_attn.{t}" for i in range(LAYERS) for t in ("q_proj", "v_proj")]
    hidden = TINY_CONFIG["hidden_size"]
    for i in range(LAYERS):
        q = adapters[f"model.layers.{i}.self_attn.q_proj"]
        v = adapters[f"model.layers.{i}.self_attn.v_proj"]
        assert torch.equal(q.lora_A, hesper_uniform((4, hidden), hidden, seed=7 + 2 * i))
        assert torch.equal(v.lora_A, hesper_uniform((4, hidden), hidden, seed=7 + 2 * i + 1))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(adapters)
    assert {id(p) for p in trainable} == {id(p) for p in lora_parameters(model)}


def test_apply_lora_rejects_unknown_targets_naming_the_modules_that_exist(checkpoints):
    model = load_bitnet(checkpoints["dense"])
    with pytest.raises(ValueError, match=r"\['query'\] match no module; linear modules in this model: "
                                         r"\['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', "
                                         r"'q_proj', 'up_proj', 'v_proj'\]"):
        add_lora_layers(model, target_modules=("q_proj", "query"))


def test_apply_lora_with_bad_arguments_leaves_the_model_untouched(checkpoints):
    model = load_bitnet(checkpoints["packed"])
    with pytest.raises(ValueError, match="r must be a positive integer"):
        add_lora_layers(model, r=0)
    assert not lora_modules(model)
    assert type(projection(model, 0, "q_proj")) is BitLinear
    assert model.model.embed_tokens.weight.requires_grad


# -- fresh adapters and one training step ------------------------------------------------------

@pytest.mark.parametrize("backend", ["wgpu", "torch"])
@pytest.mark.parametrize("flavour", ["dense", "online", "packed"])
def test_fresh_adapters_leave_the_logits_unchanged(checkpoints, flavour, backend):
    model = load_bitnet(checkpoints[flavour])
    ids = token_batch(4)
    # Eager: transformers compiles the online flavour's weight quantisation, and a compiled and an
    # eager call (dynamo falls back to eager once its recompile limit is reached) round the
    # absmean scale differently; both calls must take the same path for an exact comparison.
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        base = model(input_ids=ids).logits
        add_lora_layers(model, backend=backend)
        assert torch.equal(model(input_ids=ids).logits, base)  # B = 0: the update is exactly zero


@pytest.mark.parametrize("flavour", ["dense", "online", "packed"])
def test_one_training_step_on_webgpu_lowers_the_loss(checkpoints, flavour):
    model = add_lora_layers(load_bitnet(checkpoints[flavour]), backend="wgpu")
    ids = token_batch(5)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    # Plain SGD: for a small enough step the loss falls by ≈ lr·|g|². With lr = 0.5 B's entries move
    # by < 0.1 and the loss falls by 0.03-0.12 (measured), far above float32 noise.
    optimizer = torch.optim.SGD(lora_parameters(model), lr=0.5)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = model(input_ids=ids, labels=ids).loss
    assert after.item() < loss.item()
    for name, m in lora_modules(model).items():
        assert not torch.equal(m.lora_B, before[f"{name}.lora_B"]), name  # every adapter learned
        assert torch.equal(m.lora_A, before[f"{name}.lora_A"]), name  # dA = 0 while B = 0
    frozen = [n for n, p in model.named_parameters() if ".lora_" not in n]
    assert all(torch.equal(dict(model.named_parameters())[n], before[n]) for n in frozen)
