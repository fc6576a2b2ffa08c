"""Generation on the engine: the KV cache, the next-token choice and the token history all stay
on the GPU; only token ids come back.

A prefill pass runs the prompt and chooses the first token; then decode steps, each one pass
over a single position followed by the sampling launches, which write the chosen token where
the next step's embedding gather reads it and advance the position. ``tokens_per_submit``
steps are recorded into one command buffer; the next batch is submitted before the last one's
readback is waited on, so encoding overlaps the GPU's work. Tokens after an EOS are computed
(at most a batch's worth) and trimmed.

>>> # ids, eos_hit = engine_generate(engine, prompt_ids=[0, 17, 42], max_new_tokens=32, eos={1})
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..limits import check_context
from ..runtime import Pending, Recorder, write
from .adapters import EngineAdapters
from .kernels import STEP_POS
from .kernels.sampling import sampling_launches
from .plan import ForwardPlan, KVCache
from .weights import EngineWeights
from .workspace import Workspace


class DecodeSession:
    """What one generation shape keeps on the GPU: the cache of ``prompt_length + max_new_tokens``
    positions, the prefill and decode plans, the sampler's buffers and launches (``sampling``:
    ``sampling_launches``' strategy, temperature, top_k, top_p, repetition_penalty). Built once
    per shape, then reused: building one takes tens of ms. ``scratch``: the engine's workspace of
    scratch shared between plans."""

    def __init__(self, weights: EngineWeights, adapters: EngineAdapters, prompt_length: int, max_new_tokens: int, *,
                 scratch: Workspace | None = None, strategy: str = "greedy", temperature: float = 1.0,
                 top_k: int = 40, top_p: float = 0.9, repetition_penalty: float = 1.0) -> None:
        config = weights.config
        check_context(config.max_positions, prompt_length, max_new_tokens)
        length = prompt_length + max_new_tokens
        self.adapters, self.config = adapters, config
        self.workspace = ws = Workspace(adapters.device, shared=scratch)
        self.cache = KVCache(config, 1, length, ws)
        self.prefill = ForwardPlan(weights, adapters, self.cache, prompt_length, logits="last", from_start=True,
                                   workspace=ws)
        self.next_token = ws.alloc("inputs", (1,), "u32")
        self.decode = ForwardPlan(weights, adapters, self.cache, 1, logits="last", decode=True, ids=self.next_token,
                                  workspace=ws)
        self.seen = ws.alloc("sampling", (config.vocab,), "u32")
        self.history = ws.alloc("sampling", (max(max_new_tokens, 1),), "u32")
        self.max_new_tokens = max_new_tokens
        options = dict(vocab=config.vocab, strategy=strategy, temperature=temperature, top_k=top_k, top_p=top_p,
                       repetition_penalty=repetition_penalty, workspace=ws)

        def sampler(plan: ForwardPlan) -> list:
            return sampling_launches(plan.logits[0][1], self.seen, self.cache.step, self.cache.lengths, self.history,
                                     self.next_token, **options)

        self.prefill_sampling, self.decode_sampling = sampler(self.prefill), sampler(self.decode)

    def start(self, prompt_ids: list[int], seed: int = 0) -> None:
        """Write a generation's inputs: the prompt, the tokens the repetition penalty sees, where the
        prefill starts (position 0) and the sampling seed."""
        prompt = np.asarray(prompt_ids, np.uint32)
        write(self.prefill.ids, prompt)
        seen = np.zeros(self.config.vocab, np.uint32)
        seen[prompt] = 1
        write(self.seen, seen)
        self.cache.set_position(0, [len(prompt_ids)], seed=seed, generated=0)

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

    def generate(self, prompt_ids: list[int], eos: set[int], seed: int = 0,
                 tokens_per_submit: int = 8) -> tuple[list[int], bool]:
        """Up to ``max_new_tokens`` after ``prompt_ids`` (whose length is the session's prompt length);
        returns (new ids, whether EOS ended them)."""
        self.adapters.sync()
        self.start(prompt_ids, seed)
        history = np.zeros(self.history.shape, np.uint32)

        def submit(steps: int, prefill: bool) -> Pending:
            rec = Recorder(self.adapters.device)
            self.record(rec, steps, prefill)
            rec.read(self.history, history)
            return rec.submit_async()

        def finished(count: int) -> bool:
            return any(int(t) in eos for t in history[:count])

        # The prefill's sampler advanced the position by one from 0; the first decode step runs at
        # the prompt's length (a queue write lands before the next submit).
        queue = [(submit(0, prefill=True), 1)]  # (submitted work, tokens chosen once it is done), oldest first
        write(self.cache.step, np.array([len(prompt_ids)], np.uint32), offset=4 * STEP_POS)
        done = 1
        while done < self.max_new_tokens:
            steps = min(tokens_per_submit, self.max_new_tokens - done)
            done += steps
            queue.append((submit(steps, prefill=False), done))
            if len(queue) > 1:  # one batch stays in flight while the next one is encoded
                oldest, count = queue.pop(0)
                oldest.wait()
                if finished(count):
                    break
        for pending, _ in queue:  # in submission order: the last wait leaves the newest history
            pending.wait()
        tokens = [int(t) for t in history[: self.max_new_tokens]]
        for i, token in enumerate(tokens):
            if token in eos:
                return tokens[: i + 1], True
        return tokens, False

    def roles(self) -> dict[str, int]:
        """Bytes the session's workspace holds, by role."""
        return self.workspace.roles()


def engine_generate(engine: Any, prompt_ids: list[int], max_new_tokens: int, eos: set[int], *,
                    seed: int = 0, tokens_per_submit: int = 8, **sampling: Any) -> tuple[list[int], bool]:
    """Generate up to ``max_new_tokens`` after ``prompt_ids`` on a ``BitNetEngine``; returns (new
    ids, whether EOS ended them). ``sampling``: ``DecodeSession``'s strategy, temperature, top_k,
    top_p and repetition_penalty."""
    if max_new_tokens == 0:
        return [], False
    with engine.lock:  # one GPU pass at a time (see BitNetEngine)
        session = engine.decode_session(len(prompt_ids), max_new_tokens, **sampling)
        return session.generate(prompt_ids, eos, seed=seed, tokens_per_submit=tokens_per_submit)
