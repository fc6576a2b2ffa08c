"""The offline demo: the demo model is built deterministically in the real packed format and
reused; ``run_demo`` trains, prints the parity table, lowers the loss, saves a loadable
adapter, and gives the same numbers when run again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer
from transformers.integrations.bitnet import AutoBitLinear

from torch_wgpu_lora.demo import (DEMO_CONFIG, DEMO_MODEL_NAME, MANIFEST_NAME, build_demo_checkpoint,
                                  default_demo_path, demo_records, run_demo)
from torch_wgpu_lora.integrations.adapter_files import load_adapter_file
from torch_wgpu_lora.integrations.bitnet import load_bitnet, lora_modules


def load_eagerly(path):
    """load_bitnet without inductor: transformers compiles AutoBitLinear's unpacking, tens of
    seconds per new shape on a 2-core CPU (run_demo and the CLI run eagerly too)."""
    with torch.compiler.set_stance("force_eager"):
        return load_bitnet(path)


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    return build_demo_checkpoint(tmp_path_factory.mktemp("demo") / DEMO_MODEL_NAME)


def test_demo_model_is_the_packed_bitnet_format_with_its_tokenizer(demo_model):
    config = json.loads((demo_model / "config.json").read_text())
    assert config["quantization_config"]["linear_class"] == "autobitlinear"
    assert config["quantization_config"]["quantization_mode"] == "offline"
    assert {k: config[k] for k in DEMO_CONFIG} == DEMO_CONFIG
    with safe_open(demo_model / "model.safetensors", "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        v = f.get_tensor("model.layers.0.self_attn.v_proj.weight")
        assert "model.layers.0.self_attn.q_proj.weight_scale" in f.keys()
    hidden, kv = DEMO_CONFIG["hidden_size"], DEMO_CONFIG["hidden_size"] * 2 // 8  # 2 of 8 heads
    assert (q.dtype, tuple(q.shape), tuple(v.shape)) == (torch.uint8, (hidden // 4, hidden), (kv // 4, hidden))

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    assert len(tokenizer) == config["vocab_size"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    model = load_eagerly(demo_model)
    assert type(model.model.layers[0].self_attn.q_proj) is AutoBitLinear
    record = demo_records()[0]
    assert tokenizer.decode(tokenizer(record["output"], add_special_tokens=False)["input_ids"]) == record["output"]


def test_demo_model_is_built_the_same_every_time(demo_model, tmp_path):
    again = build_demo_checkpoint(tmp_path / "again")
    assert (again / MANIFEST_NAME).read_text() == (demo_model / MANIFEST_NAME).read_text()
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in demo_model.iterdir())


def test_a_built_model_is_reused_and_a_broken_one_refused(demo_model, tmp_path):
    stamp = (demo_model / "model.safetensors").stat().st_mtime_ns
    assert build_demo_checkpoint(demo_model) == demo_model
    assert (demo_model / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt

    broken = tmp_path / "broken"
    build_demo_checkpoint(broken)
    (broken / "model.safetensors").write_bytes(b"not the weights")
    with pytest.raises(ValueError, match=r"\(model.safetensors differs from when it was built\); delete it to have it rebuilt"):
        build_demo_checkpoint(broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors is missing"):
        build_demo_checkpoint(broken)
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match=f"is not a complete demo model \\(it has no {MANIFEST_NAME}\\)"):
        build_demo_checkpoint(tmp_path / "other")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary folder left behind


def test_default_path_is_in_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_demo_path() == tmp_path / "torch_wgpu_lora" / DEMO_MODEL_NAME
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_demo_path() == Path.home() / ".cache" / "torch_wgpu_lora" / DEMO_MODEL_NAME


def test_run_demo_trains_compares_and_saves_a_loadable_adapter(demo_model, tmp_path):
    lines: list[str] = []
    options = dict(steps=10, max_new_tokens=8, progress=False)
    result = run_demo(demo_model, tmp_path / "out", out=lines.append, **options)
    text = "\n".join(lines)

    # 10 steps at the demo's lr take the loss from 7.5 to 6.0 (measured); 1 nat says it learned.
    assert result.loss_after < result.loss_before - 1.0, (result.loss_before, result.loss_after)
    assert f"{result.loss_before:.4f}" in text and f"{result.loss_after:.4f}" in text
    assert repr(result.generation_before) in text and repr(result.generation_after) in text
    assert "| layer | module | param | max abs error | max rel error |" in text
    report = result.parity.report
    assert len(report.rows) == DEMO_CONFIG["num_hidden_layers"] * 2 * 2  # q/v × A/B in every layer
    assert all(row.reference_max > 0 for row in report.rows)  # trained adapters: real gradients, not zeros
    assert result.parity.passed and "within the tolerance" in text

    model = load_adapter_file(load_eagerly(demo_model), result.adapter)
    modules = lora_modules(model)
    assert sorted({name.rsplit(".", 1)[-1] for name in modules}) == ["q_proj", "v_proj"]
    assert all(m.r == 8 and m.lora_B.abs().max() > 0 for m in modules.values())

    # The same command again replaces the previous output and gives the same numbers.
    again = run_demo(demo_model, tmp_path / "out", out=lambda line: None, **options)
    assert (again.loss_before, again.loss_after) == (result.loss_before, result.loss_after)
    assert (again.generation_before, again.generation_after) == (result.generation_before, result.generation_after)


def test_run_demo_on_the_engine_trains_and_its_parity_table_is_the_engines(demo_model, tmp_path):
    # On a CPU adapter "auto" keeps the base model in torch (see engine.choose_engine); the engine is
    # asked for by name here, as `torch-wgpu-lora demo --engine wgpu` does.
    lines: list[str] = []
    result = run_demo(demo_model, tmp_path / "out", steps=6, max_new_tokens=4, progress=False, engine="wgpu",
                      out=lines.append)
    text = "\n".join(lines)
    assert result.loss_after < result.loss_before - 0.5, (result.loss_before, result.loss_after)
    assert "the whole model on WebGPU (BitNetEngine)" in text and "the WebGPU engine vs PyTorch autograd" in text
    report = result.parity.report
    assert report.codes > 0  # torch was fed the engine's int8 codes: the packed demo model is quantised
    assert result.parity.passed
