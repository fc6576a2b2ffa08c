"""The integrations' tests' shared fixtures: a tiny dense BitNet checkpoint and its model."""

from __future__ import annotations

import copy

import pytest
from transformers import BitNetForCausalLM

from torch_wgpu_lora.integrations.tiny import build_tiny_bitnet


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return build_tiny_bitnet(tmp_path_factory.mktemp("dense"), flavour="dense", seed=0)


@pytest.fixture(scope="module")
def pristine(dense):
    return BitNetForCausalLM.from_pretrained(dense).eval()


@pytest.fixture
def base(pristine):
    """A fresh copy of the dense base model, without adapters."""
    return copy.deepcopy(pristine)
