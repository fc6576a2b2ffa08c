"""The README's "Coming from PEFT / TRL" section runs as written, on a tiny BitNet with a chat
template (its folder in place of the real checkpoint's, 2 steps in place of 20), and does what it says."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoTokenizer, BitNetForCausalLM

from torch_wgpu_lora.integrations.bitnet import lora_modules
from torch_wgpu_lora.integrations.peft import load_adapter
from torch_wgpu_lora.integrations.tiny import CHAT_TEMPLATE, build_tiny_bitnet, build_tiny_tokenizer

README = Path(__file__).resolve().parent.parent / "README.md"


def section_code(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def test_coming_from_peft_and_trl_runs_as_written(tmp_path, monkeypatch, capsys):
    folder = build_tiny_bitnet(tmp_path / "bitnet", flavour="dense")
    build_tiny_tokenizer(folder, ["Name a primary colour. Red. Say hello in Spanish. Hola. User: Assistant:"],
                         chat_template=CHAT_TEMPLATE)
    code = section_code("Coming from PEFT / TRL")
    assert code.count("path/to/bitnet-b1.58-2B-4T") == 1 and code.count("max_steps=20") == 2
    code = code.replace("path/to/bitnet-b1.58-2B-4T", str(folder)).replace("max_steps=20", "max_steps=2")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)

    model = scope["model"]
    assert capsys.readouterr().out.startswith("trainable params: ")
    assert len(lora_modules(model)) == 14 and scope["result"].steps == 2
    assert all(m.lora_B.abs().max() > 0 for m in lora_modules(model).values())  # trained
    base = BitNetForCausalLM.from_pretrained(folder).eval()
    ids = AutoTokenizer.from_pretrained(folder)("Hello", return_tensors="pt")
    with torch.no_grad():
        base_logits = base(**ids).logits
        # disable_adapter runs the base layers alone: the base model's own computation
        assert torch.equal(scope["base_logits"], base_logits)
        ours = load_adapter(BitNetForCausalLM.from_pretrained(folder).eval(), tmp_path / "sft" / "adapter")
        theirs = PeftModel.from_pretrained(base, str(tmp_path / "sft" / "adapter")).eval()
        ours_logits, theirs_logits = ours(**ids).logits, theirs(**ids).logits
    # WebGPU adapters against peft's torch ones: 1e-4 of the largest logit (as in test_adapters.py).
    scale = theirs_logits.abs().max().item()
    assert (ours_logits - theirs_logits).abs().max().item() <= 1e-4 * scale
    assert (theirs_logits - base_logits).abs().max().item() > 1e-2 * scale  # the saved adapter is the trained one
