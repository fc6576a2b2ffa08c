"""The README stays true: its "Ten lines" and "Coming from PEFT / TRL" sections run as written, on a
tiny BitNet (its folder in place of the real checkpoint's, 2 steps in place of 20) and do what they
say; its layout ("How it is built") names only paths that exist, and every module and folder of the
package."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoTokenizer, BitNetForCausalLM

from torch_wgpu_lora.integrations.bitnet import lora_modules
from torch_wgpu_lora.integrations.peft import load_adapter
from torch_wgpu_lora.integrations.tiny import CHAT_TEMPLATE, build_tiny_bitnet, build_tiny_tokenizer
from torch_wgpu_lora.prompts import format_prompt

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PACKAGE = "torch_wgpu_lora"


def section(title: str) -> str:
    return README.read_text(encoding="utf-8").split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def section_code(title: str) -> str:
    (code,) = re.findall(r"```python\n(.*?)```", section(title), flags=re.S)
    return code


def test_the_ten_lines_run_as_written(tmp_path, monkeypatch, capsys):
    records = [{"instruction": "Name a primary colour.", "input": "", "output": "Red."},
               {"instruction": "Count to three.", "input": "", "output": "One, two, three."}]
    folder = build_tiny_bitnet(tmp_path / "bitnet", flavour="dense")
    build_tiny_tokenizer(folder, [format_prompt(r["instruction"], r["input"]) + r["output"] for r in records])
    (tmp_path / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records * 8))  # 4 steps
    code = section_code("Ten lines")
    assert len(code.splitlines()) <= 10 and code.count("path/to/bitnet-b1.58-2B-4T") == 1
    code = code.replace("path/to/bitnet-b1.58-2B-4T", str(folder))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)

    model = scope["model"]
    assert capsys.readouterr().out.strip()  # the generation, printed
    assert hasattr(model, "print_trainable_parameters")  # apply_lora gave it PEFT's model API
    assert len(lora_modules(model)) == 4 and all(m.lora_B.abs().max() > 0 for m in lora_modules(model).values())
    ids = AutoTokenizer.from_pretrained(folder)("Hello", return_tensors="pt")
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(BitNetForCausalLM.from_pretrained(folder).eval(),
                                           str(tmp_path / "my-adapter")).eval()
        ours_logits, theirs_logits = model.eval()(**ids).logits, theirs(**ids).logits
    # WebGPU adapters against peft's torch ones: 1e-4 of the largest logit (as in test_adapter_files.py).
    assert (ours_logits - theirs_logits).abs().max().item() <= 1e-4 * theirs_logits.abs().max().item()


def test_coming_from_peft_and_trl_runs_as_written(tmp_path, monkeypatch, capsys):
    # microsoft/bitnet-b1.58-2B-4T's flavour: packed ternary weights, unpacked into AutoBitLinear
    folder = build_tiny_bitnet(tmp_path / "bitnet", flavour="packed-autobitlinear")
    build_tiny_tokenizer(folder, ["Name a primary colour. Red. Say hello in Spanish. Hola. User: Assistant:"],
                         chat_template=CHAT_TEMPLATE)
    code = section_code("Coming from PEFT / TRL")
    assert code.count("path/to/bitnet-b1.58-2B-4T") == 1 and code.count("max_steps=20") == 3
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
    # WebGPU adapters against peft's torch ones: 1e-4 of the largest logit (as in test_adapter_files.py).
    scale = theirs_logits.abs().max().item()
    assert (ours_logits - theirs_logits).abs().max().item() <= 1e-4 * scale
    assert (theirs_logits - base_logits).abs().max().item() > 1e-2 * scale  # the saved adapter is the trained one
    dpo = scope["dpo"]  # its reference is the policy itself, adapters disabled: no second model
    assert dpo.ref_model.policy is model and dpo.state.global_step == 2
    after_sft = lora_modules(ours)
    assert all(not torch.equal(m.lora_B, after_sft[n].lora_B) for n, m in lora_modules(model).items())  # DPO trained


# -- the layout ----------------------------------------------------------------------------------

# A path the layout names: a folder (``name/``) or a file of a kind the tree holds.
PATH_TOKEN = re.compile(r"(?<![\w/.-])[\w.-]+(?:/[\w.-]+)*(?:/|\.(?:py|md|sh|ipynb|json|wgsl|txt))(?![\w/])")


def layout() -> dict[str, str]:
    """The layout block of "How it is built": {path: its description}, each path at the start of a
    line, its description the rest of that line and the indented lines after it."""
    (block,) = re.findall(r"```\n(.*?)```", section("How it is built"), flags=re.S)
    entries: dict[str, str] = {}
    for line in block.splitlines():
        if line.startswith(" "):
            entries[path] += " " + line.strip()
        else:
            path, _, description = line.partition(" ")
            entries[path] = description.strip()
    return entries


def listed_names(description: str) -> list[str]:
    """The names a package folder's description lists: its items at the top level (commas outside
    parentheses), after the first top-level colon if there is one, each item's first word."""
    pieces, depth, current = [], 0, ""
    for char in description:
        depth += char == "("
        depth -= char == ")"
        if depth == 0 and char in ",:":
            pieces.append((current, char))
            current = ""
        else:
            current += char
    pieces.append((current, ""))
    colon = next((i for i, (_, end) in enumerate(pieces) if end == ":"), None)
    items = [text for text, _ in pieces[colon + 1 if colon is not None else 0:]]
    return [item.strip().split(" ")[0] for item in items if item.strip()]


def ignored(path: Path) -> bool:
    """Whether ``path`` (a folder) is no part of the tree: hidden, or a build output that .gitignore names."""
    patterns = [line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
                if line.strip().endswith("/")]
    relative = path.relative_to(ROOT).as_posix()
    return path.name.startswith(".") or any(fnmatch.fnmatch(path.name, p) or relative == p for p in patterns)


def children(folder: Path) -> list[str]:
    """A folder's modules (without .py) and sub-folders (with a slash), as the layout names them."""
    return sorted([p.stem for p in folder.glob("*.py") if p.name != "__init__.py"]
                  + [f"{p.name}/" for p in folder.iterdir() if p.is_dir() and not ignored(p)])


def test_every_path_the_layout_names_exists():
    missing = []
    for entry, description in layout().items():
        if not (ROOT / entry).exists():
            missing.append(entry)
        base = ROOT / entry if entry.endswith("/") else (ROOT / entry).parent
        missing += [f"{token} (in {entry})" for token in PATH_TOKEN.findall(description) if not (base / token).exists()]
        if entry.startswith(PACKAGE) and entry.endswith("/") and (base / "__init__.py").exists():
            missing += [f"{name} (in {entry})" for name in listed_names(description)
                        if not ((base / f"{name.removesuffix('.py')}.py").exists()
                                or (name.endswith("/") and (base / name).is_dir()))]
    assert not missing, f"the README's layout names what the tree does not hold: {missing}"


def test_the_layout_names_every_module_and_folder():
    entries = layout()
    top = [p for p in ROOT.iterdir() if p.is_dir() and not ignored(p) and p.name != PACKAGE]
    unnamed = [f"{p.name}/" for p in top if f"{p.name}/" not in entries]
    # the package's own files: each an entry, or named in the description of an entry beside it
    beside = " ".join(d for e, d in entries.items() if e.startswith(f"{PACKAGE}/") and not e.endswith("/"))
    for name in children(ROOT / PACKAGE) + ["__init__"]:
        path = f"{PACKAGE}/{name}" if name.endswith("/") else f"{PACKAGE}/{name}.py"
        if path not in entries and not (not name.endswith("/") and re.search(rf"(?<![\w/]){name}\.py\b", beside)):
            unnamed.append(path)
    # each package folder's own modules and sub-folders, in its description
    for entry, description in entries.items():
        folder = ROOT / entry
        if entry.startswith(f"{PACKAGE}/") and entry.endswith("/") and (folder / "__init__.py").exists():
            named = listed_names(description)
            unnamed += [f"{entry}{name}" for name in children(folder) if name not in named]
    assert not unnamed, f"the README's layout does not name {unnamed}"
