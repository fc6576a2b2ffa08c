"""Choosing the next token on the GPU (engine/kernels/sampling.py, wgsl/sampling.wgsl):
greedy equals torch.argmax of generation.py's processed logits, sampled draws equal the
torch reference's, the decode state advances on the GPU, draws follow the filtered
distribution, every row of a batch is chosen as it would be alone, EOS ends a row (banned
below min_new_tokens), finished rows are left alone, bad arguments are named."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torch_wgpu_lora.engine.kernels.sampling import (EOS, ROW_COUNT, ROW_FIELDS, ROW_LIMIT, ROW_SEED, SEARCH_PASSES,
                                                     SEEN, inverse_cdf,
                                                     plan_shape, sample_reference, sampling_launches, uniform)
from torch_wgpu_lora.logits import process_logits
from torch_wgpu_lora.runtime import Arena, Buffer, Recorder, get_device, upload, write

from .helpers import kernel_workspace

NO_LIMIT = 2 ** 32 - 1  # a row's token limit that no test reaches


class Plan:
    """A batch's decode-state buffers and the sampling launches over them, built once; each
    ``choose`` writes a step's inputs and runs one token of every row."""

    def __init__(self, vocab: int, strategy: str, history: int = 4, arena: bool = False, batch: int = 1,
                 **options) -> None:
        self.vocab, self.batch = vocab, batch
        self.width = 4 * -(-vocab // 4)  # rows of whole vec4s
        shapes = {"logits": ((batch, self.width), "f32"), "seen": ((batch, self.width), "u32"),
                  "state": ((batch, ROW_FIELDS), "u32"), "starts": ((batch,), "u32"), "lengths": ((batch,), "u32"),
                  "history": ((batch, history), "u32"), "next_token": ((batch,), "u32")}
        # arena: every caller buffer a view of one wgpu buffer, as a model plan may keep them
        make = Arena(chunk_bytes=1 << 22).alloc if arena else Buffer
        for name, (shape, dtype) in shapes.items():
            setattr(self, name, make(shape, dtype))
        self.launches = sampling_launches(self.logits, self.seen, self.state, self.starts, self.lengths, self.history,
                                          self.next_token, vocab=vocab, strategy=strategy,
                                          workspace=kernel_workspace(), **options)

    def start(self, logits: torch.Tensor | None, seen_ids, seed=0, count=0, pos: int = 10, eos=(),
              lengths=None, limit=NO_LIMIT) -> None:
        """Every row's inputs: ``logits`` [vocab] (all rows) or [batch, vocab]; ``seen_ids`` a tensor
        (all rows) or one per row; ``seed``, ``count``, ``lengths`` and ``limit`` one value (all rows)
        or one per row (``lengths`` 0: a finished row; default ``pos``); ``eos`` the EOS token ids."""
        b = self.batch

        def per_row(value):
            return list(value) if isinstance(value, (list, tuple)) else [value] * b

        if logits is not None:
            rows = np.zeros((b, self.width), np.float32)
            rows[:, :self.vocab] = logits.numpy()
            write(self.logits, rows)
        flags = np.zeros((b, self.width), np.uint32)
        for row, ids in enumerate(per_row(seen_ids)):
            flags[row, ids.numpy()] |= SEEN
        flags[:, list(eos)] |= EOS
        write(self.seen, flags)
        state = np.zeros((b, ROW_FIELDS), np.uint32)
        state[:, ROW_SEED] = [s & 0xFFFFFFFF for s in per_row(seed)]
        state[:, ROW_COUNT] = per_row(count)
        state[:, ROW_LIMIT] = per_row(limit)
        write(self.state, state)
        write(self.starts, np.full(b, pos - 1, np.uint32))
        write(self.lengths, np.asarray(per_row(pos if lengths is None else lengths), np.uint32))
        write(self.history, np.zeros(self.history.shape, np.uint32))

    def record(self, rec: Recorder) -> None:
        for launch in self.launches:
            rec.launch(launch)

    def read(self, *names: str) -> dict[str, np.ndarray]:
        """The named buffers' contents, after a submit."""
        got = {name: np.zeros(getattr(self, name).shape, np.uint32) for name in names}
        rec = Recorder()
        for name in names:
            rec.read(getattr(self, name), got[name])
        rec.submit()
        return got

    def choose_rows(self, logits: torch.Tensor, seen_ids, seed=0, count=0, **inputs) -> list[int]:
        """Every row's next token (``start``'s arguments)."""
        self.start(logits, seen_ids, seed, count, **inputs)
        out = np.zeros(self.batch, np.uint32)
        rec = Recorder()
        self.record(rec)
        rec.read(self.next_token, out)
        rec.submit()
        return [int(t) for t in out]

    def choose(self, logits: torch.Tensor, seen_ids: torch.Tensor, seed: int = 0, count: int = 0) -> int:
        """The one row's next token."""
        return self.choose_rows(logits, seen_ids, seed, count)[0]


def _seen(rng: np.random.Generator, vocab: int, n: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, vocab, size=n))


def test_uniform_is_24_bit_reproducible_and_uniform():
    draws = np.array([uniform(1234, c) for c in range(20000)])
    assert ((0 <= draws) & (draws < 1)).all()
    assert np.array_equal(draws * 2 ** 24, np.floor(draws * 2 ** 24))  # 24 random bits
    assert uniform(1234, 5) == draws[5] and uniform(1235, 5) != draws[5]
    assert uniform(2 ** 32 + 1234, 5) == draws[5]  # the GPU's step buffer holds the seed's low 32 bits
    counts = np.histogram(draws, bins=20, range=(0, 1))[0]
    assert abs(draws.mean() - 0.5) < 0.01 and counts.min() > 900 and counts.max() < 1100


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_is_torch_argmax_of_the_processed_logits(penalty):
    rng = np.random.default_rng(0)
    cases = 0
    for vocab in (1, 7, 1000):
        plan = Plan(vocab, "greedy", repetition_penalty=penalty)
        for trial in range(12):
            kind = trial % 6
            x = torch.from_numpy((rng.standard_normal(vocab) * 3).astype(np.float32))
            seen = _seen(rng, vocab, max(1, vocab // 10))
            if kind == 1:  # exact ties of the largest value
                x[torch.from_numpy(rng.integers(0, vocab, size=4))] = float(x.max()) + 1
            elif kind == 2:  # all negative
                x = -x.abs() - 0.5
            elif kind == 3:  # the unpenalised argmax is penalised
                seen = torch.cat([seen, torch.argmax(x).reshape(1)])
            elif kind == 4:  # the penalised argmax ties exactly with another token
                top = int(torch.argmax(x))
                seen = torch.tensor([top])
                if vocab > 1:
                    x[(top + 1) % vocab] = float(process_logits(x, seen, repetition_penalty=penalty)[top])
            elif kind == 5:  # coarse values: many ties everywhere, -0.0 and +0.0 among them
                x = torch.from_numpy(rng.integers(-2, 1, size=vocab).astype(np.float32))
                x[x == 0] = torch.tensor(-0.0)
                x[rng.integers(0, vocab)] = 0.0
            expect = int(torch.argmax(process_logits(x, seen, "greedy", repetition_penalty=penalty)))
            assert plan.choose(x, seen) == expect, (vocab, trial)
            cases += 1
    assert cases == 36


def test_greedy_at_a_full_vocabulary():
    rng = np.random.default_rng(1)
    vocab = 128256
    x = torch.from_numpy((rng.standard_normal(vocab) * 2).astype(np.float32))
    seen = _seen(rng, vocab, 300)
    seen = torch.cat([seen, torch.argmax(x).reshape(1)])
    plan = Plan(vocab, "greedy", repetition_penalty=1.1)
    assert plan.choose(x, seen) == int(torch.argmax(process_logits(x, seen, repetition_penalty=1.1)))
    x[vocab - 1] = 100.0  # the last token, in the last partial vec4 row of the last workgroup
    assert plan.choose(x, seen) == vocab - 1


def test_processed_logits_are_bitwise_torchs():
    # penalty and temperature divide with correct rounding: overflow, subnormals, zeros, inf
    # (no negative logit whose product with the penalty is subnormal: GPUs may flush those)
    rng = np.random.default_rng(2)
    vocab = 4099
    x = (rng.standard_normal(vocab) * 10).astype(np.float32)
    x[:12] = [3e38, -3e38, 1e-40, -3e-38, 1e-44, 0.0, -0.0, np.inf, -np.inf, 1.1754944e-38, 5.9e-39, 7.0]
    x = torch.from_numpy(x)
    seen = torch.cat([torch.arange(12), _seen(rng, vocab, 400)])
    for temperature, penalty in ((0.7, 1.3), (1.0, 0.6), (0.1, 1.0), (3.3, 1.9)):
        plan = Plan(vocab, "top_k", temperature=temperature, repetition_penalty=penalty)
        plan.start(x, seen)
        z = np.zeros(plan.launches[0].keep[3].shape, np.float32)  # search_first stores the processed logits
        rec = Recorder()
        plan.record(rec)
        rec.read(plan.launches[0].keep[3], z)
        rec.submit()
        expect = (process_logits(x, seen, "greedy", repetition_penalty=penalty) / temperature).numpy()
        np.testing.assert_array_equal(z.reshape(-1)[:vocab].view(np.uint32), expect.view(np.uint32))


def _key(values: np.ndarray) -> np.ndarray:
    """The WGSL's order-preserving u32 keys of float32 values (finite, -0 as +0)."""
    bits = (values.astype(np.float32) + np.float32(0.0)).view(np.uint32)
    return np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)


@pytest.mark.parametrize("strategy", ["top_k", "top_p", "top_k_top_p"])
def test_the_search_lands_on_torchs_filter_boundary(strategy):
    # The threshold after the last search pass is the key of the smallest logit torch keeps.
    rng = np.random.default_rng(7)
    checked = 0
    for vocab, top_k, top_p in ((1000, 37, 0.6), (5000, 1, 0.95), (333, 333, 0.999), (64, 5, 0.05)):
        plan = Plan(vocab, strategy, temperature=0.9, top_k=top_k, top_p=top_p, repetition_penalty=1.2)
        groups = plan_shape(vocab, get_device())[0]
        scratch = plan.launches[0].keep[0]
        for trial in range(6):
            x = torch.from_numpy((rng.standard_normal(vocab) * rng.uniform(0.5, 6)).astype(np.float32))
            seen = _seen(rng, vocab, 20)
            plan.choose(x, seen)
            state = np.zeros(scratch.shape, np.uint32)
            rec = Recorder()
            rec.read(scratch, state)
            rec.submit()
            lo, hi = state[0, 21 * groups + (SEARCH_PASSES + 1) % 2, :2]
            assert lo == hi, "the search did not converge"
            kept = process_logits(x, seen, strategy, 0.9, top_k, top_p, 1.2)
            if strategy != "top_k":  # skip nuclei whose boundary a rounding difference could move
                wider = process_logits(x, seen, strategy, 0.9, top_k, top_p * (1 + 1e-5), 1.2)
                narrower = process_logits(x, seen, strategy, 0.9, top_k, top_p * (1 - 1e-5), 1.2)
                if not (torch.equal(wider, kept) and torch.equal(narrower, kept)):
                    continue
            assert lo == _key(kept[torch.isfinite(kept)].min().numpy().reshape(1))[0], (vocab, trial)
            checked += 1
    assert checked >= 20


def _accepted(x, seen, strategy, temperature, top_k, top_p, penalty, seed, count):
    """The reference token, and every token a rounding difference could give: the uniform
    moved by 1e-6 across a CDF boundary, or (top_p) the nucleus boundary moved by 1e-5."""
    u = uniform(seed, count)
    tokens = set()
    for p in ([top_p, top_p * (1 - 1e-5), min(1.0, top_p * (1 + 1e-5))] if strategy != "top_k" else [top_p]):
        probs = process_logits(x, seen, strategy, temperature, top_k, p, penalty).softmax(-1)
        tokens |= {inverse_cdf(probs, min(max(v, 0.0), 1 - 2 ** -24)) for v in (u, u - 1e-6, u + 1e-6)}
    return sample_reference(x, seen, strategy, temperature, top_k, top_p, penalty, seed, count), tokens


@pytest.mark.parametrize("strategy", ["top_k", "top_p", "top_k_top_p"])
def test_sampled_draws_equal_the_reference(strategy):
    rng = np.random.default_rng(3)
    cases = ambiguous = 0
    settings = [(50, 1.0, 40, 0.9, 1.0), (1000, 0.7, 5, 0.5, 1.3), (1000, 1.5, 200, 0.95, 1.1),
                (7, 1.0, 3, 0.3, 1.0), (3000, 0.8, 1, 1.0, 1.2), (1, 1.0, 40, 0.9, 1.0)]
    for vocab, temperature, top_k, top_p, penalty in settings:
        plan = Plan(vocab, strategy, temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty)
        for trial in range(10):
            x = torch.from_numpy((rng.standard_normal(vocab) * rng.uniform(0.5, 4)).astype(np.float32))
            if trial % 5 == 4 and strategy == "top_k":  # ties, some at the boundary (top_p: see the docs)
                x = torch.from_numpy(rng.integers(0, 4, size=vocab).astype(np.float32))
            if trial % 5 == 3 and vocab > 1:  # masked (padding) tokens: whole workgroups of -inf
                x[vocab // 2:] = float("-inf")
            seen = _seen(rng, vocab, max(1, vocab // 20))
            seed, count = int(rng.integers(0, 2 ** 32)), int(rng.integers(0, 1000))
            got = plan.choose(x, seen, seed, count)
            expect, tokens = _accepted(x, seen, strategy, temperature, top_k, top_p, penalty, seed, count)
            ambiguous += len(tokens) > 1
            assert got == expect or (len(tokens) > 1 and got in tokens), (vocab, trial, got, expect, tokens)
            cases += 1
    assert ambiguous <= cases // 20, f"{ambiguous} of {cases} draws fell on a boundary"


def test_sampled_draws_at_a_full_vocabulary():
    rng = np.random.default_rng(4)
    vocab = 128256
    for strategy in ("top_k", "top_p", "top_k_top_p"):
        plan = Plan(vocab, strategy, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.2)
        for trial in range(2):
            x = torch.from_numpy((rng.standard_normal(vocab) * 2.5).astype(np.float32))
            seen = _seen(rng, vocab, 500)
            seed, count = int(rng.integers(0, 2 ** 32)), trial
            got = plan.choose(x, seen, seed, count)
            expect, tokens = _accepted(x, seen, strategy, 0.8, 50, 0.9, 1.2, seed, count)
            assert got == expect or (len(tokens) > 1 and got in tokens), (strategy, got, expect, tokens)


@pytest.mark.parametrize("strategy", ["greedy", "top_k", "top_p", "top_k_top_p"])
def test_the_state_advances_over_several_tokens_in_one_submit(strategy):
    # The same launches recorded per token; between them only a GPU copy rewrites the logits.
    rng = np.random.default_rng(5)
    vocab, steps, prompt = 300, 6, torch.tensor([3, 17, 3, 250])
    rows = (rng.standard_normal((steps, vocab)) * 2).astype(np.float32)
    rows[1:, :] = rows[0]  # the same logits again: the penalty on chosen tokens changes the choice
    options = dict(temperature=0.9, top_p=0.8, repetition_penalty=1.5)
    plan = Plan(vocab, strategy, history=steps + 2, arena=True, **options)
    seed, pos = 77, 20
    plan.start(None, prompt, seed=seed, pos=pos)
    source = upload(rows)
    rec = Recorder()
    for i in range(steps):
        rec.copy(source, plan.logits, vocab * 4, src_offset=i * vocab * 4)
        plan.record(rec)
    rec.submit()
    got = plan.read("history", "next_token", "seen", "state", "starts", "lengths")

    seen, tokens = prompt.clone(), []
    for i in range(steps):
        expect, accepted = _accepted(torch.from_numpy(rows[i]), seen, strategy, options["temperature"], 40,
                                     options["top_p"], options["repetition_penalty"], seed, i)
        token = int(got["history"][0, i])
        assert token == expect or token in accepted, (i, token, expect)
        tokens.append(token)
        seen = torch.cat([seen, torch.tensor([token])])
    assert len(set(tokens)) > 1  # the penalty moved the choice off repeated tokens
    assert got["history"][0, steps:].tolist() == [0, 0]
    assert int(got["next_token"][0]) == tokens[-1]
    flags = np.zeros(plan.width, np.uint32)
    flags[seen.numpy()] = SEEN
    np.testing.assert_array_equal(got["seen"][0], flags)
    assert got["state"][0].tolist() == [seed, steps, NO_LIMIT]  # the seed stays, the count advances
    assert got["lengths"][0] == pos + steps and got["starts"][0] == pos + steps - 1  # the last pass at its end


@pytest.mark.parametrize("strategy, options", [("top_k", dict(top_k=6, temperature=1.3)),
                                               ("top_p", dict(top_p=0.7, temperature=0.8)),
                                               ("top_k_top_p", dict(top_k=8, top_p=0.6, temperature=1.1))])
def test_draws_follow_the_filtered_distribution(strategy, options):
    rng = np.random.default_rng(6)
    vocab, draws = 24, 2000
    x = torch.from_numpy(rng.standard_normal(vocab).astype(np.float32))
    plan = Plan(vocab, strategy, history=draws, **options)
    plan.start(x, torch.tensor([0]), seed=99)
    history = np.zeros(draws, np.uint32)
    rec = Recorder()
    for _ in range(draws):  # penalty 1.0: the seen flags set along the way change nothing
        plan.record(rec)
    rec.read(plan.history, history.reshape(1, draws))
    rec.submit()

    probs = process_logits(x, torch.tensor([0]), strategy, repetition_penalty=1.0, **options).softmax(-1).numpy()
    kept = probs > 0
    counts = np.bincount(history, minlength=vocab)
    assert counts[~kept].sum() == 0, "a filtered-out token was drawn"
    expected = probs[kept] * draws
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    df = int(kept.sum()) - 1
    # Wilson-Hilferty: chi2/df is about normal; z > 4 would be a one in 30000 fluke
    z = ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    assert z < 4, (chi2, df, counts[kept], expected)
    # and each draw is the reference's for its count
    same = sum(int(history[i]) == sample_reference(x, torch.tensor([0]), strategy, options["temperature"],
                                                   options.get("top_k", 40), options.get("top_p", 0.9), 1.0,
                                                   99, i) for i in range(0, draws, 10))
    assert same >= draws // 10 - 2


@pytest.mark.parametrize("strategy", ["greedy", "top_k", "top_p", "top_k_top_p"])
def test_every_row_of_a_batch_is_chosen_as_it_is_alone_and_finished_rows_are_left_alone(strategy):
    # Rows of different logits, seen tokens, seeds and counts in one launch: each row's token is
    # the one the same launches choose for it alone (the kernels are deterministic: bitwise), and
    # the reference's; a finished row (length 0) keeps its token, history, count and position.
    rng = np.random.default_rng(8)
    vocab, batch, options = 301, 5, dict(temperature=0.8, top_k=12, top_p=0.85, repetition_penalty=1.3)
    logits = torch.from_numpy((rng.standard_normal((batch, vocab)) * 3).astype(np.float32))
    seen = [_seen(rng, vocab, 15) for _ in range(batch)]
    seeds, counts, lengths = [11, 12, 13, 14, 15], [0, 4, 9, 2, 7], [6, 9, 0, 12, 15]
    plan = Plan(vocab, strategy, batch=batch, **options)
    plan.start(logits, seen, seeds, counts, lengths=lengths)
    write(plan.next_token, np.full(batch, 99, np.uint32))
    rec = Recorder()
    plan.record(rec)
    rec.submit()
    got = plan.read("next_token", "history", "state", "starts", "lengths")
    alone = Plan(vocab, strategy, **options)
    for row in range(batch):
        if lengths[row] == 0:
            assert got["next_token"][row] == 99 and not got["history"][row].any()
            assert got["state"][row].tolist() == [seeds[row], counts[row], NO_LIMIT] and got["lengths"][row] == 0
            continue
        token = int(got["next_token"][row])
        assert token == alone.choose(logits[row], seen[row], seeds[row], counts[row]), row
        expect, accepted = _accepted(logits[row], seen[row], strategy, options["temperature"], options["top_k"],
                                     options["top_p"], options["repetition_penalty"], seeds[row], counts[row])
        assert token == expect or token in accepted, (row, token, expect)
        assert got["history"][row, counts[row]] == token if counts[row] < 4 else not got["history"][row].any()
        assert got["state"][row].tolist() == [seeds[row], counts[row] + 1, NO_LIMIT]
        assert (got["starts"][row], got["lengths"][row]) == (lengths[row], lengths[row] + 1)


@pytest.mark.parametrize("strategy", ["greedy", "top_p"])
def test_a_row_ends_at_its_token_limit_and_the_others_run_on(strategy):
    # Rows of one batch with limits of 1, 3 and none, counts from 0, four steps in one submit:
    # each limited row takes its limit's tokens, the last of them ending it (length 0, as an EOS
    # token does: its start, history and count stay), while the unlimited row takes all four.
    rng = np.random.default_rng(10)
    vocab, steps, pos = 50, 4, 10
    x = torch.from_numpy(rng.standard_normal(vocab).astype(np.float32))
    plan = Plan(vocab, strategy, batch=3, history=8, repetition_penalty=1.4, top_p=0.9)
    limits = [1, 3, NO_LIMIT]
    plan.start(x, torch.tensor([2]), seed=4, pos=pos, limit=limits)
    rec = Recorder()
    for _ in range(steps):
        plan.record(rec)
    rec.submit()
    got = plan.read("history", "state", "starts", "lengths", "next_token")
    alone = Plan(vocab, strategy, history=8, repetition_penalty=1.4, top_p=0.9)
    alone.start(x, torch.tensor([2]), seed=4, pos=pos)
    rec = Recorder()
    for _ in range(steps):
        alone.record(rec)
    rec.submit()
    unlimited = alone.read("history")["history"][0, :steps].tolist()
    for row, taken in enumerate([1, 3, steps]):
        assert got["history"][row, :taken].tolist() == unlimited[:taken]  # the same tokens until the end
        assert not got["history"][row, taken:].any()
        assert got["state"][row].tolist() == [4, taken, limits[row]]
        assert int(got["next_token"][row]) == unlimited[taken - 1]
    assert got["lengths"].tolist() == [0, 0, pos + steps]
    assert got["starts"].tolist() == [pos - 1, pos + 1, pos + steps - 1]


@pytest.mark.parametrize("strategy", ["greedy", "top_k_top_p"])
def test_an_eos_token_ends_its_row_and_is_banned_below_min_new_tokens(strategy):
    # The EOS tokens (7 and 40) are the most likely of every row. Rows below min_new_tokens=3
    # choose among the others (transformers' MinNewTokensLengthLogitsProcessor: -inf after the
    # penalty, before the temperature); a row at 3 may end: its length drops to 0 (finished) and
    # its start stays, while a running row moves on.
    rng = np.random.default_rng(9)
    vocab, eos = 64, (7, 40)
    x = torch.from_numpy(rng.standard_normal(vocab).astype(np.float32))
    x[list(eos)] = torch.tensor([30.0, 29.0])  # sampling keeps the EOS tokens only once they are allowed
    options = dict(temperature=0.9, top_k=5, top_p=0.9, repetition_penalty=1.0, min_new_tokens=3)
    plan = Plan(vocab, strategy, batch=3, history=8, **options)
    counts = [0, 2, 3]
    tokens = plan.choose_rows(x, torch.tensor([1]), seed=5, count=counts, eos=eos)
    got = plan.read("lengths", "starts", "seen")
    for row, count in enumerate(counts):
        banned = torch.tensor(eos) if count < 3 else None
        expect = sample_reference(x, torch.tensor([1]), strategy, 0.9, 5, 0.9, 1.0, 5, count, banned_ids=banned)
        assert tokens[row] == expect, (row, tokens[row], expect)
        assert (tokens[row] in eos) == (count >= 3)
    assert got["lengths"].tolist() == [11, 11, 0] and got["starts"].tolist() == [10, 10, 9]
    assert (got["seen"][:, list(eos)] & EOS).all()  # the flags stay: later steps end there too

    v = 8
    bufs = [Buffer((v,)), Buffer((v,), "u32"), Buffer((3,), "u32"), Buffer((1,), "u32"), Buffer((1,), "u32"),
            Buffer((4,), "u32"), Buffer((1,), "u32")]  # logits, seen, state, starts, lengths, history, next_token

    def make(*buffers, **options):
        return sampling_launches(*(buffers or bufs), **{"vocab": v, "strategy": "top_k",
                                                        "workspace": kernel_workspace(), **options})

    with pytest.raises(ValueError, match=r"strategy must be one of \('greedy', 'top_k', 'top_p', 'top_k_top_p'\), "
                                         "got 'beam'"):
        make(strategy="beam")
    with pytest.raises(ValueError, match="top_k must be an integer >= 1, got 0"):
        make(top_k=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        make(top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be > 0 for sampling"):
        make(temperature=0.0)
    with pytest.raises(ValueError, match="temperature=1e-45 is not a normal float32 number"):
        make(temperature=1e-45)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        make(repetition_penalty=-1.0)
    with pytest.raises(ValueError, match=r"repetition_penalty=1e\+39 is not a normal float32 number"):
        make(repetition_penalty=1e39)
    with pytest.raises(ValueError, match="min_new_tokens must be an integer >= 0, got -1"):
        make(min_new_tokens=-1)
    with pytest.raises(ValueError, match="vocab must be an integer"):
        make(vocab=0)
    with pytest.raises(ValueError, match=r"logits must hold at least 9 element\(s\), got shape \(8,\)"):
        make(vocab=9)
    with pytest.raises(TypeError, match="seen must be a u32 buffer, got f32"):
        make(bufs[0], Buffer((v,)), *bufs[2:])
    with pytest.raises(ValueError, match=r"state must hold at least 3 element\(s\)"):
        make(*bufs[:2], Buffer((2,), "u32"), *bufs[3:])
    with pytest.raises(TypeError, match="history must be a runtime Buffer, got ndarray"):
        make(*bufs[:5], np.zeros(4, np.uint32), bufs[6])
    two = Buffer((2,), "u32")  # two sequences: every buffer needs a row of each
    with pytest.raises(ValueError, match=r"logits must hold at least 16 element\(s\), got shape \(8,\)"):
        make(*bufs[:4], two, *bufs[5:])
    with pytest.raises(ValueError, match="history must hold a row of max_new_tokens for each of the 2 sequences"):
        make(Buffer((2, v)), Buffer((2, v), "u32"), Buffer((6,), "u32"), two, two, Buffer((3,), "u32"), two)
    make(temperature=0.0, strategy="greedy")  # greedy ignores the temperature
