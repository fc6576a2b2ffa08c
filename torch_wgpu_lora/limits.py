"""The limits every path checks alike, with one message each: the model's context, wherever a
sequence meets a model (the engine's batches and generation; the torch path's generation,
training and evaluation), and the range of generation's sampling seed (the API's and the CLI's).

>>> check_context(256, 300)
Traceback (most recent call last):
...
ValueError: 300 tokens exceed the model's context of 256 positions (max_position_embeddings)

This module imports nothing from the package, so every layer can use it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SEED_LIMIT", "check_context", "check_seed", "model_context"]

SEED_LIMIT = 2 ** 32  # the engine's sampler draws from 32 bits of the seed: a wider one would alias


def model_context(model: Any) -> int | None:
    """``max_position_embeddings`` of a transformers model's config (or a ``BitNetEngine``'s), or
    None for a model whose config states none.

    >>> # model_context(load_bitnet("bitnet-b1.58-2B-4T"))  # 4096
    """
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_context(context: int | None, tokens: int, max_new_tokens: int = 0) -> None:
    """ValueError when ``tokens`` positions, and ``max_new_tokens`` to be generated after them, do
    not fit a context of ``context`` positions (None: the model states no limit).

    >>> check_context(256, 200, max_new_tokens=56)  # fits exactly
    >>> # check_context(256, 200, max_new_tokens=100): "a 200-token prompt and max_new_tokens=100 need 300 ..."
    """
    if context is None or tokens + max_new_tokens <= context:
        return
    if max_new_tokens:
        raise ValueError(f"a {tokens}-token prompt and max_new_tokens={max_new_tokens} need {tokens + max_new_tokens} "
                         f"positions; the model's context is {context} (max_position_embeddings)")
    raise ValueError(f"{tokens} tokens exceed the model's context of {context} positions (max_position_embeddings)")


def check_seed(seed: Any) -> None:
    """ValueError unless ``seed`` is None or an integer in [0, 2**32), generation's sampling seed on
    both paths (``generate(seed=...)``, ``torch-wgpu-lora generate --seed``).

    >>> check_seed(2 ** 32)
    Traceback (most recent call last):
    ...
    ValueError: seed must be an integer in [0, 2**32) (the engine's sampler uses 32 bits) or None, got 4294967296
    """
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT):
        raise ValueError(f"seed must be an integer in [0, 2**32) (the engine's sampler uses 32 bits) or None, "
                         f"got {seed!r}")
