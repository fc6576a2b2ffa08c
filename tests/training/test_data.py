"""Training data: reading JSON/JSONL with located errors, Parquet, CSV and datasets; the record forms
(Alpaca, chat against transformers' chat templates and assistant masks, prompt/completion, text);
loss masks, truncation, padding, packing (against transformers' own masks), the seeded orders."""

import copy
import json
import re

import numpy as np
import pytest
import torch

from torch_wgpu_lora.integrations.tiny import CHAT_TEMPLATE, build_tiny_tokenizer
from torch_wgpu_lora.loss import IGNORE_INDEX
from torch_wgpu_lora.training.data import collate, encode_records, epoch_order, length_grouped_order, pack, read_records

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


# -- the forms TRL's SFT data takes ---------------------------------------------------------------

CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one."},
     {"role": "assistant", "content": "Red, then."}],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}],
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    texts = [m["content"] for chat in CHATS for m in chat] + ["User: Assistant: System:"]
    return AutoTokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("chat"), texts,
                                                              chat_template=CHAT_TEMPLATE))


def test_chat_records_are_rendered_with_the_template_and_learn_the_assistant_turns_only(chat_tokenizer):
    examples = encode_records(chat_tokenizer, read_records([{"messages": chat} for chat in CHATS]))
    for example, chat in zip(examples, CHATS):
        # transformers' own rendering, and its mask of the template's {% generation %} parts
        reference = chat_tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True,
                                                       return_assistant_tokens_mask=True)
        assert example.input_ids == reference["input_ids"]
        mask = [label != IGNORE_INDEX for label in example.labels]
        assert mask == [bool(m) for m in reference["assistant_masks"]] and any(mask)
        assert all(label in (IGNORE_INDEX, token) for label, token in zip(example.labels, example.input_ids))


def test_prompt_completion_records_learn_the_completion(tokenizer, chat_tokenizer):
    (example,) = encode_records(tokenizer, read_records([{"prompt": PROMPT_NO_INPUT, "completion": "Red."}]))
    prompt = tokenizer(PROMPT_NO_INPUT)["input_ids"]
    completion = tokenizer("Red.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert example.input_ids == prompt + completion
    assert example.labels == [IGNORE_INDEX] * len(prompt) + completion
    # Conversational: the prompt's assistant turn is context, the completion's is learnt.
    chat = CHATS[0]
    (example,) = encode_records(chat_tokenizer, read_records([{"prompt": chat[:3], "completion": chat[3:]}]))
    reference = chat_tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
    first_turn = chat_tokenizer.apply_chat_template(chat[:3], tokenize=True, return_dict=True,
                                                    return_assistant_tokens_mask=True)
    expected = [bool(m) for m in reference["assistant_masks"]]
    expected[:len(first_turn["input_ids"])] = [False] * len(first_turn["input_ids"])
    assert example.input_ids == reference["input_ids"]
    assert [label != IGNORE_INDEX for label in example.labels] == expected and any(expected)


def test_text_records_learn_every_token(tokenizer):
    (example,) = encode_records(tokenizer, read_records([{"text": "One, two, three."}]))
    ids = tokenizer("One, two, three.")["input_ids"] + [tokenizer.eos_token_id]
    assert example.input_ids == ids and example.labels == [IGNORE_INDEX] + ids[1:]


def test_a_record_that_fits_no_form_is_named_with_its_fields(tmp_path):
    with pytest.raises(ValueError, match=re.escape("record 1: the record fits no form of training data; its fields "
                                                   "are ['answer', 'question']")):
        read_records([RECORDS[0], {"question": "Why?", "answer": "Because."}])
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"conversation": []}) + "\n")
    with pytest.raises(ValueError, match=re.escape("data.jsonl, line 2: the record fits no form of training data; "
                                                   "its fields are ['conversation']")):
        read_records(path)
    for record, message in [({"prompt": "Hi"}, "the record has no 'completion'"),
                            ({"messages": [{"role": "user"}]}, "messages[0] must be a message {role, content}, got "
                                                               "['role']"),
                            ({"messages": [{"role": "user", "content": "Hi"}]}, "the conversation has no assistant"),
                            ({"text": 5}, "'text' must be a string, got int")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            read_records([record])


def test_chat_needs_a_template_that_renders_each_turn_as_a_prefix(tokenizer, chat_tokenizer):
    records = read_records([{"messages": CHATS[1]}])
    with pytest.raises(ValueError, match="record 0: chat records are rendered with the tokenizer's chat template, "
                                         "and this tokenizer has none"):
        encode_records(tokenizer, records)
    shuffled = copy.copy(chat_tokenizer)
    shuffled.chat_template = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="record 0: the chat template renders the conversation up to message 1 as "
                                         "other text than the start of the whole conversation"):
        encode_records(shuffled, records)


def test_files_datasets_and_iterables_read_alike(tmp_path):
    import datasets

    rows = [{"instruction": r["instruction"], "input": r.get("input", ""), "output": r["output"]} for r in RECORDS]
    want = read_records(rows)
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(tmp_path / "data.parquet")
    table.to_csv(tmp_path / "data.csv", index=False)
    assert read_records(tmp_path / "data.parquet") == want
    assert read_records(tmp_path / "data.csv") == want
    assert read_records(table) == want
    assert read_records(row for row in rows) == want
    chats = datasets.Dataset.from_dict({"messages": CHATS})
    chats.to_parquet(tmp_path / "chat.parquet")
    assert read_records(tmp_path / "chat.parquet") == [{"messages": chat} for chat in CHATS]
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="bad.parquet could not be read as parquet"):
        read_records(tmp_path / "bad.parquet")


def test_packing_keeps_every_example_whole_and_restarts_positions(tokenizer):
    examples = encode_records(tokenizer, read_records(RECORDS * 3))
    longest = max(len(e.input_ids) for e in examples)
    packed = pack(examples, 2 * longest)
    assert len(packed) < len(examples)
    pieces = []
    for row in packed:
        assert len(row.input_ids) <= 2 * longest
        starts = [i for i, p in enumerate(row.position_ids) if p == 0] + [len(row.input_ids)]
        assert row.position_ids == [i for a, b in zip(starts, starts[1:]) for i in range(b - a)]
        pieces += [(row.input_ids[a:b], row.labels[a:b]) for a, b in zip(starts, starts[1:])]
    assert sorted(pieces) == sorted((e.input_ids, e.labels) for e in examples)
    assert all(labels[0] == IGNORE_INDEX for _, labels in pieces)  # no example learns from the one before it
    batch = collate(packed, pad_token_id=tokenizer.pad_token_id)
    assert batch["position_ids"][0, :len(packed[0].input_ids)].tolist() == packed[0].position_ids


def test_a_packed_row_gives_each_example_its_own_logits(tokenizer, tmp_path):
    """transformers' masks, fed the packed position ids, no attention mask and no cache, keep each example to
    itself: its logits match the example's own forward (same float32 ops over shorter rows: 1e-5
    of the largest logit covers their other summation orders; attending across examples moves them by O(0.1))."""
    from transformers import BitNetForCausalLM

    from torch_wgpu_lora.integrations.tiny import build_tiny_bitnet

    model = BitNetForCausalLM.from_pretrained(build_tiny_bitnet(tmp_path / "m", flavour="dense")).eval()
    examples = encode_records(tokenizer, read_records(RECORDS))
    (row,) = pack(examples, sum(len(e.input_ids) for e in examples))
    batch = collate([row], pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([e.input_ids])).logits[0]
                           for e in sorted(examples, key=lambda e: -len(e.input_ids))])
    scale = alone.abs().max().item()
    assert (packed - alone).abs().max().item() <= 1e-5 * scale


def test_length_grouped_order_is_seeded_and_batches_similar_lengths():
    lengths = [int(x) for x in np.random.default_rng(0).integers(1, 200, 400)]
    order = length_grouped_order(lengths, batch_size=4, epoch=0, seed=3)
    assert sorted(order.tolist()) == list(range(400))
    assert order.tolist() == length_grouped_order(lengths, 4, epoch=0, seed=3).tolist()
    assert order.tolist() != length_grouped_order(lengths, 4, epoch=1, seed=3).tolist()
    assert lengths[order[0]] == max(lengths)

    def padding(o):
        return sum(4 * max(lengths[i] for i in o[k:k + 4]) - sum(lengths[i] for i in o[k:k + 4])
                   for k in range(0, len(o), 4))

    assert padding(order.tolist()) < padding(epoch_order(400, 0, 3).tolist()) / 3


# -- records refused at the door, naming where they came from ------------------------------------------

def test_csv_and_tsv_cells_are_the_text_they_hold(tmp_path):
    # Python's csv module reads the cells as written: the reference for what every cell holds.
    import csv

    rows = [["instruction", "input", "output"], ["Say NA.", "", "NA"], ["null", "None", "007"],
            ["Say nan.", "N/A", "nan"], ["multi\nline", "a,b", "#N/A"]]
    for suffix, delimiter in ((".csv", ","), (".tsv", "\t")):
        path = tmp_path / f"data{suffix}"
        with path.open("w", newline="", encoding="utf-8") as file:
            csv.writer(file, delimiter=delimiter).writerows(rows)
        with path.open(newline="", encoding="utf-8") as file:
            written = list(csv.DictReader(file, delimiter=delimiter))
        assert read_records(path) == written  # the empty input is "" either way (a missing input reads as "")
    path = tmp_path / "data.csv"
    with pytest.raises(ValueError, match=r"data.csv, record 0: 'output' is missing \(null, or an empty cell\)"):
        read_records(path, na_values=("", "NA"))
    path.write_text("instruction,input,output\nSay hi.,NA,Hi.\n")
    assert read_records(path, na_values=("", "NA"))[0]["input"] == ""  # asked: "NA" is a missing input
    path.write_text("instruction,input,output\nSay hi.,NA,Hi.\nSay bye.,x,\n")
    with pytest.raises(ValueError, match=r"data.csv, record 1: 'output' is missing"):
        read_records(path)
    path.write_text("instruction,output,output\nSay hi.,Hi.,Hello.\n")
    with pytest.raises(ValueError, match=r"data.csv: the header names a column twice"):
        read_records(path)


def test_json_objects_with_a_key_twice_are_refused_and_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[{"instruction": "Say hi.", "output": "Hi."}, {"instruction": "a", "instruction": "b", '
                    '"output": "c"}]')
    with pytest.raises(ValueError, match=r"data.json, record 1: the key 'instruction' is given twice in one object"):
        read_records(path)
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine"}\n\n{"messages": [{"role": "user", "content": "Hi", "content": "Ho"}, '
                    '{"role": "assistant", "content": "Yes."}]}\n')
    with pytest.raises(ValueError, match=r"data.jsonl, line 3: the key 'content' is given twice in one object"):
        read_records(path)
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(RECORDS[0]).encode() + b"\n")
    assert read_records(path) == read_records(RECORDS[:1])


def test_a_chat_the_template_cannot_render_is_named_by_its_record(chat_tokenizer, tmp_path):
    strict = copy.copy(chat_tokenizer)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                            "{{ raise_exception('roles are user and assistant, got ' + m['role']) }}{% endif %}"
                            "{{ m['content'] }}{% endfor %}")
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHATS[1]}) + "\n\n" + json.dumps({"messages": CHATS[0]}) + "\n")
    with pytest.raises(ValueError, match=r"chat.jsonl, line 3: the tokenizer's chat template cannot render the "
                                         r"conversation \(TemplateError: roles are user and assistant, got system\)"):
        encode_records(strict, read_records(path))
    broken = copy.copy(chat_tokenizer)
    broken.chat_template = "{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}"
    with pytest.raises(ValueError, match=r"record 0: the tokenizer's chat template cannot render the conversation "
                                         r"\(TypeError: "):
        encode_records(broken, read_records([{"messages": CHATS[1]}]))
    for record, message in [({"messages": [{"role": "", "content": "Hi"}]}, "record 0: messages[0]: 'role' is empty"),
                            ({"messages": [{"role": "user", "content": None}]},
                             "record 0: messages[0]: 'content' is missing"),
                            ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
                             "record 0: messages[0]: 'content' must be a string, got list")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            read_records([record])


def test_dropped_records_are_named(tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS[:2]) + "\n")
    prompt_len = len(tokenizer(PROMPT_NO_INPUT)["input_ids"])
    with pytest.warns(UserWarning, match=r"1 of 2 records were dropped \(\S*data.jsonl, line 2\)"):
        encode_records(tokenizer, read_records(path), max_length=prompt_len + 1)
