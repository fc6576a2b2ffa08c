"""Generation for every record of a JSONL file of prompts, ``batch_size`` at once, into a JSONL file
of results or standard output (``torch-wgpu-lora generate --prompts-file IN.jsonl [--output OUT.jsonl]``).

Each record of IN is a JSON object with one of:

* ``"instruction"`` (and optionally ``"input"``): an Alpaca record, always in the template;
* ``"prompt"``: text, in the template unless ``use_template=False`` (``--no-template``);
* ``"messages"``: chat messages (``{"role", "content"}`` objects), in the tokenizer's chat template.

Its other fields ride along: record i of OUT is record i of IN with ``"generated_text"`` added.
Every record goes to one ``generation.generate`` call: on the engine, ``batch_size`` prompts decode
at once and a finished one's row takes the next (continuous batching, ``engine.generate``), so
records complete out of order; each is written once every record before it is. Without OUT,
records go to standard output as soon as they can. OUT is rewritten whole (temp + rename,
``files.write_atomic``) each time ``batch_size`` more records can go in, and when the run ends,
however it ends (an exception, Ctrl-C), so OUT holds whole records, in order; a later run with the
same IN and OUT continues after them (each line checked against its record first). Record i draws
with ``seed + i``, so a resumed run gives what an uninterrupted one gives (greedy: whatever the
seed; ``engine.generate``: a prompt's tokens do not depend on its row or its neighbours).

>>> # done, new = generate_file(engine, tokenizer, "prompts.jsonl", "out.jsonl", batch_size=64, max_new_tokens=64)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from .files import write_atomic
from .generation import Prompt, generate
from .limits import SEED_LIMIT, check_seed

__all__ = ["OUTPUT_FIELD", "PROMPT_FIELDS", "generate_file", "read_prompt_records"]

OUTPUT_FIELD = "generated_text"
PROMPT_FIELDS = ("instruction", "prompt", "messages")


def _lines(text: str) -> list[str]:
    """JSON Lines' lines of ``text``, each with its "\\n" (the last may lack it): split at "\\n" only,
    not at the other breaks ``str.splitlines`` knows (U+2028, which JSON strings may hold as it is)."""
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def read_prompt_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of the JSONL file ``path`` (blank lines skipped), each checked to hold one prompt;
    ValueError naming the file and line of a bad one."""
    records = []
    text = Path(path).read_text(encoding="utf-8")
    for number, line in enumerate(_lines(text), 1):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where} is not JSON: {err.msg}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where} is not a JSON object")
        kinds = [field for field in PROMPT_FIELDS if field in record]
        if len(kinds) != 1:
            raise ValueError(f"{where} needs exactly one of {', '.join(PROMPT_FIELDS)}; it has "
                             f"{', '.join(kinds) or 'none'}")
        if OUTPUT_FIELD in record:
            raise ValueError(f"{where} already has a {OUTPUT_FIELD!r} field, which the output adds")
        _check_prompt(record, kinds[0], where)
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def _check_prompt(record: dict[str, Any], kind: str, where: str) -> None:
    """ValueError naming ``where`` unless the record's prompt has the right types."""
    value = record[kind]
    if kind == "messages":
        if not isinstance(value, list) or not value or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value):
            raise ValueError(f"{where}: messages must be a non-empty list of objects with string 'role' and "
                             "'content'")
        return
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: {kind} must be a non-empty string")
    if kind == "instruction" and not isinstance(record.get("input", ""), str):
        raise ValueError(f"{where}: input must be a string")


def _prompt(record: dict[str, Any]) -> Prompt:
    """What ``generation.generate`` takes for a record (it checks the values)."""
    if "instruction" in record:
        return {key: record[key] for key in ("instruction", "input") if key in record}
    return record["prompt"] if "prompt" in record else record["messages"]


def _done(output: Path, prompts: Path, records: list[dict[str, Any]]) -> str:
    """What an earlier run left in ``output``: its lines, each the result of the record of its number."""
    if not output.exists():
        return ""
    text = output.read_text(encoding="utf-8")
    lines = _lines(text)
    if len(lines) > len(records):
        raise ValueError(f"{output} holds {len(lines)} records, more than the {len(records)} of {prompts}: it is the "
                         "output of other prompts; choose another --output, or remove it to start over")
    for number, (line, record) in enumerate(zip(lines, records), 1):
        try:
            result = json.loads(line) if line.endswith("\n") else None
        except json.JSONDecodeError:
            result = None
        if not isinstance(result, dict) or OUTPUT_FIELD not in result or \
                {k: v for k, v in result.items() if k != OUTPUT_FIELD} != record:
            raise ValueError(f"{output}: line {number} is not the result of record {number} of {prompts}: it is the "
                             "output of other prompts; choose another --output, or remove it to start over")
    return text


def generate_file(model: Any, tokenizer: Any, prompts: str | os.PathLike, output: str | os.PathLike | None, *,
                  batch_size: int = 8, progress: bool = True, seed: int | None = None,
                  **options: Any) -> tuple[int, int]:
    """Generate for every record of ``prompts`` not yet in ``output`` (the module docstring),
    ``batch_size`` records at once (``generation.generate``'s ``batch_size``; ``options``: its other
    settings); returns (records in ``output``, records generated by this call). ``output`` None:
    every record, to standard output. ``progress``: a progress bar on stderr."""
    from tqdm.auto import tqdm

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    check_seed(seed)
    prompts = Path(prompts)
    records = read_prompt_records(prompts)
    output = None if output is None else Path(output)
    text = "" if output is None else _done(output, prompts, records)
    first = len(_lines(text))
    base = int(torch.randint(0, SEED_LIMIT, (), dtype=torch.int64)) if seed is None else seed
    results: dict[int, str] = {}  # generated, not yet written: by record number
    written, unsaved = first, 0  # records in order so far; of them, not yet in OUT

    def save() -> None:
        nonlocal unsaved
        if output is not None and unsaved:
            write_atomic(output, text.encode("utf-8"))
            unsaved = 0

    def on_result(index: int, generated: str) -> None:
        """Record ``first + index`` is done: write every record that now has all before it done."""
        nonlocal text, written, unsaved
        bar.update(1)
        results[first + index] = generated
        lines = ""
        while written in results:
            lines += json.dumps({**records[written], OUTPUT_FIELD: results.pop(written)}, ensure_ascii=False) + "\n"
            written += 1
        if lines and output is None:
            sys.stdout.write(lines)
            sys.stdout.flush()
        elif lines:
            text += lines
            unsaved += lines.count("\n")
            if unsaved >= batch_size:
                save()

    with tqdm(total=len(records), initial=first, desc="generating", unit="record", disable=not progress) as bar:
        if first < len(records):
            try:
                generate(model, tokenizer, [_prompt(r) for r in records[first:]], seed=(base + first) % SEED_LIMIT,
                         batch_size=batch_size, on_result=on_result, **options)
            finally:  # what is done in order goes into OUT, however the run ends
                save()
    return len(records), len(records) - first
