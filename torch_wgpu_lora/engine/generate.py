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

from dataclasses import dataclass

import numpy as np

from ..limits import check_context
from ..runtime import Buffer, Pending, Recorder, write
from .kernels import STEP_POS
from .kernels.sampling import sampling_launches
from .plan import ForwardPlan, KVCache


@dataclass
class DecodeSession:
    """What one generation keeps on the GPU: the cache, both plans, the sampler's buffers."""

    cache: KVCache
    prefill: ForwardPlan
    decode: ForwardPlan
    seen: Buffer
    history: Buffer
    next_token: Buffer
    prefill_sampling: list
    decode_sampling: list


def session(engine, prompt_length: int, max_new_tokens: int, *, strategy: str = "greedy", temperature: float = 1.0,
            top_k: int = 40, top_p: float = 0.9, repetition_penalty: float = 1.0) -> DecodeSession:
    """Build the buffers and launches for a prompt of ``prompt_length`` and ``max_new_tokens``."""
    config, device = engine.engine_config, engine.device
    check_context(config.max_positions, prompt_length, max_new_tokens)
    length = prompt_length + max_new_tokens
    cache = KVCache(config, 1, length, device)
    prefill = ForwardPlan(engine.weights, engine.adapters, cache, prompt_length, logits="last", from_start=True)
    next_token = Buffer((1,), "u32", device)
    decode = ForwardPlan(engine.weights, engine.adapters, cache, 1, logits="last", decode=True, ids=next_token)
    seen = Buffer((config.vocab,), "u32", device)
    history = Buffer((max(max_new_tokens, 1),), "u32", device)
    options = dict(vocab=config.vocab, strategy=strategy, temperature=temperature, top_k=top_k, top_p=top_p,
                   repetition_penalty=repetition_penalty, device=device)

    def sampler(plan: ForwardPlan) -> list:
        return sampling_launches(plan.logits[0][1], seen, cache.step, cache.lengths, history, next_token, **options)

    return DecodeSession(cache, prefill, decode, seen, history, next_token, sampler(prefill), sampler(decode))


def engine_generate(engine, prompt_ids: list[int], max_new_tokens: int, eos: set[int], *, strategy: str = "greedy",
                    temperature: float = 1.0, top_k: int = 40, top_p: float = 0.9, repetition_penalty: float = 1.0,
                    seed: int = 0, tokens_per_submit: int = 8) -> tuple[list[int], bool]:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; returns (new ids, whether EOS ended them)."""
    if max_new_tokens == 0:
        return [], False
    with engine.lock:  # one GPU pass at a time (see BitNetEngine)
        engine.adapters.sync()
        s = engine.decode_session(len(prompt_ids), max_new_tokens, strategy=strategy, temperature=temperature,
                                  top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty)
        prompt = np.asarray(prompt_ids, np.uint32)
        write(s.prefill.ids, prompt)
        seen = np.zeros(engine.engine_config.vocab, np.uint32)
        seen[prompt] = 1
        write(s.seen, seen)
        s.cache.set_position(0, [len(prompt_ids)], seed=seed, generated=0)
        history = np.zeros(s.history.shape, np.uint32)

        def submit(steps: int, prefill: bool) -> Pending:
            rec = Recorder(engine.device)
            if prefill:
                s.prefill.record(rec)
                for launch in s.prefill_sampling:
                    rec.launch(launch)
            for _ in range(steps):
                s.decode.record(rec)
                for launch in s.decode_sampling:
                    rec.launch(launch)
            rec.read(s.history, history)
            return rec.submit_async()

        def finished(count: int) -> bool:
            return any(int(t) in eos for t in history[:count])

        # The prefill's sampler advanced the position by one from 0; the first decode step runs at
        # the prompt's length (a queue write lands before the next submit).
        queue = [(submit(0, prefill=True), 1)]  # (submitted work, tokens chosen once it is done), oldest first
        write(s.cache.step, np.array([len(prompt_ids)], np.uint32), offset=4 * STEP_POS)
        done = 1
        while done < max_new_tokens:
            steps = min(tokens_per_submit, max_new_tokens - done)
            done += steps
            queue.append((submit(steps, prefill=False), done))
            if len(queue) > 1:  # one batch stays in flight while the next one is encoded
                oldest, count = queue.pop(0)
                oldest.wait()
                if finished(count):
                    break
        for pending, _ in queue:  # in submission order: the last wait leaves the newest history
            pending.wait()
        tokens = [int(t) for t in history[:max_new_tokens]]
        for i, token in enumerate(tokens):
            if token in eos:
                return tokens[: i + 1], True
        return tokens, False
