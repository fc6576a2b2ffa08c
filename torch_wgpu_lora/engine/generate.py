"""Generation on the engine, for a batch of prompts at once: the KV cache, the next-token choice
and the token history all stay on the GPU; only token ids come back.

A prefill pass runs every prompt (right-padded to the longest) and chooses each one's first
token; then decode steps, each one pass over one position of every sequence followed by the
sampling launches, which write each sequence's chosen token where the next step's embedding
gather reads it and advance that sequence's position. Every sequence keeps its own position
(its prompt's length, then one more a token), seed, token count, seen tokens (the repetition
penalty) and end: an EOS token ends a sequence on the GPU, after which its rows cost next to
nothing (attention reads one key of it, the sampler skips it); the host may end one the same
way (a stop string, ``on_token``). ``tokens_per_submit`` steps are recorded into one command
buffer; the next batch is submitted before the last one's readback is waited on, so encoding
overlaps the GPU's work. Generation stops once every sequence has ended; tokens computed past a
sequence's end (at most a submit's worth) are dropped.

A sequence's tokens are those it gets alone (greedy: exactly; sampling: for the same seed), since
its sums do not depend on the batch around it: the prompt pass is ``batch_invariant`` (kept
attention's sums unsplit, float projections as GEMMs), decode attention cuts each sequence's keys
into the same spans whatever the batch (``kernels.attention.decode``), and up to
``gemv_max_tokens`` sequences (16 on GPUs, 4 on CPU adapters) decode on the GEMV path, as one
does: each row summed as it is alone (the ternary projections' integer dots, the float
projections' and the LM head's sums in one order; ``kernels.bitlinear``, ``kernels.matmul``).
Past either bound the sums are ordered otherwise, a last-bit difference that can round a
quantised model's int8 code differently, and with it change a token: a batch of more sequences
decodes on the GEMM path (the LM head's and float weights' sums, and on GPUs unfused launches),
and a batch whose prompt scores outgrow ``policy.SCORES_SCRATCH_BYTES`` runs its prompt pass
with flash attention where one prompt keeps its scores whole.

Limits: every prompt plus ``max_new_tokens`` must fit the model's context, a layer's keys one
storage binding (``KVCache.max_batch``) and the batch's last-position logits one binding, each
refused with a message before anything runs; and the batch's KV cache (``KVCache.nbytes``) must
fit the device's memory.

A generation is asked for with a ``GenerationRequest`` (the prompts' token ids, how many tokens,
the EOS tokens, seeds and sampling) and run by the engine (``BitNetEngine.generate_batch``), which
keeps a ``DecodeSession`` per shape; each prompt gets back a ``Generated`` (its new ids, whether an
EOS token ended them).

>>> # engine.generate_batch(GenerationRequest([[0, 17, 42], [0, 5]], max_new_tokens=32, eos={1}))
>>> # [Generated(tokens=[...], ended_by_eos=True), Generated(tokens=[...], ended_by_eos=False)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, NamedTuple, Sequence

import numpy as np

from ..limits import check_context
from ..runtime import Pending, Recorder, write
from .adapters import EngineAdapters
from .config import pad
from .kernels.sampling import EOS, ROW_FIELDS, ROW_LIMIT, ROW_SEED, SEEN, sampling_launches
from .plan import ForwardPlan, KVCache
from .weights import EngineWeights
from .workspace import Workspace

OnToken = Callable[[int, int], bool]  # (row, token) -> whether the row ends after it


@dataclass(frozen=True)
class GenerationRequest:
    """A generation of up to ``max_new_tokens`` after each of ``prompts`` (lists of token ids), all at
    once: ``eos``, the tokens that end a sequence; ``seeds``, each prompt's sampling seed (default 0);
    ``sampling``, ``DecodeSession``'s strategy, temperature, top_k, top_p, repetition_penalty and
    min_new_tokens (the defaults: greedy); ``on_token``, ``DecodeSession.generate``'s;
    ``tokens_per_submit``, the decode steps recorded into one command buffer; ``adapter_names``, one
    name a prompt (``"__base__"`` for none, as PEFT takes them): each prompt continued with that adapter."""

    prompts: Sequence[Sequence[int]]
    max_new_tokens: int
    eos: Collection[int] = ()
    seeds: Sequence[int] | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    on_token: OnToken | None = None
    tokens_per_submit: int = 8
    adapter_names: Sequence[str] | None = None


class Generated(NamedTuple):
    """One prompt's new token ids, and whether an EOS token ended them (then the last one)."""

    tokens: list[int]
    ended_by_eos: bool


class DecodeSession:
    """What one generation shape keeps on the GPU: the cache of ``batch`` sequences of
    ``prompt_length + max_new_tokens`` positions, the prefill and decode plans, the sampler's
    buffers and launches (``sampling``: ``sampling_launches``' strategy, temperature, top_k,
    top_p, repetition_penalty, min_new_tokens). Built once per shape, then reused: building one
    takes tens of ms. ``scratch``: the engine's workspace of scratch shared between plans."""

    def __init__(self, weights: EngineWeights, adapters: EngineAdapters, batch: int, prompt_length: int,
                 max_new_tokens: int, *, scratch: Workspace | None = None, strategy: str = "greedy",
                 temperature: float = 1.0, top_k: int = 40, top_p: float = 0.9, repetition_penalty: float = 1.0,
                 min_new_tokens: int = 0) -> None:
        config = weights.config
        check_context(config.max_positions, prompt_length, max_new_tokens)
        if max_new_tokens < 1:
            raise ValueError(f"a decode session generates at least one token, got max_new_tokens={max_new_tokens}")
        self.adapters, self.config = adapters, config
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
        options = dict(vocab=config.vocab, strategy=strategy, temperature=temperature, top_k=top_k, top_p=top_p,
                       repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens, workspace=ws)

        def sampler(plan: ForwardPlan) -> list:
            return sampling_launches(plan.logits[0][1], self.seen, self.state, self.cache.starts, self.cache.lengths,
                                     self.history, self.next_token, **options)

        self.prefill_sampling, self.decode_sampling = sampler(self.prefill), sampler(self.decode)

    def start(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], eos: Collection[int],
              row_slots: Sequence[int] | None = None) -> None:
        """Write a generation's inputs: the prompts (right-padded) and the row of each one's last
        token, the tokens the repetition penalty sees and the EOS tokens, each sequence's seed and
        count, where each one stands (position 0, its prompt's length), and with ``row_slots`` each
        one's adapter (a session whose adapters serve rows)."""
        b, t = self.batch, self.prompt_length
        if len(prompts) != b or len(seeds) != b or not all(1 <= len(p) <= t for p in prompts):
            raise ValueError(f"{len(prompts)} prompts of {[len(p) for p in prompts]} tokens and {len(seeds)} seeds "
                             f"for a session of {b} prompts of 1 to {t} tokens")
        ids = np.zeros((b, t), np.uint32)  # padding: token 0, never attended to (each row's length)
        flags = np.zeros(self.seen.shape, np.uint32)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = prompt
            flags[row, np.asarray(prompt, np.int64)] = SEEN
        flags[:, np.asarray(sorted(eos), np.int64)] |= EOS
        write(self.prefill.ids, ids.reshape(-1))
        self.prefill.set_last([len(p) for p in prompts])
        write(self.seen, flags)
        state = np.zeros((b, ROW_FIELDS), np.uint32)
        state[:, ROW_SEED] = [seed & 0xFFFFFFFF for seed in seeds]
        state[:, ROW_LIMIT] = self.max_new_tokens
        write(self.state, state)
        self.cache.set_position(0, [len(p) for p in prompts])
        if (row_slots is None) != (self.prefill.row_adapters is None):
            raise ValueError("a session whose adapters serve rows generates with each row's adapter slot, and only "
                             "such a session takes them")
        if row_slots is not None:
            self.prefill.set_row_slots(row_slots)
            self.decode.set_row_slots(row_slots)

    def record(self, rec: Recorder, steps: int, prefill: bool) -> None:
        """Into ``rec``: the prefill and its sampler (``prefill``), then ``steps`` decode steps."""
        if prefill:
            self.prefill.record(rec)
            for launch in self.prefill_sampling:
                rec.launch(launch)
        for _ in range(steps):
            self.decode.record(rec)
            for launch in self.decode_sampling:
                rec.launch(launch)

    def end_row(self, row: int) -> None:
        """End sequence ``row`` from the next submit on (its length 0, as an EOS token sets it)."""
        write(self.cache.lengths, np.zeros(1, np.uint32), offset=4 * row)

    def generate(self, prompts: Sequence[Sequence[int]], eos: Collection[int], seeds: Sequence[int] | None = None,
                 tokens_per_submit: int = 8, on_token: OnToken | None = None,
                 row_slots: Sequence[int] | None = None) -> list[Generated]:
        """Up to ``max_new_tokens`` after each of ``prompts`` (``batch`` of them, each at most the
        session's prompt length); returns each one's new ids and whether an EOS token ended them.
        ``seeds``: each sequence's sampling seed (default 0). ``on_token(row, token)`` sees every
        token of every sequence as the tokens come back, in order, up to the sequence's last;
        returning True ends that sequence after the token. ``row_slots``: each sequence's adapter
        (``EngineAdapters.row_slots``), in a session whose adapters serve rows."""
        self.adapters.sync()
        seeds = [0] * self.batch if seeds is None else list(seeds)
        self.start(prompts, seeds, eos, row_slots)
        history = np.zeros(self.history.shape, np.uint32)
        tokens: list[list[int]] = [[] for _ in prompts]
        ended: list[bool | None] = [None] * self.batch  # None: running; else whether EOS ended it

        def submit(steps: int, prefill: bool) -> Pending:
            rec = Recorder(self.adapters.device)
            self.record(rec, steps, prefill)
            rec.read(self.history, history)
            return rec.submit_async()

        def take(count: int) -> None:
            """Hand on each running sequence's tokens below ``count``; end those that end."""
            for row in range(self.batch):
                while ended[row] is None and len(tokens[row]) < count:
                    token = int(history[row, len(tokens[row])])
                    tokens[row].append(token)
                    stop = on_token(row, token) if on_token is not None else False
                    if token in eos:
                        ended[row] = True  # the GPU ended it
                    elif stop:
                        ended[row] = False
                        self.end_row(row)
                    elif len(tokens[row]) == self.max_new_tokens:
                        ended[row] = False

        queue = [(submit(0, prefill=True), 1)]  # (submitted work, tokens chosen once it is done), oldest first
        done = 1
        while queue:
            more = done < self.max_new_tokens and None in ended
            if more:
                steps = min(tokens_per_submit, self.max_new_tokens - done)
                done += steps
                queue.append((submit(steps, prefill=False), done))
            if len(queue) > 1 or not more:  # one batch stays in flight while the next one is encoded
                oldest, count = queue.pop(0)
                oldest.wait()  # in submission order: the readback is the newest history
                take(count)
        return [Generated(row, bool(end)) for row, end in zip(tokens, ended)]

    def roles(self) -> dict[str, int]:
        """Bytes the session's workspace holds, by role."""
        return self.workspace.roles()
