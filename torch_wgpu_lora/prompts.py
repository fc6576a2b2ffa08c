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


def format_prompt(instruction: str, input: str = "") -> str:
    """``instruction`` (and ``input`` when non-empty) in the Alpaca template, ending at "### Response:\\n"."""
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError(f"instruction must be a non-empty string, got {instruction!r}")
    if not isinstance(input, str):
        raise TypeError(f"input must be a string, got {type(input).__name__}")
    if input:
        return PROMPT_TEMPLATE.format(instruction=instruction, input=input)
    return PROMPT_TEMPLATE_NO_INPUT.format(instruction=instruction)
