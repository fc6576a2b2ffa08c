"""The command line: every subcommand runs, and every user mistake ends in one error line
(``torch-wgpu-lora: error: ...``) with exit status 2, never a traceback."""

from __future__ import annotations

import copy
import functools
import importlib.abc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torch_wgpu_lora.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from torch_wgpu_lora.integrations.adapter_files import load_adapter_file, save_adapter
from torch_wgpu_lora.integrations.bitnet import add_lora_layers, load_bitnet, lora_modules
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


def python_generation(model: Path, adapter: Path | None, prompt: str, **options) -> str:
    """What the library gives for the same request, as the reference for `generate`'s output."""
    from transformers import AutoTokenizer

    from torch_wgpu_lora.generation import generate

    loaded = load_bitnet(model)
    if adapter is not None:
        load_adapter_file(loaded, adapter)
    return generate(loaded, AutoTokenizer.from_pretrained(model), prompt, use_template=True, **options)


def usage_error(capsys, argv: list[str], message: str) -> None:
    """argparse's refusal of an option value: exit status 2, the usage and one error line naming it."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err.strip().splitlines()[-1] and "Traceback" not in err, err


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
    fails_with(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output",
                        str(tmp_path / "run"), "--ddp-bucket-cap-mb", "0"],
               "ddp_bucket_cap_mb must be a number of MiB > 0, got 0.0")


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


@pytest.mark.parametrize("command", ["train", "gradcheck", "demo"])
@pytest.mark.parametrize("alpha", ["nan", "inf", "-1"])
def test_alpha_must_be_a_finite_positive_number(capsys, tiny, tmp_path, command, alpha):
    argv = {"train": ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output",
                      str(tmp_path / "run")],
            "gradcheck": ["gradcheck", "--model", str(tiny["dense"])],
            "demo": ["demo", "--model", str(tiny["dense"]), "--output", str(tmp_path / "demo")]}[command]
    fails_with(capsys, argv + ["--alpha", alpha], f"lora_alpha must be a finite number > 0, got {float(alpha)}")
    assert not (tmp_path / "run").exists() and not (tmp_path / "demo").exists()


def test_a_truncated_weights_file_is_named(capsys, tiny, tmp_path):
    folder = shutil.copytree(tiny["dense"], tmp_path / "model")
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:5000])
    fails_with(capsys, ["generate", "--model", str(folder), "--prompt", "Hi"],
               f"{folder / 'model.safetensors'} is not a complete safetensors file")


def test_a_config_of_another_size_is_named(capsys, tiny, tmp_path):
    folder = shutil.copytree(tiny["dense"], tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    fails_with(capsys, ["generate", "--model", str(folder), "--prompt", "Hi"],
               "the weights do not match config.json: model.layers.0.mlp.down_proj.weight is [64, 96] in the "
               "weights but [64, 128] by config.json")


def test_a_folder_with_pickled_weights_only_is_refused(capsys, tiny, tmp_path):
    folder = shutil.copytree(tiny["dense"], tmp_path / "model")
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    fails_with(capsys, ["generate", "--model", str(folder), "--prompt", "Hi"],
               "has no *.safetensors weights (it holds pytorch_model.bin: pickles")


def test_a_lone_surrogate_in_data_or_prompt(capsys, tiny, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(RECORDS[0]) + "\n" + '{"instruction": "Name \\udfff.", "output": "x"}\n')
    fails_with(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(data), "--output", str(tmp_path / "r")],
               f"{data}, line 2: 'instruction' is not valid Unicode: it holds a lone surrogate '\\udfff'")
    # What Python makes of a command line that is not UTF-8 (os.fsdecode uses surrogateescape).
    prompt = os.fsdecode(b"caf\xe9")
    fails_with(capsys, ["generate", "--model", str(tiny["dense"]), "--prompt", prompt],
               "the prompt is not valid Unicode: it holds a lone surrogate '\\udce9' at character 3")


@pytest.mark.parametrize("engine,message", [
    ("torch", "temperature=1e-45 is too small: logits / temperature overflow float32"),
    ("wgpu", "temperature=1e-45 is not a normal float32 number"),  # the engine samples on the GPU in float32
])
def test_a_temperature_too_small_for_float32(capsys, tiny, engine, message):
    fails_with(capsys, ["generate", "--model", str(tiny["dense"]), "--prompt", "Hi", "--do-sample",
                        "--temperature", "1e-45", "--seed", "0", "--engine", engine], message)


@pytest.mark.parametrize("command", ["train", "gradcheck", "demo"])
@pytest.mark.parametrize("seed", ["-1", str(2 ** 32), "x"])
def test_seed_out_of_range(capsys, tiny, command, seed):
    usage_error(capsys, [command, "--model", str(tiny["dense"]), "--data", "x", "--seed", seed]
                if command != "demo" else [command, "--seed", seed],
                f"argument --seed: must be an integer in [0, 2**32), got '{seed}'")


@pytest.mark.parametrize("seed, given", [("-1", -1), (str(2 ** 32), 2 ** 32), ("x", "x")])
def test_generate_refuses_the_seeds_the_api_refuses_with_its_message(capsys, tiny, seed, given):
    from torch_wgpu_lora.generation import generate

    with pytest.raises(ValueError) as refused:
        generate(None, None, "Hi", seed=given)
    usage_error(capsys, ["generate", "--model", str(tiny["dense"]), "--prompt", "Hi", "--seed", seed],
                f"argument --seed: {refused.value}")


def test_train_refuses_an_example_longer_than_the_context_unless_told_to_cut_it(capsys, tiny, tmp_path):
    data = tmp_path / "long.jsonl"
    data.write_text(tiny["data"].read_text() + json.dumps({"instruction": "Repeat.", "output": "cat " * 400}) + "\n")
    train = ["train", "--model", str(tiny["dense"]), "--data", str(data), "--output", str(tmp_path / "run"),
             "--max-steps", "1", "--no-progress", "--engine", "torch"]
    line = fails_with(capsys, train, f"record {len(RECORDS)}: 512 tokens exceed the model's context of 256 positions "
                                     "(max_position_embeddings); long_examples='truncate' (--long-examples truncate)")
    with pytest.warns(UserWarning, match=f"1 of {len(RECORDS) + 1} records were cut to the model's context of 256"):
        assert main(train + ["--long-examples", "truncate"]) == EXIT_OK, line


@pytest.mark.parametrize("engine", ["torch", "auto"])
def test_generate_past_the_context_is_refused(capsys, tiny, engine):
    line = fails_with(capsys, ["generate", "--model", str(tiny["dense"]), "--prompt", "Hi", "--max-new-tokens",
                               "300", "--engine", engine], "-token prompt and max_new_tokens=300 need 3")
    assert line.endswith("positions; the model's context is 256 (max_position_embeddings)")


def test_epochs_and_max_steps_together_are_refused(capsys, tiny):
    # --epochs 1 is the default number of epochs: giving it must still count as giving it.
    usage_error(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--epochs", "1",
                         "--max-steps", "3"], "argument --max-steps: not allowed with argument --epochs")


def test_an_earlier_runs_output_needs_overwrite(capsys, tiny, tmp_path):
    run = tmp_path / "run"
    train = ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output", str(run),
             "--max-steps", "1", "--rank", "2", "--no-progress"]
    assert main(train) == EXIT_OK
    shutil.rmtree(run / "checkpoints")
    adapter = (run / "adapter" / "adapter_model.safetensors").read_bytes()
    capsys.readouterr()
    fails_with(capsys, train, f"{run} already holds adapter, metrics.jsonl, loss.png of an earlier run: pass "
                              "--overwrite to replace it, or choose another --output")
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() == adapter
    usage_error(capsys, train + ["--overwrite", "--resume"], "argument --resume/--resume-from-checkpoint: not allowed "
                                                             "with argument --overwrite")
    assert main(train + ["--overwrite", "--rank", "4"]) == EXIT_OK
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() != adapter


def test_a_damaged_checkpoint_on_resume_names_the_previous_good_one(capsys, tiny, tmp_path):
    run = tmp_path / "run"
    train = ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output", str(run),
             "--max-steps", "2", "--save-every", "1", "--no-progress"]
    assert main(train) == EXIT_OK
    optimizer = run / "checkpoints" / "step-000002" / "optimizer.safetensors"
    optimizer.write_bytes(optimizer.read_bytes()[:-8])
    capsys.readouterr()
    line = fails_with(capsys, train + ["--resume"], f"checkpoint {run / 'checkpoints' / 'step-000002'} is damaged: "
                                                    f"{optimizer} is truncated or corrupt")
    assert line.endswith(f"the previous good checkpoint is {run / 'checkpoints' / 'step-000001'}: resume from it "
                         f"(resume_from / --resume {run / 'checkpoints' / 'step-000001'})")


def test_generate_with_a_checkpoint_folder_points_to_its_adapter(capsys, tiny, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output", str(run),
                 "--max-steps", "1", "--no-progress"]) == EXIT_OK
    step = run / "checkpoints" / "step-000001"
    capsys.readouterr()
    fails_with(capsys, ["generate", "--model", str(tiny["dense"]), "--adapter", str(step), "--prompt", "Hi"],
               f"{step} is not an adapter folder but holds one (a training checkpoint or output folder?): "
               f"pass {step / 'adapter'}")


def test_a_fifo_adapter_is_refused_before_anything_opens_it(capsys, tiny, tmp_path):
    os.mkfifo(tmp_path / "adapter.lora")
    fails_with(capsys, ["generate", "--model", str(tiny["dense"]), "--adapter", str(tmp_path / "adapter.lora"),
                        "--prompt", "Hi"], "is neither a regular file nor a folder (a FIFO, socket or device?)")


def test_a_bad_shader_checks_variable_is_a_usage_error(tiny):
    # The runtime raises ValueError for a bad value, when it loads or when it compiles a kernel (gradcheck does).
    done = run_module("gradcheck", "--model", str(tiny["packed"]), "--batch", "1", "--seq-len", "4",
                      env={"TORCH_WGPU_LORA_SHADER_CHECKS": "bogus"})
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("torch-wgpu-lora: error: TORCH_WGPU_LORA_SHADER_CHECKS ")


def test_an_error_is_reported_without_importing_what_failed_to_load(capsys, monkeypatch):
    """A bad TORCH_WGPU_LORA_SHADER_CHECKS used to fail the runtime's import; reporting that error then
    imported the trainer (and so the runtime) again, and a second traceback replaced the message."""

    class FailingImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torch_wgpu_lora.training.trainer":
                raise ValueError("TORCH_WGPU_LORA_SHADER_CHECKS must be one of full, bounds, none (simulated)")
            return None

    monkeypatch.delitem(sys.modules, "torch_wgpu_lora.training.trainer", raising=False)
    monkeypatch.setattr(sys, "meta_path", [FailingImport(), *sys.meta_path])
    fails_with(capsys, ["info"], "TORCH_WGPU_LORA_SHADER_CHECKS must be one of full, bounds, none (simulated)")


# -- commands that work ---------------------------------------------------------------------------

def test_generate_with_an_adapter_continues_as_the_library_does(capsys, tiny, tmp_path):
    model = add_lora_layers(load_bitnet(tiny["dense"]), r=4, lora_alpha=8)
    with torch.no_grad():  # nonzero B: the adapter changes the model
        generator = torch.Generator().manual_seed(0)
        for m in lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=generator))
    adapter = save_adapter(model, tmp_path / "adapter")
    prompt = RECORDS[0]["instruction"]
    generate = ["generate", "--model", str(tiny["dense"]), "--prompt", prompt, "--max-new-tokens", "8"]
    assert main(generate + ["--adapter", str(adapter)]) == EXIT_OK
    with_adapter = capsys.readouterr().out
    assert main(generate) == EXIT_OK
    without = capsys.readouterr().out
    assert with_adapter == python_generation(tiny["dense"], adapter, prompt, max_new_tokens=8) + "\n"
    assert without == python_generation(tiny["dense"], None, prompt, max_new_tokens=8) + "\n"
    assert with_adapter != without



def test_generate_stream_prints_the_text_as_the_library_returns_it(capsys, tiny):
    prompt = RECORDS[1]["instruction"]
    for engine in ("torch", "wgpu"):
        assert main(["generate", "--model", str(tiny["dense"]), "--prompt", prompt, "--max-new-tokens", "8",
                     "--stream", "--engine", engine]) == EXIT_OK
        assert capsys.readouterr().out == python_generation(tiny["dense"], None, prompt, max_new_tokens=8) + "\n"


PROMPT_RECORDS = [{"instruction": "Name a primary colour."}, {"prompt": "Count to three.", "id": 7},
                  {"instruction": "Translate the word into French.", "input": "cat"}, {"prompt": "Name a planet."},
                  {"instruction": "Add the numbers.", "input": "2 and 3", "tag": ["x"]}]


def test_generate_for_a_prompts_file_in_batches_resumes_after_an_interruption(capsys, tiny, tmp_path, monkeypatch):
    # Every record's result is the library's for its prompt, in order (two rows on the engine, a
    # finished one taking the next record); an interrupted run leaves whole records only, those done
    # with all before them, and the same command then generates the rest: the file an uninterrupted
    # run writes, byte for byte.
    import torch_wgpu_lora.prompts_file as prompts_file

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPT_RECORDS) + "\n")  # a blank line is skipped
    command = ["generate", "--model", str(tiny["dense"]), "--prompts-file", str(prompts), "--batch-size", "2",
               "--max-new-tokens", "6", "--engine", "wgpu"]
    full = tmp_path / "full.jsonl"
    assert main(command + ["--output", str(full), "--no-progress"]) == EXIT_OK
    assert capsys.readouterr().out == f"{full}: 5 records (5 generated now, 0 by an earlier run)\n"
    results = [json.loads(line) for line in full.read_text().splitlines()]
    for record, result in zip(PROMPT_RECORDS, results, strict=True):
        prompt = {k: record[k] for k in ("instruction", "input") if k in record} or record["prompt"]
        assert result == {**record, "generated_text": python_generation(tiny["dense"], None, prompt,
                                                                        max_new_tokens=6)}
    # without --output, the same records go to standard output, and nothing else does
    assert main(command + ["--no-progress"]) == EXIT_OK
    assert capsys.readouterr().out == full.read_text()

    done = []  # records in the order they complete (2 rows: a finished row takes the next record)
    real = prompts_file.generate

    def interrupted(*args, on_result, **kwargs):
        def counted(index, text):
            on_result(index, text)
            done.append(index)
            if len(done) == 4:
                raise KeyboardInterrupt

        return real(*args, on_result=counted, **kwargs)

    monkeypatch.setattr(prompts_file, "generate", interrupted)
    out = tmp_path / "out.jsonl"
    assert main(command + ["--output", str(out), "--no-progress"]) == 130
    # the records done with all those before them, whole and in order
    kept = next(i for i in range(6) if i not in done)
    assert 0 < kept < 5
    assert out.read_text().splitlines(keepends=True) == full.read_text().splitlines(keepends=True)[:kept]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.jsonl", "out.jsonl", "prompts.jsonl"]  # no temp file
    monkeypatch.setattr(prompts_file, "generate", real)
    capsys.readouterr()
    assert main(command + ["--output", str(out)]) == EXIT_OK
    captured = capsys.readouterr()
    assert captured.out == f"{out}: 5 records ({5 - kept} generated now, {kept} by an earlier run)\n"
    assert "generating" in captured.err and "5/5" in captured.err  # the progress bar
    assert out.read_bytes() == full.read_bytes()
    assert main(command + ["--output", str(out), "--no-progress"]) == EXIT_OK  # nothing left to do
    assert capsys.readouterr().out.endswith("5 records (0 generated now, 5 by an earlier run)\n")


def test_generate_for_a_prompts_file_refuses_bad_records_and_another_files_output(capsys, tiny, tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    command = ["generate", "--model", str(tiny["dense"]), "--prompts-file", str(prompts), "--output", str(out),
               "--max-new-tokens", "2", "--no-progress"]
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n" + json.dumps({"text": "Hi"}) + "\n")
    fails_with(capsys, command, f"{prompts}: line 2 needs exactly one of instruction, prompt, messages; it has none")
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n{not json\n")
    fails_with(capsys, command, f"{prompts}: line 2 is not JSON")
    prompts.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    fails_with(capsys, command, f"{prompts}: line 1: messages must be a non-empty list of objects")
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n" + json.dumps({"prompt": "Bye"}) + "\n")
    out.write_text(json.dumps({"prompt": "Other", "generated_text": "x"}) + "\n")
    fails_with(capsys, command, f"{out}: line 1 is not the result of record 1 of {prompts}")
    fails_with(capsys, command + ["--stream"], "--input and --stream go with --prompt")
    fails_with(capsys, ["generate", "--model", str(tiny["dense"]), "--prompt", "Hi", "--output", str(out)],
               "--output goes with --prompts-file")


def test_train_then_generate_with_the_adapter(capsys, tiny, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output", str(run),
                 "--max-steps", "3", "--batch-size", "2", "--lr", "1e-2", "--rank", "4", "--no-progress"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "trained 3 steps" in out and f"adapter (PEFT layout): {run / 'adapter'}" in out
    model = load_adapter_file(load_bitnet(tiny["dense"]), run / "adapter")
    modules = lora_modules(model)
    assert sorted({name.rsplit(".", 1)[-1] for name in modules}) == ["q_proj", "v_proj"]
    assert all(m.r == 4 and m.lora_B.abs().max() > 0 for m in modules.values())  # trained: B left zero

    assert main(["generate", "--model", str(tiny["dense"]), "--adapter", str(run / "adapter"), "--prompt",
                 RECORDS[0]["instruction"], "--max-new-tokens", "4"]) == EXIT_OK
    assert capsys.readouterr().out == python_generation(tiny["dense"], run / "adapter", RECORDS[0]["instruction"],
                                                        max_new_tokens=4) + "\n"

    # Resuming the finished run with more steps is refused (other settings), naming them.
    fails_with(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output", str(run),
                        "--max-steps", "5", "--batch-size", "2", "--lr", "1e-2", "--rank", "4", "--resume",
                        "--no-progress"], "total_steps: 3 there, 5 here")


def test_the_models_the_commands_make_have_peft_model_api(capsys, tiny, tmp_path, monkeypatch):
    # train, generate --adapter and gradcheck put adapters on their model with the package's exported
    # apply_lora / load_adapter, so it has PeftModel's methods, as a model of torch_wgpu_lora.apply_lora
    # has: peft's trainable counts, the base model's logits with the adapter disabled, named adapters.
    import peft
    from transformers import AutoTokenizer, BitNetForCausalLM

    from torch_wgpu_lora import generation
    from torch_wgpu_lora.integrations import gradcheck
    from torch_wgpu_lora.training import trainer

    made: dict[str, torch.nn.Module] = {}

    real_train = trainer.Trainer.train

    @functools.wraps(real_train)
    def recording_train(self, *args, **kwargs):
        made["train"] = self.model
        return real_train(self, *args, **kwargs)

    @functools.wraps(generation.generate)  # the command line reads its defaults from the signature
    def recording_generate(runner, *args, **kwargs):
        made["generate"] = runner  # --engine torch: the model itself
        return ""

    real_check_parity = gradcheck.check_parity

    @functools.wraps(real_check_parity)
    def recording_check_parity(model, *args, **kwargs):
        made["gradcheck"] = model
        return real_check_parity(model, *args, **kwargs)

    monkeypatch.setattr(trainer.Trainer, "train", recording_train)
    monkeypatch.setattr(generation, "generate", recording_generate)
    monkeypatch.setattr(gradcheck, "check_parity", recording_check_parity)
    dense, run = str(tiny["dense"]), tmp_path / "run"
    assert main(["train", "--model", dense, "--data", str(tiny["data"]), "--output", str(run), "--max-steps", "2",
                 "--lr", "1e-2", "--rank", "4", "--engine", "torch", "--no-progress"]) == EXIT_OK
    assert main(["generate", "--model", dense, "--adapter", str(run / "adapter"), "--prompt", "Hi",
                 "--max-new-tokens", "2", "--engine", "torch"]) == EXIT_OK
    assert main(["gradcheck", "--model", dense, "--rank", "4", "--batch", "1", "--seq-len", "8",
                 "--engine", "torch"]) == EXIT_OK
    capsys.readouterr()
    assert sorted(made) == ["generate", "gradcheck", "train"]

    base = BitNetForCausalLM.from_pretrained(dense).eval()
    peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
                        ).print_trainable_parameters()
    theirs = capsys.readouterr().out
    ids = AutoTokenizer.from_pretrained(dense)("Name a primary colour.", return_tensors="pt")
    with torch.no_grad():
        base_logits = base(**ids).logits
    for command, model in made.items():
        model.print_trainable_parameters()
        assert capsys.readouterr().out == theirs and theirs.startswith("trainable params: "), command
        model.eval()
        with torch.no_grad():
            with model.disable_adapter():  # the base model's own computation: equal, not merely close
                assert torch.equal(model(**ids).logits, base_logits), command
            assert model.adapter_names == ["default"] and model.active_adapter == "default", command
            model.load_adapter(run / "adapter", adapter_name="trained")
            model.set_adapter("trained")
            assert model.active_adapter == "trained", command
            assert not torch.equal(model(**ids).logits, base_logits), command  # the trained adapter is in use


def test_gradcheck_prints_the_table_and_passes(capsys, tiny):
    assert main(["gradcheck", "--model", str(tiny["packed"]), "--batch", "2", "--seq-len", "16"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "| layer | module | param | max abs error | max rel error |" in out
    rows = [line for line in out.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert len(rows) == 2 * 2 * 2  # 2 layers × q/v × A/B
    assert "within the tolerance" in out


def test_gradcheck_exits_1_when_the_kernel_gradients_are_off(capsys, tiny, monkeypatch):
    from torch_wgpu_lora import modules
    from torch_wgpu_lora.ops.lora import base_plus_lora

    # A WebGPU path that is 0.1 % off, far above the tolerance (~1e-5 here) and far below a loud bug.
    monkeypatch.setattr(modules, "base_plus_lora",
                        lambda base, x, A, B, scaling: base_plus_lora(base, x, A, B, scaling * 1.001))
    assert main(["gradcheck", "--model", str(tiny["packed"]), "--batch", "2", "--seq-len", "16",
                 "--engine", "torch"]) == EXIT_FAILED
    assert "ABOVE the tolerance" in capsys.readouterr().out


def test_gradcheck_exits_1_when_the_engine_gradients_are_off(capsys, tiny, monkeypatch):
    from torch_wgpu_lora.engine.model import BitNetEngine

    real = BitNetEngine.loss_and_grads

    def off(self, *args, **kwargs):  # the engine's gradients 0.1 % off
        loss, grads = real(self, *args, **kwargs)
        return loss, {p: g * 1.001 for p, g in grads.items()}

    monkeypatch.setattr(BitNetEngine, "loss_and_grads", off)
    assert main(["gradcheck", "--model", str(tiny["packed"]), "--batch", "2", "--seq-len", "16",
                 "--engine", "wgpu"]) == EXIT_FAILED
    out = capsys.readouterr().out
    assert "ABOVE the tolerance" in out and "BitNetEngine" in out


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
    assert "\nwebgpu:   " in out and "\nsubgroup matrices: " in out and "the buffer pool keeps" in out
    assert main(["info", "--json"]) == EXIT_OK
    info = json.loads(capsys.readouterr().out)
    assert {"adapter", "backend", "limits", "features", "versions", "webgpu", "webgpu_choice",
            "subgroup_matrix_configs", "memory", "settings"} <= set(info)


def test_train_and_generate_take_a_gguf_model(capsys, tiny, tmp_path):
    from torch_wgpu_lora.generation import generate
    from torch_wgpu_lora.integrations.gguf import load_gguf_tokenizer

    from .integrations.helpers import gguf_source, llama3_tokenizer, write_model_gguf

    texts = [format_prompt(r["instruction"], r["input"]) + r["output"] for r in RECORDS] * 4
    path = write_model_gguf(tmp_path / "model.gguf", gguf_source(tmp_path / "source"), "i2_s", "F16", "bitnet-b1.58",
                            llama3_tokenizer(texts))
    run = tmp_path / "run"
    assert main(["train", "--model", str(path), "--data", str(tiny["data"]), "--output", str(run), "--max-steps", "2",
                 "--lr", "1e-2", "--no-progress"]) == EXIT_OK
    capsys.readouterr()
    prompt = RECORDS[0]["instruction"]
    assert main(["generate", "--model", str(path), "--adapter", str(run / "adapter"), "--prompt", prompt,
                 "--max-new-tokens", "6", "--engine", "torch"]) == EXIT_OK
    model = load_adapter_file(load_bitnet(path), run / "adapter")
    assert all(m.lora_B.abs().max() > 0 for m in lora_modules(model).values())  # trained
    expected = generate(model, load_gguf_tokenizer(path), prompt, use_template=True, max_new_tokens=6)
    assert capsys.readouterr().out == expected + "\n"
    fails_with(capsys, ["generate", "--model", str(tmp_path / "none.gguf"), "--prompt", "Hi"],
               f"GGUF file {str(tmp_path / 'none.gguf')!r} does not exist")


# -- real processes -------------------------------------------------------------------------------

def run_module(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch_wgpu_lora", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})


def test_python_m_help_exits_0():
    done = run_module("--help")
    assert done.returncode == 0, done.stderr
    assert "usage: torch-wgpu-lora" in done.stdout


def test_python_m_mistake_exits_2_with_one_line_and_no_traceback(tmp_path):
    done = run_module("train", "--model", str(tmp_path / "missing"), "--data", str(tmp_path / "missing.json"))
    assert done.returncode == EXIT_USAGE
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [f"torch-wgpu-lora: error: no data file at {tmp_path / 'missing.json'}"]


# -- options from a file, and the training loop's options -------------------------------------------

def test_train_reads_options_from_a_config_file_and_the_command_line_wins(capsys, tiny, tmp_path):
    from transformers import get_scheduler

    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {tiny['dense']}\ndata: {tiny['data']}\noutput: {run}\nepochs: 4\nbatch_size: 2\n"
                      "lr: 1.0e-2\nrank: 4\ntargets: all-linear\nlr_scheduler: polynomial\nwarmup-steps: 1\n"
                      "weight_decay: 5e-1\nno_progress: true\n")  # 5e-1: a number, as YAML 1.2 reads it
    # --max-steps on the command line replaces the file's epochs (they exclude each other), --lr its lr.
    assert main(["train", "--config", str(config), "--max-steps", "3", "--lr", "2e-2"]) == EXIT_OK
    assert "trained 3 steps" in capsys.readouterr().out
    lrs = [json.loads(line)["lr"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-2)
    reference = get_scheduler("polynomial", optimizer, num_warmup_steps=1, num_training_steps=3)
    expected = []
    for _ in range(3):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        reference.step()
    assert lrs == expected
    state = json.loads((run / "checkpoints" / "step-000003" / "state.json").read_text())
    assert state["optimizer"]["param_groups"][0]["weight_decay"] == 0.5
    modules = lora_modules(load_adapter_file(load_bitnet(tiny["dense"]), run / "adapter"))
    assert len(modules) == 14 and all(m.r == 4 for m in modules.values())  # all-linear: 7 projections × 2 layers

    json_config = tmp_path / "run.json"
    json_config.write_text(json.dumps({"model": str(tiny["dense"]), "data": str(tiny["data"]), "max_steps": 1,
                                       "output": str(tmp_path / "run2"), "no_progress": True, "warmup": 3}))
    fails_with(capsys, ["train", "--config", str(json_config)], f"--config {json_config}: unknown option 'warmup'")
    fails_with(capsys, ["train", "--config", str(tmp_path / "missing.yaml")], "missing.yaml: no such file")


def config_file(folder: Path, text: str, suffix: str = ".yaml") -> Path:
    path = folder / f"run{suffix}"
    path.write_text(text)
    return path


# (the file's text past model, data and output, the refusal); each refused before anything runs
BAD_CONFIGS = {
    "an alias bomb": ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                      "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n",
                      "line 4: YAML anchors and aliases (&a) are not read in a config file"),
    "an alias of a value": ("rank: &r 4\nalpha: *r\n", "line 4: YAML anchors and aliases (&r)"),
    "resume: a number": ("resume: 5\n", "resume is 5; give true (the newest checkpoint in --output) or a "
                                         "checkpoint folder's path"),
    "an integer as a float": ("rank: 4.5\n", "rank is 4.5; give an integer"),
    "an integer as a bool": ("rank: true\n", "rank is True; give an integer"),
    "a number as text": ("lr: fast\n", "lr is 'fast'; give a finite number"),
    "a number that is not finite": ("lr: .nan\n", "lr is nan; give a finite number"),
    "a flag as text": ("packing: 'yes'\n", "packing is 'yes'; give true or false"),
    "a path as a number": ("eval_data: 42\n", "eval_data is 42; give a string (quote it)"),
    "a list of names holding a number": ("targets: [q_proj, 3]\n", "targets is ['q_proj', 3]; give a name or a "
                                                                   "list of names"),
    "schedule options as a number": ("lr_scheduler_kwargs: 3\n", "lr_scheduler_kwargs is 3; give a mapping"),
    "a choice not offered": ("engine: gpu\n", "engine is 'gpu'; give one of auto, wgpu, torch"),
    "a seed out of range": ("seed: -1\n", "seed: must be an integer in [0, 2**32), got '-1'"),
    "one option under two names": ("max_steps: 1\nmax-steps: 2\n", "'max_steps' and 'max-steps' are the same "
                                                                    "option"),
    "a key given twice": ("rank: 4\nrank: 8\n", "line 5: 'rank' is given twice"),
    "options that exclude each other": ("epochs: 1\nmax_steps: 2\n", "epochs and max_steps cannot be given together"),
    "a list nested past the recursion limit": ("rank: " + "[" * 100_000 + "]" * 100_000 + "\n",
                                               "is nested too deeply to be a file of options"),
}


@pytest.mark.parametrize("bad", list(BAD_CONFIGS))
def test_config_values_are_checked_against_their_options_naming_the_file_and_key(bad, capsys, tiny, tmp_path):
    text, message = BAD_CONFIGS[bad]
    path = config_file(tmp_path, f"model: {tiny['dense']}\ndata: {tiny['data']}\noutput: {tmp_path / 'run'}\n" + text)
    fails_with(capsys, ["train", "--config", str(path)], f"--config {path}")
    fails_with(capsys, ["train", "--config", str(path)], message)
    assert not (tmp_path / "run").exists()


def test_json_configs_are_checked_as_yaml_ones(capsys, tiny, tmp_path):
    base = f'"model": "{tiny["dense"]}", "data": "{tiny["data"]}", "output": "{tmp_path / "run"}"'
    for text, message in [(f'{{{base}, "rank": 4, "rank": 8}}', "'rank' is given twice"),
                          (f'{{{base}, "lr": NaN}}', "NaN is not a JSON number"),
                          (f'{{{base}, "resume": "true", "resume": true}}', "'resume' is given twice"),
                          ("[" * 100_000 + "]" * 100_000, "is nested too deeply")]:
        fails_with(capsys, ["train", "--config", str(config_file(tmp_path, text, ".json"))], message)


def test_a_config_file_is_bounded_in_size_and_text(capsys, tmp_path):
    path = config_file(tmp_path, "# options\n" + "#" * (1 << 20))
    fails_with(capsys, ["train", "--config", str(path)], f"--config {path} is {path.stat().st_size} bytes; a config "
                                                         "file of options is at most 1048576")
    path.write_bytes(b"rank: 4\nlr: \xff\n")
    fails_with(capsys, ["train", "--config", str(path)], f"--config {path} is not UTF-8 text (invalid start byte at "
                                                         "byte 12)")


def test_resume_true_in_a_config_is_the_bare_flag(capsys, tiny, tmp_path):
    # An output folder without checkpoints: --resume looks for its newest one, as resume: true does.
    run = tmp_path / "run"
    common = ["--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output", str(run), "--engine", "torch",
              "--backend", "torch", "--no-progress"]
    message = f"resume_from=True, but {run / 'checkpoints'} holds no checkpoint"
    fails_with(capsys, ["train", *common, "--resume"], message)
    path = config_file(tmp_path, "resume: true\n")
    fails_with(capsys, ["train", "--config", str(path), *common], message)
    path = config_file(tmp_path, "resume: false\noverwrite: true\n")  # false: not given, so --overwrite may be
    assert main(["train", "--config", str(path), *common, "--max-steps", "1"]) == EXIT_OK


def test_one_config_file_and_options_spelled_out(capsys, tiny, tmp_path):
    first = config_file(tmp_path, f"model: {tiny['dense']}\ndata: {tiny['data']}\noutput: {tmp_path / 'run'}\n"
                                  "epochs: 2\n")
    second = tmp_path / "second.yaml"
    second.write_text("max_steps: 1\n")
    fails_with(capsys, ["train", "--config", str(first), f"--config={second}"],
               f"--config given 2 times ({first}, {second}); give one file (files are not merged)")
    # An abbreviation would override a file's key unseen (--max-st for the file's epochs): none is taken.
    usage_error(capsys, ["train", "--config", str(first), "--max-st", "3"], "unrecognized arguments: --max-st 3")
    usage_error(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--conf", str(first)],
                "unrecognized arguments: --conf")
    usage_error(capsys, ["generate", "--model", str(tiny["dense"]), "--prom", "Hi"],
                "one of the arguments --prompt --prompts-file is required")


def test_csv_cells_reading_na_are_text_unless_na_values_says(capsys, tiny, tmp_path):
    data = tmp_path / "train.csv"
    data.write_text("instruction,input,output\nSay it.,,NA\n")
    fails_with(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(data), "--output", str(tmp_path / "run"),
                        "--na-values", "NA,null"], f"{data}, record 0: 'output' is missing (null, or an empty cell)")


def test_every_train_option_has_a_kind_for_config_files():
    from torch_wgpu_lora.cli import _config_kind, build_parser

    options = build_parser().train_options
    assert {_config_kind(action) for action in options.values() if action.dest not in ("help", "config")} == \
        {"flag", "flag-or-path", "integer", "number", "names", "mapping", "string"}


def test_train_flags_of_the_training_loop(capsys, tiny, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--eval-data",
                 str(tiny["data"]), "--output", str(run), "--max-steps", "4", "--batch-size", "2", "--rank", "4",
                 "--eval-every", "1", "--early-stopping-patience", "1", "--early-stopping-threshold", "1e9",
                 "--save-best", "--lr-scheduler", "constant_with_warmup", "--warmup-steps", "2", "--packing",
                 "--group-by-length", "--no-progress"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "trained 2 steps" in out and "(early stopping: 1 evaluations without" in out
    assert f"best adapter: {run / 'best-adapter'}" in out and (run / "best-adapter" / "adapter_config.json").is_file()
    fails_with(capsys, ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output",
                        str(tmp_path / "r2"), "--lr-scheduler", "stepwise"],
               "schedule must be one of transformers' schedulers")
    usage_error(capsys, ["train", "--model", "m", "--data", "d", "--lr-scheduler-kwargs", "[1]"],
                "must be a JSON object")


def test_train_runs_a_trl_style_config_as_trl_parses_it(capsys, tiny, tmp_path):
    # The keys of `trl sft --config` (ScriptArguments, SFTConfig, ModelConfig), read by TRL's own parser
    # as the reference: the run has TRL's values, each meaning what transformers' Trainer makes of it.
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    from .training.helpers import transformers_plan

    run = tmp_path / "run"
    path = config_file(tmp_path, f"""# a TRL-style file
model_name_or_path: {tiny['dense']}
dataset_name: {tiny['data']}
output_dir: {run}
learning_rate: 2.0e-2
num_train_epochs: 1.5
per_device_train_batch_size: 2
gradient_accumulation_steps: 1
lr_scheduler_type: cosine
warmup_steps: 0.25
weight_decay: 0.1
adam_beta1: 0.8
adam_beta2: 0.99
adam_epsilon: 1.0e-6
max_grad_norm: 0.5
seed: 7
save_steps: 0.5
save_total_limit: 3
max_length: 128
packing: false
report_to: none
dtype: float32
use_peft: true
lora_r: 4
lora_alpha: 16
lora_dropout: 0.0
lora_target_modules: [q_proj, v_proj, o_proj]
use_rslora: true
""")
    # bf16 is TRL's default on a GPU; this machine has none (the file leaves it out: train refuses it)
    script, sft, model_config = TrlParser((ScriptArguments, SFTConfig, ModelConfig)).parse_args_and_config(
        ["--config", str(path), "--bf16", "false", "--use_cpu", "true"])
    assert main(["train", "--config", str(path), "--no-progress"]) == EXIT_OK
    plan = transformers_plan(sft, len(RECORDS))
    assert f"trained {plan['max_steps']} steps" in capsys.readouterr().out and plan["max_steps"] == 3
    assert [json.loads(line)["lr"] for line in (run / "metrics.jsonl").read_text().splitlines()] == plan["lrs"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    assert plan["save_steps"] == 2
    state = json.loads((run / "checkpoints" / "step-000003" / "state.json").read_text())
    settings = state["trainer"]["settings"]
    assert (settings["lr"], settings["batch_size"], settings["gradient_accumulation_steps"], settings["seed"],
            settings["max_grad_norm"], settings["schedule"]) == \
        (sft.learning_rate, sft.per_device_train_batch_size, sft.gradient_accumulation_steps, sft.seed,
         sft.max_grad_norm, sft.lr_scheduler_type.value)
    group = state["optimizer"]["param_groups"][0]
    assert (group["weight_decay"], group["betas"], group["eps"]) == \
        (sft.weight_decay, [sft.adam_beta1, sft.adam_beta2], sft.adam_epsilon)
    adapter = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"], set(adapter["target_modules"]),
            adapter["use_rslora"]) == (model_config.lora_r, model_config.lora_alpha, model_config.lora_dropout,
                                       set(model_config.lora_target_modules), model_config.use_rslora)
    assert (script.dataset_name, sft.output_dir, model_config.model_name_or_path) == \
        (str(tiny["data"]), str(run), str(tiny["dense"]))


def test_a_trl_style_config_is_refused_by_name_where_train_differs(capsys, tiny, tmp_path):
    head = f"model_name_or_path: {tiny['dense']}\ndataset_name: {tiny['data']}\noutput_dir: {tmp_path / 'run'}\n"
    for text, message in [
            ("logging_steps: 10\n", "unknown option 'logging_steps'"),
            ("use_peft: false\n", "use_peft is False; train trains LoRA adapters only, so it takes use_peft: true"),
            ("lr: 1.0e-3\nlearning_rate: 1.0e-3\n", "'lr' and 'learning_rate' are the same option"),
            ("lora_r: 4\nrank: 8\n", "'lora_r' and 'rank' are the same option"),
            ("warmup_steps: 2.5\n", "warmup_steps: must be a whole number of steps >= 0 or a fraction in (0, 1)"),
            ("dtype: auto\n", "dtype is 'auto'; give one of float32, bfloat16")]:
        fails_with(capsys, ["train", "--config", str(config_file(tmp_path, head + text))], message)
    assert not (tmp_path / "run").exists()
    # on the command line, one option under two names is refused too (argparse would keep the last)
    common = ["train", "--model", str(tiny["dense"]), "--data", str(tiny["data"]), "--output", str(tmp_path / "run")]
    fails_with(capsys, [*common, "--lr", "1e-3", "--learning-rate=1e-2"], "--lr and --learning-rate are the same "
                                                                           "option; give one")
    fails_with(capsys, [*common, "--output-dir", str(tmp_path / "other")], "--output and --output-dir are the same "
                                                                           "option; give one")
