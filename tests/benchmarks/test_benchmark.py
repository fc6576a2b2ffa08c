"""The benchmark harness runs end to end and reports consistent numbers (small cases)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from torch_wgpu_lora.benchmarks import cli, lora_op, sweep, timing
from torch_wgpu_lora.benchmarks.lora_op import Case, breakdown, measure, run, to_markdown
from torch_wgpu_lora.benchmarks.training_step import training_step
from torch_wgpu_lora.ops import lora_gpu
from torch_wgpu_lora.runtime import Buffer, Recorder, get_device, kernel


class FakeClock:
    """A clock that only moves when a fake iteration says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def iterations(self, durations: list[float]):
        pending = iter(durations)

        def fn() -> None:
            self.now += next(pending)

        return fn


def test_median_wall_is_the_median_of_individually_timed_iterations():
    clock = FakeClock()
    # A warm-up (not counted), then five iterations, two of them slow: mean 41.2, median 3.
    fn = clock.iterations([1000.0, 1.0, 100.0, 2.0, 3.0, 100.0])
    assert timing.median_wall(fn, 5, clock=clock) == 3.0
    finished = []
    fn = clock.iterations([1000.0, 1000.0, 5.0, 7.0, 6.0])
    assert timing.median_wall(fn, 3, lambda: finished.append(clock.now), warmup=2, clock=clock) == 6.0
    assert len(finished) == 5  # finish() ends every call, each timed one included


def test_steady_wall_is_the_mean_of_back_to_back_iterations_with_one_finish():
    clock = FakeClock()
    fn = clock.iterations([1000.0, 1.0, 100.0, 2.0, 3.0, 100.0])
    finished = []
    assert timing.steady_wall(fn, 5, lambda: finished.append(clock.now), clock=clock) == pytest.approx(41.2)
    assert len(finished) == 2  # after the warm-up and once at the end


@pytest.mark.parametrize("n", range(1, 13))
def test_median_interval_covers_the_median_as_often_as_it_says(n):
    # For a continuous distribution, [x_k, x_(n+1-k)] misses the median exactly when fewer than k
    # samples fall on one of its sides: counted here over all 2^n sides the samples can take.
    import itertools

    low, high, coverage = timing.median_interval([float(v) for v in range(n)])
    k = int(low) + 1
    assert high == n - k  # symmetric order statistics
    holds = sum(k <= sum(sides) <= n - k for sides in itertools.product((0, 1), repeat=n))
    assert coverage == holds / 2 ** n
    if k > 1:  # k is the largest that reaches 95%: one more would not
        assert coverage >= 0.95
    if k + 1 <= (n + 1) // 2:
        tighter = sum(k + 1 <= sum(sides) <= n - k - 1 for sides in itertools.product((0, 1), repeat=n))
        assert tighter / 2 ** n < 0.95


def test_median_interval_takes_order_statistics_of_unsorted_values():
    assert timing.median_interval([3.0, 9.0, 1.0, 7.0, 5.0, 2.0, 8.0, 4.0, 6.0]) == (2.0, 8.0, 0.9609375)
    with pytest.raises(ValueError, match="at least one value"):
        timing.median_interval([])


def test_measure_reports_times_checks_and_ratios():
    result = measure(Case(64, 128, 96, 8, True, "tiny"), iters=3, repeats=2)
    assert result.wall_us > 0 and result.staged_us > 0 and result.torch_wall_us > 0
    assert result.dispatches >= 4  # forward (down, up) and the gradient kernels
    assert result.extra["max_rel_err"] < 1e-4  # the same float32 bound as tests/ops/test_lora.py
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


def test_sweep_times_each_variant_and_restores_the_defaults():
    default_tuning, default_settings = lora_gpu.tuning(get_device()), get_device().settings
    rows = sweep.sweep(Case(8, 64, 32, 4, True, "tiny"), {"down_quads": [1], "shader_checks": ["full"]}, repeats=1)
    assert [(r["knob"], r["value"]) for r in rows] == [("down_quads", 1), ("shader_checks", "full")]
    if get_device().has_timestamps:
        assert all(r["gpu_us"] > 0 for r in rows)
    assert lora_gpu.tuning(get_device()) == default_tuning and get_device().settings == default_settings


def test_cli_runs_the_op_benchmark_and_its_modes(tmp_path, monkeypatch, capsys):
    tiny = [Case(8, 64, 32, 4, True, "tiny")]
    monkeypatch.setattr(lora_op, "quick_cases", lambda: tiny)
    monkeypatch.setattr(lora_op, "BREAKDOWN_CASES", tiny)
    assert cli.main(["--out", str(tmp_path), "--quick", "--iters", "2", "--repeats", "1", "--breakdown"]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"lora_op.json", "lora_op.md", "lora_op.png", "breakdown.txt"}
    assert (tmp_path / "breakdown.txt").read_text().startswith("tiny N=8 r=4 fwd+bwd: down ")
    out = capsys.readouterr().out
    assert out.startswith(f"adapter: {get_device().name}\n") and "| tiny | 8 | 4 | fwd+bwd |" in out


def test_training_step_times_both_backends():
    out = training_step(steps=1, batch_size=2)
    assert out["wgpu_ms"] > 0 and out["torch_ms"] > 0 and out["ratio"] == out["wgpu_ms"] / out["torch_ms"]


def test_default_cases_cover_the_issue_grid():
    cases = lora_op.default_cases()
    assert {(c.in_features, c.out_features) for c in cases} == {(2560, 2560), (2560, 640)}
    assert {c.rank for c in cases} == {8, 16} and {c.n for c in cases} == {1, 128, 2048}
    assert {c.backward for c in cases} == {False, True}
    quick = lora_op.quick_cases()
    assert {(c.name, c.rank) for c in quick} == {("q_proj", 16)}
    assert [c.n for c in quick if c.backward] == [2048] and {c.n for c in quick if not c.backward} == {1, 128, 2048}


def test_packed_model_initialises_every_weight_from_its_seed():
    import torch

    from torch_wgpu_lora.benchmarks.engine import packed_model, small_config

    first, second = packed_model(small_config(2), seed=3), packed_model(small_config(2), seed=3)
    other = packed_model(small_config(2), seed=4)
    state, again = first.state_dict(), second.state_dict()
    assert state.keys() == again.keys()
    for name, tensor in state.items():  # uninitialised memory would differ between two builds
        assert torch.equal(tensor, again[name]), name
    assert not torch.equal(state["model.layers.0.mlp.down_proj.weight"],
                           other.state_dict()["model.layers.0.mlp.down_proj.weight"])
    proj = first.model.layers[1].mlp.down_proj
    assert proj.weight_scale.item() == pytest.approx(512 ** 0.5 / 8, rel=1e-2)  # bf16
    ids = torch.arange(1, 17)[None]
    with torch.no_grad():
        logits = first(ids).logits.float()
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_base_alone_bypasses_the_adapters_and_restores_them():
    import copy

    from torch_wgpu_lora.benchmarks.engine import _base_alone, packed_model, small_config, with_adapters
    from torch_wgpu_lora.integrations.bitnet import lora_modules, lora_parameters, set_backend

    model = set_backend(with_adapters(packed_model(small_config(1), dtype=torch.float32), 4, seed=0), "torch")
    without = copy.deepcopy(model)  # the reference: the same model with every B zero adds nothing
    for m in lora_modules(without).values():
        torch.nn.init.zeros_(m.lora_B)
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        adapted, base = model(ids).logits, without(ids).logits
    assert not torch.allclose(adapted, base)  # the adapters change the output
    with _base_alone(model):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()  # runs: the embeddings' output requires grad
    torch.testing.assert_close(out.logits.detach(), base, rtol=0, atol=0)
    assert all(p.grad is None for p in lora_parameters(model))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, adapted, rtol=0, atol=0)


def test_engine_benchmark_trains_on_real_steps(tmp_path):
    from torch_wgpu_lora.benchmarks import engine

    engine.main(["--small", "--layers", "1", "--no-hf", "--out", str(tmp_path), "--prefill", "16", "--prompt", "4",
                 "--new-tokens", "4", "--repeats", "1", "--train", "16", "--train-steps", "1", "--drop-in", "8",
                 "--drop-in-steps", "2", "--batched", "1x16,3x16", "--decode-batches", "3", "--prompts-file-batch", "3",
                 "--prompts-file-count", "7"])
    result = json.loads((tmp_path / "engine.json").read_text())
    records = result["prompts_file"]  # 7 records 3 at once: continuous batching beside static batches
    assert records["prompts"] == 7 and records["batch"] == 3
    for run in ("static", "prompts_file"):
        assert records[run]["tok_per_s"] == pytest.approx(records[run]["new_tokens"] / records[run]["wall_s"])
    # 3 rows decode as one does (the GEMV path): record i draws with seed i either way, so the same completions
    assert records["static"]["completions"] == records["prompts_file"]["completions"]
    assert records["static"]["new_tokens"] == records["prompts_file"]["new_tokens"] >= 7
    decoded = result["decode_batches"]["3"]  # three prompts decoded at once: every row's tokens counted
    assert decoded["tok_per_s"] == pytest.approx(3 * 4 / decoded["wall_s"]) and decoded["new_tokens"] == 4
    step = decoded["step"]  # one step of the three rows on its own: its dispatches are the profile's
    assert step["dispatches_per_step"] == result["engine"]["decode"]["dispatches_per_token"]
    assert sum(step["kernels_us"].values()) > 0 and step["encode_ms_per_step"] > 0
    batched = result["batched"]["engine"]  # training steps and prefill passes of several sequences a step
    assert set(batched) == {"1x16", "3x16"} and all(b["train_tok_per_s"] > 0 and b["prefill_tok_per_s"] > 0
                                                    for b in batched.values())
    assert batched["3x16"]["train_tok_per_s"] == pytest.approx(48 / batched["3x16"]["train_step_s"])
    profiled = batched["3x16"]["train_kernels_us"]  # the batched step's per-dispatch profile
    assert profiled["bitlinear_t.wgsl:gemm_tiled"] > 0 and "cross_entropy.wgsl:rows" in profiled
    assert batched["3x16"]["train_gpu_ms_profiled"] == pytest.approx(sum(profiled.values()) / 1e3)
    drop_in = result["drop_in"]  # the backends' steps and the base alone, taking turns
    assert len(drop_in["wgpu"]["steps_s"]) == len(drop_in["torch"]["steps_s"]) == len(drop_in["base"]["steps_s"]) == 2
    assert all(drop_in[variant]["page_faults"] >= 0 for variant in ("wgpu", "torch", "base"))  # Linux: resource
    assert drop_in["wgpu_over_torch"] == drop_in["wgpu"]["step_s"] / drop_in["torch"]["step_s"] > 0
    turns = [w / t for w, t in zip(drop_in["wgpu"]["steps_s"], drop_in["torch"]["steps_s"])]
    assert drop_in["paired_ratio"] == pytest.approx(sum(turns) / 2)  # the median of two
    assert drop_in["paired_interval"] == [min(turns), max(turns), 0.5]  # two turns: the extremes, 50%
    for backend in ("wgpu", "torch"):
        less_base = [s - b for s, b in zip(drop_in[backend]["steps_s"], drop_in["base"]["steps_s"])]
        assert drop_in[backend]["adapters_s"] == pytest.approx(sum(less_base) / 2)
    wgpu = drop_in["wgpu"]  # uploads and waits happen inside the adapters' nodes
    assert 0 < wgpu["upload_s"] + wgpu["wait_s"] <= wgpu["adapter_s"] < wgpu["step_s"]
    training = result["engine_training"]["16"]
    assert training["loss"] is not None and 0 < training["loss"] < 20  # None: the step was skipped (non-finite)
    assert result["engine_training"]["16_response_only"]["tok_per_s"] > 0  # half the tokens labelled
    assert result["engine_training"]["16_dropout"]["tok_per_s"] > 0  # LoRA dropout on
    assert result["engine"]["prefill"]["tok_per_s"] > 0 and result["engine"]["decode"]["tok_per_s"] > 0
    assert all(v > 0 for v in result["ceilings_tera_ops_per_s"].values())
    launches = training["dispatches_us"]  # every dispatch of the step, in order, adding up to the profile
    assert len(launches) == training["dispatches"] and launches[0][0] == "embedding.wgsl:gather"
    assert sum(us for _, us in launches) == pytest.approx(training["gpu_ms_profiled"] * 1e3, rel=1e-3)
    rates = training["rates"]  # every counted kernel ran, at a share of its ceiling
    assert set(rates) == set(engine.kernel_work(engine.small_config(1), 16, training=True))
    assert all(0 < r["share_of_ceiling"] for r in rates.values())


def test_hf_generate_anchor_times_each_mode_and_batch():
    from torch_wgpu_lora.benchmarks import engine

    result = engine.measure_hf_generate(engine.small_config(1), [1, 3], 4, 5, lambda line: None, device="cpu")
    assert set(result) == set(engine.HF_GENERATE_MODES)  # the dynamic cache, and the static one
    for mode in engine.HF_GENERATE_MODES:
        for batch in (1, 3):
            run = result[mode][str(batch)]
            assert run["tok_per_s"] == pytest.approx(batch * 5 / run["wall_s"]) and run["first_s"] > 0


def test_distributed_benchmark_times_each_buckets_exchange(tmp_path):
    from torch_wgpu_lora.benchmarks import distributed

    # one process on the exchange's path (an all-reduce that changes nothing), a bucket per layer
    assert distributed.main(["--small", "--layers", "2", "--seq", "16", "--steps", "2", "--bucket-mb", "1e-6",
                             "--fake-exchange", "--out", str(tmp_path / "split.json")]) == 0
    result = json.loads((tmp_path / "split.json").read_text())
    assert result["world_size"] == 1 and result["fake_exchange"] and result["buckets"] == 2
    assert result["loss"] is not None and len(result["step_walls_s"]) == 2
    assert 0 <= result["gradient_all_reduce_s"] and 0 < result["exchange_exposed_s"] < result["step_s"]
    assert result["exposed_share"] == pytest.approx(result["exchange_exposed_s"] / result["step_s"])
    # a step's timeline: two buckets' all-reduces (0.4 s and 0.5 s), then 0.7 s from the last readback
    # to the sums written back
    events = [("submitted", 0, 0.0), ("submitted", 1, 1.0), ("read", 0, 1.5), ("reduce", 0, 1.6),
              ("reduced", 0, 2.0), ("read", 1, 3.0), ("reduce", 1, 3.1), ("reduced", 1, 3.6), ("written", -1, 3.7),
              ("updated", -1, 4.0)]
    assert distributed.exchange_times(events) == pytest.approx((0.9, 0.7))
    with pytest.raises(SystemExit):
        distributed.main(["--small", "--bucket-mb", "0", "--out", str(tmp_path / "x.json")])


def test_kernel_work_counts_the_projections_and_head_as_torch_counts_them():
    """kernel_work's GEMM operations against torch's FLOP counter on the dense model (the same
    shapes): the layers' linear projections, and the LM head of every position (training)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import BitNetForCausalLM

    from torch_wgpu_lora.benchmarks import engine

    config = engine.small_config(2)
    config._attn_implementation = "eager"  # attention as matmuls the counter sees
    model = BitNetForCausalLM(config).eval()
    seq = 24
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(input_ids=torch.zeros(1, seq, dtype=torch.long))
    counts = counter.get_flop_counts()
    # RoPE's angles are a matmul in some transformers versions (a bmm in 5.17); no projection of ours
    rope = counts.get("BitNetForCausalLM.model.rotary_emb", {})

    def total(kind: str) -> int:
        return sum(n - rope.get(op, 0) for op, n in counts["Global"].items()
                   if "mm" in str(op) and ("bmm" in str(op)) == (kind == "bmm"))

    linear = total("mm")
    head = sum(counts["BitNetForCausalLM.lm_head"].values())
    work = engine.kernel_work(config, seq, training=True)
    assert work["bitlinear.wgsl:gemm"][0] == linear - head
    assert work["matmul.wgsl:gemm_tiled"][0] == work["matmul_t.wgsl:gemm_tiled"][0] == head
    # attention: torch multiplies every (query, key) pair, the kernels the causal ones
    attention = total("bmm")
    # passes from position 0 keep S whole: S and O = P·V forward, each one product over the causal
    # pairs; training adds dP, dV, dK and dQ once each, and S again where P is not kept
    prompt = engine.kernel_work(config, seq, training=False)
    assert "attention.wgsl:prefill" not in prompt and "attention.wgsl:prefill" not in work
    assert prompt["attention_scores.wgsl:gemm_tiled"][0] == prompt["attention_apply.wgsl:gemm_tiled"][0]
    assert prompt["attention_scores.wgsl:gemm_tiled"][0] * 2 * 2 * seq == attention * (seq + 1)
    forward = 2 * prompt["attention_scores.wgsl:gemm_tiled"][0]
    assert work["attention_scores.wgsl:gemm_tiled"][0] == forward  # each layer's P kept for its backward
    assert work["attention_apply.wgsl:gemm_tiled"][0] == work["attention_kv_grad.wgsl:gemm_tiled"][0] == forward
    many = engine.kernel_work(engine.bitnet_2b_config(30), 704, training=True)  # 30 layers' P past the budget
    single = engine.kernel_work(engine.bitnet_2b_config(30), 704, training=False)
    assert many["attention_scores.wgsl:gemm_tiled"][0] == 3 * single["attention_scores.wgsl:gemm_tiled"][0]
    # past the scratch: the flash kernels, dq and dkdv recomputing S and dP
    long = engine.kernel_work(engine.bitnet_2b_config(1), 4096, training=True)
    assert "attention_apply.wgsl:gemm_tiled" not in long and "attention_scores.wgsl:gemm_tiled" not in long
    assert long["attention_backward.wgsl:dq"][0] * 2 == 3 * long["attention.wgsl:prefill"][0]
    assert long["attention_backward.wgsl:dkdv"][0] == 2 * long["attention.wgsl:prefill"][0]


def test_launch_benchmark_times_every_kernel_shape(tmp_path):
    from torch_wgpu_lora.benchmarks import launches
    from torch_wgpu_lora.engine.kernels.attention import backward_tiles, prefill_tiles
    from torch_wgpu_lora.engine.kernels.bitlinear import GEMV_GROUP, gemm_tile_tokens
    from torch_wgpu_lora.engine.kernels.projection import gemv_max_tokens, split_k_ranges

    launches.main(["--small", "--out", str(tmp_path), "--repeats", "2"])
    result = json.loads((tmp_path / "launches.json").read_text())["bounds"]
    assert {"copy", "norm_qv_lora_subgroups", "norm_qv_lora_barriers", "gemv_down_lanes32"} <= set(result)
    # one chosen split count per decode attention length; for the attention backward one split
    # count and one tile, for its forward one tile, among every tile that fits this adapter
    # and for each projection's forward GEMM one tile and input-gradient GEMM one split count; at
    # each step of several tokens one path (a GEMV group or the GEMM) for each projection and the head
    steps = launches.BATCH_TOKENS["small"]
    assert sum(key.endswith("_chosen") for key in result) == (len(launches.SHAPES["small"][-1]) + 3 + 4 + 4
                                                              + 5 * len(steps))
    device = get_device()
    for tokens in steps:  # the GEMV of each projection at each group up to the step's tokens (and the GEMM)
        group = GEMV_GROUP
        for name in ("qkv", "o", "gate_up", "down", "head"):
            timed = {key for key in result if key.startswith(f"batch_{tokens}_{name}_")}
            chosen = [key for key in timed if key.endswith("_chosen")]
            assert chosen == [f"batch_{tokens}_{name}_group{tokens if name == 'head' else group}_chosen"
                              if tokens <= gemv_max_tokens(device) else f"batch_{tokens}_{name}_gemm_chosen"]
            if name != "head":
                assert {f"batch_{tokens}_{name}_group{g}" for g in (1, 2, 4) if g <= tokens} <= {
                    key.removesuffix("_chosen") for key in timed}
    assert sum(key.startswith("gemm_") for key in result) == 8
    assert f"gemm_o_64_tile{gemm_tile_tokens(device)}_chosen" in result
    # each projection's input gradient at split counts 1, 2, 4, 8 and the one split_k_ranges picks
    hidden, ffn, _, kv_heads, head_dim = launches.SHAPES["small"][:5]
    for name, rows, k in (("qkv", hidden + 2 * kv_heads * head_dim, hidden), ("o", hidden, hidden),
                          ("gate_up", 2 * ffn, hidden), ("down", hidden, ffn)):
        chosen = split_k_ranges(k // 64, rows, device)  # 64 tokens: one token tile
        timed = {key for key in result if key.startswith(f"input_grad_{name}_64_splits")}
        assert timed == {f"input_grad_{name}_64_splits{n}" + ("_chosen" if n == chosen else "")
                         for n in {1, 2, 4, 8, chosen}}
    assert sum(key.startswith("attention_backward_") and key.endswith("_chosen") for key in result) == 2
    assert sum(key.startswith("attention_prefill_") for key in result) == len(prefill_tiles(head_dim))
    assert sum("_tile" in key and key.startswith("attention_backward_") for key in result) == len(
        backward_tiles(head_dim))
    assert sum(key.startswith("attention_prefill_") and key.endswith("_chosen") for key in result) == 1
    assert "attention_backward_64_scores_kept" in result
    assert all(v > 0 for v in result.values())


def test_decode_chain_accounts_for_every_launch_of_a_step(tmp_path):
    from torch_wgpu_lora.benchmarks import decode_chain

    decode_chain.main(["--small", "--layers", "2", "--out", str(tmp_path), "--repeats", "1"])
    result = json.loads((tmp_path / "decode_chain.json").read_text())
    kinds = result["kinds"]
    assert sum(k["launches"] for k in kinds.values()) == result["dispatches"]
    assert {"attention.wgsl:decode_partial", "embedding.wgsl:gather", "sampling.wgsl:greedy_final"} <= set(kinds)
    assert "bitlinear.wgsl:gemv 512x256" in kinds  # the small model's fused q/k/v: 256 + 2 × 128 rows
    assert result["token_us"] > 0 and result["copy_chain_us"] > 0
    assert all(k["only_us"] > 0 and 0 < k["without_us"] for k in kinds.values())


def _peak_outputs(entry: str, iters: int, seed: int) -> np.ndarray:
    out = Buffer((256,), "u32")
    values = np.zeros(256, np.uint32)
    rec = Recorder()
    rec.dispatch(kernel("peak.wgsl", entry), (1, 1, 1), (out,), (iters, seed))
    rec.read(out, values)
    rec.submit()
    return values


def test_the_fma_ceiling_kernel_computes_its_chains():
    """What arithmetic_rate times is real work: each thread's four fma chains, recomputed in float64
    (within 1e-5: float32 rounding over 4·iters contracting steps)."""
    iters, seed = 6, 5
    got = _peak_outputs("fma_chain", iters, seed).view(np.float32).astype(np.float64)
    x = ((np.arange(256) ^ seed) % 1024) * np.float32(1e-3)
    base = np.stack([x, x + 1, x + 2, x + 3], axis=1).astype(np.float64)
    m = np.array([0.999, 0.998, 0.997, 0.996], np.float32).astype(np.float64)
    total = np.zeros(256)
    for shift in (0.0, 0.5, 0.25, 0.125):
        a = base + shift
        for _ in range(4 * iters):
            a = a * m + np.float32(1e-3)
        total += a.sum(axis=1)
    np.testing.assert_allclose(got, total, rtol=1e-5)


def test_the_dp4a_ceiling_kernel_computes_its_dot_products_exactly():
    iters, seed = 3, 9
    got = _peak_outputs("dp4a_chain", iters, seed).view(np.int32)
    g = (np.arange(256, dtype=np.uint64) ^ seed)
    mask = np.uint64(0xFFFFFFFF)
    a = [(g * k) & mask for k in (1, 3, 5, 7)]
    b = [(g * k) & mask for k in (11, 13, 17, 19)]

    def dot(u, v):  # dot4I8Packed: the four signed bytes of each, multiplied and summed
        bu = u.astype(np.uint32).view(np.uint8).reshape(-1, 4).view(np.int8).astype(np.int64)
        bv = v.astype(np.uint32).view(np.uint8).reshape(-1, 4).view(np.int8).astype(np.int64)
        return (bu * bv).sum(axis=1)

    total = np.zeros(256, np.int64)
    for _ in range(iters):
        for i in range(4):  # s_i += a_i·b_i, a_i·b_(i+1), a_i·b_(i+2), a_i·b_(i+3) (s0..s7 summed at the end)
            for shift in range(4):
                total += dot(a[i], b[(i + shift) % 4])
        b = b[1:] + b[:1]
    np.testing.assert_array_equal(got.astype(np.int64), ((total + 2**31) % 2**32) - 2**31)


def test_arithmetic_rates_are_measured():
    for entry in ("fma_chain", "dp4a_chain"):  # None would mean no timestamp queries: a failure, not a skip
        rate = timing.arithmetic_rate(entry, iters=16, workgroups=8, repeats=1)
        assert rate is not None and rate > 0
