"""Generation on the engine, for many prompts at once: the KV cache, the next-token choice and
the token history all stay on the GPU; only token ids come back.

A ``DecodeSession`` holds ``batch`` rows: a KV cache row, a position, a seed, a token count and
limit, seen tokens (the repetition penalty) and an end for each. A prefill pass runs the first
``batch`` prompts (right-padded to the longest) and chooses each one's first token; then decode
steps, each one pass over one position of every row followed by the sampling launches, which
write each row's chosen token where the next step's embedding gather reads it and advance that
row's position. A row ends on the GPU at an EOS token or at its last token (its prompt's
``max_new_tokens``), after which it costs next to nothing (attention reads one key of it, the
sampler skips it); the host may end one the same way (a stop string, ``on_token``).
``tokens_per_submit`` steps are recorded into one command buffer; the next one is submitted
before the last one's readback is waited on, so encoding overlaps the GPU's work.

Continuous batching: with more prompts than rows, a row whose prompt has ended takes the next
prompt at the next submit, so the batch never waits for its longest row. The host knows a row is
done once a readback shows its EOS token or its stop, or, without waiting for one, once the
submits it has made take the row to its last token; the submit after that starts with a fill of
the freed rows: a prompt pass of their new prompts alone (``RowFill``: a plan of that many rows,
its own KV cache and sampler state, batch-invariant as the first prefill), whose sampler chooses
each one's first token, then one launch per cache layer and state buffer copies each row's keys,
values, position, seed, count, limit, seen tokens and first token into the row it takes over
(``kernels.scatter``), and the decode steps run on. Fills come in plans of powers of two rows (5
freed rows: a fill of 4 and one of 1, the longest prompts together), each padded to its own
longest prompt rounded up to a power of two (``fill_length``), not to the session's, and each
plan built the first time it is needed. A prompt pass costs about as much for one row as for
several (a chain of launches over few tokens), so freed rows wait until ``batch // FILL_SHARE``
of them (or every prompt left) can be filled together, unless no row runs. Tokens a row computes
past a stop the host sets (at most two submits' worth) are dropped; the results come back in the
prompts' order, each also handed to ``on_done`` as soon as it is complete.

Once no prompt waits, the last rows run on while the others are done, and a step over the
session's rows costs as much for a few running rows as for all of them (the step's GEMMs and launches
are the batch's). So the session narrows: when the rows the host knows may still run fit in a
quarter of the rows it decodes (a sixteenth, and so on, down to one), the running rows past that
quarter move into free rows before it (``kernels.scatter.move_rows_launch``: their keys, values
and state, at the start of the next submit), and the decode steps run a plan of only those first
rows, over the same buffers (``KVCache.first_rows``), each narrowed plan built the first time it is
needed.

A prompt's tokens are those it gets alone (greedy: exactly; sampling: for the same seed),
whichever row it takes and whenever, since its sums do not depend on the batch around it: the
prompt pass (the first prefill and every fill) is ``batch_invariant`` (kept attention's sums
unsplit, float projections as GEMMs), a fill writes exactly the keys and values it computed, decode
attention cuts each sequence's keys into the same spans whatever the batch
(``kernels.attention.decode``), and up to ``gemv_max_tokens`` rows (16 on GPUs, 8 where their
matrix units run the ternary GEMMs, 4 on CPU adapters) decode on the GEMV path, as one does: each row summed as it is alone (the ternary projections'
integer dots, the float projections' and the LM head's sums in one order; ``kernels.bitlinear``,
``kernels.matmul``). Past either bound the sums are ordered otherwise, a last-bit difference that
can round a quantised model's int8 code differently, and with it change a token: a batch of more
rows decodes on the GEMM path (the LM head's and float weights' sums, and on GPUs unfused
launches), and a prompt pass whose scores outgrow ``policy.SCORES_SCRATCH_BYTES`` runs with flash
attention where one prompt keeps its scores whole.

Limits: the longest prompt plus the most new tokens must fit the model's context (every row's
cache holds any prompt and any completion), a layer's keys one storage binding
(``KVCache.max_batch``) and the batch's last-position logits one binding, each refused with a
message before anything runs; and the batch's KV cache (``KVCache.nbytes``) must fit the device's
memory.

A generation is asked for with a ``GenerationRequest`` (the prompts' token ids, how many tokens,
the EOS tokens, seeds, sampling, and ``batch_size``, the rows decoded at once) and run by the
engine (``BitNetEngine.generate_batch``), which keeps a ``DecodeSession`` per shape; each prompt
gets back a ``Generated`` (its new ids, whether an EOS token ended them).

>>> # engine.generate_batch(GenerationRequest([[0, 17, 42], [0, 5]], max_new_tokens=32, eos={1}))
>>> # [Generated(tokens=[...], ended_by_eos=True), Generated(tokens=[...], ended_by_eos=False)]
>>> # engine.generate_batch(GenerationRequest(many_prompts, max_new_tokens=128, batch_size=64))
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, NamedTuple, Sequence

import numpy as np

from ..limits import check_context
from ..runtime import Buffer, Pending, Recorder, write
from .adapters import EngineAdapters
from .config import pad
from .kernels.sampling import EOS, ROW_FIELDS, ROW_LIMIT, ROW_SEED, SEEN, sampling_launches
from .kernels.scatter import kv_rows_launch, move_rows_launch, scatter_rows_launch
from .plan import ForwardPlan, KVCache
from .weights import EngineWeights
from .workspace import Workspace

OnToken = Callable[[int, int], bool]  # (prompt index, token) -> whether the prompt's generation ends after it
# Decode steps a command buffer, by default: fewer cost more host work a token (batch 1 decodes a token in
# about 2 ms on an H100); more leave a row whose prompt ended idle longer before the next prompt takes it
# (the host learns of an EOS token one submit late), about 1.5 × this many steps a prompt.
TOKENS_PER_SUBMIT = 8
# Continuous batching refills freed rows once batch // FILL_SHARE of them are free: a row idles a few steps
# more, and a prompt pass, which costs about a decode step whatever its rows, serves several of them.
# 4: the prompts file (256 records, 64 rows) at 1.64× static batches on an H100, where refilling every
# freed row at once (with the session's prompt length) gave 1.45× (device run 24).
FILL_SHARE = 4
FILL_MIN_TOKENS = 8  # a fill's prompt pass covers at least this many positions (fewer plans of short prompts)


def fill_length(longest: int, prompt_length: int) -> int:
    """The positions of a fill's prompt pass whose longest prompt has ``longest`` tokens: that
    rounded up to a power of two (at least ``FILL_MIN_TOKENS``), at most the session's
    ``prompt_length``: a few plans serve every fill, each far shorter than the session's longest
    prompt where its own prompts are short.

    >>> fill_length(5, 141), fill_length(33, 141), fill_length(130, 141)
    (8, 64, 141)
    """
    return min(prompt_length, max(FILL_MIN_TOKENS, 1 << (longest - 1).bit_length()))


def rows_to_fill(free: int, waiting: int, batch: int) -> int:
    """How many of ``free`` rows of a session of ``batch`` take the next of ``waiting`` prompts now:
    as many as can once ``batch // FILL_SHARE`` of them can (or every prompt left, or no row runs),
    else none yet.

    >>> rows_to_fill(9, 100, 64), rows_to_fill(17, 100, 64), rows_to_fill(2, 2, 64), rows_to_fill(1, 9, 1)
    (0, 17, 2, 1)
    """
    take = min(free, waiting)
    return take if take and (take >= max(1, batch // FILL_SHARE) or take == waiting or free == batch) else 0


class Generated(NamedTuple):
    """One prompt's new token ids, and whether an EOS token ended them (then the last one)."""

    tokens: list[int]
    ended_by_eos: bool


OnDone = Callable[[int, Generated], None]  # (prompt index, its result), as soon as it is complete


@dataclass(frozen=True)
class GenerationRequest:
    """A generation of up to ``max_new_tokens`` after each of ``prompts`` (lists of token ids):
    ``max_new_tokens`` one int for every prompt, or one per prompt; ``eos``, the tokens that end a
    sequence; ``seeds``, each prompt's sampling seed (default 0); ``sampling``, ``DecodeSession``'s
    strategy, temperature, top_k, top_p, repetition_penalty and min_new_tokens (the defaults:
    greedy); ``on_token`` and ``on_done``, ``DecodeSession.generate``'s; ``tokens_per_submit``, the
    decode steps recorded into one command buffer; ``adapter_names``, one name a prompt
    (``"__base__"`` for none, as PEFT takes them): each prompt continued with that adapter;
    ``batch_size``, the most prompts decoded at once (the KV cache's rows: past it, continuous
    batching, the module docstring), None: every prompt."""

    prompts: Sequence[Sequence[int]]
    max_new_tokens: int | Sequence[int]
    eos: Collection[int] = ()
    seeds: Sequence[int] | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    on_token: OnToken | None = None
    tokens_per_submit: int = TOKENS_PER_SUBMIT
    adapter_names: Sequence[str] | None = None
    batch_size: int | None = None
    on_done: OnDone | None = None

    def limits(self) -> list[int]:
        """Each prompt's ``max_new_tokens``; ValueError naming a bad one."""
        given = self.max_new_tokens
        if isinstance(given, int) and not isinstance(given, bool):
            given = [given] * len(self.prompts)
        given = list(given)
        if len(given) != len(self.prompts):
            raise ValueError(f"max_new_tokens gives {len(given)} limits for {len(self.prompts)} prompts")
        for number, n in enumerate(given):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"max_new_tokens of prompt {number} must be an integer >= 0, got {n!r}")
        return given


def _prompt_inputs(plan: ForwardPlan, seen: Buffer, state: Buffer, prompts: Sequence[Sequence[int]],
                   seeds: Sequence[int], limits: Sequence[int], eos: Collection[int]) -> None:
    """Write a prompt pass's inputs, one prompt a row of ``plan``: the prompts (right-padded) and
    the row of each one's last token, the tokens the repetition penalty sees and the EOS tokens,
    each row's seed, count (0) and limit, where each one stands (position 0, its prompt's length)."""
    b, t = plan.batch, plan.tokens
    if not len(prompts) == len(seeds) == len(limits) == b or not all(1 <= len(p) <= t for p in prompts):
        raise ValueError(f"{len(prompts)} prompts of {[len(p) for p in prompts]} tokens, {len(seeds)} seeds and "
                         f"{len(limits)} limits for a prompt pass of {b} prompts of 1 to {t} tokens")
    ids = np.zeros((b, t), np.uint32)  # padding: token 0, never attended to (each row's length)
    flags = np.zeros(seen.shape, np.uint32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
        flags[row, np.asarray(prompt, np.int64)] = SEEN
    flags[:, np.asarray(sorted(eos), np.int64)] |= EOS
    write(plan.ids, ids.reshape(-1))
    plan.set_last([len(p) for p in prompts])
    write(seen, flags)
    state_rows = np.zeros((b, ROW_FIELDS), np.uint32)
    state_rows[:, ROW_SEED] = [seed & 0xFFFFFFFF for seed in seeds]
    state_rows[:, ROW_LIMIT] = limits
    write(state, state_rows)
    plan.cache.set_position(0, [len(p) for p in prompts])


class RowFill:
    """A prompt pass of ``count`` prompts of up to ``length`` tokens alone that hands them to rows of
    a running ``session``: its own KV cache of ``length`` positions, sampler state and first-token
    choice, then the launches that copy each of its rows into the session row ``rows`` names (the
    module docstring). Its buffers live in the session's workspace."""

    def __init__(self, session: DecodeSession, count: int, length: int) -> None:
        ws, config = session.workspace, session.config
        self.count = count
        self.cache = KVCache(config, count, length, ws)
        self.prefill = ForwardPlan(session.weights, session.adapters, self.cache, length,
                                   logits="last", from_start=True, batch_invariant=True, workspace=ws)
        self.seen = ws.alloc("sampling", (count, pad(config.vocab, 4)), "u32")
        self.state = ws.alloc("sampling", (count, ROW_FIELDS), "u32")
        self.history = ws.alloc("sampling", (count, 1), "u32")  # the first token
        self.next_token = ws.alloc("inputs", (count,), "u32")
        self.rows = ws.alloc("inputs", (count,), "u32")  # the session row each one takes over
        self.sampling = sampling_launches(self.prefill.logits[0][1], self.seen, self.state, self.cache.starts,
                                          self.cache.lengths, self.history, self.next_token, **session.options)
        own = [*self.cache.keys, *self.cache.values]
        theirs = [*session.cache.keys, *session.cache.values]
        self.copies = [kv_rows_launch(src, self.rows, dst, count) for src, dst in zip(own, theirs)]
        for src, dst in ((self.seen, session.seen), (self.state, session.state), (self.history, session.history),
                         (self.next_token, session.next_token), (self.cache.starts, session.cache.starts),
                         (self.cache.lengths, session.cache.lengths)):
            width, dst_row = src.numel // count, dst.numel // session.batch
            self.copies.append(scatter_rows_launch(src, self.rows, dst, count=count, blocks=1, width=width,
                                                   dst_block=dst_row, dst_row=dst_row))

    def start(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], seeds: Sequence[int],
              limits: Sequence[int], eos: Collection[int], row_slots: Sequence[int] | None) -> None:
        """Write the fill's inputs: the session rows to take over, ``_prompt_inputs``' of the prompts,
        and with ``row_slots`` each one's adapter (a session whose adapters serve rows)."""
        _prompt_inputs(self.prefill, self.seen, self.state, prompts, seeds, limits, eos)
        write(self.rows, np.asarray(rows, np.uint32))
        if row_slots is not None:
            self.prefill.set_row_slots(row_slots)

    def record(self, rec: Recorder) -> None:
        """Into ``rec``: the prompt pass, its sampler, and the copies into the session's rows."""
        self.prefill.record(rec)
        for launch in (*self.sampling, *self.copies):
            rec.launch(launch)


class DecodeSession:
    """What one generation shape keeps on the GPU: the cache of ``batch`` rows of
    ``prompt_length + max_new_tokens`` positions, the prefill and decode plans, the sampler's
    buffers and launches (``sampling``: ``sampling_launches``' strategy, temperature, top_k,
    top_p, repetition_penalty, min_new_tokens), and the ``RowFill`` plans made so far. Built once
    per shape, then reused: building one takes tens of ms. ``scratch``: the engine's workspace of
    scratch shared between plans."""

    def __init__(self, weights: EngineWeights, adapters: EngineAdapters, batch: int, prompt_length: int,
                 max_new_tokens: int, *, scratch: Workspace | None = None, strategy: str = "greedy",
                 temperature: float = 1.0, top_k: int = 40, top_p: float = 0.9, repetition_penalty: float = 1.0,
                 min_new_tokens: int = 0) -> None:
        config = weights.config
        check_context(config.max_positions, prompt_length, max_new_tokens)
        if max_new_tokens < 1:
            raise ValueError(f"a decode session generates at least one token, got max_new_tokens={max_new_tokens}")
        self.weights, self.adapters, self.config = weights, adapters, config
        self.batch, self.prompt_length, self.max_new_tokens = batch, prompt_length, max_new_tokens
        self.workspace = ws = Workspace(adapters.device, shared=scratch)
        self.cache = KVCache(config, batch, prompt_length + max_new_tokens, ws)
        self.prefill = ForwardPlan(weights, adapters, self.cache, prompt_length, logits="last", from_start=True,
                                   batch_invariant=True, workspace=ws)
        self.next_token = ws.alloc("inputs", (batch,), "u32")
        self.decode = ForwardPlan(weights, adapters, self.cache, 1, logits="last", decode=True, ids=self.next_token,
                                  workspace=ws)
        self.seen = ws.alloc("sampling", (batch, pad(config.vocab, 4)), "u32")
        self.state = ws.alloc("sampling", (batch, ROW_FIELDS), "u32")
        self.history = ws.alloc("sampling", (batch, max_new_tokens), "u32")
        self.options = dict(vocab=config.vocab, strategy=strategy, temperature=temperature, top_k=top_k, top_p=top_p,
                            repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens, workspace=ws)

        def sampler(plan: ForwardPlan) -> list:
            return sampling_launches(plan.logits[0][1], self.seen, self.state, self.cache.starts, self.cache.lengths,
                                     self.history, self.next_token, **self.options)

        self.prefill_sampling, self.decode_sampling = sampler(self.prefill), sampler(self.decode)
        self.fills: dict[tuple[int, int], RowFill] = {}  # by (rows, positions), made when first needed
        self.fill_rows = 0  # rows filled since the session was made (a prompt pass each, past the first prefill)
        # by rows: the decode plan and sampling launches of the session's first rows (narrowing), made when first needed
        self.narrowed: dict[int, tuple[ForwardPlan, list]] = {}
        self.moves = ws.alloc("inputs", (2 * batch,), "u32")  # rows moved by a narrowing, then where they go

    def start(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], eos: Collection[int],
              limits: Sequence[int] | None = None, row_slots: Sequence[int] | None = None) -> None:
        """Write the first prefill's inputs, one prompt a row (``batch`` of them, each at most
        ``prompt_length`` tokens): the prompts (right-padded) and the row of each one's last token,
        the tokens the repetition penalty sees and the EOS tokens, each row's seed, count and limit
        (``limits``, default ``max_new_tokens``), where each one stands (position 0, its length),
        and with ``row_slots`` each one's adapter (a session whose adapters serve rows)."""
        limits = [self.max_new_tokens] * len(prompts) if limits is None else limits
        _prompt_inputs(self.prefill, self.seen, self.state, prompts, seeds, limits, eos)
        if (row_slots is None) != (self.prefill.row_adapters is None):
            raise ValueError("a session whose adapters serve rows generates with each row's adapter slot, and only "
                             "such a session takes them")
        if row_slots is not None:
            self.prefill.set_row_slots(row_slots)
            self.decode.set_row_slots(row_slots)

    def record(self, rec: Recorder, steps: int, prefill: bool, rows: int | None = None) -> None:
        """Into ``rec``: the prefill and its sampler (``prefill``), then ``steps`` decode steps of the
        first ``rows`` rows (default: every row; fewer: ``narrowed_decode``'s plan)."""
        if prefill:
            self.prefill.record(rec)
            for launch in self.prefill_sampling:
                rec.launch(launch)
        decode, sampling = self.narrowed_decode(self.batch if rows is None else rows)
        for _ in range(steps):
            decode.record(rec)
            for launch in sampling:
                rec.launch(launch)

    def narrowed_decode(self, rows: int) -> tuple[ForwardPlan, list]:
        """The decode plan and sampling launches of the session's first ``rows`` rows, over the
        session's own buffers (every row: ``decode``), made the first time it is asked for."""
        if rows == self.batch:
            return self.decode, self.decode_sampling
        if rows not in self.narrowed:
            cache = self.cache.first_rows(rows)
            ids = self.next_token.rows(0, rows)
            plan = ForwardPlan(self.weights, self.adapters, cache, 1, logits="last", decode=True, ids=ids,
                               workspace=self.workspace)
            sampling = sampling_launches(plan.logits[0][1], self.seen.rows(0, rows), self.state.rows(0, rows),
                                         cache.starts, cache.lengths, self.history.rows(0, rows), ids, **self.options)
            self.narrowed[rows] = (plan, sampling)
        return self.narrowed[rows]

    def narrowing(self, running: int, rows: int) -> int:
        """The rows to decode over when ``running`` of the first ``rows`` may still run: the
        fewest of the session's quarter, sixteenth, ... (at least one) that hold them, or ``rows``
        where none holds them in fewer.

        >>> # session of 64 rows: narrowing(13, 64) == 16, narrowing(13, 16) == 16, narrowing(1, 16) == 1
        """
        fit = rows
        size = self.batch >> 2
        while size >= max(1, running):
            fit = min(fit, size)
            size >>= 2
        return fit

    def record_moves(self, rec: Recorder, moves: Sequence[tuple[int, int]]) -> None:
        """Into ``rec``: each (row, to) of ``moves`` moving its row's keys, values and state into row
        ``to`` (a narrowing); their rows written now, before the submit that runs them."""
        write(self.moves, np.asarray([row for row, _ in moves] + [to for _, to in moves], np.uint32))
        for buf in (*self.cache.keys, *self.cache.values, self.seen, self.state, self.history, self.next_token,
                    self.cache.starts, self.cache.lengths):
            rec.launch(move_rows_launch(buf, self.moves, len(moves)))

    def end_row(self, row: int) -> None:
        """End sequence ``row`` from the next submit on (its length 0, as an EOS token sets it)."""
        write(self.cache.lengths, np.zeros(1, np.uint32), offset=4 * row)

    def fill(self, count: int, length: int) -> RowFill:
        """The ``RowFill`` of ``count`` rows of ``length`` positions, made the first time it is asked for."""
        if (count, length) not in self.fills:
            self.fills[count, length] = RowFill(self, count, length)
        return self.fills[count, length]

    def record_fills(self, rec: Recorder, rows: Sequence[int], prompts: Sequence[Sequence[int]],
                     seeds: Sequence[int], limits: Sequence[int], eos: Collection[int],
                     row_slots: Sequence[int] | None = None) -> None:
        """Into ``rec``: ``prompts`` taking over ``rows`` (one each; ``row_slots``, their adapters in a
        session whose adapters serve rows), in fills of powers of two rows, the largest first and
        the longest prompts together, each ``fill_length`` positions; their inputs written now,
        before the submit that runs them."""
        order = sorted(range(len(rows)), key=lambda i: -len(prompts[i]))
        at = 0
        while at < len(order):
            count = 1 << ((len(order) - at).bit_length() - 1)
            part = order[at:at + count]
            fill = self.fill(count, fill_length(len(prompts[part[0]]), self.prompt_length))
            fill.start([rows[i] for i in part], [prompts[i] for i in part], [seeds[i] for i in part],
                       [limits[i] for i in part], eos, None if row_slots is None else [row_slots[i] for i in part])
            fill.record(rec)
            at += count
        self.fill_rows += len(rows)

    def generate(self, prompts: Sequence[Sequence[int]], eos: Collection[int], seeds: Sequence[int] | None = None,
                 tokens_per_submit: int = TOKENS_PER_SUBMIT, on_token: OnToken | None = None,
                 max_new_tokens: Sequence[int] | None = None, on_done: OnDone | None = None,
                 row_slots: Sequence[int] | None = None) -> list[Generated]:
        """Up to ``max_new_tokens`` (each prompt's, at most the session's; default the session's) after
        each of ``prompts`` (at least ``batch`` of them, each at most the session's prompt length),
        ``batch`` at a time, a row taking the next prompt as soon as its own has ended (the module
        docstring); returns each one's new ids and whether an EOS token ended them, in order.
        ``seeds``: each prompt's sampling seed (default 0). ``on_token(index, token)`` sees every
        token of every prompt as the tokens come back, each prompt's in order, up to its last;
        returning True ends that prompt's generation after the token. ``on_done(index, generated)``
        gets each prompt's result as soon as it is complete. ``row_slots``: each prompt's adapter
        (``EngineAdapters.row_slots``), in a session whose adapters serve rows."""
        n, b = len(prompts), self.batch
        seeds = [0] * n if seeds is None else list(seeds)
        limits = [self.max_new_tokens] * n if max_new_tokens is None else list(max_new_tokens)
        if n < b or len(seeds) != n or len(limits) != n or (row_slots is not None and len(row_slots) != n):
            raise ValueError(f"{n} prompts, {len(seeds)} seeds, {len(limits)} limits and "
                             f"{'no' if row_slots is None else len(row_slots)} adapter slots for a session of {b} rows")
        if not all(1 <= limit <= self.max_new_tokens for limit in limits) or \
                not all(1 <= len(p) <= self.prompt_length for p in prompts):
            raise ValueError(f"prompts of {sorted({len(p) for p in prompts})} tokens and limits of "
                             f"{sorted(set(limits))} tokens for a session of prompts of 1 to {self.prompt_length} "
                             f"tokens and 1 to {self.max_new_tokens} new tokens")
        self.adapters.sync()
        history = np.zeros(self.history.shape, np.uint32)
        tokens: list[list[int]] = [[] for _ in prompts]
        ended: list[bool | None] = [None] * n  # None: running; else whether EOS ended it
        owner = list(range(b))  # each row's prompt (the last one, once no prompt waits)
        given = [1] * b  # the tokens each row's prompt has once every submit made so far is done
        waiting = b  # the next prompt to take a row
        decoded = b  # the rows the decode steps run over: the first ones, once the session narrows

        def submit(steps: int, fills: list[tuple[int, int]] | None, moves: list[tuple[int, int]]) -> Pending:
            """``fills`` (row, prompt) taking over rows, ``moves`` (row, to) narrowing the session to
            its first ``decoded`` rows, then ``steps`` decode steps; ``fills`` None: the first prefill."""
            rec = Recorder(self.adapters.device)
            if fills is None:
                self.record(rec, steps, prefill=True)
            else:
                chosen = [p for _, p in fills]
                slots = None if row_slots is None else [row_slots[p] for p in chosen]
                self.record_fills(rec, [r for r, _ in fills], [prompts[p] for p in chosen],
                                  [seeds[p] for p in chosen], [limits[p] for p in chosen], eos, slots)
                if fills and row_slots is not None:  # each row decodes with its prompt's adapter
                    self.decode.set_row_slots([row_slots[p] for p in owner])
                if moves:
                    self.record_moves(rec, moves)
                self.record(rec, steps, prefill=False, rows=decoded)
            rec.read(self.history, history)
            return rec.submit_async()

        def take(rows: list[tuple[int, int, int]]) -> None:
            """Hand on the tokens the readback holds: below ``count`` of each (row, prompt, count);
            end the prompts that end there."""
            for row, p, count in rows:
                while ended[p] is None and len(tokens[p]) < count:
                    token = int(history[row, len(tokens[p])])
                    tokens[p].append(token)
                    stop = on_token(p, token) if on_token is not None else False
                    if token in eos:
                        ended[p] = True  # the GPU ended it
                    elif stop:
                        ended[p] = False
                        if p in owner[:decoded]:  # not yet handed to the next prompt (maybe moved: narrowed)
                            self.end_row(owner.index(p))
                    elif len(tokens[p]) == limits[p]:
                        ended[p] = False  # the GPU ended it
                    if ended[p] is not None and on_done is not None:
                        on_done(p, Generated(tokens[p], ended[p]))

        def running(row: int) -> bool:
            """Whether the row's prompt may still take tokens past the submits made so far."""
            p = owner[row]
            return ended[p] is None and given[row] < limits[p]

        def snapshot() -> list[tuple[int, int, int]]:
            return [(row, p, given[row]) for row, p in enumerate(owner[:decoded]) if ended[p] is None]

        queue: deque = deque()  # (submitted work, the (row, prompt, count) its readback holds), oldest first
        self.start(prompts[:b], seeds[:b], eos, limits[:b], None if row_slots is None else row_slots[:b])
        queue.append((submit(0, None, []), snapshot()))
        try:
            while queue:
                fills, moves = [], []
                free = [row for row in range(decoded) if not running(row)]
                for row in free[:rows_to_fill(len(free), n - waiting, b)]:
                    owner[row], given[row] = waiting, 1
                    fills.append((row, waiting))
                    waiting += 1
                live = [row for row in range(decoded) if running(row)]
                narrow = self.narrowing(len(live), decoded) if waiting == n and live else decoded
                if narrow < decoded:  # the running rows past the first `narrow` move into free rows before them
                    spare = (row for row in range(narrow) if not running(row))
                    for row in live:
                        if row >= narrow:
                            to = next(spare)
                            moves.append((row, to))
                            owner[to], given[to] = owner[row], given[row]
                    decoded = narrow
                    live = [row for row in range(decoded) if running(row)]
                    if row_slots is not None:  # the narrowed plan's rows decode with their prompts' adapters
                        self.narrowed_decode(decoded)[0].set_row_slots([row_slots[p] for p in owner[:decoded]])
                more = bool(fills or live)
                if more:
                    steps = min(tokens_per_submit, max((limits[owner[r]] - given[r] for r in live), default=0))
                    for row in live:
                        given[row] = min(given[row] + steps, limits[owner[row]])
                    queue.append((submit(steps, fills, moves), snapshot()))
                if len(queue) > 1 or not more:  # one submit stays in flight while the next one is encoded
                    oldest, rows = queue.popleft()
                    oldest.wait()  # in submission order: the readback is the newest history
                    take(rows)
        finally:
            for pending, _ in queue:  # an exception (from on_token, on_done): leave nothing in flight
                pending.wait()
        return [Generated(row, bool(end)) for row, end in zip(tokens, ended)]

    def roles(self) -> dict[str, int]:
        """Bytes the session's workspace holds, by role."""
        return self.workspace.roles()
