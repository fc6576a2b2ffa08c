"""The command line: every subcommand runs, and every user mistake ends in one error line
(``torch-wgpu-lora: error: ...``) with exit status 2, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torch_wgpu_lora.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from torch_wgpu_lora.integrations.adapters import load_adapter
from torch_wgpu_lora.integrations.bitnet import load_bitnet, lora_modules
from torch_wgpu_lora.integrations.tiny import build_tiny_bitnet, build_tiny_tokenizer
from torch_wgpu_lora.prompts import format_prompt

RECORDS = [
    {"instruction": "Name a primary colour.", "input": "", "output": "Red."},
    {"instruction": "Translate the word into French.", "input": "cat", "output": "Chat."},
    {"instruction": "Count to three.", "input": "", "output": "One, two, three."},
    {"instruction": "Name a planet.", "input": "", "output": "Mars is a planet."},
]
SUBCOMMANDS = ("train", "generate", "gradcheck", "info", "demo", "bench")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny dense BitNet with its tokenizer in one folder, a packed one, and a data file."""
    root = tmp_path_factory.mktemp("cli")
    texts = [format_prompt(r["instruction"], r["input"]) + r["output"] for r in RECORDS]
    dense = build_tiny_bitnet(root / "dense", flavour="dense")
    build_tiny_tokenizer(dense, texts)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return {"dense": dense, "packed": build_tiny_bitnet(root / "packed", flavour="packed-autobitlinear"),
            "data": data}


def fails_with(capsys, argv: list[str], message: str, code: int = EXIT_USAGE) -> str:
    """Run ``main(argv)``; check the exit status and that stderr is exactly one error line holding ``message``."""
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    # The WebGPU driver may print its own notices (lavapipe without XDG_RUNTIME_DIR); ours is the last line.
    ours = [line for line in err if line.startswith("torch-wgpu-lora:")]
    assert len(ours) == 1 and err[-1] == ours[0], err
    assert "Traceback" not in "\n".join(err)
    assert message in ours[0], ours[0]
    return ours[0]


# -- help -----------------------------------------------------------------------------------------

def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in SUBCOMMANDS:
        assert f"    {command}" in out, command


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: torch-wgpu-lora {command}" in capsys.readouterr().out


def test_demo_help_documents_running_on_a_real_checkpoint(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--model DIR" in out and "microsoft/bitnet-b1.58-2B-4T-bf16" in out


def test_a_missing_required_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--data", "x.json"])
    assert exit_info.value.code == EXIT_USAGE
    assert "the following arguments are required: --model" in capsys.readouterr().err


# -- user mistakes --------------------------------------------------------------------------------

def test_train_missing_data_file(capsys, tiny, tmp_path):
    fails_with(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(tmp_path / "nope.json")],
               f"no data file at {tmp_path / 'nope.json'}")


def test_train_malformed_data_names_the_line(capsys, tiny, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(RECORDS[0]) + "\n{not json\n")
    fails_with(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(data)],
               f"{data}, line 2: not valid JSON")


def test_train_record_without_output(capsys, tiny, tmp_path):
    data = tmp_path / "bad.json"
    data.write_text(json.dumps([{"instruction": "Say hi."}]))
    fails_with(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(data)],
               f"{data}, record 0: the record has no 'output'")


def test_train_unknown_target_module_names_the_existing_ones(capsys, tiny, tmp_path):
    line = fails_with(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]),
                               "--output", str(tmp_path / "run"), "--targets", "q_proj,query"],
                      "target_modules ['query'] match no module")
    assert "'v_proj'" in line


def test_train_missing_model_folder(capsys, tiny, tmp_path):
    fails_with(capsys, ["train", "--model", str(tmp_path / "nowhere"), "--data", str(tiny["data"])],
               "does not exist")


def test_train_model_folder_that_is_not_bitnet(capsys, tiny, tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    fails_with(capsys, ["train", "--model", str(tmp_path / "llama"), "--data", str(tiny["data"])],
               "holds a 'llama' model; load_bitnet loads model_type 'bitnet'")


def test_train_model_folder_without_tokenizer(capsys, tiny):
    fails_with(capsys, ["train", "--model", str(tiny["packed"]), "--data", str(tiny["data"])],
               "has no tokenizer")


def test_train_refuses_an_earlier_run_without_resume(capsys, tiny, tmp_path):
    (tmp_path / "run" / "checkpoints" / "step-000002").mkdir(parents=True)
    fails_with(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]),
                        "--output", str(tmp_path / "run")], "pass --resume to continue it")


def test_train_bad_option_value(capsys, tiny, tmp_path):
    fails_with(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]),
                        "--output", str(tmp_path / "run"), "--batch-size", "0"], "batch_size must be an integer >= 1")


def test_generate_missing_adapter(capsys, tiny, tmp_path):
    fails_with(capsys, ["generate", "--model", str(tiny["dense"]), "--adapter", str(tmp_path / "none"),
                        "--prompt", "Hi"], f"no adapter at {tmp_path / 'none'}")


def test_generate_adapter_for_another_model_size(capsys, tiny, tmp_path):
    assert main(["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output",
                 str(tmp_path / "run"), "--max-steps", "1", "--rank", "2", "--no-progress"]) == EXIT_OK
    wider = build_tiny_bitnet(tmp_path / "wider", flavour="dense", hidden_size=128)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (wider / name).write_bytes((tiny["dense"] / name).read_bytes())
    capsys.readouterr()
    fails_with(capsys, ["generate", "--model", str(wider), "--adapter", str(tmp_path / "run" / "adapter"),
                        "--prompt", "Hi"], "the adapter was made for another model size")


def test_generate_input_needs_the_template(capsys, tiny):
    fails_with(capsys, ["generate", "--model", str(tiny["dense"]), "--prompt", "Add.", "--input", "2 and 3",
                        "--no-template"], "cannot be combined with --no-template")


def test_gradcheck_folder_without_a_checkpoint(capsys, tmp_path):
    fails_with(capsys, ["gradcheck", "--model", str(tmp_path)], "has no config.json")


def test_demo_refuses_a_folder_that_holds_something_else(capsys, tiny, tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    fails_with(capsys, ["demo", "--model", str(tiny["dense"]), "--output", str(tmp_path), "--steps", "1"],
               "is not empty and holds no earlier demo run")
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_training_that_diverges_exits_1_with_the_reason(capsys, tiny, tmp_path):
    # lr 1e30 sends the adapters to inf within a step: three non-finite steps in a row stop training.
    fails_with(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output",
                        str(tmp_path / "run"), "--max-steps", "8", "--lr", "1e30", "--max-grad-norm", "0",
                        "--no-progress"], "training stopped at step", code=EXIT_FAILED)


# -- commands that work ---------------------------------------------------------------------------

def test_train_then_generate_with_the_adapter(capsys, tiny, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output", str(run),
                 "--max-steps", "3", "--batch-size", "2", "--lr", "1e-2", "--rank", "4", "--no-progress"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "trained 3 steps" in out and f"adapter (PEFT layout): {run / 'adapter'}" in out
    model = load_adapter(load_bitnet(tiny["dense"]), run / "adapter")
    modules = lora_modules(model)
    assert sorted({name.rsplit(".", 1)[-1] for name in modules}) == ["q_proj", "v_proj"]
    assert all(m.r == 4 and m.lora_B.abs().max() > 0 for m in modules.values())  # trained: B left zero

    assert main(["generate", "--model", str(tiny["dense"]), "--adapter", str(run / "adapter"), "--prompt",
                 RECORDS[0]["instruction"], "--max-new-tokens", "4"]) == EXIT_OK
    with_adapter = capsys.readouterr().out
    assert main(["generate", "--model", str(tiny["dense"]), "--prompt", RECORDS[0]["instruction"],
                 "--max-new-tokens", "4"]) == EXIT_OK
    without = capsys.readouterr().out
    assert with_adapter.strip() and without.strip()

    # Resuming the finished run with more steps is refused (other settings), naming them.
    fails_with(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output", str(run),
                        "--max-steps", "5", "--batch-size", "2", "--lr", "1e-2", "--rank", "4", "--resume",
                        "--no-progress"], "total_steps: 3 there, 5 here")


def test_gradcheck_prints_the_table_and_passes(capsys, tiny):
    assert main(["gradcheck", "--model", str(tiny["packed"]), "--batch", "2", "--seq-len", "16"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "| layer | module | param | max abs error | max rel error |" in out
    rows = [line for line in out.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert len(rows) == 2 * 2 * 2  # 2 layers × q/v × A/B
    assert "within the tolerance" in out


def test_gradcheck_exits_1_when_the_kernel_gradients_are_off(capsys, tiny, monkeypatch):
    from torch_wgpu_lora import modules
    from torch_wgpu_lora.ops.lora import lora as webgpu_lora

    # A WebGPU path that is 0.1 % off, far above the tolerance (~1e-5 here) and far below a loud bug.
    monkeypatch.setattr(modules, "lora", lambda x, A, B, scaling: webgpu_lora(x, A, B, scaling * 1.001))
    assert main(["gradcheck", "--model", str(tiny["packed"]), "--batch", "2", "--seq-len", "16"]) == EXIT_FAILED
    assert "ABOVE the tolerance" in capsys.readouterr().out


def test_demo_without_a_model_builds_the_demo_model_in_the_cache(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out_dir = tmp_path / "out"
    assert main(["demo", "--output", str(out_dir), "--steps", "2", "--max-new-tokens", "4",
                 "--no-progress"]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"model: {tmp_path / 'cache' / 'torch_wgpu_lora' / 'demo-model-v1'}" in out
    assert "the small randomly initialised demo BitNet" in out
    assert "| layer | module | param | max abs error | max rel error |" in out
    assert out.splitlines()[-1].startswith("loss before ")
    assert (out_dir / "adapter" / "adapter_config.json").is_file()


def test_main_makes_openmp_threads_wait_passively_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_info_text_and_json(capsys):
    assert main(["info"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("adapter:  ") and "max-storage-buffer-binding-size" in out
    assert main(["info", "--json"]) == EXIT_OK
    info = json.loads(capsys.readouterr().out)
    assert {"adapter", "backend", "limits", "features", "versions"} <= set(info)


# -- real processes -------------------------------------------------------------------------------

def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch_wgpu_lora", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_python_m_help_exits_0():
    done = run_module("--help")
    assert done.returncode == 0, done.stderr
    assert "usage: torch-wgpu-lora" in done.stdout


def test_python_m_mistake_exits_2_with_one_line_and_no_traceback(tmp_path):
    done = run_module("train", "--model", str(tmp_path / "missing"), "--data", str(tmp_path / "missing.json"))
    assert done.returncode == EXIT_USAGE
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [f"torch-wgpu-lora: error: no data file at {tmp_path / 'missing.json'}"]
