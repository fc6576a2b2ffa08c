"""What the engine takes, checked at its boundary: a batch (``check_inputs``: token ids, a
right-padding attention mask, labels, the position ids of packed rows), the micro-batches of a
training step padded to one shape (``pad_micro_batch``), and a generation's prompts
(``check_prompts``). Each refusal names what was wrong and where; nothing is silently changed.

>>> check_position_ids(torch.tensor([[0, 1, 0, 1, 2]]), (1, 5)).tolist()
[[0, 1, 0, 1, 2]]
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..limits import check_context
from ..loss import IGNORE_INDEX
from .config import EngineConfig

__all__ = ["check_inputs", "check_position_ids", "check_prompts", "pad_micro_batch"]


def check_inputs(config: EngineConfig, input_ids: Any, attention_mask: Any = None, labels: Any = None,
                 position_ids: Any = None) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """Validate a batch for a model of ``config``; returns the ids as int64 [batch, tokens], each
    sequence's length (a packed batch's: the whole row, which its examples' attention covers) and the
    position ids of packed rows (``check_position_ids``) as int64 [batch, tokens], or None."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must be [batch, tokens] with both at least 1, got {tuple(input_ids.shape)}")
    for name, value in (("input_ids", input_ids), ("attention_mask", attention_mask), ("labels", labels)):
        if isinstance(value, torch.Tensor) and value.is_meta:
            raise ValueError(f"{name} is on the meta device: it has a shape but no values; pass a tensor that "
                             "holds them (on the CPU)")
    ids = input_ids.detach().cpu().long()
    batch, tokens = ids.shape
    c = config
    positions = None if position_ids is None else check_position_ids(position_ids, (batch, tokens))
    # packed rows: each example is numbered from 0, and the longest is what meets the context
    check_context(c.max_positions, tokens if positions is None else int(positions.max()) + 1)
    bad = (ids < 0) | (ids >= c.vocab)
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"token id {int(ids[where])} at {where} is outside the vocabulary [0, {c.vocab})")
    if attention_mask is None:
        lengths = [tokens] * batch
    else:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, tokens):
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"attention_mask must be a tensor shaped like input_ids {(batch, tokens)}, got {shape}")
        mask = attention_mask.detach().cpu().long()
        lengths = mask.sum(1).tolist()
        expected = torch.arange(tokens)[None, :] < torch.tensor(lengths)[:, None]
        if not torch.equal(mask.bool(), expected) or ((mask != 0) & (mask != 1)).any():
            raise ValueError("attention_mask must right-pad: each row ones, then zeros (BitNetEngine does not "
                             "take left padding or holes)")
        if min(lengths) == 0:
            raise ValueError("attention_mask has a row with no tokens")
    if labels is not None:
        if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (batch, tokens):
            shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels)
            raise ValueError(f"labels must be a tensor shaped like input_ids {(batch, tokens)}, got {shape}")
        lab = labels.detach().cpu().long()
        bad = (lab != IGNORE_INDEX) & ((lab < 0) | (lab >= c.vocab))
        if bad.any():
            raise ValueError(f"labels hold {int(lab[bad][0])}, neither -100 nor a token id in [0, {c.vocab})")
    if positions is not None:
        lengths = [tokens] * batch  # the padding is one more example: attention runs over whole rows
    return ids, lengths, positions


def pad_micro_batch(batch: dict[str, torch.Tensor], rows: int, tokens: int) -> tuple[torch.Tensor | None, ...]:
    """A micro-batch right-padded to [rows, tokens]: extra rows are one padding token, unlabelled.
    Its ids, attention mask, labels and, for packed rows, position ids (the added padding one more
    example, an added row one example)."""
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    r, t = ids.shape
    out_ids = torch.zeros(rows, tokens, dtype=torch.long)
    out_mask = torch.zeros(rows, tokens, dtype=torch.long)
    out_labels = torch.full((rows, tokens), IGNORE_INDEX, dtype=torch.long)
    out_ids[:r, :t], out_mask[:r, :t], out_labels[:r, :t] = ids, mask, labels
    out_mask[r:, 0] = 1  # an empty row is one (unlabelled) token
    positions = batch.get("position_ids")
    if positions is None:
        return out_ids, out_mask, out_labels, None
    out_positions = torch.arange(tokens).repeat(rows, 1)
    out_positions[:r, :t] = check_position_ids(positions, (r, t))
    out_positions[:r, t:] = torch.arange(tokens - t)
    return out_ids, out_mask, out_labels, out_positions


def check_position_ids(position_ids: Any, shape: tuple[int, int]) -> torch.Tensor:
    """``position_ids`` of packed rows shaped ``shape`` = (batch, tokens) (or (1, tokens), for every
    row, as transformers broadcasts it), as int64 [batch, tokens]: each row the position ids of its
    examples one after another, each counting 0, 1, … ValueError naming the row and column where a
    row is not of that form (starts past 0, jumps, or goes back to anything but 0).

    >>> check_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]), (1, 6)).tolist()
    [[0, 1, 2, 0, 1, 0]]
    """
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids must be a torch.Tensor, got {type(position_ids).__name__}")
    if position_ids.is_meta:
        raise ValueError("position_ids is on the meta device: it has a shape but no values")
    if position_ids.dtype.is_floating_point or position_ids.dtype.is_complex or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must hold integers, got dtype {position_ids.dtype}")
    if tuple(position_ids.shape) not in (shape, (1, shape[1])):
        raise ValueError(f"position_ids must be shaped like input_ids {shape}, got {tuple(position_ids.shape)}")
    positions = position_ids.detach().cpu().long().expand(shape)
    starts = positions[:, 0] != 0
    if starts.any():
        row = int(starts.nonzero()[0])
        raise ValueError(f"position_ids row {row} starts at {int(positions[row, 0])}: a packed row's position ids "
                         "count 0, 1, ... within each example, from its first token")
    before, after = positions[:, :-1], positions[:, 1:]
    bad = (after != before + 1) & (after != 0)
    if bad.any():
        row, column = (int(x) for x in bad.nonzero()[0])
        was, now = int(before[row, column]), int(after[row, column])
        how = f"jumps from {was} to {now}" if now > was else f"goes from {was} back to {now}, not to 0"
        raise ValueError(f"position_ids row {row}, column {column + 1}: {how}; a packed row's position ids count "
                         "0, 1, ... within each example and restart at 0 where the next example starts")
    return positions.contiguous()


def check_prompts(prompts: Sequence[Sequence[int]], vocab: int) -> None:
    """ValueError unless ``prompts`` holds at least one prompt and each is 1 or more token ids in
    [0, ``vocab``), naming the first that is not."""
    if not prompts:
        raise ValueError("no prompts to generate for: the list is empty")
    for number, prompt in enumerate(prompts):
        if not len(prompt) or not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt {number} must be 1 or more token ids in [0, {vocab}), got {list(prompt)[:8]}"
                             + ("..." if len(prompt) > 8 else ""))
