"""The results tables of RESULTS.md and the README: rendered from a results JSON, every figure
of it in its row, and the repository's pages up to date with their results files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from torch_wgpu_lora.benchmarks.tables import PageError, main, render_page, stamp

ROOT = Path(__file__).resolve().parents[2]


def engine_result(**shapes: int) -> dict:
    """An engine benchmark's JSON at BitNet-2B shapes (unless ``shapes`` say otherwise), with
    figures chosen so that each target's status and each ratio is known by hand."""
    return {
        "adapter": "Test GPU (1.0)", "layers": 30, "hidden": 2560, "vocab": 128256, **shapes,
        "ceilings_tera_ops_per_s": {"fma": 10.0, "dp4a": 20.0},
        "engine": {
            "prefill": {"tokens": 512, "tok_per_s": 41234.5, "gpu_ms": 40.3, "dispatches": 393},
            "decode": {"prompt": 16, "new_tokens": 128, "tok_per_s": 999.4, "gpu_ms_per_token": 0.9,
                       "encode_ms_per_token": 0.5, "dispatches_per_token": 215,
                       "host_ms_not_hidden_per_token": 0.4, "host_share_of_token_wall": 0.31},
        },
        "engine_training": {
            "512": {"step_s": 0.0512, "tok_per_s": 10000.0, "dispatches": 1267, "gpu_ms_profiled": 60.0,
                    "lora_grad_kernels_share": 0.0512,
                    "kernels_us": {"bitlinear_t.wgsl:gemm_tiled": 30000.0, "bitlinear.wgsl:gemm": 20000.0,
                                   "norm.wgsl:rmsnorm": 7500.0, "lora_grad.wgsl:db": 2500.0},
                    "rates": {"bitlinear_t.wgsl:gemm_tiled": {"tera_ops_per_s": 5.0, "share_of_ceiling": 0.5},
                              "bitlinear.wgsl:gemm": {"tera_ops_per_s": 10.0, "share_of_ceiling": 0.5}}},
            "512_response_only": {"step_s": 0.09, "tok_per_s": 5688.9},
            "512_dropout": {"step_s": 0.11, "tok_per_s": 4654.4},
            "256": {"step_s": 0.06, "tok_per_s": 4266.7, "gpu_ms_profiled": 59.0},
            "peak_gpu_bytes": 6_064_835_024,
        },
        "hf_peft": {"prefill": {"tok_per_s": 6172.8}, "decode": {"tok_per_s": 13.7}},
        "hf_peft_training": {"512": {"tok_per_s": 10200.0}, "512_response_only": {"tok_per_s": 2844.45},
                             "512_dropout": {"tok_per_s": 4654.4}, "256": {"tok_per_s": 1000.0},
                             "peak_memory_bytes": 12_129_670_048},
    }


def page_of(tmp_path: Path, kind: str, data: dict, name: str = "engine.json",
            commit: str = "abc1234", date: str = "2026-12-05") -> str:
    """``kind``'s table of ``data``, as a page in ``tmp_path`` renders it."""
    (tmp_path / "results").mkdir(exist_ok=True)
    (tmp_path / "results" / name).write_text(json.dumps(data))
    stamp(tmp_path / "results" / name, commit, date)
    return render_page(f"# Page\n<!-- table {kind} results/{name} -->\nstale\n<!-- end table -->\nafter\n", tmp_path)


def rows_of(page: str) -> dict[str, list[str]]:
    """The page's table rows: first cell -> the other cells (the header row included)."""
    rows = {}
    for line in page.splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows[cells[0]] = cells[1:]
    return rows


def test_the_engine_table_shows_each_figure_of_the_run_with_its_target(tmp_path):
    page = page_of(tmp_path, "engine", engine_result())
    assert "*Test GPU (1.0); commit `abc1234`, 2026-12-05; [`results/engine.json`](results/engine.json).*" in page
    assert "stale" not in page and page.startswith("# Page\n") and page.endswith("<!-- end table -->\nafter\n")
    rows = rows_of(page)
    assert rows["figure"] == ["engine", "HF + PEFT", "engine / HF", "target"]
    assert rows["prefill, a 512-token prompt"] == ["41,234 tok/s", "6,173 tok/s", "6.68×", "≥ 40,000 tok/s: met"]
    assert rows["decode, 128 greedy tokens after a 16-token prompt"] == [
        "999 tok/s", "13.7 tok/s", "72.9×", "≥ 1,000 tok/s: **missed**"]  # 999.4 / 13.7 = 72.95
    assert rows["training, seq 512"] == ["10,000 tok/s", "10,200 tok/s", "0.98×",
                                         "≥ 10,000 tok/s: met; ≥ HF + PEFT: **missed**"]
    assert rows["training, seq 512, loss on the second half only (the first a prompt)"] == [
        "5,689 tok/s", "2,844 tok/s", "2.00×", ""]
    assert rows["training, seq 512, LoRA dropout 0.05"] == ["4,654 tok/s", "4,654 tok/s", "1.00×", ""]
    assert rows["training, seq 256"] == ["4,267 tok/s", "1,000 tok/s", "4.27×", ""]
    assert rows["peak GPU memory, training (seq 512)"] == ["6.06 GB", "12.13 GB", "0.50×", "≤ 0.6× HF + PEFT: met"]
    assert rows["training step, seq 512: GPU time (per-dispatch profile), launches"][0] == "60.0 ms, 1,267 launches"
    assert rows["the adapters' gradient kernels' share of that step's GPU time"] == [
        "5.12%", "", "", "≤ 5%: **missed**"]
    assert rows["prefill: GPU time of the pass, launches"][0] == "40.3 ms, 393 launches"
    assert rows["decode: GPU time a token, launches a token; host time recording a token"][0] == (
        "0.900 ms, 215 launches; 0.500 ms")
    assert rows["decode: host time a token not hidden behind the GPU's, share of the token's wall time"] == [
        "0.400 ms, 31.0%", "", "", "≤ 15%: **missed**"]


def test_targets_apply_at_bitnet_2b_shapes_only(tmp_path):
    small = engine_result(hidden=256, vocab=4096)
    del small["hf_peft"], small["hf_peft_training"]
    rows = rows_of(page_of(tmp_path, "engine", small))
    assert rows["figure"] == ["engine"]  # no HF column, no target column
    assert rows["prefill, a 512-token prompt"] == ["41,234 tok/s"]


def test_the_summary_shows_the_throughputs_and_memory_of_the_same_run(tmp_path):
    rows = rows_of(page_of(tmp_path, "engine-summary", engine_result()))
    assert rows[""] == ["engine", "HF + PEFT", "engine / HF"]
    assert list(rows)[1:] == ["prefill, a 512-token prompt", "decode, 128 greedy tokens after a 16-token prompt",
                              "training, seq 512",
                              "training, seq 512, loss on the second half only (the first a prompt)",
                              "training, seq 512, LoRA dropout 0.05", "training, seq 256",
                              "peak GPU memory, training (seq 512)"]
    assert rows["training, seq 256"] == ["4,267 tok/s", "1,000 tok/s", "4.27×"]


def test_the_batched_table_sets_the_engine_beside_each_hf_configuration_and_the_best(tmp_path):
    result = engine_result()
    result["batched"] = {
        "engine": {"1x512": {"train_tok_per_s": 3000.0, "prefill_tok_per_s": 12000.0},
                   "8x512": {"train_tok_per_s": 8400.0, "prefill_tok_per_s": 20000.0}},
        "hf_eager": {"1x512": {"train_tok_per_s": 4000.0, "prefill_tok_per_s": 10000.0},
                     "8x512": {"train_tok_per_s": 4000.0, "prefill_tok_per_s": 50000.0}},
        "hf_compiled": {"1x512": {"train_tok_per_s": 6000.0, "prefill_tok_per_s": 8000.0},
                        "8x512": {"train_tok_per_s": 4100.0}},  # a prefill that did not compile: no figure
    }
    rows = rows_of(page_of(tmp_path, "batched", result))
    assert rows[""] == ["engine", "HF + PEFT, eager", "HF + PEFT, torch.compile", "engine / best HF", "target"]
    assert rows["training, 1 × 512 tokens a step"] == ["3,000 tok/s", "4,000 tok/s", "6,000 tok/s", "0.50×", ""]
    assert rows["prefill, 1 × 512 tokens a step"] == ["12,000 tok/s", "10,000 tok/s", "8,000 tok/s", "1.20×", ""]
    # 8,400 ≥ 2 × 4,100 = 8,200: met, against the best of the two, not the eager one alone
    assert rows["training, 8 × 512 tokens a step"] == ["8,400 tok/s", "4,000 tok/s", "4,100 tok/s", "2.05×",
                                                        "≥ 2× the best: met"]
    assert rows["prefill, 8 × 512 tokens a step"] == ["20,000 tok/s", "50,000 tok/s", "", "0.40×", ""]
    result["batched"]["hf_compiled"]["8x512"]["train_tok_per_s"] = 4300.0  # 2× is 8,600 now
    assert rows_of(page_of(tmp_path, "batched", result))["training, 8 × 512 tokens a step"][-1] == \
        "≥ 2× the best: **missed**"


def test_the_gemm_rates_take_each_kinds_best_variant_beside_torchs_kernel(tmp_path):
    variant = {"rows": 4, "cols": 2, "tm": 2, "tn": 4, "ks": 128, "pad": 16, "prefetch": True, "split": True}
    data = {
        "torch": [{"m": 512, "n": 13824, "k": 2560, "int8_tera_ops_per_s": 100.0, "bf16_tera_ops_per_s": 600.0}],
        "variants": [
            {**variant, "kind": "i8", "m": 512, "n": 13824, "k": 2560, "us": 300.0, "tera_ops_per_s": 120.0},
            {**variant, "kind": "i8", "m": 512, "n": 13824, "k": 2560, "ks": 64, "prefetch": False,
             "us": 700.0, "tera_ops_per_s": 35.0},
            {**variant, "kind": "f16nt", "m": 512, "n": 13824, "k": 2560, "us": 1200.0, "tera_ops_per_s": 30.0},
            {**variant, "kind": "f16nt", "m": 512, "n": 13824, "k": 2560, "error": "did not compile"},
            {**variant, "kind": "i8", "m": 64, "n": 64, "k": 64, "us": 1.0, "tera_ops_per_s": 0.5},  # no torch row
        ]}
    rows = rows_of(page_of(tmp_path, "gemm-rates", data, name="subgroup_matrix.json"))
    assert rows["`i8` 512×13824×2560"] == ["4×2 subgroups of 2×4 tiles, K step 128, prefetch", "300.0", "120.0",
                                          "100.0", "120.0%", "≥ 40%: met"]
    assert rows["`f16nt` 512×13824×2560"] == ["4×2 subgroups of 2×4 tiles, K step 128, prefetch", "1,200.0",
                                             "30.0", "600.0", "5.00%", "≥ 40%: **missed**"]
    assert rows["`i8` 64×64×64"][2:] == ["0.5", "", "", ""]


def test_the_matrix_units_table_takes_each_kinds_best_tile_and_its_share_of_the_ceiling(tmp_path):
    tile = {"sub_m": 4, "sub_n": 2, "tm": 2, "tn": 4, "kstep": 128, "pad": 16, "digits": 1}
    row = {"projection": "down", "tokens": 512, "rows": 2560, "k": 6912}
    data = {
        "adapter": "Test GPU", "ceiling": {"i8": {"rate": 1000e12}},
        "torch": [{"projection": "down", "tokens": 512, "dtype": "bf16", "rate": 600e12},
                  {"projection": "down", "tokens": 512, "dtype": "int8", "rate": 70e12}],
        "gemms": [
            {**row, "kind": "projection", "variant": "general", "tile": None, "rate": 80e12, "integer_rate": 80e12},
            {**row, "kind": "projection", "variant": "matrix_units", "tile": tile, "rate": 200e12,
             "integer_rate": 200e12},
            {**row, "kind": "projection", "variant": "matrix_units", "tile": {**tile, "kstep": 64}, "rate": 150e12,
             "integer_rate": 150e12},
            {**row, "kind": "input_grad", "variant": "matrix_units", "tile": {**tile, "digits": 4}, "rate": 50e12,
             "integer_rate": 200e12},  # four digit planes: four times the useful work
        ]}
    rows = rows_of(page_of(tmp_path, "matrix-units", data, name="matrix_units.json"))
    assert rows["projection `down` 512×2560×6912"] == ["80.0", "200.0", "4×2 subgroups of 2×4, K step 128", "20.0%",
                                                      "600", "70"]
    assert rows["input_grad `down` 512×6912×2560"] == ["", "50.0", "4×2 subgroups of 2×4, K step 128", "20.0%",
                                                      "600", "70"]


def test_the_backend_kernels_table_sets_each_backends_time_side_by_side(tmp_path):
    kernels = {"rmsnorm_512_lora": 26.8, "rmsnorm_512": 10.1, "rmsnorm_1_lora": 6.6, "rmsnorm_1": 6.5,
               "gemv_qkv_1": 6.2}
    data = {"adapter": "Test GPU", "kernels_us": {"dawn": kernels, "wgpu-native": {k: v / 2 for k, v in kernels.items()}}}
    rows = rows_of(page_of(tmp_path, "backend-kernels", data, name="backend_kernels.json"))
    assert rows["kernel (µs)"] == ["dawn", "wgpu-native"]
    assert rows["RMSNorm, 512 tokens, quantised, 16 LoRA ranks"] == ["26.8", "13.4"]
    assert rows["q/k/v GEMV, 1 token"] == ["6.2", "3.1"]


def test_the_decode_batches_table_counts_every_rows_tokens(tmp_path):
    result = engine_result()
    result["decode_batches"] = {"16": {"prompt": 16, "new_tokens": 128, "tok_per_s": 8000.0},
                                "64": {"prompt": 16, "new_tokens": 128, "tok_per_s": 12800.0},
                                "3": {"prompt": 16, "new_tokens": 128, "tok_per_s": 1500.0}}  # no target at 3
    rows = rows_of(page_of(tmp_path, "decode-batches", result))
    assert list(rows)[1:] == [f"{n} prompt{'s' if n > 1 else ''} of 16 tokens, 128 new each" for n in (1, 3, 16, 64)]
    assert rows["1 prompt of 16 tokens, 128 new each"] == ["999 tok/s", "999 tok/s", "≥ 1,000 tok/s: **missed**"]
    assert rows["3 prompts of 16 tokens, 128 new each"] == ["1,500 tok/s", "500 tok/s", ""]
    assert rows["16 prompts of 16 tokens, 128 new each"] == ["8,000 tok/s", "500 tok/s", "≥ 8,000 tok/s: met"]
    assert rows["64 prompts of 16 tokens, 128 new each"] == ["12,800 tok/s", "200 tok/s", "≥ 25,000 tok/s: **missed**"]


def test_the_prompts_file_table_puts_continuous_batching_beside_static_batches(tmp_path):
    result = engine_result()
    result["prompts_file"] = {
        "prompts": 256, "batch": 64, "max_new_tokens": 128, "eos_tokens": 4008,
        "prompt_tokens": {"min": 5, "mean": 30.2, "max": 61},
        "static": {"wall_s": 40.0, "new_tokens": 8000, "tok_per_s": 200.0,
                   "completions": {"mean": 31.25, "max": 128, "at_limit": 9}},
        "prompts_file": {"wall_s": 16.0, "new_tokens": 8000, "tok_per_s": 500.0,
                         "completions": {"mean": 31.25, "max": 128, "at_limit": 9}},
        "prompts_file_over_static": 2.5}
    rows = rows_of(page_of(tmp_path, "prompts-file", result))
    what = "256 records of 5 to 61 prompt tokens, up to 128 new, 64 at once"
    assert rows[f"{what}: static batches"] == ["200 tok/s", "31.2 (max 128, 9 at the limit)", "40.0 s", ""]
    assert rows[f"{what}: prompts file (continuous batching)"] == ["500 tok/s", "31.2 (max 128, 9 at the limit)",
                                                                   "16.0 s", "2.50×; ≥ 2.00×: met"]
    small = {**result, "hidden": 256}  # no target away from BitNet-2B's shapes
    assert rows_of(page_of(tmp_path, "prompts-file", small))[f"{what}: prompts file (continuous batching)"][3] == \
        "2.50×"


def test_the_decode_batches_table_puts_hf_generate_beside_ours(tmp_path):
    result = engine_result()
    result["decode_batches"] = {"16": {"prompt": 16, "new_tokens": 128, "tok_per_s": 2000.0}}
    result["hf_generate"] = {"eager": {"1": {"tok_per_s": 30.0}, "16": {"tok_per_s": 400.0}},
                             "static_compiled": {"16": {"tok_per_s": 2500.0}, "4": {"tok_per_s": 900.0}}}
    rows = rows_of(page_of(tmp_path, "decode-batches", result))
    assert list(rows)[3:] == ["HF + PEFT `generate`, eager: 1 prompt", "HF + PEFT `generate`, eager: 16 prompts",
                              "HF + PEFT `generate`, static cache, compiled: 4 prompts",
                              "HF + PEFT `generate`, static cache, compiled: 16 prompts"]
    assert rows["HF + PEFT `generate`, eager: 1 prompt"] == ["30.0 tok/s", "30.0 tok/s", "ours 33.31×"]  # 999.4 / 30
    assert rows["HF + PEFT `generate`, static cache, compiled: 16 prompts"] == ["2,500 tok/s", "156 tok/s",
                                                                              "ours 0.80×"]
    assert rows["HF + PEFT `generate`, static cache, compiled: 4 prompts"][2] == ""  # we ran no batch of 4


def test_kernel_rates_and_the_training_bound_come_from_the_longest_step(tmp_path):
    # seq 512 at 10,000 tok/s: 51.2 ms. The float32 GEMM: 30 ms at 50% of 10 TFLOP/s (1.5e11 flops,
    # 15 ms at the ceiling); the int8 GEMM 20 ms at 50% of 20 T/s (10 ms); the rest 10 ms. At the
    # ceilings: 15 + 10 + 10 = 35 ms, 14,629 tok/s. The int8 GEMM and the rest as they are: 30 ms,
    # leaving 21.2 ms for 1.5e11 flops: 7.08 TFLOP/s, 70.8% of the ceiling.
    page = page_of(tmp_path, "kernel-rates", engine_result())
    rows = rows_of(page)
    assert "*Ceilings measured in the same run: 10.0 TFLOP/s float32 (fma), 20.0 T int8 ops/s (dot4I8Packed).*" in page
    assert rows["input gradients through the ternary weights (float32) (`bitlinear_t.wgsl:gemm_tiled`)"] == [
        "30,000", "5.0 TFLOP/s", "50.0%"]
    assert rows["ternary projections, forward (int8 codes × ternary weights) (`bitlinear.wgsl:gemm`)"] == [
        "20,000", "10.0 T int8 ops/s", "50.0%"]
    assert rows[next(k for k in rows if k.startswith("every other kernel"))] == ["10,000", "", ""]
    assert rows["**the step** (1,267 launches)"] == ["60,000", "", ""]
    bound = page_of(tmp_path, "training-bound", engine_result())
    for phrase in ["a step of 512 tokens has 51.2 ms", "this run's took 51.2 ms (60.0 ms of profiled GPU time)",
                   "25.0 ms at 100% of their ceilings", "(10.0 ms) a step would take 35.0 ms, 14,629 tok/s",
                   "as they are (30.0 ms)",
                   "(15.0 ms of work at the fma ceiling, 30.0 ms in this run)", "7.1 TFLOP/s, 70.8% of the"]:
        assert phrase in bound, phrase


def test_the_batched_profile_shows_each_kernels_share_and_gathers_the_small_ones(tmp_path):
    # 8 × 512: 100 ms in all; the norm's 0.9 ms is under 1% there but 2% of 1 × 512's 50 ms, so it
    # keeps its row; the copy (0.4 ms, 0.5 ms) is under 1% of both and joins the last row
    result = {"adapter": "Test GPU (1.0)", "batched": {"engine": {
        "1x512": {"train_tok_per_s": 1.0, "train_kernels_us": {"bitlinear_mma.wgsl:gemm": 48600.0,
                                                                "norm.wgsl:rmsnorm": 1000.0, "copy.wgsl:copy": 400.0}},
        "8x512": {"train_tok_per_s": 1.0, "train_kernels_us": {"bitlinear_mma.wgsl:gemm": 60000.0,
                                                                "matmul_mma.wgsl:gemm_tiled": 38600.0,
                                                                "norm.wgsl:rmsnorm": 900.0, "copy.wgsl:copy": 500.0}},
        "2x16": {"train_tok_per_s": 1.0}}}}  # a shape measured without a profile: no column
    rows = rows_of(page_of(tmp_path, "batched-profile", result))
    assert rows["training step, GPU ms (share)"] == ["1 × 512 tokens", "8 × 512 tokens"]
    forward = next(k for k in rows if "`bitlinear_mma.wgsl:gemm`" in k)
    assert rows[forward] == ["48.6 (97.2%)", "60.0 (60.0%)"]
    assert rows[next(k for k in rows if "`matmul_mma.wgsl:gemm_tiled`" in k)] == ["0.0 (0.00%)", "38.6 (38.6%)"]
    assert rows[next(k for k in rows if "`norm.wgsl:rmsnorm`" in k)] == ["1.0 (2.00%)", "0.9 (0.90%)"]
    assert not any("copy" in k for k in rows)
    assert rows["every other kernel (under 1.00% of the step)"] == ["0.4 (0.80%)", "0.5 (0.50%)"]
    assert rows["**the step**"] == ["50.0", "100.0"]
    assert list(rows).index(forward) < list(rows).index(next(k for k in rows if "matmul_mma" in k))
    with pytest.raises(PageError, match="train_kernels_us"):
        page_of(tmp_path, "batched-profile", {"adapter": "Test GPU", "batched": {"engine": {"2x16": {}}}})


def test_the_training_bound_says_when_the_target_needs_more_than_the_ceiling(tmp_path):
    slow = engine_result()
    slow["engine_training"]["512"]["kernels_us"]["norm.wgsl:rmsnorm"] = 37500.0  # the rest: 40 ms
    slow["engine_training"]["512"]["gpu_ms_profiled"] = 90.0
    bound = page_of(tmp_path, "training-bound", slow)
    # the int8 GEMM and the rest: 60 ms, over the 51.2 ms a step has
    assert "as they are (60.0 ms) leave 0.0 ms for float32 GEMM work that takes 15.0 ms" in bound
    assert "the target needs more than the ceiling" in bound


def test_the_decode_chain_table_lists_each_kind_of_launch(tmp_path):
    data = {"adapter": "Test GPU (1.0)", "layers": 2, "dispatches": 95, "token_us": 1234.5, "copy_chain_us": 180.2,
            "kinds": {"norm.wgsl:rmsnorm": {"launches": 61, "marginal_us": 300.25, "only_us": 200.0},
                      "my.wgsl:new_kind": {"launches": 34, "marginal_us": 700.0, "only_us": 650.5}}}
    rows = rows_of(page_of(tmp_path, "decode-chain", data, "decode_chain.json"))
    assert rows["**the whole step**"] == ["95", "**1,234.5**", ""]
    assert rows["my.wgsl:new_kind (`my.wgsl:new_kind`)"] == ["34", "700.0", "650.5"]
    assert rows[next(k for k in rows if k.startswith("RMSNorm"))] == ["61", "300.2", "200.0"]
    assert rows["95 one-workgroup copies (dependent launches doing almost nothing)"] == ["95", "", "180.2"]
    assert list(rows).index("my.wgsl:new_kind (`my.wgsl:new_kind`)") < list(rows).index(
        next(k for k in rows if k.startswith("RMSNorm")))  # the costlier kind alone first
    # 180.2 µs / 95 copies = 1.897 µs a dependent launch; 5 launches a layer x 2 layers: 19 µs; the
    # kinds other than the norms alone: 650.5 µs, 1,537 tok/s
    bound = page_of(tmp_path, "decode-bound", data, "decode_chain.json")
    for phrase in ["costs 1.9 µs in a chain (95 copies: 180.2 µs)", "would cost 19 µs",
                   "take 650.5 µs a token without the norm launches", "at most 1,537 tok/s"]:
        assert phrase in bound, phrase


def test_the_drop_in_table_reads_the_figures_alone_or_inside_an_engine_run(tmp_path):
    drop_in = {"seq": 256, "wgpu_over_torch": 1.0161, "paired_ratio": 1.0297,
               "paired_interval": [0.9863, 1.0717, 0.9773],
               "wgpu": {"step_s": 4.4635, "steps_s": [4.4635, 3.94, 5.12], "adapters_s": 0.2372,
                        "page_faults": 128300.0, "adapter_s": 0.2004, "upload_s": 0.0322, "wait_s": 0.0346},
               "torch": {"step_s": 4.3926, "steps_s": [4.3926, 3.72, 4.78], "adapters_s": 0.0880,
                         "page_faults": 128375.0},
               "base": {"step_s": 4.3029, "steps_s": [4.3029, 3.65, 4.66], "page_faults": 128261.0}}
    for data in (drop_in, {"adapter": "Test GPU (1.0)", "drop_in": drop_in}):
        page = page_of(tmp_path, "drop-in", data, "drop_in.json")
        rows = rows_of(page)
        assert rows["training step, seq 256 (median of 3 turns)"] == ["4.46 s", "4.39 s", "4.30 s"]
        assert rows["fastest to slowest turn"] == ["3.94 to 5.12 s", "3.72 to 4.78 s", "3.65 to 4.66 s"]
        assert rows[next(k for k in rows if k.startswith("what the adapters add"))] == ["0.237 s", "0.088 s", ""]
        assert rows["minor page faults a step"] == ["128,300", "128,375", "128,261"]
        for phrase in ["1.016 (the medians' ratio)", "1.030 (the median of the turns' ratios), 0.986 to 1.072 "
                       "with 98% confidence", "0.200 s a step", "uploads 0.032 s", "waits for results 0.035 s"]:
            assert phrase in page, phrase


def test_a_page_names_what_it_cannot_render(tmp_path):
    (tmp_path / "engine.json").write_text(json.dumps(engine_result()))
    with pytest.raises(PageError, match="runs.json records no commit and date for engine.json"):
        render_page("<!-- table engine engine.json -->\n<!-- end table -->", tmp_path)
    stamp(tmp_path / "engine.json", "abc1234", "2026-12-05")
    with pytest.raises(PageError, match=r"page.md, line 2: unknown table kind 'engines'"):
        render_page("x\n<!-- table engines engine.json -->\n<!-- end table -->", tmp_path, "page.md")
    with pytest.raises(PageError, match=r"line 1: the table has no '<!-- end table -->' line"):
        render_page("<!-- table engine engine.json -->\n<!-- table engine engine.json -->\n<!-- end table -->",
                    tmp_path)
    with pytest.raises(PageError, match="missing.json: no such results file"):
        render_page("<!-- table engine missing.json -->\n<!-- end table -->", tmp_path)
    with pytest.raises(PageError, match=r"lacks what a 'decode-chain' table shows"):
        render_page("<!-- table decode-chain engine.json -->\n<!-- end table -->", tmp_path)
    for commit, date, wrong in [("ABC1234", "2026-12-05", "commit"), ("abc", "2026-12-05", "commit"),
                                ("abc1234", "5.12.2026", "date")]:
        with pytest.raises(PageError, match=wrong):
            stamp(tmp_path / "engine.json", commit, date)


def test_stamp_then_render_updates_the_pages_and_check_sees_stale_ones(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    (results / "engine.json").write_text(json.dumps(engine_result()))
    page = tmp_path / "PAGE.md"
    page.write_text("intro\n<!-- table engine-summary results/engine.json -->\n<!-- end table -->\nend\n")
    assert main(["--check", str(page)]) == 2  # no commit recorded yet
    assert "records no commit and date" in capsys.readouterr().err
    assert main(["--stamp", str(results / "engine.json"), "abc1234", "2026-12-05", str(page)]) == 0
    assert json.loads((results / "runs.json").read_text()) == {
        "engine.json": {"commit": "abc1234", "date": "2026-12-05"}}
    assert "| training, seq 256 | 4,267 tok/s | 1,000 tok/s | 4.27× |" in page.read_text()
    assert main(["--check", str(page)]) == 0
    with pytest.raises(SystemExit):  # --check writes nothing, so it refuses to stamp
        main(["--stamp", str(results / "engine.json"), "def5678", "2026-12-06", "--check", str(page)])
    stamp(results / "engine.json", "def5678", "2026-12-06")
    assert main(["--check", str(page)]) == 1
    assert f"out of date: {page}" in capsys.readouterr().err
    assert main([str(page)]) == 0 and "commit `def5678`, 2026-12-06" in page.read_text()


def _blocks(page: Path) -> dict[tuple[str, str], str]:
    """(kind, results file relative to the repository) -> the table's text, of each table on ``page``."""
    text, blocks = page.read_text(), {}
    for m in re.finditer(r"<!-- table (\S+) (\S+) -->\n(.*?)<!-- end table -->", text, re.S):
        blocks[(m[1], str((page.parent / m[2]).resolve().relative_to(ROOT)))] = m[3]
    return blocks


def test_the_repository_pages_are_up_to_date_with_their_results(capsys):
    assert main(["--check", str(ROOT / "README.md"), str(ROOT / "benchmarks" / "RESULTS.md")]) == 0, \
        capsys.readouterr().err


def test_every_figure_of_the_readme_table_is_in_results_from_the_same_run():
    readme, results = _blocks(ROOT / "README.md"), _blocks(ROOT / "benchmarks" / "RESULTS.md")
    (kind, source), summary = next(iter(readme.items()))
    assert kind == "engine-summary" and ("engine", source) in results
    full = results[("engine", source)]
    figures = re.findall(r"\d[\d,.]*(?: tok/s| GB|×)", summary.split("\n", 2)[2])
    assert len(figures) >= 20
    for figure in figures:
        assert figure in full, figure
