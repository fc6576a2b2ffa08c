"""``BitNetEngine.generate`` (engine/generate_api.py) against transformers' own ``generate`` on the
torch model: the same output tensor for the dense model (greedy, left padding: EOS, min_new_tokens,
stop strings, max_length, a GenerationConfig); quantised flavours equal up to a divergence that an
int8 rounding flip explains; sampled tokens inside transformers' own warpers' support (and
num_return_sequences); left and right padding alike; every prompt length from one token up,
alone and in a batch; streamers get the text returned; bad input refused."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from transformers import GenerationConfig, TextIteratorStreamer, TextStreamer
from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from torch_wgpu_lora import BitNetEngine, generate
from torch_wgpu_lora.engine.generate_api import TORCH_PATH
from torch_wgpu_lora.integrations.tiny import FLAVOURS

from .helpers import engine_choice_is_explained_by_a_flip, tiny_model, tiny_tokenizer

PROMPTS = ["Name a primary colour.", "Add 2 and 3", "Hi"]
NEW = 14


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def dense():
    model = tiny_model("dense", adapters=True, seed=3)
    return model, BitNetEngine(model)


def encode(tokenizer, prompts=PROMPTS, side: str = "left") -> dict[str, torch.Tensor]:
    tokenizer.padding_side = side
    return dict(tokenizer(prompts, padding=True, return_tensors="pt"))


def transformers_generate(model, **kwargs) -> torch.Tensor:
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        return model.generate(**kwargs)


def test_greedy_output_is_transformers_generates(dense, tokenizer):
    model, engine = dense
    inputs = encode(tokenizer)
    plain = transformers_generate(model, **inputs, max_new_tokens=NEW)
    assert torch.equal(engine.generate(**inputs, max_new_tokens=NEW), plain)
    width = inputs["input_ids"].shape[1]
    new = plain[:, width:]
    # an EOS token (one of two) that ends some rows and not others: they are padded after it
    eos = next(int(t) for t in new[:, 2:10].flatten() if (new == t).any(1).sum() < len(PROMPTS))
    cases = [dict(eos_token_id=[eos, 1], pad_token_id=2), dict(eos_token_id=eos, min_new_tokens=6, pad_token_id=2),
             dict(stop_strings=[tokenizer.decode(new[1, 4:6])], tokenizer=tokenizer, pad_token_id=2)]
    for case in cases:
        theirs = transformers_generate(model, **inputs, max_new_tokens=NEW, **case)
        ours = engine.generate(**inputs, max_new_tokens=NEW, **case)
        assert torch.equal(ours, theirs), case
        assert theirs.shape[1] < width + NEW or (theirs[:, width:] == 2).any(), f"no row ended early: {case}"
    theirs = transformers_generate(model, **inputs, max_length=width + 5)
    assert torch.equal(engine.generate(**inputs, max_length=width + 5), theirs)
    config = GenerationConfig(max_new_tokens=6, repetition_penalty=1.3)
    ids = encode(tokenizer, PROMPTS[:1])  # one row: transformers' penalty also sees a padded row's pads
    assert torch.equal(engine.generate(**ids, generation_config=config),
                       transformers_generate(model, **ids, generation_config=config))


@pytest.mark.parametrize("flavour", [f for f in FLAVOURS if f != "dense"])
def test_quantised_flavours_equal_transformers_up_to_a_rounding_flip(flavour, tokenizer):
    # int8 activations: a float32 sum in another order can round one code differently, and the
    # paths then diverge. Each row is equal, or its first divergence is explained: the engine's
    # choice there is torch's when torch is fed the engine's codes, after a near-tie flip.
    model = tiny_model(flavour, adapters=True, seed=3)
    engine = BitNetEngine(model)
    inputs = encode(tokenizer)
    ours = engine.generate(**inputs, max_new_tokens=NEW, eos_token_id=[])
    theirs = transformers_generate(model, **inputs, max_new_tokens=NEW, eos_token_id=[])
    assert ours.shape == theirs.shape
    width = inputs["input_ids"].shape[1]
    for row in range(len(PROMPTS)):
        if torch.equal(ours[row], theirs[row]):
            continue
        first = int((ours[row] != theirs[row]).nonzero()[0])
        prompt = inputs["input_ids"][row][inputs["attention_mask"][row].bool()].tolist()
        engine_token, fed_token = engine_choice_is_explained_by_a_flip(
            model, engine, prompt + ours[row, width:first].tolist(), penalty=1.0)
        assert engine_token == int(ours[row, first]) == fed_token


def test_left_and_right_padding_give_the_same_tokens(dense, tokenizer):
    _, engine = dense
    left, right = encode(tokenizer, side="left"), encode(tokenizer, side="right")
    ours_left = engine.generate(**left, max_new_tokens=NEW, eos_token_id=[])
    ours_right = engine.generate(**right, max_new_tokens=NEW, eos_token_id=[])
    width = left["input_ids"].shape[1]
    assert torch.equal(ours_left[:, :width], left["input_ids"])
    assert torch.equal(ours_right[:, :width], right["input_ids"])
    assert torch.equal(ours_left[:, width:], ours_right[:, width:])


def test_sampled_tokens_are_inside_transformers_warpers_and_seeded_by_torch(dense, tokenizer):
    # do_sample with temperature, top_k and top_p together (and the penalty): every token drawn has
    # a nonzero probability after transformers' own processors, in its order, on the torch model's
    # logits of the row so far (top_p widened by 1e-3: float32 sums in another order may move the
    # nucleus boundary by ~1e-6). torch.manual_seed makes a call repeatable.
    model, engine = dense
    inputs = encode(tokenizer, PROMPTS[:2])
    settings = dict(do_sample=True, temperature=0.8, top_k=6, top_p=0.7, repetition_penalty=1.2)
    torch.manual_seed(0)
    ours = engine.generate(**inputs, max_new_tokens=NEW, eos_token_id=[], **settings)
    torch.manual_seed(0)
    assert torch.equal(engine.generate(**inputs, max_new_tokens=NEW, eos_token_id=[], **settings), ours)
    torch.manual_seed(1)
    assert not torch.equal(engine.generate(**inputs, max_new_tokens=NEW, eos_token_id=[], **settings), ours)
    copies = engine.generate(**inputs, max_new_tokens=NEW, eos_token_id=[], num_return_sequences=3, **settings)
    assert copies.shape[0] == 6 and len({tuple(r.tolist()) for r in copies[:3]}) > 1  # each copy draws its own
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.8),
                                      TopKLogitsWarper(6), TopPLogitsWarper(0.7 + 1e-3)])
    width = inputs["input_ids"].shape[1]
    for row in range(2):
        prompt = inputs["input_ids"][row][inputs["attention_mask"][row].bool()]
        ids = torch.cat([prompt, ours[row, width:]])[None]
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            logits = model(input_ids=ids).logits[0]
        for i in range(NEW):
            at = len(prompt) + i
            kept = processors(ids[:, :at], logits[at - 1][None].clone())[0]
            assert torch.isfinite(kept[ids[0, at]]), (row, i)


def test_streamers_get_the_text_that_is_returned(dense, tokenizer):
    _, engine = dense
    inputs = encode(tokenizer, PROMPTS[:1])
    width = inputs["input_ids"].shape[1]
    plain = engine.generate(**inputs, max_new_tokens=NEW)
    stop = tokenizer.decode(plain[0, width + 3:width + 5])  # the row ends early, at a stop string

    class Captured(TextStreamer):
        text = ""

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            self.text += text

    streamer = Captured(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = engine.generate(**inputs, max_new_tokens=NEW, stop_strings=[stop], tokenizer=tokenizer, streamer=streamer)
    assert out.shape[1] < width + NEW
    returned = tokenizer.decode(out[0, width:], skip_special_tokens=True)
    assert streamer.text == returned and stop in returned
    iterator = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    worker = threading.Thread(target=lambda: engine.generate(**inputs, max_new_tokens=NEW, streamer=iterator))
    worker.start()
    pieces = list(iterator)
    worker.join()
    assert "".join(pieces) == tokenizer.decode(plain[0, width:], skip_special_tokens=True) and len(pieces) > 1


def test_bad_input_and_unsupported_settings_are_refused_clearly(dense, tokenizer):
    model, engine = dense
    inputs = encode(tokenizer)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    limit = model.config.max_position_embeddings
    torch_path = re.escape(TORCH_PATH)
    cases = [
        (dict(input_ids=ids[:0]), ValueError, r"input_ids holds no prompt: shape \(0, "),
        (dict(input_ids=torch.full((2, limit - 3), 5), max_new_tokens=10), ValueError,
         f"input_ids row 0: a {limit - 3}-token prompt and max_new_tokens=10 need {limit + 7} positions"),
        (dict(input_ids=ids, attention_mask=mask[:, 1:]), ValueError, "attention_mask must be a tensor shaped like "
                                                                      "input_ids"),
        (dict(input_ids=ids, attention_mask=torch.tensor([[1, 0, 1] * (ids.shape[1] // 3) + [1] * (ids.shape[1] % 3)]
                                                         * len(PROMPTS))), ValueError,
         "attention_mask row 0 is neither left- nor right-padded"),
        (dict(input_ids=ids, num_beams=2), ValueError, f"does not do beam search \\(num_beams=2\\); {torch_path}"),
        (dict(input_ids=ids, max_new_tokens=-1), ValueError, "max_new_tokens` must be greater than 0, but is -1"),
        (dict(input_ids=ids, stop_strings=["x"]), ValueError, "pass the tokenizer"),
        (dict(input_ids=ids, streamer=TextStreamer(tokenizer)), ValueError, "a streamer prints one sequence"),
        (dict(input_ids=ids, logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)])), ValueError,
         f"does not take logits_processor; {torch_path}"),
        (dict(input_ids=ids, output_scores=True), ValueError, "does not support output_scores=True"),
        (dict(input_ids=ids, typical_p=0.5), ValueError, "does not support typical_p=0.5"),
        (dict(input_ids=ids, position_ids=ids), TypeError,
         r"neither inputs nor generation settings: \['position_ids'\]"),
        (dict(input_ids=ids, generation_config={"max_new_tokens": 3}), TypeError, "must be a transformers "
                                                                                  "GenerationConfig"),
        (dict(input_ids=ids.float()), TypeError, "input_ids must hold integer token ids"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            engine.generate(**kwargs)


@pytest.mark.parametrize("refused", [dict(num_beams=2), dict(typical_p=0.5), dict(no_repeat_ngram_size=2),
                                     dict(logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]))])
def test_what_the_engine_refuses_runs_where_its_refusal_says(dense, tokenizer, refused):
    model, engine = dense
    inputs = encode(tokenizer)
    with pytest.raises(ValueError) as refusal:
        engine.generate(**inputs, max_new_tokens=3, **refused)
    assert str(refusal.value).endswith(TORCH_PATH) and "engine.model.generate(...)" in TORCH_PATH
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        out = engine.model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, **refused)
    assert out.shape == (len(PROMPTS), inputs["input_ids"].shape[1] + 3)


def test_transformers_text_generation_pipeline_runs_the_engine(dense, tokenizer):
    # transformers' own pipeline, given the engine as its model: the tokens of the engine's generate and
    # of the same pipeline over the transformers model (the dense model: exactly, as above)
    from transformers import pipeline

    model, engine = dense
    options = dict(max_new_tokens=NEW, do_sample=False, return_tensors=True, eos_token_id=tokenizer.eos_token_id)
    on_engine = pipeline("text-generation", model=engine, tokenizer=tokenizer)(PROMPTS[0], **options)
    with torch.compiler.set_stance("force_eager"):
        on_model = pipeline("text-generation", model=model, tokenizer=tokenizer)(PROMPTS[0], **options)
    ours = generate(engine, tokenizer, PROMPTS[0], max_new_tokens=NEW, return_ids=True)
    assert on_engine[0]["generated_token_ids"] == on_model[0]["generated_token_ids"] == ours.prompt_ids + ours.token_ids
    assert len(set(ours.token_ids)) > 1


# Prompt lengths from one token (a BOS alone) up, and past the 64-key attention tile.
PROMPT_LENGTHS = (1, 2, 3, 4, 5, 8, 17, 70)


def assert_rows_agree(model, engine, inputs: dict, ours: torch.Tensor, theirs: torch.Tensor, flavour: str) -> None:
    """Each row of the engine's output is transformers' (dense: exactly), or (quantised flavours)
    its first divergence is explained by an int8 rounding flip."""
    assert ours.shape == theirs.shape
    width = inputs["input_ids"].shape[1]
    for row in range(ours.shape[0]):
        if torch.equal(ours[row], theirs[row]):
            continue
        assert flavour != "dense", f"row {row}: {ours[row].tolist()} vs {theirs[row].tolist()}"
        first = int((ours[row] != theirs[row]).nonzero()[0])
        prompt = inputs["input_ids"][row][inputs["attention_mask"][row].bool()].tolist()
        engine_token, fed_token = engine_choice_is_explained_by_a_flip(
            model, engine, prompt + ours[row, width:first].tolist(), penalty=1.0)
        assert engine_token == int(ours[row, first]) == fed_token


def left_padded(prompts: list[list[int]], pad: int = 2) -> dict[str, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_prompt_length_from_one_token_generates_transformers_tokens(flavour):
    # BOS-first prompts of every length from 1 (BOS alone: a prompt pass of one token a row), each
    # alone, then all in one left-padded batch, then a batch of one-token prompts only.
    model = tiny_model(flavour, adapters=True, seed=3)
    engine = BitNetEngine(model)
    g = torch.Generator().manual_seed(9)
    prompts = [[0] + torch.randint(3, model.config.vocab_size, (n - 1,), generator=g).tolist()
               for n in PROMPT_LENGTHS]
    options = dict(max_new_tokens=6, eos_token_id=[], pad_token_id=2)
    for inputs in [left_padded([p]) for p in prompts] + [left_padded(prompts), left_padded([[0], [7], [0]])]:
        ours = engine.generate(**inputs, **options)
        theirs = transformers_generate(model, **inputs, **options)
        assert_rows_agree(model, engine, inputs, ours, theirs, flavour)
