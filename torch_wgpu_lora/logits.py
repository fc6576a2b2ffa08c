"""The next-token rules shared by generation on the CPU and on the GPU engine: repetition penalty,
banned tokens (an EOS before ``min_new_tokens``), temperature, top-k and top-p (or top-k, then
top-p within it), in Hugging Face's order, on one sequence's logits.

The filters are re-implemented here (a few lines each, the same semantics as transformers'
``RepetitionPenaltyLogitsProcessor``, ``TopKLogitsWarper`` and ``TopPLogitsWarper``, which the
tests check) so they do not depend on those classes' changing signatures across transformers
versions. ``engine.kernels.sampling`` computes the same on the GPU and uses these as its
reference.

>>> process_logits(torch.tensor([2.0, -1.0, 0.5]), torch.tensor([0]), repetition_penalty=2.0)
tensor([ 1.0000, -1.0000,  0.5000])
"""

from __future__ import annotations

from typing import Any

import torch

STRATEGIES = ("greedy", "top_k", "top_p", "top_k_top_p")


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's rule on the logits [vocab] of every token in ``seen_ids`` (each once):
    positive logits are divided by ``penalty``, negative ones multiplied.

    >>> apply_repetition_penalty(torch.tensor([2.0, -2.0, 2.0]), torch.tensor([0, 1, 1]), 2.0)
    tensor([ 1., -4.,  2.])
    """
    ids = torch.unique(seen_ids)
    picked = logits[ids]
    out = logits.clone()
    out[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
    return out


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Logits [..., vocab] with everything below the k-th largest set to -inf (ties kept).

    >>> top_k_filter(torch.tensor([1.0, 3.0, 2.0]), 2)
    tensor([-inf, 3., 2.])
    """
    kth_largest = torch.topk(logits, min(k, logits.shape[-1])).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Logits [..., vocab] restricted to the smallest set of most likely tokens whose
    probability adds up to at least ``p`` (the most likely token is always kept).

    >>> top_p_filter(torch.tensor([0.0, 2.0, 1.0]), 0.5)
    tensor([-inf, 2., -inf])
    """
    ascending, order = torch.sort(logits, descending=False)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= 1 - p
    remove_sorted[..., -1] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def process_logits(logits: torch.Tensor, seen_ids: torch.Tensor, strategy: str = "greedy",
                   temperature: float = 1.0, top_k: int = 50, top_p: float = 1.0,
                   repetition_penalty: float = 1.0, banned_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One step's next-token logits [vocab] as ``generate`` samples (or argmaxes) them.

    ``seen_ids`` are the prompt and generated tokens so far. Greedy applies the repetition
    penalty, then sets ``banned_ids`` (EOS tokens before ``min_new_tokens``, as transformers'
    ``MinNewTokensLengthLogitsProcessor``) to -inf; sampling then divides by ``temperature``
    and applies top-k (``strategy="top_k"``), top-p (``"top_p"``) or top-k then top-p
    (``"top_k_top_p"``, transformers' order when both are set) filtering.
    """
    logits = logits.float()
    if repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen_ids, repetition_penalty)
    if banned_ids is not None and len(banned_ids):
        logits = logits.index_fill(-1, torch.as_tensor(banned_ids, dtype=torch.long), float("-inf"))
    if strategy == "greedy":
        return logits
    logits = logits / temperature
    if strategy in ("top_k", "top_k_top_p"):
        logits = top_k_filter(logits, top_k)
    return top_p_filter(logits, top_p) if strategy in ("top_p", "top_k_top_p") else logits


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_processing(strategy: str, temperature: float, top_k: int, top_p: float, repetition_penalty: float) -> None:
    """Refuse bad next-token settings with a ValueError naming the setting."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not _is_number(repetition_penalty) or not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (1.0 means no penalty), got {repetition_penalty!r}")
    if strategy != "greedy" and (not _is_number(temperature) or not temperature > 0):
        raise ValueError(f"temperature must be > 0 for sampling (do_sample=True), got {temperature!r}; "
                         "use do_sample=False for greedy decoding")


def sampling_settings(do_sample: bool, temperature: float | None, top_k: int | None, top_p: float | None,
                      repetition_penalty: float | None, vocab: int) -> dict[str, Any]:
    """transformers' decoding arguments as ``process_logits``' settings (checked, a ValueError naming a
    bad one): greedy unless ``do_sample``; sampling divides by ``temperature``, then keeps the
    ``top_k`` most likely tokens unless ``top_k`` is 0 or None, then the nucleus ``top_p`` unless it is
    1.0 or None, as transformers' ``generate`` does (a temperature or penalty of None: 1.0, as there).

    >>> sampling_settings(True, 0.7, 0, 0.9, None, vocab=100)["strategy"]
    'top_p'
    """
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 or None: no top-k filter, as in transformers), got "
                         f"{top_k!r}")
    top_p = 1.0 if top_p is None else top_p
    top_k = min(top_k or vocab, vocab)  # all of the vocabulary: no filter
    strategy = "greedy"
    if do_sample:
        filter_k = top_k < vocab
        filter_p = _is_number(top_p) and top_p < 1.0
        strategy = "top_k_top_p" if filter_k and filter_p else "top_p" if filter_p else "top_k"
    settings = dict(strategy=strategy, temperature=1.0 if temperature is None else temperature, top_k=top_k,
                    top_p=top_p, repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty)
    check_processing(**settings)
    return settings
