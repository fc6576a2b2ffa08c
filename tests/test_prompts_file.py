"""The prompts file's output when records complete out of order (the engine's continuous batching
ends them as their rows end): every record is written in input order once all before it are, OUT
is only ever rewritten whole with such a prefix, an interruption keeps what is done in order, and a
resumed run continues after it. ``generation.generate`` is replaced by one that completes records
in a chosen order, so the order is the test's, not a model's (tests/test_cli.py runs the real
one)."""

from __future__ import annotations

import io
import json

import pytest

import torch_wgpu_lora.prompts_file as prompts_file
from torch_wgpu_lora.prompts_file import OUTPUT_FIELD, generate_file

# record 1 holds a line separator (U+2028), which JSON keeps as it is (ensure_ascii=False) and which
# Python's str.splitlines would take for a line break
RECORDS = [{"prompt": f"prompt {i}" + ("\u2028two lines" if i == 1 else ""), "id": i} for i in range(7)]
ORDER = [2, 0, 4, 1, 3, 6, 5]  # the order the records complete in


def line(record: dict) -> str:
    return json.dumps({**record, OUTPUT_FIELD: record["prompt"].upper()}, ensure_ascii=False) + "\n"


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    return path


def completing(monkeypatch, calls: list, stop_after: int | None = None) -> None:
    """``generate`` completes its prompts in ``ORDER`` (of those it is given), calling ``on_result``
    for each; with ``stop_after``, a KeyboardInterrupt after that many. ``calls`` gets each call's
    (prompts, seed, batch_size)."""
    def generate(model, tokenizer, prompts, *, seed, batch_size, on_result, **options):
        calls.append((list(prompts), seed, batch_size))
        first = len(RECORDS) - len(prompts)
        for n, index in enumerate(i - first for i in ORDER if i >= first):
            on_result(index, prompts[index].upper())
            if n + 1 == stop_after:
                raise KeyboardInterrupt
        return [p.upper() for p in prompts]

    monkeypatch.setattr(prompts_file, "generate", generate)


class Written(io.StringIO):
    """Standard output that keeps each write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_records_completing_out_of_order_go_to_standard_output_in_order(monkeypatch, prompts):
    calls: list = []
    completing(monkeypatch, calls)
    stdout = Written()
    monkeypatch.setattr(prompts_file.sys, "stdout", stdout)
    assert generate_file(None, None, prompts, None, batch_size=3, progress=False, seed=5) == (7, 7)
    assert stdout.getvalue() == "".join(line(r) for r in RECORDS)
    # each record as soon as those before it are: 0; then 1 with 2; 3 with 4; 5 with 6
    assert [text.count("\n") for text in stdout.writes] == [1, 2, 2, 2]
    assert calls == [([r["prompt"] for r in RECORDS], 5, 3)]  # one call: every record, batch_size rows at once


def test_out_is_rewritten_whole_in_order_and_an_interrupted_run_resumes(monkeypatch, prompts, tmp_path):
    out = tmp_path / "out.jsonl"
    writes: list[str] = []
    real = prompts_file.write_atomic

    def recorded(path, data):
        writes.append(data.decode())
        real(path, data)

    monkeypatch.setattr(prompts_file, "write_atomic", recorded)
    calls: list = []
    completing(monkeypatch, calls, stop_after=4)  # 2, 0, 4, 1 done: 0, 1, 2 in order
    with pytest.raises(KeyboardInterrupt):
        generate_file(None, None, prompts, out, batch_size=2, progress=False, seed=5)
    full = "".join(line(r) for r in RECORDS)
    assert out.read_text(encoding="utf-8") == "".join(line(r) for r in RECORDS[:3])  # 0, then 1 with 2: one write
    assert writes == [out.read_text(encoding="utf-8")]
    assert [p.name for p in tmp_path.iterdir() if p.name != "prompts.jsonl"] == ["out.jsonl"]  # no temp file

    writes.clear()
    completing(monkeypatch, calls)
    assert generate_file(None, None, prompts, out, batch_size=2, progress=False, seed=5) == (7, 4)
    assert calls[-1] == ([r["prompt"] for r in RECORDS[3:]], 5 + 3, 2)  # record i still draws with seed + i
    assert out.read_text(encoding="utf-8") == full
    assert all(full.startswith(text) for text in writes)
    # rewritten each time 2 or more records can go in: 3 and 4 (done in that order), then 5 and 6
    assert [text.count("\n") for text in writes] == [5, 7]
