"""Choosing the next token on the GPU (``wgsl/sampling.wgsl``), and its torch reference.

The model engine decodes several tokens per submit: the last position's logits stay on
the GPU, these launches choose the next token there and write it where the next step's
embedding gather reads it, and advance the decode state. Build the launches once per
plan and record the same ones for every generated token::

    launches = sampling_launches(logits_row, seen, step, lengths, history, next_token,
                                 vocab=V, strategy="top_p", temperature=0.8, top_p=0.9,
                                 repetition_penalty=1.1, workspace=ws)
    for launch in launches:          # after the model's launches, every token
        rec.launch(launch)

Buffers: ``logits`` f32 [V] (the last position's row), ``seen`` u32 [V] flags (1 for
every prompt and generated token: the repetition penalty applies to them), ``step`` u32
(``STEP_SEED`` the sampling seed, ``STEP_TOKEN_COUNT`` the tokens generated so far,
``STEP_POS`` the position), ``lengths`` u32 [1], ``history`` u32 [max_new_tokens],
``next_token`` u32 [1]. After choosing ``token``, the last launch sets
``history[count] = token``, ``seen[token] = 1``, ``next_token[0] = token`` and adds 1 to
``step[STEP_POS]``, ``lengths[0]`` and ``step[STEP_TOKEN_COUNT]``.

The processing is generation.py's, in its order: repetition penalty, then (sampling)
temperature, then top-k or top-p, with correctly rounded divisions, so the processed
logits are bitwise torch's. Launches per token (no atomics; every scratch value is
written earlier in the same step, so nothing carries over between tokens):

* ``greedy``: 2 (a partial argmax per workgroup, then one workgroup's reduction and the
  advance). Ties go to the smallest token id, as ``torch.argmax``: greedy tokens are
  exactly the CPU path's.
* ``top_k``, ``top_p``: ``SEARCH_PASSES + 1`` = 9. The kept tokens are those whose
  processed logit is at least a threshold, found by a 17-way search over the logits'
  ordered bit patterns: each pass counts (top-k) or sums the probability (top-p) of the
  tokens above 16 candidates, each workgroup over its chunk, and the next pass folds those
  sums into a narrower interval (8 passes narrow 2^32 keys to one; the first pass also
  stores the processed logits). The last launch, one workgroup, folds the last pass, draws
  by inverse CDF over the kept tokens (blocks, then one block's tokens) and advances.

What these launches cost on an H200: ``benchmarks/results/h200/kernel_tuning.md``.

Sampling draws ``u = uniform(seed, count)`` from a counter-based generator (a PCG hash of
the seed and the token count, 24 random bits) and picks the first kept token, in id
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
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ...logits import check_processing, process_logits
from ...runtime import Buffer, Device, Launch, kernel, write
from ..workspace import Workspace
from . import STEP_FIELDS, STEP_POS, STEP_SEED, STEP_TOKEN_COUNT

if TYPE_CHECKING:
    import torch

__all__ = ["SEARCH_PASSES", "inverse_cdf", "plan_shape", "sample_reference", "sampling_launches",
           "uniform"]

SEARCH_PASSES = 8  # 17 ** 8 > 2 ** 32: 8 folds narrow any interval of 32-bit keys to one
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
    32 bits, as ``step[STEP_SEED]`` holds it) and token ``count``.

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
    import torch

    cdf = probabilities.double().cumsum(-1)
    index = int(torch.searchsorted(cdf, torch.tensor([float(u)], dtype=torch.float64), right=True)[0])
    positive = torch.nonzero(probabilities > 0).flatten()
    if len(positive) == 0:
        return 0
    return min(index, int(positive[-1]))


def sample_reference(logits: "torch.Tensor", seen_ids: "torch.Tensor", strategy: str, temperature: float,
                     top_k: int, top_p: float, repetition_penalty: float, seed: int, count: int) -> int:
    """The token the GPU chooses, computed with torch: generation.py's ``process_logits``
    (penalty, temperature, filter), then argmax (greedy) or ``inverse_cdf`` of the softmax at
    ``uniform(seed, count)``.

    >>> import torch
    >>> sample_reference(torch.tensor([1.0, 3.0, 2.0]), torch.tensor([1]), "greedy", 1.0, 40, 0.9, 2.0, 0, 0)
    2
    """
    import torch

    processed = process_logits(logits, seen_ids, strategy=strategy, temperature=temperature, top_k=top_k,
                               top_p=top_p, repetition_penalty=repetition_penalty)
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


def _check_buffer(name: str, buf: Any, dtype: str, size: int | None = None, at_least: int = 1) -> None:
    if not isinstance(buf, Buffer):
        raise TypeError(f"{name} must be a runtime Buffer, got {type(buf).__name__}")
    if buf.dtype != dtype:
        raise TypeError(f"{name} must be a {dtype} buffer, got {buf.dtype}")
    if size is not None and buf.numel != size:
        raise ValueError(f"{name} must hold vocab={size} elements, got shape {buf.shape}")
    if buf.numel < at_least:
        raise ValueError(f"{name} must hold at least {at_least} element(s), got shape {buf.shape}")


def _check_arguments(vocab: int, strategy: str, temperature: float, top_k: int, top_p: float,
                     repetition_penalty: float) -> None:
    check_processing(strategy, temperature, top_k, top_p, repetition_penalty)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab < 2 ** 30:
        raise ValueError(f"vocab must be an integer in [1, 2**30), got {vocab!r}")
    if not _normal_f32(repetition_penalty):
        raise ValueError(f"repetition_penalty={repetition_penalty!r} is not a normal float32 number")
    if strategy != "greedy" and not _normal_f32(temperature):
        raise ValueError(f"temperature={temperature!r} is not a normal float32 number")


def plan_shape(vocab: int, device: Device) -> tuple[int, int]:
    """(workgroups, vec4s per workgroup) of the multi-workgroup launches for ``vocab``."""
    v4 = -(-vocab // 4)
    most = CPU_GROUPS if device.is_cpu else GPU_GROUPS
    groups = max(1, min(most, -(-v4 // WORKGROUP)))
    chunk = -(-v4 // groups)
    return -(-v4 // chunk), chunk  # every workgroup has work


def sampling_launches(logits: Buffer, seen: Buffer, step: Buffer, lengths: Buffer, history: Buffer,
                      next_token: Buffer, *, vocab: int, strategy: str, temperature: float = 1.0, top_k: int = 40,
                      top_p: float = 0.9, repetition_penalty: float = 1.0,
                      workspace: Workspace) -> list[Launch]:
    """The launches that choose the next token from ``logits`` and advance the decode state
    (see the module docstring): 2 for ``greedy``, 9 for ``top_k`` and ``top_p``. Record
    them in order, once per token; each records the same work every time (per-step values
    live in ``step``, ``lengths`` and ``seen``). Their scratch buffers are ``workspace``'s.

    ``temperature``, ``top_k`` and ``top_p`` are used by the sampling strategies only;
    ``repetition_penalty`` 1.0 skips the penalty. Raises ValueError or TypeError naming
    the bad argument.

    >>> # launches = sampling_launches(logits, seen, step, lengths, history, next_token,
    >>> #                              vocab=128256, strategy="greedy", repetition_penalty=1.1)
    >>> # rec = Recorder(); [rec.launch(x) for x in launches]; rec.submit()
    """
    _check_arguments(vocab, strategy, temperature, top_k, top_p, repetition_penalty)
    _check_buffer("logits", logits, "f32", vocab)
    _check_buffer("seen", seen, "u32", vocab)
    _check_buffer("step", step, "u32", at_least=len(STEP_FIELDS))
    _check_buffer("lengths", lengths, "u32")
    _check_buffer("history", history, "u32")
    _check_buffer("next_token", next_token, "u32")
    device = workspace.device
    for name, buf in (("logits", logits), ("seen", seen), ("step", step), ("lengths", lengths),
                      ("history", history), ("next_token", next_token)):
        if buf.device is not device:
            raise ValueError(f"{name} lives on another device than the one given")

    groups, chunk = plan_shape(vocab, device)
    v4 = -(-vocab // 4)
    sampled = strategy != "greedy"
    params = {"vocab": vocab, "v4": v4, "chunk": chunk, "groups": groups, "pass_index": 0,
              "history_len": history.numel, "top_k": min(top_k, vocab), "top_p": float(top_p),
              "penalty": float(repetition_penalty), "temperature": float(temperature) if sampled else 1.0}
    processing = {"PENALIZE": int(repetition_penalty != 1.0), "SCALE": int(sampled and float(temperature) != 1.0)}
    steps = {"STEP_POS": STEP_POS, "STEP_SEED": STEP_SEED, "STEP_TOKEN_COUNT": STEP_TOKEN_COUNT}
    scratch = workspace.alloc("sampling", (21 * groups + 2, 4), "u32")
    write(scratch, np.zeros(scratch.shape, np.uint32))  # pooled memory: start from known values
    state = (scratch, seen, step, lengths, history, next_token)

    def build(entry: str, grid: int, buffers: Sequence[Buffer], pass_index: int = 0, **constants: int) -> Launch:
        k = kernel(FILE, entry, device, WG=WORKGROUP, **constants)
        return Launch.build(k, (grid, 1, 1), buffers, {**params, "pass_index": pass_index})

    if not sampled:
        return [build("greedy_partial", groups, (scratch, logits, seen), **processing),
                build("greedy_final", 1, state, **steps)]

    z = workspace.alloc("sampling", (v4, 4), "f32")
    search = {"PASSES": SEARCH_PASSES, "MODE": int(strategy == "top_p")}
    launches = [build("search_first", groups, (scratch, logits, seen, z), 1, **search, **processing)]
    launches += [build("search", groups, (scratch, z), i, **search) for i in range(2, SEARCH_PASSES + 1)]
    launches.append(build("draw", 1, (*state, z), SEARCH_PASSES + 1, **search, **steps))
    return launches
