"""Our GGUF models and adapter GGUFs in llama.cpp itself: llama.cpp 0c1e57098 as llama-cpp-python
0.3.36's source distribution vendors it, built by ``scripts/llama-cpp.sh`` (CPU only, into
.ci-cache/llama.cpp, or the folder TORCH_WGPU_LORA_LLAMA_CPP names) and run through its driver
``scripts/llama-logits.c``: the logits of one sequence and the float32 input of every ternary matmul.

The comparison. llama.cpp quantises each ternary matmul's input to Q8_K (blocks of 256 values, each
with its factor) where transformers' BitNet quantises per token, so the two programs compute
different functions (1.4% of the logits apart on these models). Our torch path is run with llama.cpp's
own Q8_K codes fed at every quantisation point (``feeding_codes(..., rule="q8_K")``, which checks
that each code differs from our rounding of our own value only at a rounding tie, and by one); with
the codes pinned, the rest (norms, RoPE, attention, the scales, the adapters' terms) is float32
arithmetic in two orders, held to ``LOGIT_RTOL``. An adapter's effect (the logits with it minus
without) is held to ``EFFECT_RTOL`` of its size, on every projection kind we export, on rsLoRA, and
on gate/up adapters of a file whose projections carry ``.scale`` tensors.

The tiny models: hidden 256, intermediate 512 (whole Q8_K and TQ blocks), 2 layers, SiLU-gated FFN
(what llama.cpp's bitnet architecture computes), F32 embeddings (llama.cpp would round the LM
head's input to F16 for an F16 one).

On CI (the environment variable CI set) a missing build fails these tests; elsewhere they skip,
naming the command that builds it.
"""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from torch_wgpu_lora.integrations.adapter_files import save_adapter
from torch_wgpu_lora.integrations.bitnet import PROJECTIONS, add_lora_layers, load_bitnet
from torch_wgpu_lora.integrations.quantisation import FLIP_SHARE, FeedStats, feeding_codes, q8_k_codes

from .helpers import gguf_metadata, gguf_source, gguf_tensors, llama3_tokenizer, randomize, tokenizer_metadata, write_gguf
from .test_gguf import TEXTS

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CPP = Path(os.environ.get("TORCH_WGPU_LORA_LLAMA_CPP", ROOT / ".ci-cache" / "llama.cpp"))
DRIVER = LLAMA_CPP / "bin" / "llama-logits"

# Observed: 2e-7 of the largest logit (float32 sums in other orders through two layers); a wrong
# scale, norm, RoPE or code is off by percents.
LOGIT_RTOL = 1e-5
# Of the largest |effect|; the effects are 0.1-0.7 of the largest logit (EFFECT_SHARE at least), so
# float rounding (LOGIT_RTOL of the logits) is at most 1e-4 of them. The faults this guards
# against are 0.3 to 0.99 of the effect (a wrong alpha, a scale applied twice).
EFFECT_RTOL = 2e-4
EFFECT_SHARE = 0.05
SITES = {"attn_norm": "attn", "attn_sub_norm": "o", "ffn_norm": "mlp", "ffn_sub_norm": "down"}  # llama.cpp → ours
TOKENS = 16


@pytest.fixture(scope="module")
def llama_cpp() -> Path:
    if not DRIVER.is_file():
        message = f"llama.cpp is not built in {LLAMA_CPP}: bash scripts/llama-cpp.sh builds it (about 5 minutes)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return DRIVER


def run_llama_cpp(driver: Path, model: Path, ids: torch.Tensor, adapters: tuple[Path, ...] = ()) -> tuple:
    """llama.cpp's logits [tokens, vocabulary] for ``ids``, and its Q8_K codes by (layer, site) in
    ``feeding_codes``' layout (batch 1), from the float32 inputs of its ternary matmuls."""
    logits, activations = model.with_suffix(".logits"), model.with_suffix(".activations")
    command = [str(driver), str(model), ",".join(map(str, ids.tolist())), str(logits), str(activations)]
    for adapter in adapters:
        command += [str(adapter), "1"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    codes = {}
    data = activations.read_bytes()
    at = 0
    while at < len(data):
        name = data[at:at + 64].rstrip(b"\0").decode()
        rows, cols = np.frombuffer(data, "<i4", 2, at + 64)
        values = np.frombuffer(data, "<f4", rows * cols, at + 72).reshape(rows, cols)
        at += 72 + values.nbytes
        site, layer = name.rsplit("-", 1)
        q, d, _ = q8_k_codes(torch.from_numpy(values.copy())[None])  # ggml's float32 ops, so its codes
        codes[(int(layer), SITES[site])] = (q, d)
    return torch.from_numpy(np.fromfile(logits, "<f4").reshape(len(ids), -1)), codes


def fed_logits(model: torch.nn.Module, ids: torch.Tensor, codes: dict) -> torch.Tensor:
    """Our torch path's logits [tokens, vocabulary] with llama.cpp's Q8_K codes fed, after checking
    that every quantisation point was fed and flips are rare."""
    stats = FeedStats()
    with feeding_codes(model, codes, stats, rule="q8_K"), torch.no_grad(), torch.compiler.set_stance("force_eager"):
        logits = model(input_ids=ids[None]).logits[0]
    layers = model.config.num_hidden_layers
    assert len(stats.sites) == 4 * layers and stats.calls == 7 * layers  # every quantisation point fed
    assert stats.nonzero > stats.codes // 2
    assert stats.flips <= FLIP_SHARE * stats.codes, f"{stats.flips} flips in {stats.codes} codes"
    return logits


# (ternary type, source options): TQ2_0 and TQ1_0 carry the scale in their f16 block scales; "-unit"
# blocks have scale 1 and a .scale tensor per projection, which llama.cpp multiplies by.
MODELS = {"TQ2_0": ("TQ2_0", dict(f16_scales=True)), "TQ1_0": ("TQ1_0", dict(f16_scales=True)),
          "TQ2_0-scale-tensors": ("TQ2_0-unit", {})}


@pytest.fixture(scope="module")
def tokenizer():
    return llama3_tokenizer(TEXTS)


def write_bitnet(path: Path, source: torch.nn.Module, ternary: str, tokenizer, **metadata) -> Path:
    """``source`` as a llama.cpp bitnet GGUF with F32 float tensors, ``metadata`` keys added."""
    return write_gguf(path, "bitnet", {**gguf_metadata(source, "bitnet"), **tokenizer_metadata(tokenizer), **metadata},
                      gguf_tensors(source, ternary, "F32"))


@pytest.fixture(scope="module", params=list(MODELS))
def base(request, tmp_path_factory, tokenizer, llama_cpp) -> dict:
    """A tiny SiLU BitNet GGUF, the model we load from it, one sequence and llama.cpp's run of it."""
    ternary, options = MODELS[request.param]
    root = tmp_path_factory.mktemp("llama_cpp")
    source = gguf_source(root / "source", hidden_act="silu", **options)
    path = write_bitnet(root / "model.gguf", source, ternary, tokenizer)
    ids = torch.randint(0, source.config.vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(1))
    logits, codes = run_llama_cpp(llama_cpp, path, ids)
    return {"name": request.param, "path": path, "model": load_bitnet(path), "ids": ids, "logits": logits,
            "codes": codes, "root": root}


def test_base_logits_equal_llama_cpps(base):
    ours = fed_logits(base["model"], base["ids"], base["codes"])
    theirs = base["logits"]
    err, scale = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    assert err <= LOGIT_RTOL * scale, f"{base['name']}: max |logit error| {err:.3g} vs largest |logit| {scale:.3g}"


def assert_effect_matches(base: dict, adapted: torch.nn.Module, label: str, llama_cpp: Path) -> None:
    """``adapted``'s effect on the logits in llama.cpp (its GGUF adapter on the base file) equals ours."""
    adapter = save_adapter(adapted, base["root"] / f"{label}.gguf", format="gguf")
    logits, codes = run_llama_cpp(llama_cpp, base["path"], base["ids"], (adapter,))
    theirs = logits - base["logits"]
    ours = fed_logits(adapted, base["ids"], codes) - fed_logits(base["model"], base["ids"], base["codes"])
    size = theirs.abs().max().item()
    assert size >= EFFECT_SHARE * base["logits"].abs().max().item(), f"{label}: an effect too small to tell ({size:.3g})"
    err = (ours - theirs).abs().max().item()
    assert err <= EFFECT_RTOL * size, f"{base['name']} {label}: effect error {err:.3g} vs largest |effect| {size:.3g}"


def with_adapters(model: torch.nn.Module, targets: tuple[str, ...], seed: int, **options) -> torch.nn.Module:
    return randomize(add_lora_layers(copy.deepcopy(model), target_modules=targets, **options), seed, scale=0.1)


@pytest.mark.parametrize("base", ["TQ2_0"], indirect=True)
@pytest.mark.parametrize("projection", PROJECTIONS)
def test_each_projections_adapter_has_our_effect_in_llama_cpp(base, projection, llama_cpp):
    adapted = with_adapters(base["model"], (projection,), seed=3, r=4, lora_alpha=8)
    assert_effect_matches(base, adapted, projection, llama_cpp)


@pytest.mark.parametrize("base", ["TQ1_0"], indirect=True)
def test_rslora_adapters_have_our_effect_in_llama_cpp(base, llama_cpp):
    """llama.cpp scales by adapter.lora.alpha / r; rsLoRA's lora_alpha / √r is written as alpha·√r."""
    adapted = with_adapters(base["model"], PROJECTIONS, seed=4, r=8, lora_alpha=16, use_rslora=True)
    assert_effect_matches(base, adapted, "rslora", llama_cpp)


@pytest.mark.parametrize("base", ["TQ2_0-scale-tensors"], indirect=True)
@pytest.mark.parametrize("targets", [("gate_proj",), ("up_proj",), PROJECTIONS], ids=["gate", "up", "all"])
def test_adapters_on_a_file_with_scale_tensors_have_our_effect_in_llama_cpp(base, targets, llama_cpp):
    """llama.cpp multiplies gate's and up's adapter terms by ffn_gate_s / ffn_up_s (the others' not)."""
    assert base["model"].config.gguf_gate_up_scales  # the file's gate/up .scale tensors, kept
    adapted = with_adapters(base["model"], targets, seed=5, r=4, lora_alpha=8)
    assert_effect_matches(base, adapted, "-".join(targets), llama_cpp)


def test_llama_cpp_computes_bitnet_with_silu_whatever_the_file_says(tmp_path, tokenizer, llama_cpp):
    """Why a bitnet file naming relu2 is refused (test_gguf): llama.cpp runs it as the same SiLU model."""
    source = gguf_source(tmp_path / "source", hidden_act="silu", f16_scales=True)
    ids = torch.arange(TOKENS)
    silu = run_llama_cpp(llama_cpp, write_bitnet(tmp_path / "silu.gguf", source, "TQ2_0", tokenizer), ids)[0]
    relu2_path = write_bitnet(tmp_path / "relu2.gguf", source, "TQ2_0", tokenizer, **{"bitnet.hidden_activation": "relu2"})
    assert torch.equal(run_llama_cpp(llama_cpp, relu2_path, ids)[0], silu)
    with pytest.raises(ValueError, match="llama.cpp computes the bitnet architecture's FFN with SiLU"):
        load_bitnet(relu2_path)
