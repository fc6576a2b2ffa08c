"""The Alpaca prompt template, written out in full here so a change to it fails loudly."""

import pytest

from torch_wgpu_lora.prompts import format_prompt

HEADER = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"


def test_template_without_input_has_no_input_block():
    assert format_prompt("Name a primary colour.") == (
        HEADER + "### Instruction:\nName a primary colour.\n\n### Response:\n")


def test_template_with_input_has_input_block():
    assert format_prompt("Add the numbers.", "2 and 3") == (
        HEADER + "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n")


def test_empty_input_is_the_same_as_no_input():
    assert format_prompt("Say hi.", "") == format_prompt("Say hi.")


@pytest.mark.parametrize("instruction", ["", "   ", None])
def test_empty_instruction_is_rejected(instruction):
    with pytest.raises(ValueError, match="instruction must be a non-empty string"):
        format_prompt(instruction)


def test_non_string_input_is_rejected():
    with pytest.raises(TypeError, match="input must be a string, got int"):
        format_prompt("Add one.", 3)
