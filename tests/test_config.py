"""LoraConfig: every field checked on construction with an error naming it; apply_lora takes a
config or keyword fields and the model remembers the config it was given."""

from __future__ import annotations

import copy
import dataclasses
import re

import numpy as np
import pytest
import torch

import torch_wgpu_lora as twl
from torch_wgpu_lora.config import LoraConfig
from torch_wgpu_lora.integrations.adapter_files import load_adapter_file, save_adapter
from torch_wgpu_lora.integrations.bitnet import add_lora_layers, load_bitnet, lora_modules, set_backend
from torch_wgpu_lora.integrations.tiny import build_tiny_bitnet


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_bitnet(tmp_path_factory.mktemp("config") / "dense", flavour="dense")


@pytest.fixture(scope="module")
def pristine(checkpoint):
    return load_bitnet(checkpoint)


def test_defaults_and_normalised_values():
    config = LoraConfig()
    assert (config.r, config.lora_alpha, config.target_modules, config.lora_dropout, config.init, config.seed,
            config.backend) == (8, 8.0, ("q_proj", "v_proj"), 0.0, "hesper", 42, "wgpu")
    config = LoraConfig(r=np.int64(4), lora_alpha=16, target_modules=["q_proj"], lora_dropout=np.float32(0.25))
    assert (type(config.r), config.r, type(config.lora_alpha), config.scaling) == (int, 4, float, 4.0)
    assert config.target_modules == ("q_proj",) and config.lora_dropout == 0.25
    assert LoraConfig(target_modules="o_proj").target_modules == ("o_proj",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.r = 2


@pytest.mark.parametrize("alpha", [np.float32(16.0), np.float64(16.0), np.int32(16), 16, 16.0])
def test_numpy_and_python_numbers_are_the_same_alpha(alpha):
    config = LoraConfig(r=4, lora_alpha=alpha)
    assert type(config.lora_alpha) is float and config.lora_alpha == 16.0 and config.scaling == 4.0


@pytest.mark.parametrize("fields, message", [
    (dict(r=0), "r must be a positive integer, got 0"),
    (dict(r=2.0), "r must be a positive integer, got 2.0"),
    (dict(r=True), "r must be a positive integer, got True"),
    (dict(lora_alpha=float("nan")), "lora_alpha must be a finite number > 0, got nan"),
    (dict(lora_alpha=float("inf")), "lora_alpha must be a finite number > 0, got inf"),
    (dict(lora_alpha=np.float32("nan")), "lora_alpha must be a finite number > 0, got np.float32(nan)"),
    (dict(lora_alpha="8"), "lora_alpha must be a finite number > 0, got '8'"),
    (dict(lora_alpha=True), "lora_alpha must be a finite number > 0, got True"),
    (dict(lora_alpha=-1.0), "lora_alpha must be a finite number > 0, got -1.0"),
    (dict(lora_alpha=torch.tensor(8.0)), "lora_alpha must be a finite number > 0, got tensor(8.)"),
    (dict(r=1, lora_alpha=1e39), "lora_alpha=1e+39 gives scaling lora_alpha / r = 1e+39, beyond float32's largest "
                                 "value (3.4e+38) that the kernels compute in"),
    (dict(lora_dropout=1.0), "lora_dropout must be a number in [0, 1), got 1.0"),
    (dict(lora_dropout=float("nan")), "lora_dropout must be a number in [0, 1), got nan"),
    (dict(lora_dropout="0.1"), "lora_dropout must be a number in [0, 1), got '0.1'"),
    (dict(target_modules=()), "target_modules must be one or more module names"),
    (dict(target_modules=("q_proj", "")), "target_modules must be one or more module names"),
    (dict(target_modules=("self_attn.",)), "target_modules must be one or more module names (the last part"),
    (dict(target_modules=("q proj",)), "target_modules must be one or more module names (the last part"),
    (dict(target_modules=5), "target_modules must be module names such as ('q_proj', 'v_proj'), 'all-linear' or a "
                             "regular expression, got 5"),
    (dict(target_modules="(q_proj"), "target_modules='(q_proj' is not a valid regular expression"),
    (dict(exclude_modules=[3]), "exclude_modules must be one or more module names"),
    (dict(layers_to_transform=[-1]), "layers_to_transform must be layer indices (integers >= 0), got [-1]"),
    (dict(layers_to_transform=[0], target_modules=".*q_proj"), "layers_to_transform takes module names as "
                                                                 "target_modules"),
    (dict(rank_pattern={"q_proj": 0}), "rank_pattern['q_proj'] must be a positive integer, got 0"),
    (dict(alpha_pattern={"q_proj": float("inf")}), "alpha_pattern['q_proj'] must be a finite number > 0, got inf"),
    (dict(rank_pattern=[("q_proj", 2)]), "rank_pattern must be a dict of {regex: value}"),
    (dict(use_rslora="yes"), "use_rslora must be True or False, got 'yes'"),
    (dict(target_modules=("q_proj", "q_proj")), "target_modules names a module twice"),
    (dict(init="xavier"), "init must be one of ('hesper', 'peft', 'gaussian'), got 'xavier'"),
    (dict(seed=-1), "seed must be an integer in [0, 2**64), got -1"),
    (dict(seed=2 ** 64), "seed must be an integer in [0, 2**64)"),
    (dict(backend="cuda"), "backend must be one of ('wgpu', 'torch'), got 'cuda'"),
])
def test_every_bad_field_is_named(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LoraConfig(**fields)


def test_a_float32_sized_scaling_is_accepted():
    assert LoraConfig(r=1, lora_alpha=3e38).scaling == 3e38
    assert LoraConfig(r=16, lora_alpha=1e39).scaling == 1e39 / 16  # r brings it back into float32's range


def test_updated_checks_the_new_values_and_the_field_names():
    config = LoraConfig(r=4)
    assert config.updated(lora_alpha=8).scaling == 2.0 and config.r == 4
    with pytest.raises(ValueError, match="lora_alpha must be a finite number > 0, got nan"):
        config.updated(lora_alpha=float("nan"))
    with pytest.raises(TypeError, match=r"unknown LoraConfig field\(s\) \['rank'\]"):
        config.updated(rank=8)


def test_it_is_exported():
    assert twl.LoraConfig is LoraConfig and "LoraConfig" in twl.__all__


def test_apply_lora_takes_a_config_or_fields_and_remembers_it(pristine):
    by_fields = add_lora_layers(copy.deepcopy(pristine), r=4, lora_alpha=16, seed=3)
    by_config = add_lora_layers(copy.deepcopy(pristine), LoraConfig(r=4, lora_alpha=16, seed=3))
    overridden = add_lora_layers(copy.deepcopy(pristine), LoraConfig(r=2, lora_alpha=16, seed=3), r=4)
    expected = LoraConfig(r=4, lora_alpha=16, seed=3)
    for model in (by_fields, by_config, overridden):
        assert model.lora_config == expected
        assert all(m.r == 4 and m.scaling == 4.0 for m in lora_modules(model).values())
    for name, m in lora_modules(by_fields).items():  # same seeds, so the same initial A
        assert torch.equal(m.lora_A, lora_modules(by_config)[name].lora_A)
        assert torch.equal(m.lora_A, lora_modules(overridden)[name].lora_A)


@pytest.mark.parametrize("fields, error, message", [
    (dict(lora_alpha=float("nan")), ValueError, "lora_alpha must be a finite number > 0, got nan"),
    (dict(lora_alpha="8"), ValueError, "lora_alpha must be a finite number > 0, got '8'"),
    (dict(rank=8), TypeError, r"unknown LoraConfig field\(s\) \['rank'\]"),
    (dict(config={"r": 8}), TypeError, r"config must be a LoraConfig \(torch_wgpu_lora's or peft's\), got dict"),
])
def test_apply_lora_refuses_bad_settings_before_changing_the_model(pristine, fields, error, message):
    model = copy.deepcopy(pristine)
    config = fields.pop("config", None)
    with pytest.raises(error, match=message):
        add_lora_layers(model, config, **fields)
    assert not lora_modules(model) and not hasattr(model, "lora_config")
    assert all(p.requires_grad for p in model.parameters())


def test_the_remembered_config_follows_backend_and_loaded_alpha(pristine, tmp_path):
    model = add_lora_layers(copy.deepcopy(pristine), r=4, lora_alpha=8)
    set_backend(model, "torch")
    assert model.lora_config.backend == "torch"
    path = save_adapter(add_lora_layers(copy.deepcopy(pristine), r=4, lora_alpha=32), tmp_path / "adapter")
    load_adapter_file(model, path)
    assert model.lora_config.lora_alpha == 32.0 and all(m.lora_alpha == 32.0 for m in lora_modules(model).values())
    fresh = load_adapter_file(copy.deepcopy(pristine), path)
    assert (fresh.lora_config.r, fresh.lora_config.lora_alpha, fresh.lora_config.target_modules) == \
        (4, 32.0, ("q_proj", "v_proj"))
