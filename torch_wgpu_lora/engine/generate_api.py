"""transformers' ``generate`` on the engine, translated: ``BitNetEngine.generate(input_ids,
attention_mask=..., generation_config=..., **kwargs)`` takes the arguments a decoder-only model's
``generate`` takes and returns what it returns, a LongTensor [batch, prompt + new tokens] (each row
its input as given, then its new tokens, padded with ``pad_token_id`` after the row ended). This
module only translates: ``TransformersCall.from_arguments`` turns the arguments into the engine's
``GenerationRequest`` (every row generated at once on the GPU, ``BitNetEngine.generate_batch``),
and ``TransformersCall.output`` lays its result out as transformers does.

The settings resolve as transformers resolves them: the ``generation_config`` given (else a blank
one), then what it leaves unset from the model's ``generation_config``, then transformers' own
defaults (``max_length`` 20, ``top_k`` 50, ...), and the keyword arguments over all of them.

Supported: ``max_new_tokens`` (or ``max_length``, counting the prompt), ``min_new_tokens`` (or
``min_length``), ``do_sample`` with ``temperature``, ``top_k`` and ``top_p`` (together: top-p
within the top k, transformers' order), ``repetition_penalty``, ``eos_token_id`` (one or a list),
``pad_token_id`` (default the first EOS token, as transformers), ``stop_strings`` (with
``tokenizer=``: transformers' ``StopStringCriteria`` decides where a row ends),
``num_return_sequences``, and a ``streamer`` (``TextStreamer``, ``TextIteratorStreamer``: one
sequence, as they print one). Settings that change only how transformers computes
(``use_cache``, ``cache_implementation``, ...) are accepted and have no effect here. Anything else
that changes the tokens (beam search, other logits processors, scores in the output, ...) is
refused with an error naming it and pointing to the torch path.

Padding: left or right, each row ones then zeros or zeros then ones in ``attention_mask``. The
pads are dropped: each row runs as its prompt alone would (the engine right-pads internally), so
both paddings give the same tokens; so does transformers for left padding, while for right
padding it continues from the padding's logits (and warns). Sampling draws each row's seed from
torch's default generator (``torch.manual_seed`` makes a call repeatable); the draws are the
engine's own (``engine.kernels.sampling``), not those of transformers' ``torch.multinomial``. The
repetition penalty sees each row's own tokens (transformers' also sees a padded row's pads).

>>> # out = engine.generate(**tokenizer(["Hi", "Name a colour."], padding=True, return_tensors="pt"),
>>> #                       max_new_tokens=32, do_sample=True, top_p=0.9, stop_strings=["\\n"], tokenizer=tokenizer)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from ..limits import check_context
from ..logits import sampling_settings
from .config import EngineConfig
from .generate import GenerationRequest, Generated

__all__ = ["TRANSFORMERS_DEFAULTS", "TransformersCall"]

# transformers' defaults for what neither the call nor the model's generation config sets
# (GenerationConfig leaves them None, generate() fills them in)
TRANSFORMERS_DEFAULTS = {"max_length": 20, "min_length": 0, "do_sample": False, "num_beams": 1, "temperature": 1.0,
                         "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0, "num_return_sequences": 1}
SUPPORTED = {"max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k",
             "top_p", "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id", "stop_strings",
             "num_return_sequences"}
# settings that change how transformers computes, or only apply to what is refused elsewhere
# (beam search, assistant models, encoder-decoder models): nothing here
NO_EFFECT = {"use_cache", "cache_implementation", "cache_config", "max_cache_len", "compile_config",
             "disable_compile", "prefill_chunk_size", "low_memory", "continuous_batching_config",
             "transformers_version", "_from_model_config", "decoder_start_token_id", "length_penalty",
             "early_stopping", "is_assistant", "num_assistant_tokens", "num_assistant_tokens_schedule",
             "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind"}
# the value of each other setting that leaves generation alone (besides None and False)
NEUTRAL = {"num_beams": 1, "num_beam_groups": 1, "typical_p": 1.0, "no_repeat_ngram_size": 0,
           "encoder_no_repeat_ngram_size": 0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
           "encoder_repetition_penalty": 1.0, "diversity_penalty": 0.0, "guidance_scale": 1.0}
# generate()'s own arguments besides the config, each refused unless left empty
HOOKS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model",
         "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate")
TORCH_PATH = ("generate with the transformers model the engine runs instead: engine.model.generate(...) (its "
              "LoRA layers compute on WebGPU or torch as their backend says)")


def _resolve(model_config: Any, generation_config: Any, kwargs: dict) -> tuple[Any, dict]:
    """The generation config transformers' ``generate`` would use, and the keyword arguments that are
    not generation settings."""
    from transformers import GenerationConfig

    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers GenerationConfig, got "
                        f"{type(generation_config).__name__}")
    config = copy.deepcopy(generation_config if generation_config is not None else GenerationConfig())
    if model_config is not None:
        config.update(**model_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**TRANSFORMERS_DEFAULTS, defaults_only=True)
    rest = config.update(**kwargs)
    return config, rest


def _check_supported(config: Any, rest: dict) -> None:
    """Refuse, naming it, every setting that would make transformers generate something the engine does not."""
    for name in HOOKS:
        value = rest.pop(name, None)
        if value is not None and value is not False and not (isinstance(value, (list, tuple)) and not value):
            raise ValueError(f"BitNetEngine.generate does not take {name}; {TORCH_PATH}")
    if rest:
        raise TypeError(f"BitNetEngine.generate got arguments that are neither inputs nor generation settings: "
                        f"{sorted(rest)}")
    if (config.num_beams or 1) > 1:
        raise ValueError(f"BitNetEngine.generate does not do beam search (num_beams={config.num_beams}); {TORCH_PATH}")
    for name, value in config.to_dict().items():
        if name in SUPPORTED or name in NO_EFFECT or value is None or value is False or value == NEUTRAL.get(name):
            continue
        raise ValueError(f"BitNetEngine.generate does not support {name}={value!r}; {TORCH_PATH}")


def _int(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def _token_ids(name: str, value: Any, vocab: int) -> list[int]:
    """An int or a list of ints (token ids in the vocabulary) as a list; None as []."""
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{name} must be a token id or a list of token ids, got {value!r}")
    outside = [i for i in ids if not 0 <= i < vocab]
    if outside:
        raise ValueError(f"{name} {outside[0]} is outside the vocabulary [0, {vocab})")
    return list(ids)


def _prompts(input_ids: Any, attention_mask: Any, vocab: int) -> list[list[int]]:
    """Each row's real tokens: the ids where the mask is 1, the mask left- or right-padding each row."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids [batch, tokens], got "
                        f"{type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids holds no prompt: shape {tuple(input_ids.shape)}")
    ids = input_ids.detach().cpu().long()
    if attention_mask is None:
        mask = torch.ones_like(ids)
    else:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(ids.shape):
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"attention_mask must be a tensor shaped like input_ids {tuple(ids.shape)}, got {shape}")
        mask = attention_mask.detach().cpu().long()
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError("attention_mask must hold only 0 and 1")
    prompts = []
    for row, (r_ids, r_mask) in enumerate(zip(ids, mask)):
        n = int(r_mask.sum())
        if n == 0:
            raise ValueError(f"attention_mask row {row} has no tokens")
        ones = torch.ones(n, dtype=torch.long)
        if not (torch.equal(r_mask[:n], ones) or torch.equal(r_mask[-n:], ones)):
            raise ValueError(f"attention_mask row {row} is neither left- nor right-padded (its ones are not "
                             "contiguous at one end): BitNetEngine.generate takes left or right padding")
        real = r_ids[r_mask.bool()]
        bad = (real < 0) | (real >= vocab)
        if bad.any():
            raise ValueError(f"input_ids row {row} holds token id {int(real[bad][0])}, outside the vocabulary "
                             f"[0, {vocab})")
        prompts.append(real.tolist())
    return prompts


@dataclass(frozen=True)
class TransformersCall:
    """A call of transformers' ``generate`` as the engine runs it: the ``request`` (each returned row's
    prompt, without its padding), and what lays the result out as transformers does (``output``):
    the ``input_ids`` as given, each row repeated ``copies`` times (``num_return_sequences``), rows
    that end early padded with ``pad``, and the ``streamer`` to tell the end."""

    request: GenerationRequest
    input_ids: torch.Tensor
    copies: int
    pad: int
    streamer: Any = None

    @classmethod
    def from_arguments(cls, config: EngineConfig, model_generation_config: Any, input_ids: Any,
                       attention_mask: Any, generation_config: Any, streamer: Any, tokenizer: Any,
                       kwargs: dict[str, Any]) -> TransformersCall:
        """``generate``'s arguments (``kwargs``: its keyword settings), for a model of ``config`` whose
        own ``generation_config`` is ``model_generation_config``, checked and resolved (the module
        docstring); the streamer, if any, then gets the prompt, as transformers' does before the
        first token."""
        resolved, rest = _resolve(model_generation_config, generation_config, kwargs)
        adapter_names = rest.pop("adapter_names", None)
        _check_supported(resolved, rest)
        prompts = _prompts(input_ids, attention_mask, config.vocab)
        if isinstance(adapter_names, (list, tuple)) and len(adapter_names) != len(prompts):
            raise ValueError(f"adapter_names has {len(adapter_names)} names for a batch of {len(prompts)} rows; give "
                             "one a row ('__base__' for a row without adapter)")
        width = input_ids.shape[1]
        if resolved.max_new_tokens is not None:
            max_new = _int("max_new_tokens", resolved.max_new_tokens, 1)
        else:
            max_new = _int("max_length", resolved.max_length, 1) - width
            if max_new < 1:
                raise ValueError(f"max_length={resolved.max_length} leaves no room after the {width}-token input; "
                                 "set max_new_tokens")
        min_new = (_int("min_new_tokens", resolved.min_new_tokens, 0) if resolved.min_new_tokens is not None
                   else max(0, _int("min_length", resolved.min_length, 0) - width))
        for row, prompt in enumerate(prompts):
            try:
                check_context(config.max_positions, len(prompt), max_new)
            except ValueError as err:
                raise ValueError(f"input_ids row {row}: {err}") from None
        copies = _int("num_return_sequences", resolved.num_return_sequences, 1)
        eos = _token_ids("eos_token_id", resolved.eos_token_id, config.vocab)
        pads = _token_ids("pad_token_id", resolved.pad_token_id, config.vocab) or eos[:1]
        stop_strings = resolved.stop_strings
        if stop_strings is not None and tokenizer is None:
            raise ValueError("stop_strings are matched in the decoded text: pass the tokenizer (generate(..., "
                             "tokenizer=tokenizer)), as transformers' generate asks")
        if (stop_strings or eos) and not pads:
            raise ValueError("rows that end early are padded with pad_token_id: give pad_token_id (or eos_token_id)")
        sampling = sampling_settings(bool(resolved.do_sample), resolved.temperature, resolved.top_k, resolved.top_p,
                                     resolved.repetition_penalty, config.vocab)
        rows = [p for p in prompts for _ in range(copies)]
        if streamer is not None and len(rows) != 1:
            raise ValueError(f"a streamer prints one sequence (transformers' TextStreamer takes batch 1); this call "
                             f"generates {len(rows)}")
        seeds = (torch.randint(0, 2 ** 32, (len(rows),), dtype=torch.int64).tolist() if resolved.do_sample
                 else [0] * len(rows))
        if isinstance(adapter_names, (list, tuple)):  # the copies of a row keep its adapter, as PEFT's
            adapter_names = [name for name in adapter_names for _ in range(copies)]
        request = GenerationRequest(rows, max_new, set(eos), seeds=seeds, sampling={"min_new_tokens": min_new,
                                                                                   **sampling},
                                    on_token=_row_hook(rows, streamer, tokenizer, stop_strings),
                                    adapter_names=adapter_names)
        if streamer is not None:
            streamer.put(input_ids.detach().cpu())
        return cls(request, input_ids.detach().cpu().long(), copies, pads[0] if pads else 0, streamer)

    def output(self, generated: list[Generated]) -> torch.Tensor:
        """transformers' layout of the request's ``generated`` tokens: [rows, input + new tokens], each
        row its input as given, then its new tokens, then ``pad``; the streamer, if any, is ended."""
        if self.streamer is not None:
            self.streamer.end()
        width = self.input_ids.shape[1]
        steps = max(len(tokens) for tokens, _ in generated)
        out = torch.full((len(generated), width + steps), self.pad, dtype=torch.long)
        out[:, :width] = self.input_ids.repeat_interleave(self.copies, dim=0)
        for row, (tokens, _) in enumerate(generated):
            out[row, width:width + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return out


def _row_hook(rows: list[list[int]], streamer: Any, tokenizer: Any, stop_strings: Any) -> Any:
    """The ``on_token`` of a generation: the streamer gets each token; a row ends where transformers'
    ``StopStringCriteria`` says its text (prompt and new tokens) ends with a stop string."""
    if streamer is None and not stop_strings:
        return None
    criteria = None
    if stop_strings:
        from transformers import StopStringCriteria

        criteria = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
    sequences = [list(prompt) for prompt in rows]

    def on_token(row: int, token: int) -> bool:
        if streamer is not None:
            streamer.put(torch.tensor([token]))
        if criteria is None:
            return False
        sequences[row].append(token)
        return bool(criteria(torch.tensor([sequences[row]]), None)[0])

    return on_token
