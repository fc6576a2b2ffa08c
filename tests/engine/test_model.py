"""BitNetEngine's forward against transformers' own BitNetForCausalLM, on tiny models of all
four checkpoint flavours built offline, with and without adapters (B ≠ 0).

Dense flavour: logits within ``helpers.LOGIT_RTOL`` of the largest |logit|. Quantised flavours:
the same tolerance once torch is fed the engine's int8 codes, with every code flip checked to be a
near-tie and flips bounded (``integrations.quantisation`` says why).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from torch_wgpu_lora import BitNetEngine
from torch_wgpu_lora.engine.kernels import bitlinear
from torch_wgpu_lora.engine.kernels.gemms import f16_matrix_units
from torch_wgpu_lora.integrations.quantisation import FLIP_SHARE, FeedStats, feeding_codes
from torch_wgpu_lora.integrations.tiny import FLAVOURS
from torch_wgpu_lora.runtime import get_device

from ..concurrency import in_forked_child, in_threads
from .helpers import (CONFIGS, LOGIT_RTOL, LOSS_RTOL, assert_close, batch, forward_with_codes, generate_alone,
                      packed_positions, tiny_model, torch_logits)

@pytest.mark.parametrize("adapters", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_dense_logits_match_transformers(config, adapters):
    model = tiny_model("dense", adapters, **CONFIGS[config])
    ids, mask = batch(model.config.vocab_size, [9, 6, 1])
    out = BitNetEngine(model)(ids, attention_mask=mask)
    assert out.logits.shape == (3, 9, model.config.vocab_size) and out.logits.dtype == torch.float32
    assert_close(out.logits, torch_logits(model, ids, mask), LOGIT_RTOL, "logits")


def test_a_bfloat16_models_logits_match_transformers_in_float64():
    # bfloat16 weights (BitNet-2B-4T's), multiplied exactly in float32; past the rows a GEMV serves
    # the LM head may run on f16 matrix units (matmul_mma.wgsl; always with
    # TORCH_WGPU_LORA_GEMMS=matrix_units, as scripts/matrix-units-lavapipe.sh runs this). Against
    # transformers' model in float64 on the same weights (in bfloat16 it would compute in bfloat16).
    model = tiny_model("dense", adapters=True).to(torch.bfloat16)
    ids, mask = batch(model.config.vocab_size, [9, 6, 1])
    engine = BitNetEngine(model)
    out = engine(ids, attention_mask=mask)
    assert_close(out.logits, torch_logits(copy.deepcopy(model).double(), ids, mask), LOGIT_RTOL, "logits")
    names = [launch.kernel.name for launch in engine.plan(3, 9).launches]
    device = get_device()
    if device.settings.gemms == "matrix_units" and f16_matrix_units(device):  # 27 rows: past any GEMV's
        assert names.count("matmul_mma.wgsl:split") == names.count("matmul_mma.wgsl:gemm_tiled") == 1
    elif device.settings.gemms == "general" or not f16_matrix_units(device):
        assert not any(name.startswith("matmul_mma.wgsl") for name in names)


@pytest.mark.parametrize("adapters", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("flavour", [f for f in FLAVOURS if f != "dense"])
def test_quantised_logits_match_transformers_fed_the_engines_codes(flavour, config, adapters):
    model = tiny_model(flavour, adapters, **CONFIGS[config])
    ids, mask = batch(model.config.vocab_size, [12, 7])
    engine = BitNetEngine(model)
    logits, codes = forward_with_codes(engine, ids, mask.sum(1).tolist())
    c = model.config
    stats = FeedStats()
    with feeding_codes(model, codes, stats):
        ref = torch_logits(model, ids, mask)
    layers = c.num_hidden_layers
    assert len(stats.sites) == 4 * layers  # every quantisation point was fed
    assert stats.calls == 7 * layers  # every projection quantised through the hook (q, k, v, o, gate, up, down)
    assert stats.nonzero > stats.codes // 2  # real codes, not a degenerate all-zero input
    assert stats.flips <= FLIP_SHARE * stats.codes, f"{stats.flips} flips in {stats.codes} codes"
    assert_close(logits, ref, LOGIT_RTOL, "logits")
    # and the public forward gives the same logits as this instrumented pass
    assert torch.equal(engine(ids, attention_mask=mask).logits, logits)


def test_quantised_logits_with_the_gpus_gemm_tile_match_transformers(monkeypatch):
    # GPUs run the forward ternary GEMM in 32-token tiles (gemm_tile_tokens), CPU adapters in 64:
    # the whole model with the GPU's tile, on this adapter, across two tiles of tokens.
    monkeypatch.setattr(bitlinear, "gemm_tile_tokens", lambda device: 32)
    model = tiny_model("packed", True, **CONFIGS["gqa-tied"])
    ids, mask = batch(model.config.vocab_size, [40, 23])
    engine = BitNetEngine(model)
    logits, codes = forward_with_codes(engine, ids, mask.sum(1).tolist())
    tiles = {launch.kernel.constants.get("TILE_TOKENS") for launch in engine.plan(2, 40).launches}
    assert tiles == {None, 32}  # every gemm launch (the others have no tile)
    stats = FeedStats()
    with feeding_codes(model, codes, stats):
        ref = torch_logits(model, ids, mask)
    assert stats.flips <= FLIP_SHARE * stats.codes, f"{stats.flips} flips in {stats.codes} codes"
    assert_close(logits, ref, LOGIT_RTOL, "logits")


def test_loss_is_transformers_shifted_mean_over_labelled_tokens():
    model = tiny_model("dense", True)
    ids, mask = batch(model.config.vocab_size, [10, 7])
    labels = ids.clone()
    labels[:, :3] = -100
    labels[mask == 0] = -100
    out = BitNetEngine(model)(ids, attention_mask=mask, labels=labels)
    with torch.compiler.set_stance("force_eager"), torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert_close(out.loss, ref, LOSS_RTOL, "loss")


def test_adapter_changes_reach_the_engine_without_a_new_engine():
    from torch_wgpu_lora.integrations.adapter_files import load_adapter_file, save_adapter

    model = tiny_model("dense", True)
    engine = BitNetEngine(model)
    ids, mask = batch(model.config.vocab_size, [8])
    before = engine(ids).logits
    folder = tempfile.mkdtemp()
    save_adapter(model, folder)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss = model(input_ids=ids).logits.square().mean()  # any torch optimizer step on the shared Parameters
    loss.backward()
    opt.step()
    stepped = engine(ids).logits
    assert not torch.equal(stepped, before)
    assert_close(stepped, torch_logits(model, ids, mask), LOGIT_RTOL, "logits after a step")
    load_adapter_file(model, folder)  # load_adapter brings the saved values back
    assert_close(engine(ids).logits, before, LOGIT_RTOL, "logits after load_adapter")


def test_bad_inputs_are_named():
    model = tiny_model("dense", False)
    engine = BitNetEngine(model)
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"token id {V} at \(0, 1\) is outside the vocabulary \[0, {V}\)"):
        engine(torch.tensor([[1, V, 2]]))
    with pytest.raises(ValueError, match="token id -1"):
        engine(torch.tensor([[-1, 2]]))
    with pytest.raises(TypeError, match="input_ids must hold integer token ids, got dtype torch.float32"):
        engine(torch.ones(1, 3))
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor"):
        engine([[1, 2]])
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, tokens\]"):
        engine(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="attention_mask must be a tensor shaped like input_ids"):
        engine(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="attention_mask must right-pad"):
        engine(torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[0, 1, 1]]))
    with pytest.raises(ValueError, match="labels hold 999"):
        engine(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 999, -100]]))
    too_long = model.config.max_position_embeddings + 1
    with pytest.raises(ValueError, match=f"{too_long} tokens exceed the model's context of "
                                         f"{too_long - 1} positions"):
        engine(torch.zeros(1, too_long, dtype=torch.long))
    meta = torch.zeros(1, 3, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="^input_ids is on the meta device: it has a shape but no values"):
        engine(meta)
    with pytest.raises(ValueError, match="^labels is on the meta device"):
        engine(torch.tensor([[1, 2, 3]]), labels=meta)


def test_models_the_engine_cannot_run_are_refused_by_name():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, vocab_size=50))
    with pytest.raises(ValueError, match=r"BitNetEngine runs transformers' BitNetForCausalLM; got a "
                                         r"LlamaForCausalLM \(model_type 'llama'\)"):
        BitNetEngine(llama)
    with pytest.raises(ValueError, match="got a Linear"):
        BitNetEngine(torch.nn.Linear(2, 2))
    odd = tiny_model("dense", False, hidden_size=24, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="head_dim to be a multiple of 4, got 6"):
        BitNetEngine(odd)


# -- like any torch module: threads, fork, torch.compile, double backward -----------------------------

# Threads: the same kernels on the same inputs give the same bits; 1e-6 of the scale would allow
# a reduction whose order followed the GPU's scheduling. Two passes sharing a plan's buffers
# (the failure this guards against) give O(1) errors.
SAME_RTOL = 1e-6


def test_threads_sharing_an_engine_each_get_their_own_logits_loss_gradients_and_tokens():
    model = tiny_model("dense", True)
    engine = BitNetEngine(model)
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = [batch(model.config.vocab_size, [12, 9], seed=seed) for seed in range(4)]  # one shape: one plan

    def run(ids, mask):
        logits = engine(ids, mask).logits
        out = engine(ids, mask, labels=ids)
        grads = torch.autograd.grad(out.loss, params)
        tokens, _ = generate_alone(engine, ids[0, :5].tolist(), 6, set())
        return logits, out.loss, grads, tokens

    expected = [run(*x) for x in inputs]

    def check(i: int) -> None:
        for _ in range(4):
            logits, loss, grads, tokens = run(*inputs[i])
            ref_logits, ref_loss, ref_grads, ref_tokens = expected[i]
            assert_close(logits, ref_logits, SAME_RTOL, "logits")
            assert_close(loss, ref_loss, SAME_RTOL, "loss")
            for g, r in zip(grads, ref_grads):
                assert_close(g, r, SAME_RTOL, "gradients")
            assert tokens == ref_tokens, "generated tokens"

    in_threads(check, 4)


def _runs_the_engine(engine, ids) -> str:
    engine(ids)
    return "no error"


def test_an_engine_made_before_a_fork_gives_the_child_a_clear_error_instead_of_hanging():
    model = tiny_model("dense", False)
    engine = BitNetEngine(model)
    ids, _ = batch(model.config.vocab_size, [6])
    before = engine(ids).logits
    message = in_forked_child(_runs_the_engine, engine, ids)
    assert "forked after its parent created the WebGPU device" in message and "'spawn'" in message
    assert torch.equal(engine(ids).logits, before)  # the parent's engine goes on


def test_torch_compile_runs_the_engine_as_it_is_and_fullgraph_names_what_it_cannot_trace():
    model = tiny_model("dense", True)
    engine = BitNetEngine(model)
    params = [p for p in model.parameters() if p.requires_grad]
    ids, mask = batch(model.config.vocab_size, [10, 7])
    eager = engine(ids, mask, labels=ids)
    eager_grads = torch.autograd.grad(eager.loss, params)
    torch._dynamo.reset()
    compiled = torch.compile(engine)(ids, mask, labels=ids)
    assert torch.equal(compiled.loss, eager.loss)
    assert all(torch.equal(g, r) for g, r in zip(torch.autograd.grad(compiled.loss, params), eager_grads))
    assert torch.equal(torch.compile(engine)(ids, mask).logits, engine(ids, mask).logits)
    torch._dynamo.reset()
    # torch names the disabled forward: "BitNetEngine.forward ... torch.compiler.disable" (2.13),
    # "inline in skipfiles: BitNetEngine.forward" (2.6)
    names = r"BitNetEngine\.forward.*torch\.compiler\.disable|skipfiles: BitNetEngine\.forward"
    with pytest.raises(Exception, match=names):
        torch.compile(engine, fullgraph=True)(ids, mask)


def test_copying_or_pickling_an_engine_is_refused_naming_what_to_do_instead():
    import copy
    import pickle

    engine = BitNetEngine(tiny_model("dense", False))
    for attempt in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match="BitNetEngine holds GPU buffers and cannot be copied or pickled"):
            attempt(engine)


def test_double_backward_through_the_engine_loss_is_refused_clearly():
    model = tiny_model("dense", True)
    engine = BitNetEngine(model)
    params = [p for p in model.parameters() if p.requires_grad]
    ids, mask = batch(model.config.vocab_size, [8])
    loss = engine(ids, mask, labels=ids).loss
    with pytest.raises(RuntimeError, match="can be differentiated once.*create_graph=True.*engine='torch'"):
        torch.autograd.grad(loss, params, create_graph=True)
    (grad,) = torch.autograd.grad(engine(ids, mask, labels=ids).loss, params[:1])  # a plain backward still works
    assert torch.isfinite(grad).all()


# -- packed rows ---------------------------------------------------------------------------------------

# Rows of one, two and three examples, examples of one token, a last run of padding (one more
# example, as the collator makes it): lengths of each row's examples.
PACKED = [[5, 1, 3], [9], [2, 2, 1, 4]]


@pytest.mark.parametrize("adapters", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_packed_rows_logits_match_transformers(config, adapters):
    # transformers' own model on the same packed rows (position ids, no attention mask): RoPE at
    # each token's position id, each example attending to itself only
    model = tiny_model("dense", adapters, **CONFIGS[config])
    positions = packed_positions(PACKED)
    ids, _ = batch(model.config.vocab_size, [positions.shape[1]] * positions.shape[0], seed=3)
    labels = ids.clone()
    labels[positions == 0] = -100  # no example predicts its first token from the one before
    with torch.no_grad():
        out = BitNetEngine(model)(ids, position_ids=positions, labels=labels)
        ref_loss = model(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss
    ref = torch_logits(model, ids, None, positions)
    assert_close(out.logits, ref, LOGIT_RTOL, "logits")
    assert_close(out.loss, ref_loss, LOSS_RTOL, "loss")
    unpacked = torch_logits(model, ids, None)
    assert (unpacked - ref).abs().max() > 100 * LOGIT_RTOL * ref.abs().max()  # the packing matters


@pytest.mark.parametrize("flavour", [f for f in FLAVOURS if f != "dense"])
def test_packed_rows_quantised_logits_match_transformers_fed_the_engines_codes(flavour):
    model = tiny_model(flavour, True, **CONFIGS["gqa-tied"])
    positions = packed_positions(PACKED)
    batch_size, tokens = positions.shape
    ids, _ = batch(model.config.vocab_size, [tokens] * batch_size, seed=4)
    engine = BitNetEngine(model)
    logits, codes = forward_with_codes(engine, ids, [tokens] * batch_size, positions)
    stats = FeedStats()
    with feeding_codes(model, codes, stats):
        ref = torch_logits(model, ids, None, positions)
    assert stats.calls == 7 * model.config.num_hidden_layers and stats.nonzero > stats.codes // 2
    assert stats.flips <= FLIP_SHARE * stats.codes, f"{stats.flips} flips in {stats.codes} codes"
    assert_close(logits, ref, LOGIT_RTOL, "logits")
    assert torch.equal(engine(ids, position_ids=positions).logits, logits)  # the public forward: this pass


def test_a_packed_row_may_be_longer_than_the_context_while_its_examples_fit():
    # as transformers numbers packed rows: two examples of 200 tokens make a row of 400 positions
    # numbered up to 199, within the context of 256; an example of 300 is refused as 300 tokens are
    model = tiny_model("dense", True)
    assert model.config.max_position_embeddings == 256
    engine = BitNetEngine(model)
    positions = packed_positions([[200, 200]])
    ids, _ = batch(model.config.vocab_size, [400], seed=5)
    assert_close(engine(ids, position_ids=positions).logits, torch_logits(model, ids, None, positions), LOGIT_RTOL,
                 "logits")
    assert any(row.owner == "forward 1×400, packed" for row in engine.memory_report().rows)
    with pytest.raises(ValueError) as unpacked:
        engine(torch.zeros(1, 300, dtype=torch.long))
    with pytest.raises(ValueError) as packed:
        engine(ids, position_ids=packed_positions([[300, 100]]))
    assert str(packed.value) == str(unpacked.value) == "300 tokens exceed the model's context of 256 positions " \
                                                         "(max_position_embeddings)"


def test_position_ids_that_are_not_packed_rows_are_refused_naming_what_is_wrong():
    model = tiny_model("dense", False)
    engine = BitNetEngine(model)
    ids, mask = batch(model.config.vocab_size, [6, 6])
    good = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]])
    cases = {  # what is wrong: (position_ids, the error)
        "a row not starting at 0": (torch.tensor([[0, 1, 2, 0, 1, 2], [1, 2, 3, 4, 5, 6]]),
                                    r"position_ids row 1 starts at 1: a packed row's position ids count 0, 1, \.\.\. "
                                    r"within each example, from its first token"),
        "a gap": (torch.tensor([[0, 1, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5]]),
                  r"position_ids row 0, column 2: jumps from 1 to 3; a packed row's position ids count 0, 1, \.\.\. "
                  r"within each example and restart at 0 where the next example starts"),
        "going back mid-run": (torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 1, 2, 3]]),
                               r"position_ids row 1, column 3: goes from 2 back to 1, not to 0"),
        "a left-padded row": (torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 1, 2]]), None),  # 0, 0: single tokens
    }
    for what, (positions, error) in cases.items():
        if error is None:  # several examples of one token are packed rows too
            engine(ids, position_ids=positions)
            continue
        with pytest.raises(ValueError, match=error):
            engine(ids, position_ids=positions)
    with pytest.raises(ValueError, match=r"position_ids must be shaped like input_ids \(2, 6\), got \(2, 5\)"):
        engine(ids, position_ids=good[:, :5])
    with pytest.raises(TypeError, match="position_ids must hold integers, got dtype torch.float32"):
        engine(ids, position_ids=good.float())
    with pytest.raises(ValueError, match="with position_ids and no attention_mask .* drop the attention_mask"):
        engine(ids, attention_mask=mask, position_ids=good)
    # (1, tokens) serves every row, as transformers broadcasts it
    assert torch.equal(engine(ids, position_ids=good[:1]).logits, engine(ids, position_ids=good[[0, 0]]).logits)


# -- memory ------------------------------------------------------------------------------------------

_MEMORY_SCRIPT = """
import json, torch
from tests.engine.helpers import labelled_batch, tiny_model
from torch_wgpu_lora import BitNetEngine, WgpuAdamW
from torch_wgpu_lora.integrations.bitnet import lora_parameters

model = tiny_model("packed", adapters=True, seed=7, num_hidden_layers=3)
engine = BitNetEngine(model)
micro = [labelled_batch(model, [40, 23])]
engine.train_step(micro, WgpuAdamW(lora_parameters(model), lr=1e-3), max_grad_norm=1.0)
engine(micro[0]["input_ids"], attention_mask=micro[0]["attention_mask"])
report = engine.memory_report()
print(json.dumps({"rows": [[r.owner, r.role, r.nbytes] for r in report.rows], "allocated": report.allocated,
                  "peak": report.peak, "table": str(report), "weights": engine.weights.arena.nbytes}))
"""


def test_the_memory_report_accounts_for_the_measured_peak():
    """In a fresh process (no other test's buffers), after a training step and a forward: the
    report's rows other than "unattributed" add up to the runtime's measured peak within 5% (the
    peak also saw what a step frees again: its uploads' and readbacks' transient buffers), and name
    what holds the memory."""
    done = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {(owner, role): n for owner, role, n in report["rows"]}
    attributed = sum(rows.values()) - rows.get(("runtime", "unattributed"), 0)
    assert sum(rows.values()) == report["allocated"]  # the rows, unattributed included, are what is allocated
    assert abs(attributed - report["peak"]) <= 0.05 * report["peak"], report["table"]
    assert rows[("weights", "frozen weights")] == report["weights"]
    assert rows[("train 2×40", "saved for the backward")] > rows[("train 2×40", "gradients")] > 0
    assert rows[("forward 2×40", "KV cache")] > 0 and rows[("optimizer step", "optimizer")] > 0
    assert "saved for the backward" in report["table"]
