"""Alpaca data: reading JSON/JSONL with located errors, the prompt template, loss masks,
truncation, padding and the seeded order."""

import json

import pytest
import torch

from torch_wgpu_lora.integrations.tiny import build_tiny_tokenizer
from torch_wgpu_lora.loss import IGNORE_INDEX
from torch_wgpu_lora.training.data import collate, encode_records, epoch_order, read_records

RECORDS = [
    {"instruction": "Name a primary colour.", "input": "", "output": "Red."},
    {"instruction": "Translate the word into French.", "input": "cat", "output": "The French word is chat."},
    {"instruction": "Count to three.", "output": "One, two, three."},
]

# The seed design's template, written out literally.
PROMPT_WITH_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                     "the request.\n\n### Instruction:\nTranslate the word into French.\n\n### Input:\ncat\n\n"
                     "### Response:\n")
PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\nName a primary colour.\n\n### Response:\n")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    texts = [PROMPT_WITH_INPUT, PROMPT_NO_INPUT] + [r["output"] for r in RECORDS]
    return AutoTokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), texts))


def test_json_array_and_jsonl_read_alike(tmp_path):
    array, lines = tmp_path / "data.json", tmp_path / "data.jsonl"
    array.write_text(json.dumps(RECORDS, indent=1))
    lines.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")  # blank lines are skipped
    want = [{"instruction": r["instruction"], "input": r.get("input", ""), "output": r["output"]} for r in RECORDS]
    assert read_records(array) == want
    assert read_records(lines) == want
    assert read_records(RECORDS) == want


def test_bad_jsonl_line_is_reported_by_number(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps(RECORDS[1]) + "\n{\"instruction\": \"x\",\n")
    with pytest.raises(ValueError, match=r"data.jsonl, line 3: not valid JSON"):
        read_records(path)
    path.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({"instruction": "Say hi."}) + "\n")
    with pytest.raises(ValueError, match=r"data.jsonl, line 2: the record has no 'output'"):
        read_records(path)


def test_bad_records_are_named(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([RECORDS[0], {"instruction": "Hi", "output": 3}]))
    with pytest.raises(ValueError, match=r"data.json, record 1: 'output' must be a string, got int"):
        read_records(path)
    with pytest.raises(ValueError, match=r"record 0: 'instruction' is empty"):
        read_records([{"instruction": " ", "output": "x"}])
    with pytest.raises(ValueError, match="the data holds no records"):
        read_records([])
    with pytest.raises(FileNotFoundError, match="no data file at"):
        read_records(tmp_path / "missing.json")


def test_a_lone_surrogate_is_named_before_the_tokenizer_sees_it(tmp_path):
    path = tmp_path / "data.jsonl"  # JSON's escape of half a surrogate pair decodes to a lone surrogate
    path.write_text(json.dumps(RECORDS[0]) + "\n" + '{"instruction": "Say hi.", "output": "Hi \\ud83d!"}\n')
    with pytest.raises(ValueError, match=r"data.jsonl, line 2: 'output' is not valid Unicode: it holds a lone "
                                         r"surrogate '\\ud83d' at character 3"):
        read_records(path)
    pair = tmp_path / "pair.jsonl"  # a whole pair is one character, and fine
    pair.write_text('{"instruction": "Say hi.", "output": "Hi \\ud83d\\ude00!"}\n')
    assert read_records(pair)[0]["output"] == "Hi \U0001F600!"


def test_prompt_masked_response_and_eos_labelled(tokenizer):
    examples = encode_records(tokenizer, read_records(RECORDS))
    for example, record, prompt in zip(examples, RECORDS, (PROMPT_NO_INPUT, PROMPT_WITH_INPUT)):
        prompt_ids = tokenizer(prompt)["input_ids"]
        n = len(prompt_ids)
        assert example.input_ids[:n] == prompt_ids  # the template, exactly
        assert example.labels[:n] == [IGNORE_INDEX] * n
        assert example.labels[n:] == example.input_ids[n:]
        assert example.input_ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(example.input_ids[n:-1]) == record["output"]
        assert example.loss_tokens == len(example.input_ids) - n


def test_truncation_and_dropping(tokenizer):
    records = read_records(RECORDS[:2])
    full = encode_records(tokenizer, records)
    prompt_len = len(tokenizer(PROMPT_NO_INPUT)["input_ids"])
    cut = encode_records(tokenizer, records[:1], max_length=prompt_len + 2)[0]
    assert cut.input_ids == full[0].input_ids[: prompt_len + 2]
    assert cut.labels == full[0].labels[: prompt_len + 2] and cut.loss_tokens == 2
    # A prompt that fills max_length leaves nothing to learn: that record is dropped, loudly.
    with_input_len = len(tokenizer(PROMPT_WITH_INPUT)["input_ids"])
    assert with_input_len > prompt_len + 1
    with pytest.warns(UserWarning, match="1 of 2 records were dropped"):
        kept = encode_records(tokenizer, records, max_length=prompt_len + 1)
    assert len(kept) == 1 and kept[0].loss_tokens == 1
    with pytest.raises(ValueError, match="every record's prompt fills max_length=5"):
        encode_records(tokenizer, records, max_length=5)
    with pytest.raises(ValueError, match="max_length must be an integer >= 2, got 1"):
        encode_records(tokenizer, records, max_length=1)


def test_collate_pads_whole_sequences(tokenizer):
    examples = encode_records(tokenizer, read_records(RECORDS))
    batch = collate(examples, pad_token_id=tokenizer.pad_token_id)
    longest = max(len(e.input_ids) for e in examples)
    assert batch["input_ids"].shape == (3, longest)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        assert batch["input_ids"][row, :n].tolist() == e.input_ids
        assert batch["labels"][row, :n].tolist() == e.labels
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (longest - n)
        assert (batch["input_ids"][row, n:] == tokenizer.pad_token_id).all()
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
    assert batch["input_ids"].dtype == torch.long


def test_epoch_order_is_seeded():
    a = epoch_order(50, epoch=0, seed=7)
    assert sorted(a.tolist()) == list(range(50))
    assert a.tolist() == epoch_order(50, epoch=0, seed=7).tolist()
    assert a.tolist() != epoch_order(50, epoch=1, seed=7).tolist()
    assert a.tolist() != epoch_order(50, epoch=0, seed=8).tolist()
