"""Training data in the forms TRL's SFT data takes: read, tokenise with loss masks, pack, order, batch.

>>> records = read_records([{"instruction": "Say hi.", "output": "Hi!"}])
>>> records[0]
{'instruction': 'Say hi.', 'input': '', 'output': 'Hi!'}

**Forms** (``record_form``), told apart by their fields (the first that fits):

* chat, ``{"messages": [{"role", "content"}, ...]}``: rendered with the tokenizer's chat
  template; the loss covers the assistant turns only (each turn's tokens, from the end of
  the generation prompt to the end of the turn as the template renders it);
* prompt / completion, ``{"prompt", "completion"}``: strings (the prompt encoded with the
  tokenizer's default special tokens, then the completion and EOS, the loss on those), or
  lists of messages (a chat whose loss covers the completion's assistant turns);
* plain text, ``{"text"}``: encoded with the default special tokens, then EOS; the loss covers
  every token;
* Alpaca, ``{"instruction", "input" (optional), "output"}``: the prompt
  (``prompts.format_prompt``, encoded as generation encodes it), the response and EOS; the
  loss covers the response and EOS.

A record that fits no form is an error naming its number and its fields.

**Inputs** (``read_records``): a path to a JSON array or JSONL file (read here, errors naming
the line or record; a key given twice in one object is refused), or to a Parquet, CSV or TSV
file (read with ``datasets``); a ``datasets.Dataset``; a list or any iterable of dicts.
Everything is read and checked before anything is trained on, and a record that cannot become
a training example (no form, a field of the wrong type or missing, a chat the template cannot
render) is refused naming where it came from (``Records.origins``: the file's line or record
number, or the record's index) and why. A CSV or TSV cell is the text it holds (``"NA"``,
``"null"``, ``"007"`` included: every column is read as text); only the cell texts in
``na_values`` (by default the empty cell) are missing, as JSON's null is.

Sequences longer than ``max_length`` are cut at the end; one left with nothing to learn is
dropped with a warning. A sequence still longer than the model's context
(``max_position_embeddings``) is refused, naming the record, unless
``long_examples="truncate"``, which cuts it to the context and warns with the count. Batches
hold whole sequences, right-padded, with an attention mask; the order of examples is a seeded
permutation per epoch (``epoch_order``), optionally grouped by length
(``length_grouped_order``). **Packing** (``pack``) puts several examples into one sequence of
at most ``max_length`` tokens; its ``position_ids`` restart at 0 for each example, which tells
transformers' masks, and ``BitNetEngine``, to attend within each example only.

Data-parallel training (several processes): every process computes the same epoch order and
takes its ``shard`` of it, dealt out as torch's ``DistributedSampler`` deals indices.
"""

from __future__ import annotations

import csv
import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..limits import check_context
from ..loss import IGNORE_INDEX
from ..prompts import check_unicode, format_prompt

__all__ = ["FORMS", "LONG_EXAMPLES", "Example", "Records", "collate", "encode_records", "epoch_order",
           "length_grouped_order", "pack", "read_records", "record_form", "shard"]

LONG_EXAMPLES = ("refuse", "truncate")  # what encode_records does with a sequence longer than the context

# Each form by the fields that identify it, in the order records are matched against them.
FORMS = {"chat": ("messages",), "prompt-completion": ("prompt", "completion"), "text": ("text",),
         "alpaca": ("instruction", "output")}
_TABLE_FORMATS = {".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}  # files read through ``datasets``

Record = dict[str, Any]


class Records(list):
    """``read_records``' result: the checked records, and where each came from (``origins[i]``, e.g.
    "train.jsonl, line 7" or "record 3"), which ``encode_records`` names in its refusals."""

    def __init__(self, records: Iterable[Record], origins: Iterable[str]) -> None:
        super().__init__(records)
        self.origins = list(origins)
        if len(self.origins) != len(self):
            raise ValueError(f"{len(self)} records and {len(self.origins)} origins")


@dataclass(frozen=True)
class Example:
    """One tokenised sequence and its labels (-100 where there is no loss). A packed sequence
    (``pack``) also has ``position_ids``, restarting at 0 where each of its examples starts."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None

    @property
    def loss_tokens(self) -> int:
        """Positions the loss covers (each label is predicted from the token before it)."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


def _text(record: Mapping[str, Any], key: str, where: str, optional: bool = False) -> str:
    value = record.get(key)
    if value is None and optional:
        value = ""
    if value is None:
        raise ValueError(f"{where}: {key!r} is missing (null, or an empty cell)")
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    return check_unicode(value, f"{where}: {key!r}")


def _messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{where}: {key!r} must be a non-empty list of messages {{role, content}}, got "
                         f"{type(value).__name__}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            fields = sorted(message) if isinstance(message, Mapping) else type(message).__name__
            raise ValueError(f"{where}: {key}[{i}] must be a message {{role, content}}, got {fields}")
        role = _text(message, "role", f"{where}: {key}[{i}]")
        if not role.strip():
            raise ValueError(f"{where}: {key}[{i}]: 'role' is empty")
        out.append({"role": role, "content": _text(message, "content", f"{where}: {key}[{i}]")})
    return out


def record_form(record: Any, where: str) -> str:
    """The form of ``record`` (a key of ``FORMS``); ValueError naming ``where`` and the record's fields
    when it fits none."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    for form, keys in FORMS.items():
        if any(key in record for key in keys):
            missing = [key for key in keys if key not in record]
            if missing:
                raise ValueError(f"{where}: the record has no {missing[0]!r} (keys: {sorted(record)})")
            return form
    raise ValueError(f"{where}: the record fits no form of training data; its fields are {sorted(record)}. The forms: "
                     "chat {messages}, {prompt, completion}, {text}, Alpaca {instruction, input?, output}")


def _check_record(record: Any, where: str) -> Record:
    form = record_form(record, where)
    if form == "chat":
        messages = _messages(record["messages"], where, "messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: the conversation has no assistant message: nothing to learn")
        return {"messages": messages}
    if form == "prompt-completion":
        if isinstance(record["prompt"], str) or isinstance(record["completion"], str):
            return {"prompt": _text(record, "prompt", where), "completion": _text(record, "completion", where)}
        completion = _messages(record["completion"], where, "completion")
        if not any(m["role"] == "assistant" for m in completion):
            raise ValueError(f"{where}: the completion has no assistant message: nothing to learn")
        return {"prompt": _messages(record["prompt"], where, "prompt"), "completion": completion}
    if form == "text":
        text = _text(record, "text", where)
        if not text.strip():
            raise ValueError(f"{where}: 'text' is empty")
        return {"text": text}
    out = {key: _text(record, key, where, optional=key == "input") for key in ("instruction", "input", "output")}
    if not out["instruction"].strip():
        raise ValueError(f"{where}: 'instruction' is empty")
    return out


class _KeyedTwice(dict):
    """A JSON object that gives ``twice`` more than once (Python's reader would keep the last value)."""

    twice: str


def _json(text: str) -> Any:
    """``text`` parsed as JSON, each object that gives a key twice a ``_KeyedTwice``."""
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in items]
        twice = next((key for key in keys if keys.count(key) > 1), None)
        if twice is None:
            return dict(items)
        marked = _KeyedTwice(items)
        marked.twice = twice
        return marked

    return json.loads(text, object_pairs_hook=pairs)


def _checked_json(item: Any, where: str) -> Record:
    """A record parsed by ``_json``, checked; a key given twice anywhere in it is refused."""
    stack = [item]
    while stack:
        value = stack.pop()
        if isinstance(value, _KeyedTwice):
            raise ValueError(f"{where}: the key {value.twice!r} is given twice in one object")
        stack.extend(value.values() if isinstance(value, dict) else value if isinstance(value, list) else ())
    return _check_record(item, where)


def _read_json(path: Path) -> Records:
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark, as some editors write, is not JSON
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text: {err}") from None
    if text.lstrip().startswith("["):
        try:
            items = _json(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {err.lineno}: not valid JSON ({err.msg})") from None
        origins = [f"{path}, record {i}" for i in range(len(items))]
        return Records((_checked_json(item, where) for item, where in zip(items, origins)), origins)
    records, origins = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {lineno}"
        try:
            item = _json(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
        records.append(_checked_json(item, where))
        origins.append(where)
    return Records(records, origins)


def _read_table(path: Path, na_values: Sequence[str]) -> Records:
    """A Parquet, CSV or TSV file's rows, read with ``datasets`` (an optional dependency); a CSV or
    TSV file's columns as text, missing only where a cell's text is one of ``na_values``."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path}: reading {path.suffix} files needs the datasets package "
                         "(pip install 'torch_wgpu_lora[data]'), or give the data as JSON / JSONL") from None
    options: dict[str, Any] = {}
    if _TABLE_FORMATS[path.suffix] == "csv":
        delimiter = "\t" if path.suffix == ".tsv" else ","
        try:  # the header names the columns, each read as text (pandas would guess numbers, and NaN for "NA")
            with path.open(encoding="utf-8", newline="") as file:
                header = next(csv.reader(file, delimiter=delimiter), None)
        except (UnicodeDecodeError, csv.Error) as err:
            raise ValueError(f"{path}: its header line cannot be read ({err})") from None
        if not header:
            raise ValueError(f"{path} holds no header line naming its columns")
        if len(set(header)) != len(header):
            raise ValueError(f"{path}: the header names a column twice: {header}")
        options = dict(delimiter=delimiter, keep_default_na=False, na_values=list(na_values),
                       features=datasets.Features({column: datasets.Value("string") for column in header}))
    try:
        table = datasets.load_dataset(_TABLE_FORMATS[path.suffix], data_files=str(path), split="train", **options)
    except Exception as err:  # datasets raises many kinds for a damaged file; each is this file's problem
        raise ValueError(f"{path} could not be read as {_TABLE_FORMATS[path.suffix]}: {err}") from None
    origins = [f"{path}, record {i}" for i in range(len(table))]
    return Records((_check_record(row, where) for row, where in zip(table, origins)), origins)


def read_records(source: Any, na_values: Sequence[str] = ("",)) -> Records:
    """All records of ``source``, each checked and normalised (see the module docstring for the forms),
    with where each came from (``Records.origins``).

    ``source``: a path to a JSON array, JSONL, Parquet, CSV or TSV file; a ``datasets.Dataset``; a
    list or any iterable of dicts. For Alpaca records ``input`` may be missing or null (read as "");
    keys outside the record's form are ignored. ``na_values``: a CSV or TSV file's cell texts that
    are missing values (default: the empty cell; ``("", "NA", "null")`` reads those as pandas
    would); every other cell is its text.
    """
    if isinstance(na_values, str) or not all(isinstance(v, str) for v in na_values):
        raise TypeError(f"na_values must be a list of cell texts, got {na_values!r}")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"no data file at {path}")
        records = _read_table(path, na_values) if path.suffix.lower() in _TABLE_FORMATS else _read_json(path)
        name = str(path)
    elif isinstance(source, Iterable) and not isinstance(source, (Mapping, bytes)):
        items = list(source)
        origins = [f"record {i}" for i in range(len(items))]
        records = Records((_check_record(item, where) for item, where in zip(items, origins)), origins)
        name = "the data"
    else:
        raise TypeError("data must be a path to a JSON/JSONL/Parquet/CSV file, a datasets.Dataset or a list of "
                        f"records, got {type(source).__name__}")
    if not records:
        raise ValueError(f"{name} holds no records")
    return records


def _chat_tokens(tokenizer: Any, messages: list[dict[str, str]], first: int, where: str) -> tuple[list[int], list[int]]:
    """A conversation's tokens as the chat template renders it, and labels on its assistant turns
    from message ``first`` on.

    Each turn's text is found by rendering the conversation up to it (with the generation prompt)
    and up to its end: both must start the whole conversation's text. A token is labelled when
    any of its characters lies in a turn (as transformers' assistant masks count them)."""
    def render(part: list[dict[str, str]], prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)
        except Exception as err:  # the template is the tokenizer's code: any error is its refusal of this chat
            raise ValueError(f"{where}: the tokenizer's chat template cannot render the conversation "
                             f"({type(err).__name__}: {err})") from None

    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{where}: chat records are rendered with the tokenizer's chat template, and this tokenizer "
                         "has none (set tokenizer.chat_template)")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{where}: chat records need a fast tokenizer (its offsets say which tokens are the "
                         "assistant's)")
    text = render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < first:
            continue
        start, end = render(messages[:i], prompt=True), render(messages[: i + 1])
        if not text.startswith(start) or not text.startswith(end):
            raise ValueError(f"{where}: the chat template renders the conversation up to message {i} as other text "
                             "than the start of the whole conversation, so its assistant turns cannot be told apart")
        spans.append((len(start), len(end)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [token if any(a < e and b > s for s, e in spans) else IGNORE_INDEX
              for token, (a, b) in zip(ids, encoded["offset_mapping"])]
    return ids, labels


def _tokens(tokenizer: Any, record: Record, where: str) -> tuple[list[int], list[int]]:
    """A record's whole sequence and its labels, before truncation."""
    eos = tokenizer.eos_token_id
    if "messages" in record:
        return _chat_tokens(tokenizer, record["messages"], 0, where)
    if "text" in record:
        ids = tokenizer(record["text"])["input_ids"] + [eos]
        return ids, list(ids)
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            return _chat_tokens(tokenizer, record["prompt"] + record["completion"], len(record["prompt"]), where)
        prompt, completion = record["prompt"], record["completion"]
    else:
        prompt, completion = format_prompt(record["instruction"], record["input"]), record["output"]
    prompt_ids = tokenizer(prompt)["input_ids"]
    response = tokenizer(completion, add_special_tokens=False)["input_ids"] + [eos]
    return prompt_ids + response, [IGNORE_INDEX] * len(prompt_ids) + response


def encode_records(tokenizer: Any, records: list[Record], max_length: int = 512, context: int | None = None,
                   long_examples: str = "refuse") -> list[Example]:
    """Tokenise ``records`` (``read_records``' output) into ``Example``s with loss masks, cut to
    ``max_length`` tokens.

    ``context``: the model's (``limits.model_context``; None: no limit). A sequence longer than it
    is refused (``long_examples="refuse"``, naming the record) or cut to it (``"truncate"``, with a
    warning that counts them). Records left with no labelled token after truncation are dropped
    (with a warning).
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length must be an integer >= 2, got {max_length!r}")
    if long_examples not in LONG_EXAMPLES:
        raise ValueError(f"long_examples must be one of {LONG_EXAMPLES}, got {long_examples!r}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id; training appends EOS to every response")
    examples, dropped, cut = [], [], 0
    for index, record in enumerate(records):
        where = records.origins[index] if isinstance(records, Records) else f"record {index}"
        ids, labels = _tokens(tokenizer, record, where)
        length = min(len(ids), max_length)
        if context is not None and length > context:
            if long_examples == "refuse":
                try:
                    check_context(context, length)
                except ValueError as err:
                    raise ValueError(f"{where}: {err}; long_examples='truncate' (--long-examples truncate) "
                                     "cuts such records to the context") from None
            length, cut = context, cut + 1
        # The first token is predicted from nothing: never a label (nor, packed, from the example before it).
        example = Example(input_ids=ids[:length], labels=[IGNORE_INDEX, *labels[1:length]])
        if example.loss_tokens == 0:
            dropped.append(where)
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
        named = "; ".join(dropped[:3]) + ("; ..." if len(dropped) > 3 else "")
        warnings.warn(f"{len(dropped)} of {len(records)} records were dropped ({named}): their prompt fills {kept} "
                      "tokens, leaving no response to learn", stacklevel=2)
    return examples


def pack(examples: Sequence[Example], max_length: int) -> list[Example]:
    """Examples packed into sequences of at most ``max_length`` tokens, first-fit decreasing (longest
    first, each into the first sequence with room, as TRL's "bfd" packing fills them); each
    sequence's ``position_ids`` restart at 0 where each of its examples starts.

    >>> packed = pack([Example([5, 6, 7], [-100, 6, 7]), Example([8, 9], [-100, 9]), Example([4], [-100])], 5)
    >>> [(p.input_ids, p.position_ids) for p in packed]
    [([5, 6, 7, 8, 9], [0, 1, 2, 0, 1]), ([4], [0])]
    """
    bins: list[list[Example]] = []
    room: list[int] = []
    for example in sorted(examples, key=lambda e: -len(e.input_ids)):  # a stable sort: ties keep data order
        if len(example.input_ids) > max_length:
            raise ValueError(f"an example of {len(example.input_ids)} tokens does not fit max_length={max_length}")
        for i, free in enumerate(room):
            if free >= len(example.input_ids):
                bins[i].append(example)
                room[i] -= len(example.input_ids)
                break
        else:
            bins.append([example])
            room.append(max_length - len(example.input_ids))
    return [Example(input_ids=[t for e in group for t in e.input_ids], labels=[t for e in group for t in e.labels],
                    position_ids=[i for e in group for i in range(len(e.input_ids))]) for group in bins]


def collate(examples: Sequence[Example], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad whole sequences into ``input_ids``, ``attention_mask`` and ``labels`` [batch, longest]
    (and ``position_ids`` for packed sequences: the padding continues as one more example).

    >>> batch = collate([Example([5, 6, 7], [-100, 6, 7]), Example([5, 8], [-100, 8])], pad_token_id=2)
    >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["labels"].tolist()
    ([[5, 6, 7], [5, 8, 2]], [[1, 1, 1], [1, 1, 0]], [[-100, 6, 7], [-100, 8, -100]])
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    packed = [e.position_ids is not None for e in examples]
    if any(packed) and not all(packed):
        raise ValueError("collate takes packed sequences or unpacked examples, not both in one batch")
    length = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        attention_mask[row, :n] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if all(packed):
        position_ids = torch.zeros((len(examples), length), dtype=torch.long)
        for row, e in enumerate(examples):
            n = len(e.input_ids)
            position_ids[row, :n] = torch.tensor(e.position_ids)
            position_ids[row, n:] = torch.arange(length - n)
        batch["position_ids"] = position_ids
    return batch


def epoch_order(num_examples: int, epoch: int, seed: int) -> np.ndarray:
    """The order of examples in ``epoch``: a permutation fixed by (seed, epoch) alone,
    so a resumed run needs only the epoch and its position in it.

    >>> sorted(epoch_order(5, epoch=0, seed=1).tolist())
    [0, 1, 2, 3, 4]
    """
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def length_grouped_order(lengths: Sequence[int], batch_size: int, epoch: int, seed: int) -> np.ndarray:
    """``epoch_order`` with examples of similar length brought together, so that batches waste less
    padding: the order is cut into megabatches of up to 50 batches (transformers'
    ``LengthGroupedSampler`` rule: fewer when the data is small), each sorted longest first, and the
    longest example of all leads, so that a first step that does not fit shows at once.

    >>> order = length_grouped_order([3, 9, 1, 8, 2, 7], batch_size=2, epoch=0, seed=0)
    >>> int(order[0]), sorted(order.tolist())
    (1, [0, 1, 2, 3, 4, 5])
    """
    order = epoch_order(len(lengths), epoch, seed)
    lengths = np.asarray(lengths)
    megabatch = max(1, min(len(lengths) // (4 * batch_size), 50)) * batch_size
    groups = [sorted(order[i:i + megabatch].tolist(), key=lambda j: -lengths[j])
              for i in range(0, len(order), megabatch)]
    grouped = np.array([j for group in groups for j in group])
    longest = int(np.argmax(lengths[grouped]))
    grouped[[0, longest]] = grouped[[longest, 0]]
    return grouped


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
