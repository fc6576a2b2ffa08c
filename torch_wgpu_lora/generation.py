"""Text generation with a KV cache: greedy, top-k or top-p sampling, repetition penalty.

>>> # model = BitNetForCausalLM.from_pretrained(path); apply_lora(model); tokenizer = AutoTokenizer.from_pretrained(path)
>>> # generate(model, tokenizer, "Name a primary colour.", use_template=True)  # the new text
>>> # generate(model, tokenizer, {"instruction": "Add the numbers.", "input": "2 and 3"}, do_sample=True, seed=0)
>>> # result = generate(model, tokenizer, "Once upon a time", max_new_tokens=16, return_ids=True)
>>> # result.text, result.token_ids, result.finished_by_eos
>>> # generate(engine, tokenizer, ["Name a colour.", "Add 2 and 3."])        # a list: every prompt at once
>>> # generate(model, tokenizer, [{"role": "user", "content": "Hi!"}])        # chat messages
>>> # generate(model, tokenizer, "Once upon a time", streamer=TextStreamer(tokenizer, skip_prompt=True))

The decoding arguments are transformers' (``do_sample``, ``temperature``, ``top_k``, ``top_p``,
``repetition_penalty``), with its defaults and meanings. Each step processes the next-token
logits in Hugging Face's order (``logits``: repetition penalty, then, sampling only, temperature,
then top-k and top-p filtering); greedy takes the argmax, sampling draws from the softmax with a
local ``torch.Generator``.

Hugging Face's own ``model.generate()`` works too with ``LoRALinear`` modules in place.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .engine import TOKENS_PER_SUBMIT, BitNetEngine, GenerationRequest
from .integrations.peft import LoraModelMixin
from .limits import SEED_LIMIT, check_context, check_seed, model_context
from .logits import process_logits, sampling_settings
from .prompts import check_unicode, format_prompt

Prompt = str | Mapping[str, str] | list[Mapping[str, str]]  # text, an Alpaca record, or chat messages

@dataclass(frozen=True)
class Generation:
    """What ``generate(..., return_ids=True)`` returns.

    ``token_ids`` are the new tokens only, ending with the EOS token when
    ``finished_by_eos``; ``text`` is their decoding without special tokens.
    """

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finished_by_eos: bool


def _check_arguments(max_new_tokens: int, seed: int | None) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    check_seed(seed)


def _is_chat(prompt: Any) -> bool:
    """Whether ``prompt`` is chat messages: a list of dicts with a role."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, Mapping) and "role" in m for m in prompt)


def _prompt_ids(prompt: Prompt, tokenizer: Any, use_template: bool) -> list[int]:
    """The token ids of one prompt: text (``use_template``: in the Alpaca template), an Alpaca record,
    or chat messages rendered with the tokenizer's chat template (and the assistant's turn opened)."""
    if _is_chat(prompt):
        for i, message in enumerate(prompt):
            if not isinstance(message.get("content"), str):
                raise ValueError(f"chat message {i} needs a string 'content', got {message.get('content')!r}")
            check_unicode(message["content"], f"chat message {i}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat messages are rendered with the tokenizer's chat template, and this tokenizer has "
                             "none (tokenizer.chat_template)")
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    text = _prompt_text(prompt, use_template)
    ids = list(tokenizer(text)["input_ids"])
    if not ids:
        raise ValueError(f"prompt {text!r} encodes to no tokens")
    return ids


def _prompt_text(prompt: str | Mapping[str, str], use_template: bool) -> str:
    if isinstance(prompt, Mapping):
        unknown = set(prompt) - {"instruction", "input"}
        if "instruction" not in prompt or unknown:
            raise ValueError(f"a dict prompt has the keys 'instruction' and optionally 'input', got {sorted(prompt)}")
        for key, value in prompt.items():
            if isinstance(value, str):  # format_prompt checks the types
                check_unicode(value, f"the prompt's {key!r}")
        return format_prompt(prompt["instruction"], prompt.get("input", ""))
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, a dict with 'instruction' (and 'input'), chat messages (dicts "
                        f"with 'role' and 'content') or a list of those, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("prompt is empty")
    check_unicode(prompt, "the prompt")
    return format_prompt(prompt) if use_template else prompt


def _eos_ids(eos_token_id: int | Iterable[int] | None, tokenizer: Any, model: nn.Module) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
    if eos_token_id is None:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    ids = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos_token_id!r}")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    outside = sorted(i for i in ids if vocab is not None and not 0 <= i < vocab)
    if outside:
        raise ValueError(f"eos_token_id {outside[0]} is outside the vocabulary [0, {vocab}): no token could end "
                         "the generation")
    return ids


def _non_finite_message(raw_logits: torch.Tensor, temperature: float) -> str:
    if not torch.isfinite(raw_logits).all():
        return "the model's next-token logits are not finite (NaN or infinite): its weights or adapter are broken"
    return (f"temperature={temperature!r} is too small: logits / temperature overflow float32, so the "
            "next-token probabilities are not finite; use a larger temperature, or do_sample=False for the "
            "most likely token")


def _decode_loop(model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, eos: set[int],
                 generator: torch.Generator | None, streamer: Any = None, **processing: Any) -> tuple[list[int], bool]:
    """(new token ids, whether EOS ended them); greedy when ``generator`` is None, else sampling;
    ``streamer`` gets each token as it is chosen."""
    parameters = inspect.signature(model.forward).parameters
    # transformers 5 renamed forward's ``past_key_values`` (and the output field) to ``cache``.
    cache_name = "cache" if "cache" in parameters else "past_key_values"
    # Only the last position's logits are used: skip the LM head on the rest of the prompt.
    keep_last = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
    seen = prompt_ids[0]
    output = model(input_ids=prompt_ids, use_cache=True, **keep_last)
    new_ids: list[int] = []
    for step in range(max_new_tokens):
        logits = process_logits(output.logits[0, -1], seen, **processing)
        if generator is None:
            token = int(torch.argmax(logits))
        else:
            probabilities = logits.softmax(dim=-1)
            if not torch.isfinite(probabilities).all():
                raise ValueError(_non_finite_message(output.logits[0, -1], processing["temperature"]))
            token = int(torch.multinomial(probabilities, 1, generator=generator))
        new_ids.append(token)
        if streamer is not None:
            streamer.put(torch.tensor([token]))
        if token in eos:
            return new_ids, True
        if step + 1 == max_new_tokens:
            break
        next_input = torch.tensor([[token]], device=prompt_ids.device)
        seen = torch.cat([seen, next_input[0]])
        output = model(input_ids=next_input, use_cache=True, **{cache_name: getattr(output, cache_name)}, **keep_last)
    return new_ids, False


def generate(model: nn.Module, tokenizer: Any, prompt: Prompt | list[Prompt], max_new_tokens: int = 128,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = 50, top_p: float = 1.0,
             repetition_penalty: float = 1.0, eos_token_id: int | Iterable[int] | None = None,
             seed: int | None = None, use_template: bool = False, return_ids: bool = False,
             streamer: Any = None, adapter_names: list[str] | None = None, batch_size: int | None = None,
             on_result: Callable[[int, str | Generation], None] | None = None,
             tokens_per_submit: int = TOKENS_PER_SUBMIT) -> str | Generation | list[str] | list[Generation]:
    """Continue ``prompt`` with up to ``max_new_tokens`` tokens; return the new text.

    ``model`` is a transformers causal LM (LoRA adapters in place or not), or a
    ``BitNetEngine`` (the whole model on WebGPU: KV cache, sampling and token history stay
    on the GPU), ``tokenizer`` its tokenizer.
    ``prompt`` is text (encoded with the tokenizer's default special tokens, e.g. BOS;
    ``use_template=True`` wraps it in the Alpaca template as the instruction,
    ``prompts.format_prompt``), a dict ``{"instruction": ..., "input": ...}`` (always in the
    template), chat messages (a list of ``{"role": ..., "content": ...}``, rendered with the
    tokenizer's chat template, the assistant's turn opened), or a list of those: then each is
    continued (on the engine ``batch_size`` at once, default all, a finished one's row taking the
    next prompt, each exactly as it would be alone; on the torch path one after another) and a
    list of results comes back, one per prompt, in order. ``on_result(index, result)`` gets each
    prompt's result (what the list holds) as soon as it is complete: on the engine in the order
    the prompts end, on the torch path in input order. ``tokens_per_submit`` (the engine): decode
    steps a command buffer (``engine.generate.TOKENS_PER_SUBMIT`` says what more and fewer cost).

    Decoding, as transformers' ``generate`` (its defaults too): ``do_sample=False`` takes the most
    likely token (``temperature``, ``top_k``, ``top_p`` and ``seed`` unused); ``do_sample=True``
    divides the logits by ``temperature``, keeps the ``top_k`` most likely tokens (0 or None: all),
    then the nucleus of probability ``top_p`` among them (1.0: all), and draws.
    ``repetition_penalty`` applies CTRL's rule to every prompt and generated token (1.0: off).
    ``seed`` (in [0, 2**32)) makes sampling reproducible (``None``: a fresh random seed each
    call); the i-th prompt of a list draws with ``seed + i`` (mod 2**32). Greedy results are the
    same on both paths; sampled ones are reproducible per seed on each path but differ between
    them (the engine draws on the GPU with its own counter-based generator,
    ``engine.kernels.sampling``).
    Generation stops after an EOS token (``eos_token_id``, by default the tokenizer's, else
    the model's generation config's; an int or several, each in the vocabulary; ``[]``: none) or
    ``max_new_tokens``. The prompt and ``max_new_tokens`` must fit the model's context
    (``max_position_embeddings``) on both paths: more is refused before anything runs.
    ``streamer`` (one prompt): a transformers streamer (``TextStreamer``,
    ``TextIteratorStreamer``) that gets the prompt's ids, then each new token as it comes.

    ``adapter_names`` (a list, one name a prompt, ``"__base__"`` for none; a model with named
    adapters, or an engine running one): each prompt is continued with its own adapter, as PEFT's
    ``generate(..., adapter_names=...)`` does (on the engine all at once, ``EngineAdapters.refresh(serve_rows=True)``;
    on the torch path ``LoraModelMixin.per_row_adapters``).

    ``return_ids=True`` returns a ``Generation`` (text, new token ids, prompt ids, whether
    EOS ended it) instead of the text. The model runs in eval mode without gradients; its
    training flag is restored afterwards.
    """
    _check_arguments(max_new_tokens, seed)
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1 (or None: every prompt at once), got {batch_size!r}")
    several = isinstance(prompt, list) and not _is_chat(prompt)
    prompts = prompt if several else [prompt]
    if not prompts:
        raise ValueError("no prompts to generate for: the list is empty")
    if streamer is not None and len(prompts) != 1:
        raise ValueError(f"a streamer prints one generation; {len(prompts)} prompts were given")
    engine = model if isinstance(model, BitNetEngine) else None
    if adapter_names is not None:
        _check_adapter_names(model, adapter_names, len(prompts))
    transformers_model = engine.model if engine is not None else model
    sampling = sampling_settings(do_sample, temperature, top_k, top_p, repetition_penalty,
                                 transformers_model.config.vocab_size)
    eos = _eos_ids(eos_token_id, tokenizer, transformers_model)
    prompt_ids = [_prompt_ids(p, tokenizer, use_template) for p in prompts]
    for ids in prompt_ids:
        check_context(model_context(model), len(ids), max_new_tokens)
    first_seed = int(torch.randint(0, 2**31, (1,))) if seed is None else seed
    seeds = [(first_seed + i) % SEED_LIMIT for i in range(len(prompts))]
    if streamer is not None:
        streamer.put(torch.tensor([prompt_ids[0]]))

    def result(index: int, new_ids: list[int], by_eos: bool) -> str | Generation:
        """Prompt ``index``'s result, handed to ``on_result`` too."""
        generation = Generation(text=tokenizer.decode(new_ids, skip_special_tokens=True), token_ids=new_ids,
                                prompt_ids=prompt_ids[index], finished_by_eos=by_eos)
        out = generation if return_ids else generation.text
        if on_result is not None:
            on_result(index, out)
        return out

    if engine is not None:
        def stream(row: int, token: int) -> bool:
            streamer.put(torch.tensor([token]))
            return False  # the streamer ends nothing

        done: dict[int, str | Generation] = {}

        def finished(index: int, got: Any) -> None:
            done[index] = result(index, *got)

        request = GenerationRequest(prompt_ids, max_new_tokens, eos, seeds=seeds, sampling=sampling,
                                    on_token=stream if streamer is not None else None, adapter_names=adapter_names,
                                    batch_size=batch_size, on_done=finished, tokens_per_submit=tokens_per_submit)
        engine.generate_batch(request)
        out = [done[i] for i in range(len(prompts))]
    else:
        names = adapter_names or [None] * len(prompts)
        out = [result(i, *_generate_on_torch(model, ids, max_new_tokens, eos, seed, streamer, name, **sampling))
               for i, (ids, seed, name) in enumerate(zip(prompt_ids, seeds, names))]
    if streamer is not None:
        streamer.end()
    return out if several else out[0]


def _check_adapter_names(model: Any, adapter_names: Any, prompts: int) -> None:
    """Refuse ``adapter_names`` that ``generate`` cannot honour, saying why."""
    if isinstance(model, BitNetEngine):
        model = model.model
    if not isinstance(model, LoraModelMixin):
        raise ValueError(f"adapter_names picks among a model's named adapters, and this {type(model).__name__} has "
                         "none (apply_lora or load_adapter give a model its adapters and PEFT's adapter API)")
    if not isinstance(adapter_names, list) or len(adapter_names) != prompts:
        raise ValueError(f"adapter_names must be a list of one adapter name a prompt ({prompts} prompts), got "
                         f"{adapter_names!r}")


def _generate_on_torch(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, eos: set[int], seed: int,
                       streamer: Any, adapter: str | None, strategy: str, **processing: Any) -> tuple[list[int], bool]:
    """One prompt's (new ids, whether EOS ended them) from transformers' model with a KV cache, with
    the named ``adapter`` (``LoraModelMixin.per_row_adapters``) where one is given."""
    if max_new_tokens == 0:
        return [], False
    device = next(model.parameters()).device
    generator = None
    if strategy != "greedy":
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), model.per_row_adapters([adapter], 1) if adapter is not None else nullcontext():
            return _decode_loop(model, torch.tensor([prompt_ids], device=device), max_new_tokens, eos, generator,
                                streamer, strategy=strategy, **processing)
    finally:
        model.train(was_training)
