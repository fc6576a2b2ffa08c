"""Choosing the next token of every sequence of a batch on the GPU (``wgsl/sampling.wgsl``), and
its torch reference.

The model engine decodes several tokens per submit: each sequence's last-position logits stay
on the GPU, these launches choose its next token there and write it where the next step's
embedding gather reads it, and advance the sequence's decode state. Build the launches once
per plan and record the same ones for every generated token::

    launches = sampling_launches(logits, seen, state, starts, lengths, history, next_token,
                                 vocab=V, strategy="top_p", temperature=0.8, top_p=0.9,
                                 repetition_penalty=1.1, workspace=ws)
    for launch in launches:          # after the model's launches, every token
        rec.launch(launch)

Buffers, for a batch of B sequences (rows): ``logits`` f32 [B, 4·⌈V/4⌉] (each row's last
position; one row may be [V]), ``seen`` u32 flags of the same shape (``SEEN`` for every prompt
and generated token: the repetition penalty applies to them; ``EOS`` for the tokens that end a
sequence), ``state`` u32 [B, 3] (``ROW_SEED`` the row's sampling seed, ``ROW_COUNT`` the tokens
it has generated, ``ROW_LIMIT`` the most it may generate), ``starts`` and ``lengths`` u32 [B] (the
KV cache's: where the row's next pass starts, its valid positions), ``history`` u32 [B, max_new_tokens]
(or fewer columns: a token past the row's last column is not kept), ``next_token`` u32 [B].
After choosing ``token`` for row b, the last launch sets ``history[b, count] = token``, the
token's ``SEEN`` flag, ``next_token[b] = token``, adds 1 to the count, and puts the row's next
pass at its end (``starts[b] = lengths[b]``, then ``lengths[b]`` += 1); an ``EOS`` token, or the
row's last (the count reaching its limit), sets ``lengths[b] = 0`` instead: the row has finished,
and every launch (these, and attention, which then reads one key of it) skips it from the next
step on. The host may end a row the same way (a stop string). Rows of one batch may so end at
different steps without the host telling them apart (continuous batching: ``engine.generate``).

The processing is generation.py's, in transformers' order: repetition penalty, EOS tokens to
-inf while the row has fewer than ``min_new_tokens`` (``MinNewTokensLengthLogitsProcessor``),
then (sampling) temperature, then top-k, top-p, or top-k then top-p, with correctly rounded
divisions, so the processed logits are bitwise torch's. Launches per token (no atomics; every
scratch value is written earlier in the same step, so nothing carries over between tokens):

* ``greedy``: 2 (a partial argmax per workgroup, then one workgroup's reduction and the
  advance). Ties go to the smallest token id, as ``torch.argmax``: greedy tokens are
  exactly the CPU path's.
* ``top_k``, ``top_p``: ``SEARCH_PASSES + 1`` = 9 (``top_k_top_p``: 17, a top-k search, then a
  top-p search above its threshold). The kept tokens are those whose
  processed logit is at least a threshold, found by a 17-way search over the logits'
  ordered bit patterns: each pass counts (top-k) or sums the probability (top-p) of the
  tokens above 16 candidates, each workgroup over its chunk, and the next pass folds those
  sums into a narrower interval (8 passes narrow 2^32 keys to one; the first pass also
  stores the processed logits). The last launch, one workgroup, folds the last pass, draws
  by inverse CDF over the kept tokens (blocks, then one block's tokens) and advances.

What these launches cost on an H200: ``benchmarks/results/h200/kernel_tuning.md``.

Sampling draws ``u = uniform(seed, count)`` from a counter-based generator (a PCG hash of
the row's seed and token count, 24 random bits) and picks the first kept token, in id
order, whose cumulative probability exceeds ``u``. Sampled tokens are therefore
reproducible for a seed, and ``sample_reference`` computes the same draw with torch, but
they differ from the CPU path's (``generate`` draws with ``torch.multinomial``, whose
random stream cannot be reproduced here); ties straddling the top-p boundary keep all
equal logits (torch's sort may keep only some). Non-finite logits give an unspecified
token (the CPU path raises); a negative logit whose product with the penalty is subnormal
(above -1.2e-38) may come out as -0 on GPUs that flush subnormal products (NVIDIA's do).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import torch

from ...logits import check_processing, process_logits
from ...runtime import Buffer, Device, Launch, kernel, write
from ..workspace import Workspace

__all__ = ["EOS", "ROW_COUNT", "ROW_FIELDS", "ROW_LIMIT", "ROW_SEED", "SEARCH_PASSES", "SEEN", "inverse_cdf",
           "plan_shape", "sample_reference", "sampling_launches", "uniform"]

SEEN, EOS = 1, 2  # the seen buffer's flags: the repetition penalty applies; the token ends its sequence
ROW_SEED, ROW_COUNT, ROW_LIMIT = 0, 1, 2  # the fields of a row's state (the WGSL's SEED, COUNT, LIMIT)
ROW_FIELDS = 3  # u32s of a row's state
SEARCH_PASSES = 8  # 17 ** 8 > 2 ** 32: 8 folds narrow any interval of 32-bit keys to one
MODES = {"top_k": 0, "top_p": 1, "top_k_top_p": 2}  # the searches (the WGSL's MODE)
WORKGROUP = 128  # threads per workgroup of every launch (the WGSL's WG)
GPU_GROUPS, CPU_GROUPS = 128, 16  # most workgroups of a multi-workgroup launch (at most WORKGROUP)
FILE = "sampling.wgsl"
_MASK = 0xFFFFFFFF


# -- the random number generator (the WGSL's pcg and uniform) --------------------------------
def _pcg(v: int) -> int:
    s = (v * 747796405 + 2891336453) & _MASK
    w = (((s >> ((s >> 28) + 4)) ^ s) * 277803737) & _MASK
    return (w >> 22) ^ w


def uniform(seed: int, count: int) -> float:
    """The uniform float in [0, 1) (24 random bits) the GPU draws with for ``seed`` (its low
    32 bits, as a row's state holds it) and token ``count``.

    >>> uniform(0, 0) == uniform(0, 0), 0.0 <= uniform(7, 3) < 1.0
    (True, True)
    """
    h = _pcg(_pcg(count & _MASK) ^ _pcg((seed & _MASK) ^ 0x5BD1E995))
    return (h >> 8) / 16777216.0


# -- the torch reference --------------------------------------------------------------------
def inverse_cdf(probabilities: "torch.Tensor", u: float) -> int:
    """The first token id whose cumulative probability (in id order) exceeds ``u`` (the last
    token with a positive probability when rounding leaves ``u`` past the total).

    >>> import torch
    >>> inverse_cdf(torch.tensor([0.25, 0.0, 0.75]), 0.3)
    2
    """
    cdf = probabilities.double().cumsum(-1)
    index = int(torch.searchsorted(cdf, torch.tensor([float(u)], dtype=torch.float64), right=True)[0])
    positive = torch.nonzero(probabilities > 0).flatten()
    if len(positive) == 0:
        return 0
    return min(index, int(positive[-1]))


def sample_reference(logits: "torch.Tensor", seen_ids: "torch.Tensor", strategy: str, temperature: float,
                     top_k: int, top_p: float, repetition_penalty: float, seed: int, count: int,
                     banned_ids: "torch.Tensor | None" = None) -> int:
    """The token the GPU chooses, computed with torch: generation.py's ``process_logits``
    (penalty, ``banned_ids`` to -inf: the EOS tokens while ``count`` < ``min_new_tokens``,
    temperature, filter), then argmax (greedy) or ``inverse_cdf`` of the softmax at
    ``uniform(seed, count)``.

    >>> import torch
    >>> sample_reference(torch.tensor([1.0, 3.0, 2.0]), torch.tensor([1]), "greedy", 1.0, 40, 0.9, 2.0, 0, 0)
    2
    """
    processed = process_logits(logits, seen_ids, strategy=strategy, temperature=temperature, top_k=top_k,
                               top_p=top_p, repetition_penalty=repetition_penalty, banned_ids=banned_ids)
    if strategy == "greedy":
        return int(torch.argmax(processed))
    return inverse_cdf(processed.softmax(-1), uniform(seed, count))


# -- the launches ---------------------------------------------------------------------------
def _normal_f32(value: float) -> bool:
    """Whether ``value`` as a float32 is a finite normal number (the divisions need one)."""
    try:
        f = struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return False
    return math.isfinite(f) and abs(f) >= 2.0 ** -126


def _check_buffer(name: str, buf: Any, dtype: str, at_least: int) -> None:
    if not isinstance(buf, Buffer):
        raise TypeError(f"{name} must be a runtime Buffer, got {type(buf).__name__}")
    if buf.dtype != dtype:
        raise TypeError(f"{name} must be a {dtype} buffer, got {buf.dtype}")
    if buf.numel < at_least:
        raise ValueError(f"{name} must hold at least {at_least} element(s), got shape {buf.shape}")


def _check_arguments(vocab: int, strategy: str, temperature: float, top_k: int, top_p: float,
                     repetition_penalty: float, min_new_tokens: int) -> None:
    check_processing(strategy, temperature, top_k, top_p, repetition_penalty)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab < 2 ** 30:
        raise ValueError(f"vocab must be an integer in [1, 2**30), got {vocab!r}")
    if not _normal_f32(repetition_penalty):
        raise ValueError(f"repetition_penalty={repetition_penalty!r} is not a normal float32 number")
    if strategy != "greedy" and not _normal_f32(temperature):
        raise ValueError(f"temperature={temperature!r} is not a normal float32 number")
    if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or not 0 <= min_new_tokens < 2 ** 32:
        raise ValueError(f"min_new_tokens must be an integer >= 0, got {min_new_tokens!r}")


def plan_shape(vocab: int, device: Device) -> tuple[int, int]:
    """(workgroups, vec4s per workgroup) of the multi-workgroup launches for ``vocab``."""
    v4 = -(-vocab // 4)
    most = CPU_GROUPS if device.is_cpu else GPU_GROUPS
    groups = max(1, min(most, -(-v4 // WORKGROUP)))
    chunk = -(-v4 // groups)
    return -(-v4 // chunk), chunk  # every workgroup has work


def sampling_launches(logits: Buffer, seen: Buffer, state: Buffer, starts: Buffer, lengths: Buffer,
                      history: Buffer, next_token: Buffer, *, vocab: int, strategy: str, temperature: float = 1.0,
                      top_k: int = 40, top_p: float = 0.9, repetition_penalty: float = 1.0, min_new_tokens: int = 0,
                      workspace: Workspace) -> list[Launch]:
    """The launches that choose the next token of each of the ``lengths.numel`` rows from
    ``logits`` and advance the decode state (see the module docstring): 2 for ``greedy``, 9
    for ``top_k`` and ``top_p``, 17 for ``top_k_top_p``. Record them in order, once per token;
    each records the same work every time (per-step values live in ``state``, ``starts``,
    ``lengths`` and ``seen``). Their scratch buffers are ``workspace``'s.

    ``temperature``, ``top_k`` and ``top_p`` are used by the sampling strategies only;
    ``repetition_penalty`` 1.0 skips the penalty; ``min_new_tokens`` bans the ``EOS``-flagged
    tokens while a row has generated fewer. Raises ValueError or TypeError naming the bad
    argument.

    >>> # launches = sampling_launches(logits, seen, state, starts, lengths, history, next_token,
    >>> #                              vocab=128256, strategy="greedy", repetition_penalty=1.1)
    >>> # rec = Recorder(); [rec.launch(x) for x in launches]; rec.submit()
    """
    _check_arguments(vocab, strategy, temperature, top_k, top_p, repetition_penalty, min_new_tokens)
    _check_buffer("lengths", lengths, "u32", 1)
    batch = lengths.numel
    v4 = -(-vocab // 4)
    rows = (batch - 1) * 4 * v4 + vocab  # rows of 4·v4; the last may end at vocab
    _check_buffer("logits", logits, "f32", rows)
    _check_buffer("seen", seen, "u32", rows)
    _check_buffer("state", state, "u32", ROW_FIELDS * batch)
    _check_buffer("starts", starts, "u32", batch)
    _check_buffer("history", history, "u32", batch)
    _check_buffer("next_token", next_token, "u32", batch)
    if history.numel % batch:
        raise ValueError(f"history must hold a row of max_new_tokens for each of the {batch} sequences, got shape "
                         f"{history.shape}")
    device = workspace.device
    for name, buf in (("logits", logits), ("seen", seen), ("state", state), ("starts", starts),
                      ("lengths", lengths), ("history", history), ("next_token", next_token)):
        if buf.device is not device:
            raise ValueError(f"{name} lives on another device than the one given")
    if batch > device.max_workgroups:
        raise ValueError(f"{batch} sequences: a launch's grid holds at most {device.max_workgroups} rows")

    groups, chunk = plan_shape(vocab, device)
    sampled = strategy != "greedy"
    scratch_rows = 21 * groups + 2
    params = {"vocab": vocab, "v4": v4, "chunk": chunk, "groups": groups, "pass_index": 0,
              "history_len": history.numel // batch, "top_k": min(top_k, vocab), "top_p": float(top_p),
              "penalty": float(repetition_penalty), "temperature": float(temperature) if sampled else 1.0,
              "min_new": min_new_tokens, "scratch_rows": scratch_rows}
    processing = {"PENALIZE": int(repetition_penalty != 1.0), "SCALE": int(sampled and float(temperature) != 1.0),
                  "BAN": int(min_new_tokens > 0)}
    scratch = workspace.alloc("sampling", (batch, scratch_rows, 4), "u32")
    write(scratch, np.zeros(scratch.shape, np.uint32))  # pooled memory: start from known values
    advance = {1: scratch, 2: seen, 3: state, 4: starts, 5: lengths, 6: history, 7: next_token}

    def build(entry: str, grid: int, buffers: dict[int, Buffer], pass_index: int = 0, **constants: int) -> Launch:
        k = kernel(FILE, entry, device, WG=WORKGROUP, **constants)
        return Launch.build(k, (grid, batch, 1), buffers, {**params, "pass_index": pass_index})

    if not sampled:
        return [build("greedy_partial", groups, {1: scratch, 2: logits, 3: seen, 5: state, 6: lengths}, **processing),
                build("greedy_final", 1, advance)]

    z = workspace.alloc("sampling", (batch, v4, 4), "f32")
    passes = SEARCH_PASSES * (2 if strategy == "top_k_top_p" else 1)
    search = {"PASSES": SEARCH_PASSES, "MODE": MODES[strategy]}
    launches = [build("search_first", groups, {1: scratch, 2: logits, 3: seen, 4: z, 5: state, 6: lengths}, 1,
                      **search, **processing)]
    launches += [build("search", groups, {1: scratch, 2: z, 6: lengths}, i, **search) for i in range(2, passes + 1)]
    launches.append(build("draw", 1, {**advance, 8: z}, passes + 1, **search))
    return launches
