"""generate(): agreement with Hugging Face's generate and logits processors, KV cache,
seeding, EOS, templates, lists of prompts, chat messages, streamers and argument checks, on a
tiny BitNet with WebGPU LoRA adapters."""

import copy
import inspect
import json
import re
from importlib import resources
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer, BitNetForCausalLM, TextStreamer
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import torch_wgpu_lora
from torch_wgpu_lora.engine import BitNetEngine
from torch_wgpu_lora.generation import Generation, _eos_ids, generate
from torch_wgpu_lora.logits import (apply_repetition_penalty, process_logits, sampling_settings, top_k_filter,
                                    top_p_filter)
from torch_wgpu_lora.integrations.bitnet import add_lora_layers, lora_modules
from torch_wgpu_lora.integrations.tiny import build_tiny_bitnet, build_tiny_tokenizer
from torch_wgpu_lora.prompts import format_prompt

PROMPT = "Name a primary colour."
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("generation")
    records = json.loads((resources.files("torch_wgpu_lora") / "assets" / "alpaca_demo.json").read_text())
    texts = [format_prompt(r["instruction"], r["input"]) + r["output"] for r in records]
    return build_tiny_bitnet(root / "model", flavour="dense", seed=0), build_tiny_tokenizer(root / "tok", texts)


@pytest.fixture(scope="module")
def tokenizer(paths):
    return AutoTokenizer.from_pretrained(paths[1])


@pytest.fixture(scope="module")
def model(paths):
    model = BitNetForCausalLM.from_pretrained(paths[0])
    add_lora_layers(model, r=4, target_modules=("q_proj", "v_proj", "o_proj"), backend="wgpu")
    generator = torch.Generator().manual_seed(1)
    for module in lora_modules(model).values():
        # lora_B starts at zero; random values make the adapters change every output.
        module.lora_B.data = 0.5 * torch.randn(module.lora_B.shape, generator=generator)
    return model.eval()


def prompt_ids(tokenizer, text):
    return tokenizer(text, return_tensors="pt").input_ids


def hf_new_ids(model, tokenizer, text, **kwargs):
    ids = prompt_ids(tokenizer, text)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **kwargs)
    return out[0, ids.shape[1]:].tolist()


# -- agreement with Hugging Face's generate -----------------------------------------------------

def test_adapters_change_the_model(model, paths, tokenizer):
    ids = prompt_ids(tokenizer, PROMPT)
    base = BitNetForCausalLM.from_pretrained(paths[0]).eval()
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, base(ids).logits, atol=1e-2)
    assert {m.backend for m in lora_modules(model).values()} == {"wgpu"}


def test_greedy_matches_hf_generate_token_for_token(model, tokenizer):
    ours = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, repetition_penalty=1.3,
                    use_template=True, return_ids=True)
    theirs = hf_new_ids(model, tokenizer, format_prompt(PROMPT), do_sample=False, repetition_penalty=1.3)
    assert ours.token_ids == theirs
    assert len(set(theirs)) > 1  # a degenerate single-token output would prove little


@pytest.mark.parametrize("filters", [dict(top_k=5, top_p=1.0), dict(top_k=0, top_p=0.8), dict(top_k=5, top_p=0.8),
                                     dict(top_k=None, top_p=None), dict()])
def test_seeded_sampling_matches_hf_generate_under_the_same_seed(model, tokenizer, filters):
    # HF draws with torch.multinomial from the global generator; ours from a local one
    # seeded alike, so the same processed logits give the same draws. The same arguments mean the
    # same in both (top_k 0 or None: no top-k; top_p 1.0 or None: no top-p; left out: the defaults).
    ours = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8,
                    repetition_penalty=1.2, seed=3, return_ids=True, **filters)
    torch.manual_seed(3)
    theirs = hf_new_ids(model, tokenizer, PROMPT, do_sample=True, temperature=0.8, repetition_penalty=1.2,
                        **filters)
    assert ours.token_ids == theirs


def test_kv_cache_matches_full_recomputation(model, tokenizer):
    ours = generate(model, tokenizer, PROMPT, max_new_tokens=5, repetition_penalty=1.3, return_ids=True)
    ids = prompt_ids(tokenizer, PROMPT)[0]
    with torch.no_grad():
        for _ in range(5):
            logits = model(ids[None], use_cache=False).logits[0, -1]
            token = int(torch.argmax(process_logits(logits, ids, "greedy", repetition_penalty=1.3)))
            ids = torch.cat([ids, torch.tensor([token])])
    assert ours.token_ids == ids[-5:].tolist()


# -- logits processing against transformers' processors -----------------------------------------

def test_repetition_penalty_follows_ctrl_rule_for_both_signs():
    logits = torch.tensor([2.0, -2.0, 0.5, 3.0, -1.0])
    seen = torch.tensor([0, 1, 1, 4])  # a repeated id is penalised once
    assert torch.equal(apply_repetition_penalty(logits, seen, 2.0), torch.tensor([1.0, -4.0, 0.5, 3.0, -2.0]))
    # penalty < 1 rewards repetition: the same rule with the factor inverted
    assert torch.equal(apply_repetition_penalty(logits, seen, 0.5), torch.tensor([4.0, -1.0, 0.5, 3.0, -0.5]))
    assert torch.equal(logits, torch.tensor([2.0, -2.0, 0.5, 3.0, -1.0]))  # input untouched


@pytest.mark.parametrize("penalty", [0.7, 1.1, 1.5])
def test_repetition_penalty_equals_hf(penalty):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=generator)
    seen = torch.randint(0, 50, (30,), generator=generator)
    expected = RepetitionPenaltyLogitsProcessor(penalty)(seen[None], logits[None].clone())[0]
    assert torch.equal(apply_repetition_penalty(logits, seen, penalty), expected)


def test_top_k_keeps_the_k_largest_and_ties():
    logits = torch.tensor([1.0, 4.0, 3.0, 3.0, 0.0])
    inf = float("-inf")
    assert torch.equal(top_k_filter(logits, 1), torch.tensor([inf, 4.0, inf, inf, inf]))
    assert torch.equal(top_k_filter(logits, 2), torch.tensor([inf, 4.0, 3.0, 3.0, inf]))
    assert torch.equal(top_k_filter(logits, 10), logits)


@pytest.mark.parametrize("k", [1, 3, 40, 100])
def test_top_k_equals_hf(k):
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(k)).round(decimals=1)  # rounding makes ties
    assert torch.equal(top_k_filter(logits, k), TopKLogitsWarper(k)(None, logits))


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    inf = float("-inf")
    expected = torch.tensor([logits[0], logits[1], inf, inf])
    assert torch.allclose(top_p_filter(logits, 0.75), expected)  # 0.5 + 0.3 reaches 0.75
    assert torch.equal(top_p_filter(logits, 0.01).isfinite(), torch.tensor([True, False, False, False]))
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_top_p_keeps_the_top_token_when_rounding_leaves_less_than_one_minus_p():
    # Logits whose float32 cumulative probability (as top_p_filter sums it) ends below 1, and so at or
    # below 1 - 1e-9 in float32: which random ones do depends on how this CPU rounds; most do.
    def total(logits: torch.Tensor) -> float:
        return torch.sort(logits).values.softmax(-1).cumsum(-1)[-1].item()

    candidates = (torch.randn(64, generator=torch.Generator().manual_seed(seed)) for seed in range(32))
    logits = next(x for x in candidates if total(x) < 1)
    kept = top_p_filter(logits, 1e-9).isfinite()
    assert kept.sum() == 1 and kept[logits.argmax()]


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 1.0])
def test_top_p_equals_hf(p):
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(int(p * 100)))
    assert torch.equal(top_p_filter(logits, p), TopPLogitsWarper(p)(None, logits))


@pytest.mark.parametrize("strategy", ["greedy", "top_k", "top_p", "top_k_top_p"])
def test_process_logits_equals_hf_chain(strategy):
    # with EOS tokens banned below min_new_tokens (transformers' MinNewTokensLengthLogitsProcessor)
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(64, generator=generator)
    seen = torch.randint(0, 64, (20,), generator=generator)
    eos = torch.tensor([int(torch.argmax(logits)), 3])
    chain = [RepetitionPenaltyLogitsProcessor(1.2), MinNewTokensLengthLogitsProcessor(20, 5, eos)]
    if strategy != "greedy":
        chain.append(TemperatureLogitsWarper(0.7))
        if "top_k" in strategy:
            chain.append(TopKLogitsWarper(7))
        if "top_p" in strategy:
            chain.append(TopPLogitsWarper(0.6))
    expected = logits[None].clone()
    for processor in chain:
        expected = processor(seen[None], expected)
    ours = process_logits(logits, seen, strategy, temperature=0.7, top_k=7, top_p=0.6, repetition_penalty=1.2,
                          banned_ids=eos)
    assert torch.allclose(ours, expected[0], atol=1e-6)  # temperature division may round differently by 1 ulp


# -- sampling, stopping, templates -----------------------------------------------------------------

def test_seeded_sampling_is_reproducible_and_leaves_global_rng_alone(model, tokenizer):
    state = torch.get_rng_state()
    first = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=0, top_p=0.95, seed=7,
                     return_ids=True)
    assert torch.equal(torch.get_rng_state(), state)
    again = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=0, top_p=0.95, seed=7,
                     return_ids=True)
    other = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=0, top_p=0.95, seed=8,
                     return_ids=True)
    assert first == again
    assert first.token_ids != other.token_ids


def test_top_k_of_one_samples_the_greedy_tokens(model, tokenizer):
    greedy = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, return_ids=True)
    sampled = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=1,
                       temperature=0.5, seed=0, return_ids=True)
    assert sampled.token_ids == greedy.token_ids


def test_generation_stops_at_eos(model, tokenizer):
    full = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, eos_token_id=[], return_ids=True)
    assert len(full.token_ids) == NEW_TOKENS and not full.finished_by_eos
    third = full.token_ids[2]
    stop = full.token_ids.index(third) + 1
    unused = next(i for i in range(model.config.vocab_size) if i not in full.token_ids)
    stopped = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, eos_token_id=[unused, third],
                       return_ids=True)
    assert stopped.token_ids == full.token_ids[:stop] and stopped.finished_by_eos
    assert stopped.text == tokenizer.decode(stopped.token_ids, skip_special_tokens=True)


def test_eos_defaults_to_tokenizer_then_generation_config():
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[5, 6]))
    assert _eos_ids(None, SimpleNamespace(eos_token_id=1), model) == {1}
    assert _eos_ids(None, SimpleNamespace(eos_token_id=None), model) == {5, 6}
    assert _eos_ids(9, SimpleNamespace(eos_token_id=1), model) == {9}
    assert _eos_ids(None, SimpleNamespace(eos_token_id=None), SimpleNamespace()) == set()
    with pytest.raises(ValueError, match="eos_token_id must be an int or a list of ints"):
        _eos_ids(["1"], None, model)


def test_text_is_the_decoded_new_tokens(model, tokenizer):
    result = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, return_ids=True)
    assert isinstance(result, Generation)
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS) == result.text
    assert torch_wgpu_lora.generate is generate


def test_zero_new_tokens_returns_empty_text(model, tokenizer):
    result = generate(model, tokenizer, PROMPT, max_new_tokens=0, return_ids=True)
    assert result.text == "" and result.token_ids == [] and not result.finished_by_eos


def test_templates(model, tokenizer):
    plain = generate(model, tokenizer, PROMPT, max_new_tokens=0, return_ids=True)
    templated = generate(model, tokenizer, PROMPT, max_new_tokens=0, use_template=True, return_ids=True)
    with_input = generate(model, tokenizer, {"instruction": "Add the numbers.", "input": "2 and 3"},
                          max_new_tokens=0, return_ids=True)
    assert plain.prompt_ids == prompt_ids(tokenizer, PROMPT)[0].tolist()
    assert templated.prompt_ids == prompt_ids(tokenizer, format_prompt(PROMPT))[0].tolist()
    assert with_input.prompt_ids == prompt_ids(tokenizer, format_prompt("Add the numbers.", "2 and 3"))[0].tolist()


def test_training_flag_is_restored(model, tokenizer):
    model.train()
    try:
        generate(model, tokenizer, PROMPT, max_new_tokens=2)
        assert all(m.training for m in model.modules())
    finally:
        model.eval()
    generate(model, tokenizer, PROMPT, max_new_tokens=2)
    assert not any(m.training for m in model.modules())


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(do_sample="yes"), ValueError, "do_sample must be True or False, got 'yes'"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=-1), ValueError, r"top_k must be an integer >= 0 \(0 or None: no top-k filter, as in transformers\), "
                                 "got -1"),
    (dict(do_sample=True, temperature=0.0), ValueError, r"temperature must be > 0 for sampling \(do_sample=True\)"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be an integer >= 0, got -1"),
    (dict(repetition_penalty=0.0), ValueError, "repetition_penalty must be > 0"),
    (dict(seed="1"), ValueError, r"seed must be an integer in \[0, 2\*\*32\) \(the engine's sampler uses 32 bits\) or "
                                 r"None, got '1'"),
    (dict(seed=-1), ValueError, r"seed must be an integer in \[0, 2\*\*32\) .* got -1"),
    (dict(seed=2 ** 32), ValueError, r"seed must be an integer in \[0, 2\*\*32\) .* got 4294967296"),
    (dict(eos_token_id=-7), ValueError, r"eos_token_id -7 is outside the vocabulary \[0, 320\)"),
    (dict(eos_token_id=[3, 320]), ValueError, r"eos_token_id 320 is outside the vocabulary \[0, 320\)"),
    (dict(prompt="caf\udce9"), ValueError, r"the prompt is not valid Unicode: it holds a lone surrogate '\\udce9' "
                                           r"at character 3"),
    (dict(prompt={"instruction": "Add.", "input": "\ud800"}), ValueError,
     r"the prompt's 'input' is not valid Unicode: it holds a lone surrogate '\\ud800' at character 0"),
    (dict(do_sample=True, temperature=1e-45), ValueError,
     r"temperature=1e-45 is too small: logits / temperature overflow float32, so the next-token probabilities are "
     r"not finite"),
    (dict(prompt=""), ValueError, "prompt is empty"),
    (dict(prompt=3), TypeError, "prompt must be a string, a dict with 'instruction'"),
    (dict(prompt={"input": "x"}), ValueError, "a dict prompt has the keys 'instruction'"),
    (dict(prompt={"instruction": ""}), ValueError, "instruction must be a non-empty string"),
])
def test_bad_arguments_are_rejected(model, tokenizer, kwargs, error, message):
    kwargs = {"prompt": PROMPT, **kwargs}
    with pytest.raises(error, match=message):
        generate(model, tokenizer, max_new_tokens=kwargs.pop("max_new_tokens", 1), **kwargs)


def test_the_defaults_are_transformers_generate_defaults():
    # transformers' own defaults for what neither a call nor a model's generation config sets
    from transformers import GenerationConfig

    theirs = GenerationConfig._get_default_generation_params()
    defaults = {name: p.default for name, p in inspect.signature(generate).parameters.items()}
    for name in ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty"):
        assert defaults[name] == theirs[name], name
    assert "strategy" not in defaults  # do_sample is the one way to choose sampling


def test_greedy_ignores_temperature(model, tokenizer):
    # HF ignores the sampling settings for greedy decoding too; temperature=0 is not an error there.
    assert generate(model, tokenizer, PROMPT, max_new_tokens=2, temperature=0.0) == \
        generate(model, tokenizer, PROMPT, max_new_tokens=2)


def test_both_paths_refuse_a_generation_past_the_context_with_one_message(model, tokenizer):
    # The tiny model has 256 positions; the torch path would otherwise run past them (RoPE goes on).
    prompt = len(prompt_ids(tokenizer, PROMPT)[0])
    expected = (f"a {prompt}-token prompt and max_new_tokens=300 need {prompt + 300} positions; the model's context "
                "is 256 (max_position_embeddings)")
    engine = BitNetEngine(model)
    for runner in (model, engine):
        with pytest.raises(ValueError) as refused:
            generate(runner, tokenizer, PROMPT, max_new_tokens=300)
        assert str(refused.value) == expected
    assert len(generate(model, tokenizer, PROMPT, max_new_tokens=256 - prompt, eos_token_id=[],
                        return_ids=True).token_ids) == 256 - prompt  # exactly the context: allowed
    with pytest.raises(ValueError) as refused:
        engine(torch.zeros(1, 257, dtype=torch.long))
    assert str(refused.value) == "257 tokens exceed the model's context of 256 positions (max_position_embeddings)"


# -- lists of prompts, chat messages, streamers ---------------------------------------------------

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n\n{% endfor %}"
                 "{% if add_generation_prompt %}### assistant:\n{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHAT_TEMPLATE
    return chat


def test_a_list_of_prompts_gives_each_prompts_result_on_both_paths(model, chat_tokenizer):
    # text, an Alpaca record and chat messages in one list: each result is that prompt's alone
    # (on the engine all at once); the i-th draws with seed + i
    prompts = [PROMPT, {"instruction": "Add the numbers.", "input": "2 and 3"},
               [{"role": "user", "content": "Name a flower."}]]
    engine = BitNetEngine(model)
    for runner in (model, engine):
        for options in (dict(), dict(do_sample=True, top_k=5, top_p=0.9, seed=11)):
            together = generate(runner, chat_tokenizer, prompts, max_new_tokens=NEW_TOKENS, return_ids=True,
                                 **options)
            alone = [generate(runner, chat_tokenizer, p, max_new_tokens=NEW_TOKENS, return_ids=True,
                              **{**options, **({"seed": 11 + i} if options else {})})
                     for i, p in enumerate(prompts)]
            assert together == alone, (runner.__class__.__name__, options)


def test_more_prompts_than_the_batch_size_give_each_prompts_result_in_order_on_both_paths(model, chat_tokenizer):
    # batch_size=2 over five prompts: on the engine two rows, a finished one taking the next prompt;
    # each result is that prompt's alone, the list in input order, and on_result gets each one once
    # (on the engine as they complete)
    prompts = [PROMPT, {"instruction": "Add the numbers.", "input": "2 and 3"}, "Hi",
               [{"role": "user", "content": "Name a flower."}], "Count to three, slowly, then stop."]
    engine = BitNetEngine(model)
    for runner in (model, engine):
        for options in (dict(), dict(do_sample=True, top_k=5, top_p=0.9, seed=11)):
            results: list = []
            together = generate(runner, chat_tokenizer, prompts, max_new_tokens=NEW_TOKENS, return_ids=True,
                                batch_size=2, on_result=lambda i, r: results.append((i, r)), tokens_per_submit=3,
                                **options)
            alone = [generate(runner, chat_tokenizer, p, max_new_tokens=NEW_TOKENS, return_ids=True,
                              **{**options, **({"seed": 11 + i} if options else {})})
                     for i, p in enumerate(prompts)]
            assert together == alone, (runner.__class__.__name__, options)
            assert sorted(results, key=lambda x: x[0]) == list(enumerate(alone))
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        generate(engine, chat_tokenizer, prompts, batch_size=0)


def test_chat_messages_are_rendered_with_the_tokenizers_chat_template(model, chat_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    ours = generate(model, chat_tokenizer, messages, max_new_tokens=NEW_TOKENS, return_ids=True)
    ids = chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    assert ours.prompt_ids == ids[0].tolist()
    assert chat_tokenizer.decode(ids[0]).endswith("### assistant:\n")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=chat_tokenizer.eos_token_id, pad_token_id=chat_tokenizer.pad_token_id)
    assert ours.token_ids == out[0, ids.shape[1]:].tolist()


class Captured(TextStreamer):
    """A TextStreamer that keeps what it would print."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.pieces: list[str] = []

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.pieces.append(text)


def test_the_streamer_gets_the_text_returned_on_both_paths(model, tokenizer):
    for runner in (model, BitNetEngine(model)):
        streamer = Captured(tokenizer)
        text = generate(runner, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, streamer=streamer)
        assert "".join(streamer.pieces) == text and len(streamer.pieces) > 1


def test_lists_chats_and_streamers_refuse_what_they_cannot_take(model, tokenizer):
    with pytest.raises(ValueError, match="no prompts to generate for: the list is empty"):
        generate(model, tokenizer, [])
    with pytest.raises(ValueError, match="a streamer prints one generation; 2 prompts were given"):
        generate(model, tokenizer, [PROMPT, PROMPT], streamer=Captured(tokenizer))
    with pytest.raises(ValueError, match="this tokenizer has none"):
        generate(model, tokenizer, [{"role": "user", "content": PROMPT}])
    with pytest.raises(ValueError, match="chat message 0 needs a string 'content'"):
        generate(model, tokenizer, [{"role": "user"}])


# -- an adapter a prompt (PEFT's adapter_names) ---------------------------------------------------

@pytest.mark.parametrize("path", ["torch", "engine", "engine, 2 rows"])
def test_adapter_names_continue_each_prompt_with_its_adapter_as_peft_does(paths, tokenizer, tmp_path, path):
    import peft

    from torch_wgpu_lora.integrations.bitnet import set_backend

    pristine = BitNetForCausalLM.from_pretrained(paths[0]).eval()
    theirs = peft.get_peft_model(copy.deepcopy(pristine), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    theirs.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    theirs.eval().save_pretrained(tmp_path / "peft")
    ours = torch_wgpu_lora.load_adapter(copy.deepcopy(pristine), tmp_path / "peft")
    ours.load_adapter(tmp_path / "peft" / "other", adapter_name="other")
    ours.set_adapter("other")
    set_backend(ours, "torch")
    ours.set_adapter("default")
    set_backend(ours, "torch")
    prompts, names = [PROMPT, "Add two and three.", PROMPT], ["other", "__base__", "default"]

    model = ours if path == "torch" else BitNetEngine(ours)  # the engine: every prompt at once, on WebGPU
    # or two rows: the third prompt takes the first's row when it ends, with its own adapter
    rows = {"engine, 2 rows": 2}.get(path)
    got = generate(model, tokenizer, prompts, max_new_tokens=NEW_TOKENS, repetition_penalty=1.0,
                   eos_token_id=[], return_ids=True, adapter_names=names, batch_size=rows)
    if rows:  # the call's session (greedy, generate's defaults): one prompt filled a row another's had
        greedy = sampling_settings(False, 1.0, 50, 1.0, 1.0, ours.config.vocab_size)
        longest = max(len(r.prompt_ids) for r in got)
        assert model.decode_session(2, longest, NEW_TOKENS, serve_rows=True, **greedy).fill_rows == 1
    for prompt, name, result in zip(prompts, names, got):
        ids = prompt_ids(tokenizer, prompt)
        expected = theirs.generate(ids, attention_mask=torch.ones_like(ids), adapter_names=[name],
                                   max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=None, output_scores=True, return_dict_in_generate=True)
        # Greedy picks are compared up to peft's first near tie (top two logits within 1e-3 of the
        # largest): from there another float32 rounding may rightly pick the other token.
        scores = torch.cat(expected.scores)
        top = scores.topk(2, dim=-1).values
        steps = int(((top[:, 0] - top[:, 1]) > 1e-3 * scores.abs().max()).long().cumprod(0).sum())
        assert steps >= 3, f"{name}: peft's greedy choices are near ties from step {steps}"
        assert result.token_ids[:steps] == expected.sequences[0, ids.shape[1]:][:steps].tolist(), name
    assert got[0].token_ids != got[2].token_ids  # the same prompt, two adapters

    with pytest.raises(ValueError, match=r"adapter_names must be a list of one adapter name a prompt \(3 prompts\)"):
        generate(model, tokenizer, prompts, max_new_tokens=2, adapter_names=names[:2])
    with pytest.raises(ValueError, match="this BitNetForCausalLM has none"):
        generate(pristine if path == "torch" else BitNetEngine(pristine), tokenizer, PROMPT, max_new_tokens=2,
                 adapter_names=["default"])
