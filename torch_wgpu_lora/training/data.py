"""Alpaca-style instruction data: read, tokenise with loss masks, shuffle, batch.

>>> records = read_records([{"instruction": "Say hi.", "output": "Hi!"}])
>>> records[0]
{'instruction': 'Say hi.', 'input': '', 'output': 'Hi!'}

Records are ``{"instruction", "input" (optional), "output"}``, from a JSON array, a
JSONL file (one record a line) or a list of dicts. A file is read and checked whole
before anything is trained on it; the first problem raises ``ValueError`` naming the
line (JSONL) or record (JSON array).

Each record becomes one sequence: the prompt (``prompts.format_prompt``, encoded as
generation encodes it, with the tokenizer's default special tokens such as BOS), the
response (no special tokens) and EOS. Labels are -100 on the prompt, so the loss
covers only the response and EOS. Sequences longer than ``max_length`` are cut at
the end; one whose prompt alone fills ``max_length`` has nothing to learn and is
dropped with a warning. A sequence still longer than the model's context
(``max_position_embeddings``) is refused, naming the record, unless
``long_examples="truncate"``, which cuts it to the context and warns with the count.
Batches hold whole sequences, right-padded, with an attention mask; the order of
examples is a seeded permutation per epoch.

Data-parallel training (several processes): every process computes the same epoch order and
takes its ``shard`` of it, dealt out as torch's ``DistributedSampler`` deals indices.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..limits import check_context
from ..loss import IGNORE_INDEX
from ..prompts import check_unicode, format_prompt

__all__ = ["LONG_EXAMPLES", "Example", "collate", "encode_records", "epoch_order", "read_records", "shard"]

LONG_EXAMPLES = ("refuse", "truncate")  # what encode_records does with a sequence longer than the context

Records = list[dict[str, str]]


@dataclass(frozen=True)
class Example:
    """One tokenised sequence and its labels (-100 where there is no loss)."""

    input_ids: list[int]
    labels: list[int]

    @property
    def loss_tokens(self) -> int:
        """Positions the loss covers (each label is predicted from the token before it)."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


def _check_record(record: Any, where: str) -> dict[str, str]:
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    for key in ("instruction", "output"):
        if key not in record:
            raise ValueError(f"{where}: the record has no {key!r} (keys: {sorted(record)})")
    out = {}
    for key in ("instruction", "input", "output"):
        value = record.get(key, "")
        if value is None and key == "input":
            value = ""
        if not isinstance(value, str):
            raise ValueError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
        out[key] = check_unicode(value, f"{where}: {key!r}")
    if not out["instruction"].strip():
        raise ValueError(f"{where}: 'instruction' is empty")
    return out


def _read_file(path: Path) -> Records:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text: {err}") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {err.lineno}: not valid JSON ({err.msg})") from None
        return [_check_record(item, f"{path}, record {i}") for i, item in enumerate(items)]
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {lineno}: not valid JSON ({err.msg})") from None
        records.append(_check_record(item, f"{path}, line {lineno}"))
    return records


def read_records(source: str | os.PathLike | Sequence[Mapping[str, Any]]) -> Records:
    """All records of a JSON array or JSONL file, or of a list of dicts, checked.

    ``input`` may be missing or null (read as ""); other keys are ignored.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"no data file at {path}")
        records = _read_file(path)
        name = str(path)
    elif isinstance(source, Sequence):
        records = [_check_record(item, f"record {i}") for i, item in enumerate(source)]
        name = "the data"
    else:
        raise TypeError(f"data must be a path to a JSON/JSONL file or a list of records, got {type(source).__name__}")
    if not records:
        raise ValueError(f"{name} holds no records")
    return records


def encode_records(tokenizer: Any, records: Records, max_length: int = 512, context: int | None = None,
                   long_examples: str = "refuse") -> list[Example]:
    """Tokenise ``records`` into ``Example``s with loss masks, cut to ``max_length`` tokens.

    ``context``: the model's (``limits.model_context``; None: no limit). A sequence longer than it
    is refused (``long_examples="refuse"``, naming the record) or cut to it (``"truncate"``, with a
    warning that counts them). Records left with no response token after truncation are dropped
    (with a warning).
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length must be an integer >= 2, got {max_length!r}")
    if long_examples not in LONG_EXAMPLES:
        raise ValueError(f"long_examples must be one of {LONG_EXAMPLES}, got {long_examples!r}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; training appends EOS to every response")
    examples, dropped, cut = [], 0, 0
    for index, record in enumerate(records):
        prompt = tokenizer(format_prompt(record["instruction"], record["input"]))["input_ids"]
        response = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + [eos]
        length = min(len(prompt) + len(response), max_length)
        if context is not None and length > context:
            if long_examples == "refuse":
                try:
                    check_context(context, length)
                except ValueError as err:
                    raise ValueError(f"record {index}: {err}; long_examples='truncate' (--long-examples truncate) "
                                     "cuts such records to the context") from None
            length, cut = context, cut + 1
        example = Example(input_ids=(prompt + response)[:length],
                          labels=([IGNORE_INDEX] * len(prompt) + response)[:length])
        if example.loss_tokens == 0:
            dropped += 1
            continue
        examples.append(example)
    kept = f"max_length={max_length}"
    if context is not None and long_examples == "truncate" and context < max_length:
        kept += f" (cut to the model's context of {context} positions)"
    if not examples:
        raise ValueError(f"every record's prompt fills {kept} tokens: nothing to train on")
    if cut:
        warnings.warn(f"{cut} of {len(records)} records were cut to the model's context of {context} positions "
                      "(long_examples='truncate')", stacklevel=2)
    if dropped:
        warnings.warn(f"{dropped} of {len(records)} records were dropped: their prompt fills {kept} tokens, "
                      "leaving no response to learn", stacklevel=2)
    return examples


def collate(examples: Sequence[Example], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad whole sequences into ``input_ids``, ``attention_mask`` and ``labels`` [batch, longest].

    >>> batch = collate([Example([5, 6, 7], [-100, 6, 7]), Example([5, 8], [-100, 8])], pad_token_id=2)
    >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["labels"].tolist()
    ([[5, 6, 7], [5, 8, 2]], [[1, 1, 1], [1, 1, 0]], [[-100, 6, 7], [-100, 8, -100]])
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    length = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def epoch_order(num_examples: int, epoch: int, seed: int) -> np.ndarray:
    """The order of examples in ``epoch``: a permutation fixed by (seed, epoch) alone,
    so a resumed run needs only the epoch and its position in it.

    >>> sorted(epoch_order(5, epoch=0, seed=1).tolist())
    [0, 1, 2, 3, 4]
    """
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def shard(order: Sequence[int] | np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Process ``rank``'s share of ``order`` among ``world_size`` processes, as torch's
    ``DistributedSampler`` deals it: ``order`` is padded by wrapping around to a multiple of
    ``world_size`` (so every process gets ceil(n / world_size) examples and takes the same
    number of steps), then dealt round-robin (``padded[rank::world_size]``).

    Dealing round-robin keeps steps equal across world sizes: the first k examples of each of
    W shards are the first W·k examples of ``order``, so W processes with batch k train each
    step on the examples one process with batch W·k would (when W·k divides the epoch; only
    an epoch's last, short step can differ: the shards' padding repeats its first examples).

    >>> shard(np.arange(5), 0, 2).tolist(), shard(np.arange(5), 1, 2).tolist()
    ([0, 2, 4], [1, 3, 0])
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    order = np.asarray(order)
    if world_size == 1 or len(order) == 0:
        return order
    total = -(-len(order) // world_size) * world_size
    padded = np.resize(order, total)  # repeats order from its start: DistributedSampler's wrap-around padding
    return padded[rank::world_size]
