"""The Alpaca prompt template, shared by training data and generation.

>>> print(format_prompt("Name a primary colour."), end="")
Below is an instruction that describes a task. Write a response that appropriately completes the request.
<BLANKLINE>
### Instruction:
Name a primary colour.
<BLANKLINE>
### Response:
>>> "### Input:\\nroses" in format_prompt("Name the flower.", "roses")
True

The response follows the template directly; training appends it, generation lets the
model write it.
"""

from __future__ import annotations

PROMPT_TEMPLATE = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_TEMPLATE_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def check_unicode(text: str, what: str) -> str:
    """``text`` itself if it is valid Unicode; else ValueError naming ``what`` and where the problem is.

    A lone surrogate (``"\\ud800"``: a JSON escape of half a pair, or bytes that were not UTF-8
    decoded with ``errors="surrogateescape"``, as Python does for command lines) is no character,
    and tokenizers refuse it.

    >>> check_unicode("Hi", "the prompt")
    'Hi'
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{what} is not valid Unicode: it holds a lone surrogate {text[err.start]!r} at character "
                         f"{err.start} (invalid UTF-8, or half of an escaped surrogate pair)") from None
    return text


def format_prompt(instruction: str, input: str = "") -> str:
    """``instruction`` (and ``input`` when non-empty) in the Alpaca template, ending at "### Response:\\n"."""
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError(f"instruction must be a non-empty string, got {instruction!r}")
    if not isinstance(input, str):
        raise TypeError(f"input must be a string, got {type(input).__name__}")
    if input:
        return PROMPT_TEMPLATE.format(instruction=instruction, input=input)
    return PROMPT_TEMPLATE_NO_INPUT.format(instruction=instruction)
