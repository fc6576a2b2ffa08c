"""Generation on the engine against the CPU path (``generate(model, ...)``, transformers' own
modules with a KV cache): greedy tokens equal for 40 tokens on every flavour, except where a
quantised model's rounding flip is shown to explain a divergence (``integrations.quantisation``);
and a batch of prompts against each prompt alone: the same tokens, exactly, on every flavour."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_wgpu_lora import BitNetEngine, generate
from torch_wgpu_lora.engine import Generated
from torch_wgpu_lora.engine.generate import FILL_SHARE, fill_length, rows_to_fill
from torch_wgpu_lora.engine.kernels.bitlinear import GEMV_GROUP
from torch_wgpu_lora.engine.kernels.projection import gemv_max_tokens
from torch_wgpu_lora.engine.kernels.sampling import ROW_COUNT
from torch_wgpu_lora.engine.plan import ForwardPlan, KVCache
from torch_wgpu_lora.engine.program import read_codes
from torch_wgpu_lora.engine.workspace import Workspace
from torch_wgpu_lora.integrations.bitnet import add_lora_layers
from torch_wgpu_lora.integrations.quantisation import FLIP_SHARE, FeedStats, feeding_codes
from torch_wgpu_lora.integrations.tiny import FLAVOURS
from torch_wgpu_lora.logits import process_logits
from torch_wgpu_lora.runtime import Recorder, write

from .helpers import (CONFIGS, LOGIT_RTOL, assert_close, engine_choice_is_explained_by_a_flip, generate_alone,
                      generate_batch, mixed_prompts, tiny_model, tiny_tokenizer, torch_greedy, torch_logits)

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def cpu_generate(model, tokenizer, prompt, **options):
    with torch.compiler.set_stance("force_eager"):
        return generate(model, tokenizer, prompt, return_ids=True, eos_token_id=[], **options)


def decoded_logits_and_codes(engine, rows: list[list[int]], fuse: bool) -> tuple[torch.Tensor, dict, list[str]]:
    """The decode plan's logits [batch, vocab] for the last of each row's ids (rows of one length)
    after a prefill of the others, the int8 codes of every quantisation point of both passes
    ({(layer, site): ([batch, length, K], scales)}), and the decode plan's kernels in order."""
    batch, prompt, config = len(rows), len(rows[0]) - 1, engine.engine_config
    ids = np.asarray(rows, np.uint32)
    workspace = Workspace(engine.device)
    cache = KVCache(config, batch, prompt + 1, workspace)
    prefill = ForwardPlan(engine.weights, engine.adapters, cache, prompt, logits="none", workspace=workspace)
    decode = ForwardPlan(engine.weights, engine.adapters, cache, 1, logits="last", decode=True, fuse=fuse,
                         workspace=workspace)
    engine.adapters.sync()
    write(prefill.ids, np.ascontiguousarray(ids[:, :-1]).ravel())
    cache.set_position(0, [prompt] * batch)
    rec, first = Recorder(), {}
    prefill.record(rec, capture=first)
    rec.submit()
    write(decode.ids, np.ascontiguousarray(ids[:, -1]))
    cache.set_position(prompt, [prompt + 1] * batch)
    rec, last, logits = Recorder(), {}, torch.empty(batch, config.vocab)
    decode.record(rec, capture=last)
    decode.read_logits(rec, logits.numpy())
    rec.submit()
    before, after = read_codes(first, batch, prompt, config), read_codes(last, batch, 1, config)
    codes = {key: (torch.cat([before[key][0], after[key][0]], 1),
                   torch.cat([before[key][1].reshape(batch, prompt), after[key][1].reshape(batch, 1)], 1).reshape(-1))
             for key in before}
    return logits, codes, [launch.kernel.name for launch in decode.program.launches]


def q_v_model(flavour: str, config: str, seed: int) -> torch.nn.Module:
    """A tiny model with LoRA on q_proj and v_proj only (BitNet-2B's benchmark shape: the o, mlp
    and down sites have none), its B matrices random."""
    model = tiny_model(flavour, False, seed=seed, **CONFIGS[config])
    add_lora_layers(model, r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def assert_fed_logits_match(model, rows: list[list[int]], logits: torch.Tensor, codes: dict) -> None:
    """transformers' logits of the last position of each row, its projections fed the engine's
    codes (near-tie flips only, few of them), against the engine's."""
    stats = FeedStats()
    with feeding_codes(model, codes, stats):
        ref = torch_logits(model, torch.tensor(rows), torch.ones(len(rows), len(rows[0]), dtype=torch.long))[:, -1]
    assert len(stats.sites) == 4 * model.config.num_hidden_layers
    assert stats.flips <= FLIP_SHARE * stats.codes, f"{stats.flips} flips in {stats.codes} codes"
    assert_close(logits, ref, LOGIT_RTOL, "decoded logits")


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("adapters", ["none", "q-v", "all"])
@pytest.mark.parametrize("config", ["gqa-tied", "odd-sizes"])
@pytest.mark.parametrize("flavour", [f for f in FLAVOURS if f != "dense"])
def test_decoded_logits_match_transformers_fed_the_engines_codes(flavour, config, adapters, fuse):
    # The decode step against transformers' modules over the whole sequence; fused: GEMVs that
    # normalise their own input where the site has no adapter, the q/k/v GEMV rotating into the
    # cache (the default on GPUs), unfused: the default on CPU adapters.
    # BitNet-2B's benchmark shape, q-v: the o, mlp and down sites fuse their norms
    model = (q_v_model(flavour, config, seed=6) if adapters == "q-v"
             else tiny_model(flavour, adapters == "all", seed=6, **CONFIGS[config]))
    engine = BitNetEngine(model)
    ids = torch.randint(0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    logits, codes, _ = decoded_logits_and_codes(engine, [ids], fuse)
    assert_fed_logits_match(model, [ids], logits, codes)


@pytest.mark.parametrize("adapters", ["q-v", "all"])
@pytest.mark.parametrize("config", ["gqa-tied", "odd-sizes"])
def test_a_decoded_batch_matches_transformers_fed_the_engines_codes(config, adapters):
    # two rows past the GEMV path's (four on a CPU adapter): o_proj's norm merges attention's key-span
    # partials (no combine launch); where the projections run on the matrix units (the Mesa 26 leg
    # runs this with the gemms setting "matrix_units"), q/k/v's split epilogue rotates (no rope
    # launch), and with Q/V adapters o_proj's and gate/up's split sums are finished by the next
    # norm's launch (two a layer), with adapters everywhere by their own epilogue launches
    model = (q_v_model("packed", config, seed=8) if adapters == "q-v"
             else tiny_model("packed", True, seed=8, **CONFIGS[config]))
    engine = BitNetEngine(model)
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, model.config.vocab_size, (gemv_max_tokens(engine.device) + 2, 7), generator=g).tolist()
    logits, codes, kernels = decoded_logits_and_codes(engine, rows, fuse=True)
    layers = model.config.num_hidden_layers
    on_units = kernels.count("bitlinear_mma.wgsl:gemm")
    assert on_units in (0, 4 * layers), kernels
    finished = kernels.count("norm.wgsl:rmsnorm_split")
    assert finished == (2 * layers if adapters == "q-v" and on_units else 0), kernels
    assert kernels.count("bitlinear_mma.wgsl:split_epilogue_rope") == (layers if on_units else 0)
    assert kernels.count("rope.wgsl:rope") == (0 if on_units else layers)
    assert kernels.count("norm.wgsl:rmsnorm_partials") == layers and "attention.wgsl:decode_combine" not in kernels
    assert_fed_logits_match(model, rows, logits, codes)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_greedy_tokens_equal_the_cpu_paths(flavour, tokenizer):
    model = tiny_model(flavour, adapters=True, seed=3)
    engine = BitNetEngine(model)
    prompt = "Name a primary colour."
    ours = generate(engine, tokenizer, prompt, max_new_tokens=NEW_TOKENS, return_ids=True, eos_token_id=[])
    theirs = cpu_generate(model, tokenizer, prompt, max_new_tokens=NEW_TOKENS)
    assert ours.prompt_ids == theirs.prompt_ids and len(ours.token_ids) == NEW_TOKENS
    if ours.token_ids == theirs.token_ids:
        return
    assert flavour != "dense", f"dense tokens differ: {ours.token_ids} vs {theirs.token_ids}"
    first = next(i for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)) if a != b)
    engine_token, fed_token = engine_choice_is_explained_by_a_flip(
        model, engine, ours.prompt_ids + ours.token_ids[:first], penalty=1.1)
    assert engine_token == ours.token_ids[first] == fed_token


def test_any_number_of_tokens_a_submit_and_eos_give_the_torch_models_tokens(tokenizer):
    # dense: no int8 rounding between the paths, so greedy tokens must be equal
    model = tiny_model("dense", adapters=True, seed=4)
    engine = BitNetEngine(model)
    prompt_ids = tokenizer("Name a primary colour.")["input_ids"]
    expected = torch_greedy(model, prompt_ids, 20, penalty=1.0)
    for k in (1, 3, 8, 64):
        assert generate_alone(engine, prompt_ids, 20, set(), tokens_per_submit=k) == (expected, False), k
    stop = expected[6]
    first = expected.index(stop)
    tokens, by_eos = generate_alone(engine, prompt_ids, 20, {stop}, tokens_per_submit=4)
    assert by_eos and tokens == expected[: first + 1]


def test_sampling_is_reproducible_per_seed_and_follows_the_filters(tokenizer):
    model = tiny_model("dense", adapters=True, seed=5)
    engine = BitNetEngine(model)
    prompt = "Name a primary colour."
    a = generate(engine, tokenizer, prompt, max_new_tokens=12, do_sample=True, top_k=3, temperature=0.7, seed=11,
                 repetition_penalty=1.1, return_ids=True, eos_token_id=[])
    b = generate(engine, tokenizer, prompt, max_new_tokens=12, do_sample=True, top_k=3, temperature=0.7, seed=11,
                 repetition_penalty=1.1, return_ids=True, eos_token_id=[])
    assert a.token_ids == b.token_ids
    # every sampled token was among the 3 most likely (after the penalty) at its step
    ids = a.prompt_ids + a.token_ids
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    for i, token in enumerate(a.token_ids):
        position = len(a.prompt_ids) + i - 1
        processed = process_logits(logits[position], torch.tensor(ids[: position + 1]), repetition_penalty=1.1)
        assert token in torch.topk(processed, 3).indices.tolist()
    others = {tuple(generate(engine, tokenizer, prompt, max_new_tokens=12, do_sample=True, top_k=0, top_p=0.95,
                             temperature=1.5, seed=s, return_ids=True, eos_token_id=[]).token_ids) for s in range(4)}
    assert len(others) > 1  # seeds matter


def test_generation_past_the_context_is_refused(tokenizer):
    model = tiny_model("dense", adapters=False)
    engine = BitNetEngine(model)
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"need {limit + 4} positions; the model's context is {limit}"):
        generate_alone(engine, [1, 2, 3, 4], limit, set())


def test_a_reused_session_generates_what_the_torch_model_does():
    # Generations of one shape share the engine's cached session (KV cache, plans, the sampler's
    # seen-token and history buffers); a repetition penalty makes stale seen tokens show. Dense:
    # greedy tokens equal the torch model's.
    model = tiny_model("dense", adapters=True, seed=5)
    engine = BitNetEngine(model)
    first, second = [5, 9, 2, 7, 11, 3], [8, 1, 6, 4, 10, 12]
    generate_alone(engine, first, 12, set(), repetition_penalty=5.0)
    session = engine.decode_session(1, 6, 12, repetition_penalty=5.0)
    reused, _ = generate_alone(engine, second, 12, set(), repetition_penalty=5.0)
    assert engine.decode_session(1, 6, 12, repetition_penalty=5.0) is session  # nothing new was built
    assert reused == torch_greedy(model, second, 12, penalty=5.0)


def test_the_prompt_pass_keeps_its_attention_scores_whole_and_decoding_cannot():
    # A prompt starts at position 0: its attention runs as GEMMs over S kept whole (checked against
    # transformers by the generation tests above); a decoding plan continues a cache.
    model = tiny_model("packed", adapters=True, seed=5)
    engine = BitNetEngine(model)
    s = engine.decode_session(1, 6, 4)
    assert "attention_softmax.wgsl:rows" in [launch.kernel.name for launch in s.prefill.launches]
    assert "attention_softmax.wgsl:rows" not in [launch.kernel.name for launch in s.decode.launches]
    with pytest.raises(ValueError, match="cannot promise to start at position 0"):
        ForwardPlan(engine.weights, engine.adapters, s.cache, 1, logits="last", decode=True, from_start=True)


def row_state(session) -> tuple[np.ndarray, np.ndarray]:
    """A decode session's rows as the GPU left them: each one's length and count of tokens generated."""
    lengths, state = np.zeros(session.batch, np.uint32), np.zeros(session.state.shape, np.uint32)
    rec = Recorder()
    rec.read(session.cache.lengths, lengths)
    rec.read(session.state, state)
    rec.submit()
    return lengths, state[:, ROW_COUNT]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_batch_generates_each_prompts_tokens_alone_on_every_flavour(flavour):
    # Prompts of 5, 9, 2 and 13 tokens decode together, each at its own position, with its own
    # repetition penalty: each row's greedy tokens are the ones it gets alone, exactly (its sums do
    # not depend on the batch: engine.generate's docstring). Then with an EOS token that ends some
    # rows early and not others: those rows end there, the others run on, and a finished row's
    # length on the GPU is 0 (attention reads one key of it, the sampler skips it). The batch's
    # projections and LM head run as GEMVs (a workgroup a row in each ternary GEMV, the 4 rows in
    # one group in each float one), alone as one row a launch.
    model = tiny_model(flavour, adapters=True, seed=3)
    engine = BitNetEngine(model)
    prompts = mixed_prompts(model.config.vocab_size)
    alone = [generate_alone(engine, p, 20, set(), repetition_penalty=1.1) for p in prompts]
    assert generate_batch(engine, prompts, 20, set(), repetition_penalty=1.1) == alone
    eos = next({t} for tokens, _ in alone for t in tokens[2:12]
               if sum(t in other for other, _ in alone) < len(alone))  # a token some rows never choose
    alone = [generate_alone(engine, p, 20, eos, repetition_penalty=1.1) for p in prompts]
    ended = [by_eos for _, by_eos in alone]
    assert any(ended) and not all(ended)
    assert generate_batch(engine, prompts, 20, eos, repetition_penalty=1.1) == alone
    session = engine.decode_session(len(prompts), 13, 20, repetition_penalty=1.1)
    lengths, counts = row_state(session)
    # each row ended on the GPU, at its EOS token or its 20th, and generated nothing after; but the row
    # of the last prompt running moved into row 0 when the session narrowed (engine.generate), and was
    # left as it stood then
    expected = [len(tokens) for tokens, _ in alone]
    moved = [row for row, n in enumerate(lengths.tolist()) if n]
    assert len(moved) <= 1 and set(session.narrowed) <= {1}
    for row in moved:
        assert counts[row] < expected[row]
        expected[0] = expected[row]
    assert [n for row, n in enumerate(counts.tolist()) if row not in moved] == \
        [n for row, n in enumerate(expected) if row not in moved]
    projections = [launch for launch in session.decode.launches
                   if launch.kernel.name.split(":")[0] in ("bitlinear.wgsl", "matmul.wgsl")]
    groups = {"bitlinear.wgsl": GEMV_GROUP, "matmul.wgsl": len(prompts)}
    assert projections and all(":gemv" in launch.kernel.name
                               and launch.kernel.constants["GROUP"] == groups[launch.kernel.name.split(":")[0]]
                               for launch in projections)


def test_seeded_sampling_in_a_batch_draws_each_rows_tokens_alone():
    # Each row samples with its own seed and count: the tokens of the same prompt and seed alone;
    # the same seeds again give the same tokens, other seeds others.
    model = tiny_model("packed", adapters=True, seed=5)
    engine = BitNetEngine(model)
    prompts = mixed_prompts(model.config.vocab_size, (4, 11, 7), seed=1)
    options = dict(strategy="top_k_top_p", top_k=20, top_p=0.9, temperature=1.3, repetition_penalty=1.2)
    seeds = [7, 8, 9]
    batch = generate_batch(engine, prompts, 16, set(), seeds=seeds, **options)
    assert batch == [generate_alone(engine, p, 16, set(), seed=s, **options) for p, s in zip(prompts, seeds)]
    assert generate_batch(engine, prompts, 16, set(), seeds=seeds, **options) == batch
    assert generate_batch(engine, prompts, 16, set(), seeds=[1, 2, 3], **options) != batch


def test_the_host_ends_a_row_where_on_token_says_and_the_others_run_on():
    # A stop string is the host's end of a row: on_token sees every token in order and ends row 1
    # after its third; the row's tokens stop there and its GPU length drops to 0, while the other
    # rows generate what they generate alone.
    model = tiny_model("dense", adapters=True, seed=4)
    engine = BitNetEngine(model)
    prompts = mixed_prompts(model.config.vocab_size, (6, 3, 8), seed=2)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def on_token(row: int, token: int) -> bool:
        seen[row].append(token)
        return row == 1 and len(seen[row]) == 3

    got = generate_batch(engine, prompts, 12, set(), tokens_per_submit=2, on_token=on_token)
    alone = [generate_alone(engine, p, 12, set()) for p in prompts]
    assert got[1] == (alone[1][0][:3], False) and got[0] == alone[0] and got[2] == alone[2]
    assert [seen[r] for r in range(3)] == [tokens for tokens, _ in got]
    lengths, counts = row_state(engine.decode_session(3, 8, 12))  # the session the call used
    assert lengths.tolist() == [0, 0, 0]  # every row ended: row 1 by the host, the others at their 12th token
    # row 1 stopped generating once the host's end reached the GPU, at most two submits after its third token
    assert counts[0] == counts[2] == 12 and 3 <= counts[1] <= 3 + 2 * 2


def test_batch_limits_are_stated_and_refused_before_anything_runs():
    model = tiny_model("dense", adapters=False)
    engine = BitNetEngine(model)
    config, limit = engine.engine_config, model.config.max_position_embeddings
    most = KVCache.max_batch(config, 64, engine.device.max_binding)
    with pytest.raises(ValueError, match=f"a layer's keys must fit one storage binding of "
                                         f"{engine.device.max_binding} bytes: at most {most} sequences"):
        KVCache(config, most + 1, 64, Workspace(engine.device))
    assert KVCache.nbytes(config, 3, 64) == 2 * config.layers * 3 * config.kv_heads * 64 * config.head_dim * 4
    with pytest.raises(ValueError, match="no prompts to generate for: the list is empty"):
        generate_batch(engine, [], 4, set())
    with pytest.raises(ValueError, match=r"prompt 1 must be 1 or more token ids in \[0, 320\), got \[3, 320\]"):
        generate_batch(engine, [[3], [3, 320]], 4, set())
    with pytest.raises(ValueError, match=f"prompt 0: a 2-token prompt and max_new_tokens={limit} need {limit + 2} "
                                         f"positions; the model's context is {limit}"):
        generate_batch(engine, [[3, 4], [3, 4, 5, 6]], limit, set())
    # each prompt fits with its own limit, but every row's cache holds the longest prompt and the most tokens
    with pytest.raises(ValueError, match=f"prompts of up to 4 tokens and up to {limit - 2} new tokens share KV cache "
                                         f"rows of {limit + 2} positions, past the model's context of {limit}"):
        generate_batch(engine, [[3, 4], [3, 4, 5, 6]], [limit - 2, 2], set())
    with pytest.raises(ValueError, match="max_new_tokens gives 1 limits for 2 prompts"):
        generate_batch(engine, [[3, 4], [3, 4, 5, 6]], [2], set())
    with pytest.raises(ValueError, match="max_new_tokens of prompt 1 must be an integer >= 0, got -1"):
        generate_batch(engine, [[3, 4], [3, 4, 5, 6]], [2, -1], set())
    with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1 \(or None: every prompt at once\), "
                                         "got 0"):
        generate_batch(engine, [[3, 4], [3, 4, 5, 6]], 2, set(), batch_size=0)
    with pytest.raises(ValueError, match="tokens_per_submit must be an integer >= 1, got 0"):
        generate_batch(engine, [[3, 4], [3, 4, 5, 6]], 2, set(), tokens_per_submit=0)


def test_a_prompt_pass_is_told_each_rows_last_token_within_its_shape():
    model = tiny_model("dense", adapters=False)
    engine = BitNetEngine(model)
    session = engine.decode_session(2, 3, 4)
    with pytest.raises(ValueError, match=r"lengths \[3, 4\] for a pass of 2 sequences × 3 tokens"):
        session.prefill.set_last([3, 4])
    with pytest.raises(ValueError, match=r"lengths \[0, 1\] for a pass of 2 sequences × 3 tokens"):
        session.prefill.set_last([0, 1])
    with pytest.raises(ValueError, match="this one keeps 'all'"):
        engine.plan(1, 3).set_last([3])


# -- continuous batching: more prompts than rows, a finished row taking the next prompt ------------

def transformers_tokens(model, prompt: list[int], max_new_tokens: int, eos: set[int], penalty: float) -> list[int]:
    """transformers' own greedy ``generate`` of the torch model, for one prompt: its new tokens."""
    ids = torch.tensor([prompt])
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=sorted(eos), pad_token_id=2, repetition_penalty=penalty)
    return out[0, len(prompt):].tolist()


def assert_is_transformers(model, engine, prompt: list[int], ours: list[int], theirs: list[int], flavour: str,
                           penalty: float) -> None:
    """``ours`` are transformers' tokens (dense: exactly), or (quantised flavours) their first
    divergence is explained by an int8 rounding flip."""
    if ours == theirs:
        return
    assert flavour != "dense", f"{ours} vs {theirs}"
    first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    engine_token, fed_token = engine_choice_is_explained_by_a_flip(model, engine, prompt + ours[:first], penalty)
    assert engine_token == ours[first] == fed_token


CONTINUOUS_LENGTHS = (5, 9, 2, 13, 7, 1, 11, 4)
CONTINUOUS_LIMITS = [20, 3, 3, 1, 17, 9, 6, 14]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_continuous_batching_gives_each_prompt_its_tokens_alone_and_transformers(flavour):
    # Eight prompts of mixed lengths and max_new_tokens through 3 cache rows, with an EOS token that
    # ends some of them early: rows end at different steps (two together, after their third token),
    # and each finished row takes the next prompt, prefilled alone and copied into the row. Every
    # prompt gets exactly the tokens it gets alone (its sums do not depend on its row or its
    # neighbours: engine.generate's docstring) and transformers' own generate gives the torch
    # model's (quantised flavours: up to a divergence an int8 rounding flip explains). The
    # results come back in input order, each handed to on_done as soon as it is complete.
    model = tiny_model(flavour, adapters=True, seed=3)
    engine = BitNetEngine(model)
    prompts = mixed_prompts(model.config.vocab_size, CONTINUOUS_LENGTHS, seed=4)
    options = dict(repetition_penalty=1.1, tokens_per_submit=4)
    plain = [generate_alone(engine, p, n, set(), **options) for p, n in zip(prompts, CONTINUOUS_LIMITS)]
    # a token some prompts choose and others never, the first (20 tokens) among them: it ends after others
    eos = next({t} for tokens, _ in plain[1:] for t in tokens[1:] if t not in plain[0][0])
    alone = [generate_alone(engine, p, n, eos, **options) for p, n in zip(prompts, CONTINUOUS_LIMITS)]
    assert any(by_eos for _, by_eos in alone)
    done: list[tuple[int, Generated]] = []
    got = generate_batch(engine, prompts, CONTINUOUS_LIMITS, eos, batch_size=3,
                         on_done=lambda i, result: done.append((i, result)), **options)
    assert got == alone
    assert sorted(done) == list(enumerate(alone)) and [i for i, _ in done] != sorted(i for i, _ in done)
    session = engine.decode_session(3, max(CONTINUOUS_LENGTHS), max(CONTINUOUS_LIMITS), repetition_penalty=1.1)
    assert session.fill_rows == len(prompts) - 3  # the call's session: every prompt past the first 3 filled a row
    # two rows freed at once took their prompts in one prompt pass; a fill's pass covers its own longest
    # prompt rounded up to a power of two (at least 8), not the session's 13 tokens
    assert any(count == 2 for count, _ in session.fills)
    assert {length for _, length in session.fills} == {8, 13}
    for prompt, n, (tokens, _) in zip(prompts, CONTINUOUS_LIMITS, got):
        theirs = transformers_tokens(model, prompt, n, eos, penalty=1.1)
        assert_is_transformers(model, engine, prompt, tokens, theirs, flavour, penalty=1.1)


def test_continuous_batching_samples_each_prompt_as_it_is_alone_for_its_seed():
    # Sampling: a row a prompt takes over starts from that prompt's seed and a count of 0, so each
    # prompt draws what it draws alone with its seed, whichever row it gets and whenever.
    model = tiny_model("packed", adapters=True, seed=5)
    engine = BitNetEngine(model)
    prompts = mixed_prompts(model.config.vocab_size, (4, 11, 7, 3, 9), seed=1)
    limits, seeds = [5, 16, 2, 9, 12], [7, 8, 9, 10, 11]
    options = dict(strategy="top_k_top_p", top_k=20, top_p=0.9, temperature=1.3, repetition_penalty=1.2)
    alone = [generate_alone(engine, p, n, set(), seed=s, **options) for p, n, s in zip(prompts, limits, seeds)]
    got = generate_batch(engine, prompts, limits, set(), seeds=seeds, batch_size=2, tokens_per_submit=3, **options)
    assert got == alone
    assert engine.decode_session(2, 11, 16, **options).fill_rows == 3
    assert generate_batch(engine, prompts, limits, set(), seeds=[1, 2, 3, 4, 5], batch_size=2, **options) != got


def test_a_prompt_the_host_ends_frees_its_row_for_the_next_prompt():
    # on_token sees each prompt's tokens in order, by the prompt's index; ending prompt 0 after its
    # second token frees its row, which takes prompt 2 before prompt 1 is done; prompts 1 and 2
    # still get their tokens alone, and prompt 0 its first two.
    model = tiny_model("dense", adapters=True, seed=4)
    engine = BitNetEngine(model)
    prompts = mixed_prompts(model.config.vocab_size, (6, 3, 8), seed=2)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def on_token(index: int, token: int) -> bool:
        seen[index].append(token)
        return index == 0 and len(seen[index]) == 2

    got = generate_batch(engine, prompts, 30, set(), batch_size=2, tokens_per_submit=2, on_token=on_token)
    alone = [generate_alone(engine, p, 30, set()) for p in prompts]
    assert got == [(alone[0][0][:2], False), alone[1], alone[2]]
    assert [seen[i] for i in range(3)] == [tokens for tokens, _ in got]
    session = engine.decode_session(2, 8, 30)
    assert session.fill_rows == 1
    lengths, counts = row_state(session)
    assert lengths.tolist() == [0, 0] and counts.tolist() == [30, 30]  # both rows' last prompts ran to their limit


def test_prompts_with_no_new_tokens_are_done_without_a_row():
    model = tiny_model("dense", adapters=False)
    engine = BitNetEngine(model)
    prompts = mixed_prompts(model.config.vocab_size, (3, 5, 4), seed=3)
    done: list[int] = []
    got = generate_batch(engine, prompts, [0, 4, 0], set(), on_done=lambda i, _: done.append(i))
    assert got == [([], False), generate_alone(engine, prompts[1], 4, set()), ([], False)]
    assert sorted(done) == [0, 1, 2]


def test_freed_rows_wait_for_company_and_fills_cover_their_own_prompts():
    # A fill's prompt pass covers its longest prompt rounded up to a power of two (at least 8), at
    # most the session's prompt length; freed rows take prompts once batch // FILL_SHARE of them can,
    # or every prompt left fits, or no row runs.
    assert [fill_length(n, 141) for n in (1, 8, 9, 33, 64, 65, 129, 141)] == [8, 8, 16, 64, 64, 128, 141, 141]
    assert fill_length(20, 12) == 12
    batch = 8 * FILL_SHARE
    assert [rows_to_fill(free, 100, batch) for free in (0, 1, 7, 8, 30)] == [0, 0, 0, 8, 30]
    assert rows_to_fill(3, 3, batch) == 3 and rows_to_fill(5, 3, batch) == 3  # the last prompts
    assert rows_to_fill(batch, 100, batch) == batch and rows_to_fill(1, 100, 1) == 1
    assert rows_to_fill(4, 0, batch) == 0


def test_rows_refilled_in_groups_give_each_prompt_its_tokens_alone(monkeypatch):
    # Four rows (within the GEMV bound of CPU adapters, where a batch decodes each row as alone),
    # whose freed rows wait for a second (FILL_SHARE 2) before taking prompts: 24 prompts of 1 to 30
    # tokens, limits of 1 to 12, through fills of several rows and lengths; every prompt gets exactly
    # its tokens alone.
    monkeypatch.setattr("torch_wgpu_lora.engine.generate.FILL_SHARE", 2)
    model = tiny_model("packed", adapters=True, seed=6)
    engine = BitNetEngine(model)
    g = np.random.default_rng(11)
    lengths = [int(n) for n in g.integers(1, 31, 24)]
    limits = [int(n) for n in g.integers(1, 13, 24)]
    prompts = mixed_prompts(model.config.vocab_size, lengths, seed=8)
    alone = [generate_alone(engine, p, n, set()) for p, n in zip(prompts, limits)]
    assert generate_batch(engine, prompts, limits, set(), batch_size=4, tokens_per_submit=2) == alone
    session = engine.decode_session(4, max(lengths), max(limits))
    assert session.fill_rows == 24 - 4
    assert any(count >= 2 for count, _ in session.fills) and len({n for _, n in session.fills}) >= 2


def test_a_session_narrowed_to_its_first_rows_gives_each_prompt_its_tokens_alone():
    # Four rows (the GEMV bound of CPU adapters: each row decodes as it does alone). Once no prompt
    # waits and one row runs, the session moves that row into row 0 and decodes a plan of that row
    # alone. A static batch whose last row runs longest (it moves from row 3), and continuous
    # batching whose long prompt takes row 3 and is ended by the host (on_token) after its move:
    # every prompt gets exactly its tokens alone.
    model = tiny_model("packed", adapters=True, seed=7)
    engine = BitNetEngine(model)
    prompts = mixed_prompts(model.config.vocab_size, (6, 3, 9, 5, 7, 4), seed=5)
    static = [3, 2, 4, 30]
    alone = [generate_alone(engine, p, n, set()) for p, n in zip(prompts, static)]
    assert generate_batch(engine, prompts[:4], static, set(), batch_size=4, tokens_per_submit=2) == alone
    assert set(engine.decode_session(4, 9, 30).narrowed) == {1}
    lengths, counts = row_state(engine.decode_session(4, 9, 30))
    assert counts[0] == 30  # prompt 3 ran to its limit in row 0, where it had moved

    limits = [12, 10, 11, 2, 30, 3]  # row 3 frees first and takes prompt 4, row 1 next and takes prompt 5
    alone = [generate_alone(engine, p, n, set()) for p, n in zip(prompts, limits)]
    seen: list[int] = []

    def on_token(index: int, token: int) -> bool:
        if index == 4:
            seen.append(token)
        return index == 4 and len(seen) == 20

    got = generate_batch(engine, prompts, limits, set(), batch_size=4, tokens_per_submit=2, on_token=on_token)
    assert got == [*alone[:4], (alone[4][0][:20], False), alone[5]]
    assert seen == alone[4][0][:20]
    lengths, counts = row_state(engine.decode_session(4, 9, 30))
    assert lengths[0] == 0 and 20 <= counts[0] < 30  # the host ended prompt 4 in row 0, where it had moved
