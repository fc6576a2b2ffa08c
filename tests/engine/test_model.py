"""BitNetEngine's forward against transformers' own BitNetForCausalLM, on tiny models of all
four checkpoint flavours built offline, with and without adapters (B ≠ 0).

Dense flavour: logits within 1e-4 of the largest |logit| (float32 on both sides, sums in other
orders: errors ~1e-6 of the scale, so 100× margin; an indexing bug gives O(1)). Quantised
flavours: the same tolerance once torch is fed the engine's int8 codes, with every code flip
checked to be a near-tie and flips bounded (``integrations.quantisation`` says why).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from torch_wgpu_lora import BitNetEngine
from torch_wgpu_lora.engine.kernels import bitlinear
from torch_wgpu_lora.integrations.bitnet import apply_lora, load_bitnet
from torch_wgpu_lora.integrations.tiny import FLAVOURS, build_tiny_bitnet

from torch_wgpu_lora.integrations.quantisation import FLIP_SHARE, FeedStats, feeding_codes

from ..concurrency import in_forked_child, in_threads
from .helpers import forward_with_codes

LOGIT_RTOL = 1e-4

CONFIGS = {
    "gqa-tied": {},
    "untied-mha-3-layers": dict(tie_word_embeddings=False, num_key_value_heads=4, num_hidden_layers=3),
    "odd-sizes": dict(hidden_size=48, intermediate_size=40, num_attention_heads=4, num_key_value_heads=1,
                      vocab_size=67, num_hidden_layers=1),
}


def tiny_model(flavour: str, adapters: bool, seed: int = 0, **config) -> torch.nn.Module:
    model = load_bitnet(build_tiny_bitnet(tempfile.mkdtemp(), flavour=flavour, seed=seed, **config))
    if adapters:
        apply_lora(model, r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def batch(vocab: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), tokens), generator=g)
    mask = (torch.arange(tokens)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def torch_logits(model, ids, mask):
    with torch.compiler.set_stance("force_eager"), torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def assert_logits_close(got, ref):
    scale = ref.abs().max().item()
    err = (got - ref).abs().max().item()
    assert err <= LOGIT_RTOL * scale, f"max |logit error| {err:.3g} vs largest |logit| {scale:.3g}"


@pytest.mark.parametrize("adapters", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_dense_logits_match_transformers(config, adapters):
    model = tiny_model("dense", adapters, **CONFIGS[config])
    ids, mask = batch(model.config.vocab_size, [9, 6, 1])
    out = BitNetEngine(model)(ids, attention_mask=mask)
    assert out.logits.shape == (3, 9, model.config.vocab_size) and out.logits.dtype == torch.float32
    assert_logits_close(out.logits, torch_logits(model, ids, mask))


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
    assert_logits_close(logits, ref)
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
    assert_logits_close(logits, ref)


def test_loss_is_transformers_shifted_mean_over_labelled_tokens():
    model = tiny_model("dense", True)
    ids, mask = batch(model.config.vocab_size, [10, 7])
    labels = ids.clone()
    labels[:, :3] = -100
    labels[mask == 0] = -100
    out = BitNetEngine(model)(ids, attention_mask=mask, labels=labels)
    with torch.compiler.set_stance("force_eager"), torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert abs(out.loss.item() - ref.item()) <= 1e-5 * abs(ref.item())


def test_adapter_changes_reach_the_engine_without_a_new_engine():
    from torch_wgpu_lora.integrations.adapters import load_adapter, save_adapter

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
    assert_logits_close(stepped, torch_logits(model, ids, mask))
    load_adapter(model, folder)  # load_adapter brings the saved values back
    assert_logits_close(engine(ids).logits, before)


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


def _same(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool((got - ref).abs().max() <= SAME_RTOL * ref.abs().max())


def test_threads_sharing_an_engine_each_get_their_own_logits_loss_gradients_and_tokens():
    from torch_wgpu_lora.engine.generate import engine_generate

    model = tiny_model("dense", True)
    engine = BitNetEngine(model)
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = [batch(model.config.vocab_size, [12, 9], seed=seed) for seed in range(4)]  # one shape: one plan

    def run(ids, mask):
        logits = engine(ids, mask).logits
        out = engine(ids, mask, labels=ids)
        grads = torch.autograd.grad(out.loss, params)
        tokens, _ = engine_generate(engine, ids[0, :5].tolist(), 6, set())
        return logits, out.loss, grads, tokens

    expected = [run(*x) for x in inputs]

    def check(i: int) -> None:
        for _ in range(4):
            logits, loss, grads, tokens = run(*inputs[i])
            ref_logits, ref_loss, ref_grads, ref_tokens = expected[i]
            assert _same(logits, ref_logits), "logits"
            assert _same(loss, ref_loss), "loss"
            assert all(_same(g, r) for g, r in zip(grads, ref_grads)), "gradients"
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


def test_position_ids_are_refused_rather_than_ignored():
    # Packed sequences restart their positions; the engine numbers every row 0, 1, ... and attends
    # across it, so taking position_ids silently would give another model's logits.
    model = tiny_model("dense", False)
    ids, mask = batch(model.config.vocab_size, [6])
    with pytest.raises(ValueError, match="BitNetEngine numbers positions 0, 1, ... in each row and attends across "
                                         "the whole row; it does not take position_ids"):
        BitNetEngine(model)(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
