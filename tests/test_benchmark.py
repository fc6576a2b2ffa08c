"""The benchmark harness runs end to end and reports consistent numbers (small cases)."""

from __future__ import annotations

import json

from torch_wgpu_lora import benchmark
from torch_wgpu_lora.benchmark import Case, breakdown, measure, run, to_markdown, training_step
from torch_wgpu_lora.runtime import get_device


def test_measure_reports_times_checks_and_ratios():
    result = measure(Case(64, 128, 96, 8, True, "tiny"), iters=3, repeats=2)
    assert result.wall_us > 0 and result.staged_us > 0 and result.torch_wall_us > 0
    assert result.dispatches >= 4  # forward (down, up) and the gradient kernels
    assert result.extra["max_rel_err"] < 1e-4  # the same float32 bound as tests/test_ops_lora.py
    if get_device().has_timestamps:
        assert 0 < result.gpu_us and result.tbps > 0
    row = result.row()
    assert row["wall_ratio"] == result.wall_us / result.torch_wall_us
    assert "| tiny | 64 | 8 | fwd+bwd |" in to_markdown([result])


def test_breakdown_names_each_launch():
    names = [name for name, _ in breakdown(Case(16, 64, 32, 4, True, "tiny"), repeats=1)]
    assert names[0] == "lora_down.wgsl:down" and "lora_outer.wgsl:outer" in names and names[-1] == "lora_up.wgsl:up"


def test_run_writes_json_markdown_and_chart(tmp_path):
    run([Case(8, 64, 32, 4, False, "tiny")], out=tmp_path, iters=2, progress=lambda line: None)
    data = json.loads((tmp_path / "lora_op.json").read_text())
    assert data["meta"]["adapter"] == get_device().name and len(data["results"]) == 1
    assert (tmp_path / "lora_op.md").read_text().count("| tiny |") == 1
    assert (tmp_path / "lora_op.png").stat().st_size > 0


def test_training_step_times_both_backends():
    out = training_step(steps=1, batch_size=2)
    assert out["wgpu_ms"] > 0 and out["torch_ms"] > 0 and out["ratio"] == out["wgpu_ms"] / out["torch_ms"]


def test_default_cases_cover_the_issue_grid():
    cases = benchmark.default_cases()
    assert {(c.in_features, c.out_features) for c in cases} == {(2560, 2560), (2560, 640)}
    assert {c.rank for c in cases} == {8, 16} and {c.n for c in cases} == {1, 128, 2048}
    assert {c.backward for c in cases} == {False, True}
