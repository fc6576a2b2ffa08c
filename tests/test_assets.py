"""The bundled instruction dataset ships with the package and is well-formed."""

import json
from importlib import resources

from torch_wgpu_lora.prompts import format_prompt


def load_records():
    text = (resources.files("torch_wgpu_lora") / "assets" / "alpaca_demo.json").read_text(encoding="utf-8")
    return json.loads(text)


def test_alpaca_demo_records_are_well_formed():
    records = load_records()
    assert isinstance(records, list) and 30 <= len(records) <= 60
    for i, record in enumerate(records):
        assert isinstance(record, dict) and set(record) == {"instruction", "input", "output"}, i
        assert all(isinstance(v, str) for v in record.values()), i
        assert record["instruction"].strip() and record["output"].strip(), i
        assert record["input"] == record["input"].strip() and record["output"] == record["output"].strip(), i
        # Short outputs let a tiny model's loss fall visibly within the CPU demo's few minutes.
        assert len(record["output"]) <= 120, (i, record["output"])
        format_prompt(record["instruction"], record["input"])


def test_alpaca_demo_is_varied():
    records = load_records()
    with_input = [r for r in records if r["input"]]
    assert 5 <= len(with_input) <= len(records) - 5, "mix records with and without input"
    keys = [(r["instruction"], r["input"]) for r in records]
    assert len(set(keys)) == len(keys), "duplicate records"
