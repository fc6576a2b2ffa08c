"""PEFT's ways against the real ``peft``: its LoraConfig (every target form, patterns, rsLoRA,
gaussian init) selects and scales as peft does; adapter files with those options load and save
both ways; PiSSA/OLoRA adapters are refused unless loaded into their changed base; PEFT's model
API (trainable counts, disable_adapter, named adapters, save_pretrained); PeftModels converted
sharing their Parameters; transformers' Trainer and TRL's SFTTrainer on a model with our adapters.

Tolerances, as max |ours - peft| relative to max |peft logits|, on the torch backend: the same float32
math in another order (peft: B(A x)·s, ours: s·(x Aᵀ) Bᵀ) through two layers, exactly equal where s is
a power of two and otherwise a few ulps of the largest logit, where a wrong module, rank or scaling
moves logits by O(1). The bound is TOL (1e-6), or, where larger, twice how far the compared model's
float32 logits are from a float64 evaluation of it: each of two float32 evaluations is about that
far from the exact logits, and that distance (measured 7e-7 to 9e-7 of the largest logit here)
depends on how the CPU's kernels round. Each comparison also checks that the adapters move the
logits by far more than TOL.
"""

from __future__ import annotations

import copy
import json
import re

import peft
import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoTokenizer, BitNetForCausalLM

import torch_wgpu_lora as twl
from torch_wgpu_lora.integrations.adapter_files import save_adapter
from torch_wgpu_lora.integrations.bitnet import load_bitnet, lora_modules, set_backend
from torch_wgpu_lora.integrations.peft import from_peft, load_adapter
from torch_wgpu_lora.integrations.tiny import CHAT_TEMPLATE, build_tiny_bitnet, build_tiny_tokenizer
from torch_wgpu_lora.modules import LoRALinear

from .helpers import logits, randomize

TOL = 1e-6  # relative to max |logit|; see the module docstring
PREFIX = "base_model.model."


def assert_matches(model, theirs, base_logits):
    """``model``'s logits equal peft's logits ``theirs`` within float32 rounding (see the module docstring)."""
    ours = logits(model)
    scale = theirs.abs().max().item()
    rounding = (ours.double() - logits(copy.deepcopy(model).double())).abs().max().item()
    err = (ours - theirs).abs().max().item()
    assert err <= max(TOL * scale, 2 * rounding), \
        f"max |ours - peft| = {err:.3g} vs scale {scale:.3g}, float32 rounding {rounding:.3g}"
    effect = (theirs - base_logits).abs().max().item()
    assert effect > 1000 * TOL * scale, f"the adapters barely change the logits ({effect:.3g})"


def peft_layers_of(peft_model):
    """{module name in the base model: (r, lora_alpha, scaling)} of peft's LoRA layers."""
    out = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, peft.tuners.lora.layer.Linear):
            out[name.removeprefix(PREFIX)] = (module.r["default"], float(module.lora_alpha["default"]),
                                              module.scaling["default"])
    return out


def ours_of(model):
    return {name: (m.r, m.lora_alpha, m.scaling) for name, m in lora_modules(model).items()}


def copy_peft_weights(peft_model, model):
    """Our adapters take the values of peft's, module by module."""
    modules = lora_modules(model)
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if isinstance(module, peft.tuners.lora.layer.Linear):
                ours = modules[name.removeprefix(PREFIX)]
                ours.lora_A.copy_(module.lora_A["default"].weight)
                ours.lora_B.copy_(module.lora_B["default"].weight)


CONFIGS = {
    "names": dict(target_modules=["q_proj", "v_proj"]),
    "all-linear": dict(target_modules="all-linear"),
    "regex": dict(target_modules=r".*\.layers\.1\.self_attn\.(q|k)_proj"),
    "suffix-names-and-exclude": dict(target_modules=["self_attn.q_proj", "down_proj"],
                                     exclude_modules=["model.layers.0.mlp.down_proj"]),
    "exclude-regex": dict(target_modules="all-linear", exclude_modules=r".*mlp\..*"),
    "layers": dict(target_modules=["q_proj", "o_proj"], layers_to_transform=[1], layers_pattern="layers"),
    "patterns": dict(target_modules=["q_proj", "v_proj", "up_proj"], r=4, lora_alpha=8,
                     rank_pattern={"v_proj": 2, r"layers\.1\.mlp\.up_proj": 6}, alpha_pattern={"q_proj": 32}),
    "rslora": dict(target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16, use_rslora=True),
}


@pytest.mark.parametrize("fields", list(CONFIGS.values()), ids=list(CONFIGS))
def test_a_peft_config_selects_ranks_and_scales_as_peft_does(pristine, fields):
    config = peft.LoraConfig(**fields)
    theirs = randomize(get_peft_model(copy.deepcopy(pristine), copy.deepcopy(config)), seed=3).eval()
    ours = twl.apply_lora(copy.deepcopy(pristine), config, backend="torch")
    assert ours_of(ours) == peft_layers_of(theirs)
    assert all(p.requires_grad == ("lora_" in n) for n, p in ours.named_parameters())
    copy_peft_weights(theirs, ours)
    assert_matches(ours, logits(theirs), logits(pristine))


@pytest.mark.parametrize("fields", [CONFIGS[k] for k in ("layers", "patterns", "rslora", "regex", "all-linear")],
                         ids=["layers", "patterns", "rslora", "regex", "all-linear"])
def test_peft_files_with_these_options_load_as_peft_reloads_them(pristine, tmp_path, fields):
    theirs = randomize(get_peft_model(copy.deepcopy(pristine), peft.LoraConfig(**fields)), seed=4).eval()
    theirs.save_pretrained(tmp_path / "adapter")
    ours = load_adapter(copy.deepcopy(pristine), tmp_path / "adapter")
    for module in lora_modules(ours).values():
        module.backend = "torch"
    assert ours_of(ours) == peft_layers_of(theirs)
    assert_matches(ours, logits(theirs), logits(pristine))


@pytest.mark.parametrize("fields", [
    dict(target_modules=("q_proj", "v_proj", "down_proj"), rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 3}),
    dict(target_modules=("q_proj", "o_proj"), layers_to_transform=[1]),  # some modules of a name only
    dict(target_modules=("q_proj", "v_proj"), r=8, lora_alpha=16, use_rslora=True),
])
def test_peft_loads_our_adapters_with_per_module_ranks_subsets_and_rslora(pristine, tmp_path, fields):
    ours = randomize(twl.apply_lora(copy.deepcopy(pristine), backend="torch", **fields), seed=5)
    save_adapter(ours, tmp_path / "adapter")
    theirs = PeftModel.from_pretrained(copy.deepcopy(pristine), str(tmp_path / "adapter")).eval()
    assert peft_layers_of(theirs) == ours_of(ours)
    assert_matches(ours, logits(theirs), logits(pristine))


@pytest.mark.parametrize("fields, option", [
    (dict(use_dora=True), "use_dora=True asks for DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save=['lm_head'] asks for fully trained extra modules"),
    (dict(bias="all"), "bias='all' asks for trained biases"),
    (dict(lora_bias=True), "lora_bias=True asks for a bias on lora_B"),
    (dict(init_lora_weights="pissa"), "init_lora_weights='pissa' (pissa) starts the adapter from the base weights"),
    (dict(init_lora_weights="olora"), "init_lora_weights='olora' (olora) starts the adapter from the base weights"),
    (dict(init_lora_weights=False), "init_lora_weights=False is not implemented"),
    (dict(init_lora_weights="orthogonal"), "init_lora_weights='orthogonal' is not implemented"),
    (dict(layer_replication=[[0, 2]]), "layer_replication=[[0, 2]] asks for replicated layers"),
])
def test_peft_config_options_we_do_not_implement_are_refused_by_name(base, fields, option):
    config = peft.LoraConfig(target_modules=["q_proj", "v_proj"], **fields)
    with pytest.raises(ValueError, match=re.escape(f"the peft LoraConfig: {option}")):
        twl.apply_lora(base, config)
    assert not lora_modules(base) and all(p.requires_grad for p in base.parameters())


def test_gaussian_init_draws_what_peft_draws_from_the_same_seed():
    layer = peft.tuners.lora.layer.Linear(torch.nn.Linear(64, 32), "default", peft.LoraConfig(), r=4, lora_alpha=8)
    torch.manual_seed(11)
    layer.reset_lora_parameters("default", "gaussian")  # peft's own init, from torch's global generator
    ours = LoRALinear(torch.nn.Linear(64, 32), r=4, lora_alpha=8, init="gaussian", seed=11)
    # The same torch op (normal_, std 1/r) from a generator in the same state: the same draws.
    assert torch.equal(ours.lora_A.detach(), layer.lora_A["default"].weight.detach())
    assert not ours.lora_B.any()
    config = twl.LoraConfig.from_peft(peft.LoraConfig(target_modules=["q_proj"], init_lora_weights="gaussian"))
    assert config.init == "gaussian"


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_an_adapter_whose_init_changed_the_base_loads_only_into_that_base(pristine, tmp_path, init):
    theirs = get_peft_model(copy.deepcopy(pristine), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                     init_lora_weights=init))
    with torch.no_grad():  # training stands in: move the adapters away from their initial values
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    theirs.eval().save_pretrained(tmp_path / "adapter")
    expected = logits(theirs)
    with pytest.raises(ValueError, match=re.escape(f"init_lora_weights={init!r} ({init}) starts the adapter from "
                                                   "the base weights' own components")):
        load_adapter(copy.deepcopy(pristine), tmp_path / "adapter")
    residual = copy.deepcopy(theirs).unload()  # the base with the weights peft changed
    ours = load_adapter(residual, tmp_path / "adapter", residual_base=True)
    for module in lora_modules(ours).values():
        module.backend = "torch"
    assert_matches(ours, expected, logits(pristine))


def test_trainable_counts_are_printed_as_peft_prints_them(pristine, capsys):
    config = peft.LoraConfig(r=4, target_modules="all-linear")
    get_peft_model(copy.deepcopy(pristine), copy.deepcopy(config)).print_trainable_parameters()
    theirs = capsys.readouterr().out
    twl.apply_lora(copy.deepcopy(pristine), config).print_trainable_parameters()
    assert capsys.readouterr().out == theirs and theirs.startswith("trainable params: ")


def test_disable_adapter_gives_the_base_models_logits(pristine):
    model = randomize(twl.apply_lora(copy.deepcopy(pristine), r=4, target_modules="all-linear", backend="torch"), 6)
    adapted = logits(model)
    with model.disable_adapter():
        # The same modules and ops as the base model's own forward: equal, not merely close.
        assert torch.equal(logits(model), logits(pristine))
    assert torch.equal(logits(model), adapted) and not torch.equal(adapted, logits(pristine))


def test_transformers_adapter_switches_act_on_our_adapters(pristine):
    # transformers' PeftAdapterMixin names, which its Trainer and users reach once the model reports
    # adapters loaded (_hf_peft_config_loaded): disable_adapters/enable_adapters as transformers has them
    model = randomize(twl.apply_lora(copy.deepcopy(pristine), r=4, target_modules="all-linear", backend="torch"), 6)
    adapted = logits(model)
    model.disable_adapters()
    assert torch.equal(logits(model), logits(pristine))  # the base model's own modules and ops
    model.enable_adapters()
    assert torch.equal(logits(model), adapted)
    with pytest.raises(ValueError, match="get_adapter_state_dict is not offered.*save_pretrained"):
        model.get_adapter_state_dict()


def test_named_adapters_follow_peft(pristine, tmp_path):
    theirs = get_peft_model(copy.deepcopy(pristine), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    theirs.add_adapter("other", peft.LoraConfig(r=2, target_modules="all-linear", lora_alpha=4))
    randomize(theirs, seed=8).eval()
    theirs.save_pretrained(tmp_path / "peft")  # "default" in the folder, "other" in peft/other
    expected = {}
    for name in ("default", "other"):
        theirs.set_adapter(name)
        expected[name] = logits(theirs)

    ours = load_adapter(copy.deepcopy(pristine), tmp_path / "peft")
    ours.load_adapter(tmp_path / "peft" / "other", adapter_name="other")
    assert ours.active_adapter == "default" and ours.adapter_names == ["default", "other"]
    assert_matches(set_backend(ours, "torch"), expected["default"], logits(pristine))
    ours.set_adapter("other")
    assert_matches(set_backend(ours, "torch"), expected["other"], logits(pristine))
    assert len(lora_modules(ours)) == 14 and all(m.r == 2 for m in lora_modules(ours).values())

    ours.save_pretrained(tmp_path / "ours")  # and back: peft reads our folders as it wrote its own
    again = PeftModel.from_pretrained(copy.deepcopy(pristine), str(tmp_path / "ours")).eval()
    again.load_adapter(str(tmp_path / "ours" / "other"), adapter_name="other")
    assert_matches(again, expected["default"], logits(pristine))
    again.set_adapter("other")
    assert_matches(again, expected["other"], logits(pristine))
    assert ours.active_adapter == "other"  # saving every adapter leaves the active one in place

    with pytest.raises(ValueError, match=r"no adapter named 'nope'; the adapters are \['default', 'other'\]"):
        ours.set_adapter("nope")
    with pytest.raises(ValueError, match="an adapter named 'default' already exists"):
        ours.add_adapter("default", peft.LoraConfig(target_modules=["q_proj"]))
    ours.delete_adapter("other")  # the active one: the first remaining takes its place, as in peft
    assert ours.adapter_names == ["default"] and ours.active_adapter == "default"
    assert_matches(ours, expected["default"], logits(pristine))
    ours.add_adapter("third", twl.LoraConfig(r=3, target_modules=("k_proj",)))  # ours or peft's config
    assert ours.active_adapter == "default" and ours.adapter_names == ["default", "third"]


def test_a_peft_model_converts_sharing_its_parameters(pristine):
    theirs = get_peft_model(copy.deepcopy(pristine), peft.LoraConfig(r=4, lora_alpha=16, lora_dropout=0.1,
                                                                     target_modules=["q_proj", "v_proj", "up_proj"]))
    randomize(theirs, seed=9).eval()
    ours = from_peft(theirs, backend="torch")
    assert_matches(ours, logits(theirs), logits(pristine))
    layer = theirs.base_model.model.model.layers[1].mlp.up_proj
    module = lora_modules(ours)["model.layers.1.mlp.up_proj"]
    assert module.lora_A is layer.lora_A["default"].weight and module.lora_B is layer.lora_B["default"].weight
    assert module.lora_dropout.p == 0.1 and module.scaling == 4.0
    assert not lora_modules(theirs)  # the PeftModel is left as it was
    with torch.no_grad():  # training the conversion trains the PeftModel
        module.lora_B.add_(0.5)
    assert_matches(ours, logits(theirs), logits(pristine))


@pytest.mark.parametrize("change, whole, message", [
    (dict(use_dora=True), True, "the PeftModel's adapter 'default': use_dora=True asks for DoRA"),
    (dict(use_dora=True), False, "model.layers.0.self_attn.q_proj (PEFT adapter 'default'): DoRA (use_dora)"),
    (dict(target_modules=["q_proj", "embed_tokens"]), False,
     "model.embed_tokens is a PEFT peft.tuners.lora.layer.Embedding"),
    ("merge", True, "its adapters are merged into the base weight"),
])
def test_what_a_peft_model_holds_that_we_do_not_run_is_refused_by_module(pristine, change, whole, message):
    """``whole``: the PeftModel (its config is checked too), else the base model get_peft_model wrapped."""
    fields = dict(r=4, target_modules=["q_proj", "v_proj"])
    if isinstance(change, dict):
        fields.update(change)
    theirs = get_peft_model(copy.deepcopy(pristine), peft.LoraConfig(**fields))
    if change == "merge":
        theirs.merge_adapter()
    with pytest.raises(ValueError, match=re.escape(message)):
        from_peft(theirs if whole else theirs.base_model.model)


def test_twl_train_on_a_peft_model_trains_its_adapter(dense, tmp_path):
    texts = ["Say hi.", "Hi there.", "Name a colour.", "Blue."]
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "tok", texts))
    theirs = get_peft_model(BitNetForCausalLM.from_pretrained(dense), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    before = {n: p.detach().clone() for n, p in theirs.named_parameters() if "lora_B" in n}
    result = twl.train(theirs, tokenizer, [{"prompt": texts[0], "completion": texts[1]},
                                           {"prompt": texts[2], "completion": texts[3]}],
                       output_dir=tmp_path / "run", max_steps=2, batch_size=2, lr=1e-2, progress=False, plot=False,
                       engine="torch")
    after = {n: p.detach() for n, p in theirs.named_parameters() if "lora_B" in n}
    assert all(not torch.equal(before[n], after[n]) for n in before)  # peft's own Parameters were trained
    reloaded = PeftModel.from_pretrained(BitNetForCausalLM.from_pretrained(dense), str(result.adapter)).eval()
    assert_matches(reloaded, logits(theirs.eval()), logits(BitNetForCausalLM.from_pretrained(dense)))


def test_transformers_trainer_saves_our_adapters_in_peft_layout(dense, pristine, tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = twl.apply_lora(BitNetForCausalLM.from_pretrained(dense), peft.LoraConfig(r=4, target_modules="all-linear"),
                           backend="torch")
    ids = torch.randint(3, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2, per_device_train_batch_size=2,
                             learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "saved").iterdir()}
    assert not (tmp_path / "saved" / "model.safetensors").exists()
    theirs = PeftModel.from_pretrained(copy.deepcopy(pristine), str(tmp_path / "saved")).eval()
    assert_matches(model.eval(), logits(theirs), logits(pristine))
    ours = load_adapter(copy.deepcopy(pristine), tmp_path / "saved")
    assert torch.equal(lora_modules(ours)["model.layers.1.mlp.down_proj"].lora_B,
                       lora_modules(model)["model.layers.1.mlp.down_proj"].lora_B)


def test_trl_sft_trainer_trains_our_adapters_on_chat_data(dense, pristine, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
             for q, a in [("Name a colour.", "Blue."), ("Say hi.", "Hi!"), ("Count to two.", "One, two."),
                          ("Name a fruit.", "A pear.")]]
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_tokenizer(
        tmp_path / "tok", [m["content"] for c in chats for m in c], chat_template=CHAT_TEMPLATE))
    model = twl.apply_lora(BitNetForCausalLM.from_pretrained(dense), peft.LoraConfig(r=4, target_modules="all-linear"),
                           backend="torch")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    config = SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=6, per_device_train_batch_size=2,
                       learning_rate=2e-2, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                       assistant_only_loss=True, max_length=64, bf16=False)  # float32, for the comparison below
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"messages": chats}),
                         processing_class=tokenizer)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 6 and losses[-1] < losses[0]  # TRL's own loss went down
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)  # only adapters moved
    assert all(m.lora_B.abs().max() > 0 for m in lora_modules(model).values())
    trainer.save_model(str(tmp_path / "saved"))
    theirs = PeftModel.from_pretrained(copy.deepcopy(pristine), str(tmp_path / "saved")).eval()
    assert_matches(model.eval(), logits(theirs), logits(pristine))
    assert json.loads((tmp_path / "saved" / "adapter_config.json").read_text())["r"] == 4


# -- several adapters in one batch, several active adapters ---------------------------------------

ROWS = torch.randint(3, 300, (3, 8), generator=torch.Generator().manual_seed(5))  # three prompts, one a row
ROW_ADAPTERS = ["other", "__base__", "default"]


def two_adapter_pair(pristine, tmp_path):
    """peft's model with "default" (r=4 on q_proj, v_proj) and "other" (r=2 on every linear module, with
    dropout), random, and ours holding the same adapters (loaded from peft's files), all on the torch backend."""
    theirs = get_peft_model(copy.deepcopy(pristine), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    theirs.add_adapter("other", peft.LoraConfig(r=2, target_modules="all-linear", lora_alpha=4, lora_dropout=0.3))
    randomize(theirs, seed=8).eval()
    theirs.save_pretrained(tmp_path / "peft")
    ours = load_adapter(copy.deepcopy(pristine), tmp_path / "peft")
    ours.load_adapter(tmp_path / "peft" / "other", adapter_name="other")
    for name in ("other", "default"):
        ours.set_adapter(name)
        set_backend(ours, "torch")
    return theirs, ours


def assert_rows_match(ours, theirs, theirs64, base):
    """Each row of ``ours`` is peft's row within TOL of the largest |logit|, or, where larger, twice
    peft's float32 distance from its float64 evaluation ``theirs64`` (the module docstring)."""
    scale = theirs.abs().max().item()
    bound = max(TOL * scale, 2 * (theirs.double() - theirs64).abs().max().item())
    for row in range(len(theirs)):
        err = (ours[row] - theirs[row]).abs().max().item()
        assert err <= bound, f"row {row}: max |ours - peft| = {err:.3g}, bound {bound:.3g}"
        if not torch.equal(theirs[row], base[row]):
            assert (theirs[row] - base[row]).abs().max() > 1000 * bound, f"row {row}: the adapter barely matters"


def test_adapter_names_give_each_row_its_adapter_as_peft_does(pristine, tmp_path):
    theirs, ours = two_adapter_pair(pristine, tmp_path)
    ours.train().set_adapter("other")  # "other" in training mode, then put aside: no dropout in an eval batch
    ours.set_adapter("default")
    ours.eval()
    with torch.no_grad():
        expected = theirs(input_ids=ROWS, adapter_names=ROW_ADAPTERS).logits
        expected64 = copy.deepcopy(theirs).double()(input_ids=ROWS, adapter_names=ROW_ADAPTERS).logits
        base = pristine(input_ids=ROWS).logits
        got = ours(input_ids=ROWS, adapter_names=ROW_ADAPTERS).logits
    assert_rows_match(got, expected, expected64, base)
    assert torch.equal(got[1], base[1])  # "__base__": the base model's own modules and ops, exactly
    assert not torch.equal(expected[0], base[0]) and not torch.equal(expected[2], base[2])
    assert ours.active_adapter == "default" and lora_modules(ours)  # the model is as it was


def test_generate_with_adapter_names_gives_each_row_what_peft_gives(pristine, tmp_path):
    theirs, ours = two_adapter_pair(pristine, tmp_path)
    settings = dict(input_ids=ROWS, attention_mask=torch.ones_like(ROWS), adapter_names=ROW_ADAPTERS,
                    max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = theirs.generate(**settings, output_scores=True, return_dict_in_generate=True)
    got = ours.generate(**settings)
    # Greedy picks are compared where peft's top two logits differ by far more than float32 rounding
    # (1e-3 of the largest logit): nearer, another rounding may rightly pick the other token.
    scores = torch.stack(expected.scores, dim=1)  # [rows, steps, vocab]
    top = scores.topk(2, dim=-1).values
    clear = (top[..., 0] - top[..., 1]) > 1e-3 * scores[scores.isfinite()].abs().max()  # EOS is -inf (min_new_tokens)
    width = ROWS.shape[1]
    for row in range(len(ROWS)):
        steps = int(clear[row].long().cumprod(0).sum())  # the steps before the first near tie
        assert steps >= 3, f"row {row}: peft's greedy choices are near ties from step {steps}"
        assert torch.equal(got[row, :width + steps], expected.sequences[row, :width + steps]), f"row {row}"
    assert not torch.equal(expected.sequences[0], expected.sequences[2]) or not torch.equal(ROWS[0], ROWS[2])


def test_beam_search_keeps_each_rows_adapter_on_its_beams_as_peft_does(pristine, tmp_path):
    # One new token, two beams: the beams' scores are each row's two best next-token log-probabilities
    # under its adapter. Scores, not tokens, are compared (sorted): a near tie between two tokens
    # changes which token a beam holds, not the scores.
    theirs, ours = two_adapter_pair(pristine, tmp_path)
    settings = dict(input_ids=ROWS, attention_mask=torch.ones_like(ROWS), adapter_names=ROW_ADAPTERS, num_beams=2,
                    num_return_sequences=2, max_new_tokens=1, do_sample=False, pad_token_id=0,
                    output_scores=True, return_dict_in_generate=True)
    expected = theirs.generate(**settings).sequences_scores.view(len(ROWS), 2).sort(dim=1).values
    got = ours.generate(**settings).sequences_scores.view(len(ROWS), 2).sort(dim=1).values
    base = {k: v for k, v in settings.items() if k != "adapter_names"}
    base = pristine.generate(**base).sequences_scores.view(len(ROWS), 2).sort(dim=1).values
    # Log-probabilities of magnitude ~5 from logits within ~1e-6 relative of peft's (a few ulps of
    # float32 each): 2e-5 leaves tenfold room over that rounding, and the adapters move these scores
    # by far more (> 5e-3 on the adapted rows: this tiny model's next-token distribution is flat).
    assert (got - expected).abs().max() < 2e-5, (got, expected)
    assert (expected[[0, 2]] - base[[0, 2]]).abs().amax(dim=1).min() > 5e-3


def test_set_adapter_with_a_list_adds_the_adapters_effects_as_peft_does(pristine, tmp_path):
    theirs, ours = two_adapter_pair(pristine, tmp_path)
    theirs.base_model.set_adapter(["default", "other"])  # peft's LoraModel takes a list; PeftModel one name
    ours.set_adapter(["default", "other"])
    assert ours.active_adapter == ["default", "other"] and ours.active_adapters == ["default", "other"]
    assert_matches(ours, logits(theirs), logits(pristine))
    with pytest.raises(ValueError, match=re.escape("model.layers.0.self_attn.q_proj runs several adapters at once "
                                                   "(default, other: set_adapter was given a list); this needs one")):
        save_adapter(ours, tmp_path / "one")
    with ours.disable_adapter():
        assert torch.equal(logits(ours), logits(pristine))
    ours.set_adapter("other")
    theirs.base_model.set_adapter("other")
    assert_matches(ours, logits(theirs), logits(pristine))
    with pytest.raises(ValueError, match=r"no adapter named 'nope'"):
        ours.set_adapter(["other", "nope"])
    with pytest.raises(TypeError, match="an adapter name or a non-empty list of names"):
        ours.set_adapter([])


def test_adapter_names_are_refused_where_peft_refuses_them(pristine, tmp_path):
    _, ours = two_adapter_pair(pristine, tmp_path)
    with pytest.raises(ValueError, match=re.escape("adapter_names names no adapter of this model: ['nope']")):
        ours(input_ids=ROWS, adapter_names=["default", "nope", "__base__"])
    with pytest.raises(ValueError, match="adapter_names has 2 names for a batch of 3 rows"):
        ours(input_ids=ROWS, adapter_names=["default", "other"])
    with pytest.raises(TypeError, match="adapter_names must be a list of adapter names"):
        ours(input_ids=ROWS, adapter_names="default")
    ours.train()
    with pytest.raises(ValueError, match=r"adapter_names is for inference \(as in PEFT\): call model.eval\(\) first"):
        ours(input_ids=ROWS, adapter_names=ROW_ADAPTERS)
    ours.eval().merge_adapter()
    with pytest.raises(ValueError, match=r"adapter_names: the active adapters are merged .* unmerge_adapter\(\) first"):
        ours(input_ids=ROWS, adapter_names=ROW_ADAPTERS)
    with pytest.raises(ValueError, match=r"set_adapter: the active adapters are merged .* unmerge_adapter\(\) first"):
        ours.set_adapter("other")  # the merged adapter would stay in the weights, put aside
    with pytest.raises(ValueError, match=r"delete_adapter: the active adapters are merged"):
        ours.delete_adapter("default")
    ours.add_adapter("third", peft.LoraConfig(r=2, target_modules=["k_proj"]))  # beside a merged adapter: fine
    ours.delete_adapter(["other", "third"])
    assert ours.adapter_names == ["default"] and ours.active_adapter == "default"


# -- merging ----------------------------------------------------------------------------------------

def weight_bound(weight):
    """Float32 rounding of one merge: the sum W + s·B·A rounds once more than either term, and the
    rank-r product's own rounding is below that at these sizes; 4 ulps of the largest weight."""
    return 4 * torch.finfo(torch.float32).eps * weight.abs().max().item()


def test_merge_and_unload_on_the_dense_flavour_gives_what_peft_gives(pristine, tmp_path):
    theirs, ours = two_adapter_pair(pristine, tmp_path)
    ours.set_adapter("other")  # every linear module but lm_head
    theirs.set_adapter("other")
    unmerged = logits(ours)
    peft_merged = copy.deepcopy(theirs).merge_and_unload()
    pristine_weights = dict(pristine.state_dict())

    ours.merge_adapter()
    assert all(m.merged for m in lora_modules(ours).values())
    assert_matches(ours, unmerged, logits(pristine))  # the merged model computes what the adapters did
    for name, weight in peft_merged.state_dict().items():
        ours_weight = ours.get_submodule(name.rsplit(".", 1)[0]).weight if name.endswith("proj.weight") \
            else ours.state_dict()[name]
        assert (ours_weight - weight).abs().max() <= weight_bound(weight), name
    ours.unmerge_adapter()  # the base weights back, the adapters running again
    assert not any(m.merged for m in lora_modules(ours).values())
    for name, module in lora_modules(ours).items():
        original = pristine_weights[f"{name}.weight"]
        assert (module.weight - original).abs().max() <= 2 * weight_bound(original), name
    assert_matches(ours, unmerged, logits(pristine))

    merged = ours.merge_and_unload()
    assert merged is ours and type(merged) is BitNetForCausalLM and not lora_modules(merged)
    assert not hasattr(merged, "merge_adapter")  # a plain transformers model again, as peft's result is
    assert_matches(merged, logits(peft_merged), logits(pristine))
    assert_matches(merged, unmerged, logits(pristine))


def test_merging_several_active_adapters_gives_what_peft_gives(pristine, tmp_path):
    theirs, ours = two_adapter_pair(pristine, tmp_path)
    with pytest.raises(ValueError, match=re.escape("merge_adapter merges active adapters; ['other'] are not active")):
        ours.merge_adapter(["other"])
    theirs.base_model.set_adapter(["default", "other"])
    ours.set_adapter(["default", "other"])
    expected = copy.deepcopy(theirs).merge_and_unload()
    merged = ours.merge_and_unload()
    assert type(merged) is BitNetForCausalLM and not lora_modules(merged)
    assert_matches(merged, logits(expected), logits(pristine))


def test_unload_and_get_base_model_follow_peft(pristine, tmp_path):
    theirs, ours = two_adapter_pair(pristine, tmp_path)
    assert ours.get_base_model() is ours  # as PeftModel.get_base_model(): the model holding the adapters
    assert torch.equal(logits(ours.get_base_model()), logits(ours))
    unloaded = ours.unload()
    assert type(unloaded) is BitNetForCausalLM and not lora_modules(unloaded)
    assert torch.equal(logits(unloaded), logits(pristine))
    assert torch.equal(logits(theirs.unload()), logits(pristine))  # peft's unload: the same base model


@pytest.mark.parametrize("flavour, held", [
    ("online", "AutoBitLinear (the online flavour) ternarises its weight W on every forward"),
    ("packed", "BitLinear (the packed flavour) holds W as ternary values and a scale"),
    ("packed-autobitlinear", "AutoBitLinear (the packed flavour) holds W as ternary values and a scale"),
])
def test_merging_a_quantised_flavour_is_refused_saying_why_and_how_to_serve_instead(tmp_path, flavour, held):
    model = twl.apply_lora(load_bitnet(build_tiny_bitnet(tmp_path, flavour=flavour)), r=4,
                           target_modules=["q_proj"], backend="torch")
    randomize(model, seed=4)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    for merge in (model.merge_adapter, model.merge_and_unload):
        with pytest.raises(ValueError) as refusal:
            merge()
        message = str(refusal.value)
        assert message.startswith(f"model.layers.0.self_attn.q_proj: cannot merge the adapter exactly. {held}; "
                                  "W + scaling·B·A is no longer ternary"), message
        for route in ("model.save_pretrained(folder)", "PeftModel.from_pretrained(base, folder)",
                      "format='gguf'", "llama.cpp applies with --lora"):
            assert route in message
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())  # nothing was written
    assert not any(m.merged for m in lora_modules(model).values())
