"""What BitNetEngine accepts: every adapter it cannot run refused at construction, naming the module
(on lm_head, a PEFT layer, a PeftModel); PEFT models run once converted (``from_peft``), with the
PeftModel's logits; the engine follows the model's active adapter and ``disable_adapter``.

Dense models, logits within LOGIT_RTOL of the largest |logit| of transformers' own forward
(helpers.py; a dropped or wrong adapter moves logits by O(0.1-1)), each comparison also checking
that the adapters change the logits by far more.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import peft
import pytest
import torch

import torch_wgpu_lora as twl
from torch_wgpu_lora import BitNetEngine, WgpuAdamW
from torch_wgpu_lora.engine import GenerationRequest
from torch_wgpu_lora.integrations.bitnet import load_bitnet, lora_modules, lora_parameters, lora_state_dict, set_backend
from torch_wgpu_lora.integrations.tiny import build_tiny_bitnet

from ..integrations.helpers import randomize
from .helpers import LOGIT_RTOL, assert_close, labelled_batch, mixed_prompts, torch_logits

IDS = torch.tensor([[0, 5, 17, 42, 99, 200, 7, 3], [9, 8, 7, 6, 5, 4, 3, 2]])


@pytest.fixture(scope="module")
def checkpoint():
    return build_tiny_bitnet(tempfile.mkdtemp(), flavour="dense", seed=0)


def logits_of(model):
    return torch_logits(model, IDS, None)


def assert_runs_the_adapters(got, ref, unlike):
    """``got`` is ``ref`` within LOGIT_RTOL, and ``ref`` is far from ``unlike`` (the adapters matter)."""
    assert_close(got, ref, LOGIT_RTOL, "logits")
    scale = ref.abs().max().item()
    assert (ref - unlike).abs().max().item() > 100 * LOGIT_RTOL * scale, "the adapters barely change the logits"


def two_adapters(checkpoint):
    """A model whose active adapter, "default", is r=4 on q_proj and v_proj (random A and B), beside
    "wide", r=2 on every linear module."""
    model = twl.apply_lora(load_bitnet(checkpoint), r=4, target_modules=("q_proj", "v_proj"))
    randomize(model, 2, scale=0.2)
    model.add_adapter("wide", peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    return model


def test_an_adapter_on_lm_head_is_refused_naming_it(checkpoint):
    model = twl.apply_lora(load_bitnet(checkpoint), r=4, target_modules=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match=re.escape("lm_head has a LoRA adapter, which BitNetEngine cannot run")):
        BitNetEngine(model)


def test_the_engines_refusals_name_a_way_that_runs(checkpoint, tmp_path):
    # WITHOUT_ENGINE, which the refusals end with, names engine='torch' of train and Trainer and the
    # CLI's --engine torch: the refused model trains that way, and every command with --engine takes torch.
    from torch_wgpu_lora.cli import build_parser
    from torch_wgpu_lora.engine.config import WITHOUT_ENGINE

    from .helpers import tiny_tokenizer

    model = twl.apply_lora(load_bitnet(checkpoint), r=4, target_modules=("q_proj", "lm_head"))
    with pytest.raises(ValueError) as refused:
        BitNetEngine(model)
    assert str(refused.value).endswith(WITHOUT_ENGINE) and "engine='torch'" in WITHOUT_ENGINE
    result = twl.train(model, tiny_tokenizer(), [{"prompt": "Hi", "completion": " there"}], engine="torch",
                       max_steps=1, output_dir=tmp_path, progress=False, plot=False)
    assert result.steps == 1 and result.loss is not None
    commands = build_parser()._subparsers._group_actions[0].choices
    with_engine = {name: action for name, command in commands.items() for action in command._actions
                   if "--engine" in action.option_strings}
    assert set(with_engine) == {"train", "generate", "gradcheck", "demo"}
    assert all("torch" in action.choices for action in with_engine.values())
    # no other message of the package sends anyone to an engine option of its own wording
    package = Path(twl.__file__).parent
    naming = sorted(str(f.relative_to(package)) for f in package.rglob("*.py") if "engine='torch'" in f.read_text())
    assert naming == ["engine/config.py"]


def test_the_trainers_auto_choice_falls_back_to_torch_for_what_the_engine_refuses(checkpoint):
    from torch_wgpu_lora.engine import choose_engine

    model = twl.apply_lora(load_bitnet(checkpoint), r=4, target_modules=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match="lm_head has a LoRA adapter"):
        choose_engine(model, "wgpu")
    assert choose_engine(model, "auto") is None


def test_peft_layers_are_refused_and_run_once_converted(checkpoint):
    base = load_bitnet(checkpoint).eval()
    reference = logits_of(base)
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                           "down_proj"]))
    randomize(theirs, 1, scale=0.2).eval()
    for model in (theirs, theirs.base_model.model):  # the PeftModel, and the base it wrapped in place
        with pytest.raises(ValueError, match=re.escape("model.layers.0.self_attn.q_proj is a PEFT layer (Linear), "
                                                       "which BitNetEngine does not run; convert the model with")):
            BitNetEngine(model)
    engine = BitNetEngine(twl.from_peft(theirs))
    assert_runs_the_adapters(engine(IDS).logits, logits_of(theirs), reference)


def test_the_engine_follows_the_active_adapter_and_disable_adapter(checkpoint):
    pristine = load_bitnet(checkpoint).eval()
    reference = logits_of(pristine)
    model = two_adapters(checkpoint).eval()
    engine = BitNetEngine(model)
    expected_default = logits_of(set_backend(model, "torch"))
    assert_runs_the_adapters(engine(IDS).logits, expected_default, reference)

    model.set_adapter("wide")  # other modules, other ranks: the engine lays them out anew
    randomize(model, 3, scale=0.2)
    assert len(lora_modules(model)) == 14
    assert_runs_the_adapters(engine(IDS).logits, logits_of(set_backend(model, "torch")), reference)
    with model.disable_adapter():
        assert_close(engine(IDS).logits, reference, LOGIT_RTOL, "logits with the adapter disabled")

    model.set_adapter("default")
    assert_runs_the_adapters(engine(IDS).logits, expected_default, reference)


ROWS3 = torch.tensor([[0, 5, 17, 42, 99, 200, 7, 3], [9, 8, 7, 6, 5, 4, 3, 2], [0, 5, 17, 42, 99, 200, 7, 3]])
ROW_ADAPTERS = ["wide", "__base__", "default"]


def peft_pair(checkpoint, tmp_path):
    """peft's model with "default" (r=4 on q_proj and v_proj) and "wide" (r=2 on every linear module),
    random, and ours holding the same adapters, loaded from peft's files."""
    pristine = load_bitnet(checkpoint).eval()
    theirs = peft.get_peft_model(load_bitnet(checkpoint), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    theirs.add_adapter("wide", peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    randomize(theirs, 4, scale=0.2).eval()
    theirs.save_pretrained(tmp_path / "peft")
    ours = twl.load_adapter(load_bitnet(checkpoint), tmp_path / "peft")
    ours.load_adapter(tmp_path / "peft" / "wide", adapter_name="wide")
    return pristine, theirs, ours.eval()


def test_adapter_names_give_each_row_its_adapter_on_the_engine_as_peft_does(checkpoint, tmp_path):
    pristine, theirs, ours = peft_pair(checkpoint, tmp_path)
    engine = BitNetEngine(ours)
    with torch.no_grad():
        expected = theirs(input_ids=ROWS3, adapter_names=ROW_ADAPTERS).logits
    reference = logits_of_rows(pristine)
    got = engine(ROWS3, adapter_names=ROW_ADAPTERS).logits
    for row in (0, 2):  # rows 0 and 2: one prompt, two adapters
        assert_runs_the_adapters(got[row], expected[row], reference[row])
    assert_close(got[1], reference[1], LOGIT_RTOL, "the __base__ row")
    assert_close(got[1], expected[1], LOGIT_RTOL, "the __base__ row against peft's")
    # the next call without adapter_names runs the active adapter on every row again, as before
    assert_runs_the_adapters(engine(ROWS3).logits, logits_of_rows(theirs.base_model.model), reference)
    assert ours.active_adapter == "default"


def logits_of_rows(model):
    return torch_logits(model, ROWS3, None)


def test_a_narrowed_session_decodes_each_row_with_its_prompts_adapter(checkpoint, tmp_path):
    # Four rows serving two adapters and the base model: the prompt running longest ("wide") moves
    # from row 3 into row 0, whose own prompt ran "default", when the session narrows to one row
    # (engine.generate), and goes on with its own adapter; every prompt gets its tokens alone with
    # its adapter, and "wide" changes them (against the same prompt on "default").
    _, _, ours = peft_pair(checkpoint, tmp_path)
    engine = BitNetEngine(ours)
    prompts = mixed_prompts(ours.config.vocab_size, (5, 7, 3, 6), seed=9)
    names, limits = ["default", "__base__", "default", "wide"], [2, 3, 2, 16]

    def request(rows: list[int], adapters: list[str], **options):
        return GenerationRequest([prompts[i] for i in rows], [limits[i] for i in rows], adapter_names=adapters,
                                 tokens_per_submit=2, **options)

    alone = [engine.generate_batch(request([i], [name]))[0] for i, name in enumerate(names)]
    assert engine.generate_batch(request([0, 1, 2, 3], names, batch_size=4)) == alone
    assert set(engine.decode_session(4, 7, 16, serve_rows=True).narrowed) == {1}
    assert engine.generate_batch(request([3], ["default"]))[0] != alone[3]


def test_adapter_names_on_the_engine_are_refused_where_peft_refuses_them(checkpoint, tmp_path):
    _, _, ours = peft_pair(checkpoint, tmp_path)
    engine = BitNetEngine(ours)
    with pytest.raises(ValueError, match=re.escape("adapter_names names no adapter of this model: ['nope']")):
        engine(ROWS3, adapter_names=["default", "nope", "__base__"])
    with pytest.raises(ValueError, match="adapter_names has 2 names for a batch of 3 rows"):
        engine(ROWS3, adapter_names=["default", "wide"])
    with pytest.raises(ValueError, match="adapter_names has 2 names for a batch of 3 rows"):
        engine.generate(input_ids=ROWS3, adapter_names=["default", "wide"], max_new_tokens=2)
    with pytest.raises(TypeError, match="adapter_names must be a list of adapter names"):
        engine(ROWS3, adapter_names="default")
    ours.train()
    with pytest.raises(ValueError, match=r"adapter_names is for inference \(as in PEFT\): call model.eval\(\) first"):
        engine(ROWS3, adapter_names=ROW_ADAPTERS)
    bare = BitNetEngine(load_bitnet(checkpoint).eval())
    with pytest.raises(ValueError, match="adapter_names picks among a model's named adapters, and this "
                                         "BitNetForCausalLM has none"):
        bare(ROWS3, adapter_names=ROW_ADAPTERS)


def test_several_adapters_at_once_are_refused_by_the_engine_naming_the_torch_path(checkpoint):
    model = two_adapters(checkpoint).eval()
    engine = BitNetEngine(model)
    expected = engine(IDS).logits
    model.set_adapter(["default", "wide"])  # q_proj and v_proj hold both
    with pytest.raises(ValueError, match=re.escape("model.layers.0.self_attn.q_proj runs several adapters at once "
                                                   "(default, wide: set_adapter was given a list), which BitNetEngine "
                                                   "does not")):
        engine(IDS)
    model.set_adapter("default")
    assert torch.equal(engine(IDS).logits, expected)  # the same adapter, the same program


def test_training_steps_follow_the_active_adapter_and_each_optimizer_keeps_its_moments(checkpoint):
    # A step of "default", one of "wide" (another layout: the engine's flat moments are made anew),
    # then one of "default" again: "default" ends as two steps of a fresh engine leave it, bit for bit
    # (the same kernels on the same values), so its optimizer's moments outlived the other layout.
    model, twin = two_adapters(checkpoint), two_adapters(checkpoint)
    micro = [labelled_batch(model, [8, 6])]
    engine, twin_engine = BitNetEngine(model), BitNetEngine(twin)
    first, twin_optimizer = (WgpuAdamW(lora_parameters(m), lr=1e-2) for m in (model, twin))
    engine.train_step(micro, first, max_grad_norm=1.0)
    model.set_adapter("wide")
    wide = engine.train_step(micro, WgpuAdamW(lora_parameters(model), lr=1e-2), max_grad_norm=1.0)
    assert not wide["skipped"] and len(lora_modules(model)) == 14
    model.set_adapter("default")
    engine.train_step(micro, first, max_grad_norm=1.0)
    for _ in range(2):
        twin_engine.train_step(micro, twin_optimizer, max_grad_norm=1.0)
    engine.adapters.pull()  # the GPU's values into the Parameters
    twin_engine.adapters.pull()
    ours, theirs = lora_state_dict(model), lora_state_dict(twin)
    assert ours.keys() == theirs.keys() and len(ours) == 8
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
