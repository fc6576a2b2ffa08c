"""What BitNetEngine accepts: every adapter it cannot run refused at construction, naming the module
(on lm_head, a PEFT layer, a PeftModel); PEFT models run once converted (``from_peft``), with the
PeftModel's logits; the engine follows the model's active adapter and ``disable_adapter``.

Dense models, logits within 1e-4 of the largest |logit| of transformers' own forward (as in
test_model.py: float32 on both sides, sums in other orders; a dropped or wrong adapter moves
logits by O(0.1-1)), each comparison also checking that the adapters change the logits by far more.
"""

from __future__ import annotations

import re
import tempfile

import peft
import pytest
import torch

import torch_wgpu_lora as twl
from torch_wgpu_lora import BitNetEngine
from torch_wgpu_lora.integrations.bitnet import load_bitnet, lora_modules, set_backend
from torch_wgpu_lora.integrations.tiny import build_tiny_bitnet

LOGIT_RTOL = 1e-4  # see the module docstring
IDS = torch.tensor([[0, 5, 17, 42, 99, 200, 7, 3], [9, 8, 7, 6, 5, 4, 3, 2]])


@pytest.fixture(scope="module")
def checkpoint():
    return build_tiny_bitnet(tempfile.mkdtemp(), flavour="dense", seed=0)


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def torch_logits(model):
    with torch.compiler.set_stance("force_eager"), torch.no_grad():
        return model(input_ids=IDS).logits


def assert_close(got, ref, unlike):
    scale = ref.abs().max().item()
    err = (got - ref).abs().max().item()
    assert err <= LOGIT_RTOL * scale, f"max |logit error| {err:.3g} vs largest |logit| {scale:.3g}"
    assert (ref - unlike).abs().max().item() > 100 * LOGIT_RTOL * scale, "the adapters barely change the logits"


def test_an_adapter_on_lm_head_is_refused_naming_it(checkpoint):
    model = twl.apply_lora(load_bitnet(checkpoint), r=4, target_modules=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match=re.escape("lm_head has a LoRA adapter, which BitNetEngine cannot run")):
        BitNetEngine(model)


def test_the_trainers_auto_choice_falls_back_to_torch_for_what_the_engine_refuses(checkpoint):
    from torch_wgpu_lora.engine import choose_engine

    model = twl.apply_lora(load_bitnet(checkpoint), r=4, target_modules=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match="lm_head has a LoRA adapter"):
        choose_engine(model, "wgpu")
    assert choose_engine(model, "auto") is None


def test_peft_layers_are_refused_and_run_once_converted(checkpoint):
    base = load_bitnet(checkpoint).eval()
    reference = torch_logits(base)
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                           "down_proj"]))
    randomize(theirs, 1).eval()
    for model in (theirs, theirs.base_model.model):  # the PeftModel, and the base it wrapped in place
        with pytest.raises(ValueError, match=re.escape("model.layers.0.self_attn.q_proj is a PEFT layer (Linear), "
                                                       "which BitNetEngine does not run; convert the model with")):
            BitNetEngine(model)
    engine = BitNetEngine(twl.from_peft(theirs))
    assert_close(engine(IDS).logits, torch_logits(theirs), reference)


def test_the_engine_follows_the_active_adapter_and_disable_adapter(checkpoint):
    pristine = load_bitnet(checkpoint).eval()
    reference = torch_logits(pristine)
    model = randomize(twl.apply_lora(load_bitnet(checkpoint), r=4, target_modules=("q_proj", "v_proj")), 2).eval()
    model.add_adapter("wide", peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    engine = BitNetEngine(model)
    expected_default = torch_logits(set_backend(model, "torch"))
    assert_close(engine(IDS).logits, expected_default, reference)

    model.set_adapter("wide")  # other modules, other ranks: the engine lays them out anew
    randomize(model, 3)
    assert len(lora_modules(model)) == 14
    assert_close(engine(IDS).logits, torch_logits(set_backend(model, "torch")), reference)
    with model.disable_adapter():
        got = engine(IDS).logits
    scale = reference.abs().max().item()
    assert (got - reference).abs().max().item() <= LOGIT_RTOL * scale

    model.set_adapter("default")
    assert_close(engine(IDS).logits, expected_default, reference)
