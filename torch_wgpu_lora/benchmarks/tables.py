"""The results tables of ``benchmarks/RESULTS.md`` and the README, rendered from the benchmarks' JSON.

A page marks each table it holds with a pair of comment lines::

    <!-- table KIND PATH -->
    ...                          (replaced by the rendering)
    <!-- end table -->

``PATH`` is a results file relative to the page (``engine.json`` of ``torch_wgpu_lora.benchmarks.engine``,
``decode_chain.json``, ``drop_in.json``, ``matrix_units_*.json``) and ``KIND`` one of ``RENDERERS``. Every table
starts with a line naming its run: the adapter, and the commit and date recorded for that
file in ``runs.json`` beside it. So one measurement updates every page identically:

    python -m torch_wgpu_lora.benchmarks.tables --stamp benchmarks/results/h200/engine.json COMMIT DATE

records that ``engine.json`` was measured on ``COMMIT`` on ``DATE`` (YYYY-MM-DD) and renders
README.md and benchmarks/RESULTS.md again; ``--check`` renders without writing and exits 1
if a page is out of date.

>>> # render_page(Path("benchmarks/RESULTS.md").read_text(), Path("benchmarks"))
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..files import write_atomic
from .engine import DROPOUT

RUNS = "runs.json"  # beside the results files: {file name: {"commit": ..., "date": ...}}
BEGIN = re.compile(r"<!-- table (\S+) (\S+) -->")
END = "<!-- end table -->"
PAGES = ("README.md", "benchmarks/RESULTS.md")  # relative to the repository's root
BITNET_2B = {"layers": 30, "hidden": 2560, "vocab": 128256}  # the shapes the targets are set for

# The engine's targets at BitNet-2B shapes, batch 1 unless named (tok/s, or a share)
PREFILL_TOK_S, PREFILL_TOKENS = 40_000, 512
DECODE_TOK_S = 1_000
DECODE_BATCH_TOK_S = {16: 8_000, 64: 25_000}  # every row's tokens, so many prompts decoded at once
TRAINING_TOK_S, TRAINING_SEQ = 10_000, 512
BATCHED_SEQS, BATCHED_OVER_BEST = 8, 2.0  # training 8 × 512 a step: 2× the best HF + PEFT configuration
MEMORY_SHARE = 0.6  # peak GPU memory training seq 512, of HF + PEFT's
LORA_SHARE = 0.05  # of a training step's GPU time, in the kernels of the adapters' gradients
HOST_SHARE = 0.15  # of a decoded token's wall time, host work the GPU's did not hide
TORCH_SHARE = 0.4  # a subgroup-matrix GEMM's rate, of torch's own on the same shape
PROMPTS_FILE_OVER_STATIC = 2.0  # the prompts file's tok/s (continuous batching), of static batches of its size

KERNELS = {  # what each entry point of the per-dispatch profile computes
    "bitlinear.wgsl:gemm": "ternary projections, forward (int8 codes × ternary weights)",
    "bitlinear_t.wgsl:gemm_tiled": "input gradients through the ternary weights (float32)",
    "matmul.wgsl:gemm_tiled": "LM head, forward (float32)",
    "matmul_t.wgsl:gemm_tiled": "LM head, input gradient (float32)",
    "attention_scores.wgsl:gemm_tiled": "attention: S = q·Kᵀ forward; dP, with P into dS, backward",
    "attention_apply.wgsl:gemm_tiled": "attention: O = P·V forward; dQ backward",
    "attention_kv_grad.wgsl:gemm_tiled": "attention: dV and dK backward",
    "bitlinear_mma.wgsl:gemm": "ternary projections, forward, on the matrix units (int8 subgroup matrices)",
    "bitlinear_t_mma.wgsl:gemm_tiled": "input gradients through the ternary weights, on the matrix units (int8 digits)",
    "bitlinear_t_mma.wgsl:digits": "input gradients: the int8 digits of the output gradients",
    "matmul_mma.wgsl:gemm_tiled": "LM head, forward and input gradient, on the matrix units (f16 pairs)",
    "matmul_mma.wgsl:split": "LM head: float32 rows split into f16 pairs",
    "norm.wgsl:rmsnorm": "RMSNorm, forward, and the int8 codes of its output",
    "norm_backward.wgsl:rmsnorm_backward4": "RMSNorm backward",
    "ffn_backward.wgsl:relu2_backward": "relu(gate)² · up backward",
    "lora_grad.wgsl:db": "the adapters' B gradients",
    "attention.wgsl:prefill": "attention, flash forward",
    "attention_backward.wgsl:dq": "attention, flash backward: dQ",
    "attention_backward.wgsl:dkdv": "attention, flash backward: dK and dV",
}
DECODE_KINDS = {  # decode_chain's kinds of launch at BitNet-2B shapes
    "norm.wgsl:rmsnorm": "RMSNorm (the Q/V site's, computing the adapters' h; down_proj's input; the final norm)",
    "bitlinear.wgsl:gemv 3840x2560": "q/k/v GEMV, rotating into the KV cache",
    "attention.wgsl:decode_partial": "attention over the KV cache, in key-span partials",
    "bitlinear.wgsl:gemv 2560x2560": "o_proj GEMV, merging attention's partials and normalising",
    "bitlinear.wgsl:gemv 13824x2560": "gate/up GEMV, normalising its input",
    "bitlinear.wgsl:gemv 2560x6912": "down_proj GEMV",
    "matmul.wgsl:gemv": "LM head (bf16 GEMV)",
    "embedding.wgsl:gather": "embedding gather",
    "sampling.wgsl:greedy_partial": "sampling (greedy), partial",
    "sampling.wgsl:greedy_final": "sampling (greedy), final",
}


class PageError(ValueError):
    """A page's table markers, or the results they name, cannot be rendered."""


@dataclass(frozen=True)
class Run:
    """A results file with the commit and date it was measured on."""

    path: Path
    data: dict[str, Any]
    commit: str
    date: str

    def label(self, shown: str) -> str:
        """The line above a table: adapter, commit, date and the file (``shown``, as the page names it)."""
        adapter = f"{self.data['adapter']}; " if self.data.get("adapter") else ""
        return f"*{adapter}commit `{self.commit}`, {self.date}; [`{shown}`]({shown}).*"


def load_run(path: Path) -> Run:
    """``path``'s results with its commit and date from ``runs.json`` beside it."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PageError(f"{path}: no such results file") from None
    except json.JSONDecodeError as e:
        raise PageError(f"{path}: not JSON ({e})") from None
    runs = _read_runs(path.parent / RUNS)
    if path.name not in runs:
        raise PageError(f"{path.parent / RUNS} records no commit and date for {path.name}: "
                        f"stamp it (--stamp {path} COMMIT DATE)")
    entry = runs[path.name]
    return Run(path, data, entry["commit"], entry["date"])


def _read_runs(path: Path) -> dict[str, dict[str, str]]:
    if not path.exists():
        return {}
    try:
        runs = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PageError(f"{path}: not JSON ({e})") from None
    for name, entry in runs.items():
        if not isinstance(entry, dict) or not {"commit", "date"} <= entry.keys():
            raise PageError(f"{path}: the entry of {name} needs a commit and a date")
    return runs


def stamp(path: Path, commit: str, date: str) -> None:
    """Record in ``runs.json`` beside ``path`` that it was measured on ``commit`` on ``date``."""
    if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        raise PageError(f"commit {commit!r}: expected 7 to 40 lowercase hex digits")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
        raise PageError(f"date {date!r}: expected YYYY-MM-DD")
    if not path.is_file():
        raise PageError(f"{path}: no such results file")
    runs = _read_runs(path.parent / RUNS)
    runs[path.name] = {"commit": commit, "date": date}
    write_atomic(path.parent / RUNS, (json.dumps(dict(sorted(runs.items())), indent=1) + "\n").encode())


# Numbers as the pages print them
def rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def times(x: float) -> str:
    return f"{x:.2f}×" if x < 10 else f"{x:.1f}×" if x < 100 else f"{x:.0f}×"


def share(x: float) -> str:
    return f"{x * 100:.1f}%" if x >= 0.1 else f"{x * 100:.2f}%"


def ms(seconds: float) -> str:
    x = seconds * 1e3
    return f"{x:,.1f} ms" if x >= 10 else f"{x:.3f} ms"


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(row) + " |" for row in rows])


def _status(met: bool) -> str:
    return "met" if met else "**missed**"


def engine_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine benchmark's figures, a dict a row: ``figure``, ``engine``, and where measured
    ``hf`` (HF + PEFT), ``ratio`` (engine / HF) and ``target`` (at BitNet-2B shapes only);
    ``summary`` marks the rows the README shows."""
    targets = all(result.get(k) == v for k, v in BITNET_2B.items())
    hf, hf_training = result.get("hf_peft") or {}, result.get("hf_peft_training") or {}
    engine, training = result["engine"], result.get("engine_training", {})
    rows = []

    def compared(figure: str, ours: float, theirs: float | None, target: str = "") -> None:
        rows.append({"figure": figure, "engine": f"{rate(ours)} tok/s", "summary": True, "target": target,
                     "hf": f"{rate(theirs)} tok/s" if theirs else "", "ratio": times(ours / theirs) if theirs else ""})

    prefill = engine["prefill"]
    compared(f"prefill, a {prefill['tokens']}-token prompt", prefill["tok_per_s"],
             hf.get("prefill", {}).get("tok_per_s"),
             f"≥ {PREFILL_TOK_S:,} tok/s: {_status(prefill['tok_per_s'] >= PREFILL_TOK_S)}"
             if targets and prefill["tokens"] == PREFILL_TOKENS else "")
    decode = engine["decode"]
    compared(f"decode, {decode['new_tokens']} greedy tokens after a {decode['prompt']}-token prompt",
             decode["tok_per_s"], hf.get("decode", {}).get("tok_per_s"),
             f"≥ {DECODE_TOK_S:,} tok/s: {_status(decode['tok_per_s'] >= DECODE_TOK_S)}" if targets else "")
    for key, step in training.items():
        if not isinstance(step, dict):
            continue
        seq, _, variant = key.partition("_")
        figure = {"": f"training, seq {seq}",
                  "response_only": f"training, seq {seq}, loss on the second half only (the first a prompt)",
                  "dropout": f"training, seq {seq}, LoRA dropout {DROPOUT}"}[variant]
        theirs = hf_training.get(key, {}).get("tok_per_s")
        target = ""
        if targets and not variant and int(seq) == TRAINING_SEQ:
            target = f"≥ {TRAINING_TOK_S:,} tok/s: {_status(step['tok_per_s'] >= TRAINING_TOK_S)}"
            if theirs:
                target += f"; ≥ HF + PEFT: {_status(step['tok_per_s'] >= theirs)}"
        compared(figure, step["tok_per_s"], theirs, target)
    if "peak_gpu_bytes" in training:
        longest = max(int(k) for k in training if k.isdigit())
        ours, theirs = training["peak_gpu_bytes"], hf_training.get("peak_memory_bytes")
        rows.append({"figure": f"peak GPU memory, training (seq {longest})", "engine": gigabytes(ours),
                     "hf": gigabytes(theirs) if theirs else "", "ratio": times(ours / theirs) if theirs else "",
                     "target": f"≤ {MEMORY_SHARE}× HF + PEFT: {_status(ours <= MEMORY_SHARE * theirs)}"
                     if targets and theirs else "",
                     "summary": True})
        step = training[str(longest)]
        rows.append({"figure": f"training step, seq {longest}: GPU time (per-dispatch profile), launches",
                     "engine": f"{ms(step['gpu_ms_profiled'] / 1e3)}, {step['dispatches']:,} launches"})
        lora = step.get("lora_grad_kernels_share")
        if lora is not None:
            rows.append({"figure": "the adapters' gradient kernels' share of that step's GPU time",
                         "engine": share(lora),
                         "target": f"≤ {LORA_SHARE:.0%}: {_status(lora <= LORA_SHARE)}"
                         if targets and longest == TRAINING_SEQ else ""})
    if prefill.get("gpu_ms"):
        rows.append({"figure": "prefill: GPU time of the pass, launches",
                     "engine": f"{ms(prefill['gpu_ms'] / 1e3)}, {prefill['dispatches']:,} launches"})
    if decode.get("gpu_ms_per_token"):
        rows.append({"figure": "decode: GPU time a token, launches a token; host time recording a token",
                     "engine": f"{ms(decode['gpu_ms_per_token'] / 1e3)}, {decode['dispatches_per_token']:,} "
                               f"launches; {ms(decode['encode_ms_per_token'] / 1e3)}"})
        hidden = decode["host_share_of_token_wall"]
        rows.append({"figure": "decode: host time a token not hidden behind the GPU's, share of the token's wall time",
                     "engine": f"{ms(decode['host_ms_not_hidden_per_token'] / 1e3)}, {share(hidden)}",
                     "target": f"≤ {HOST_SHARE:.0%}: {_status(hidden <= HOST_SHARE)}" if targets else ""})
    return rows


def _columns(rows: list[dict[str, Any]], columns: dict[str, str]) -> str:
    """``rows`` as a table of the ``columns`` (key: heading) that any row fills."""
    shown = {key: head for key, head in columns.items() if key == "figure" or any(r.get(key) for r in rows)}
    return _table(list(shown.values()), [[r.get(key, "") for key in shown] for r in rows])


def render_engine(run: Run) -> str:
    """Every figure of an engine benchmark run, with the targets at BitNet-2B shapes."""
    return _columns(engine_rows(run.data), {"figure": "figure", "engine": "engine", "hf": "HF + PEFT",
                                            "ratio": "engine / HF", "target": "target"})


def render_engine_summary(run: Run) -> str:
    """The throughputs and the peak memory of an engine benchmark run, against HF + PEFT."""
    rows = [r for r in engine_rows(run.data) if r.get("summary")]
    return _columns(rows, {"figure": "", "engine": "engine", "hf": "HF + PEFT", "ratio": "engine / HF"})


def _ceiling_kind(rates: dict[str, float], ceilings: dict[str, float]) -> str:
    """Which measured ceiling a kernel's share was taken of ("fma" or "dp4a")."""
    ceiling = rates["tera_ops_per_s"] / rates["share_of_ceiling"]
    return min(ceilings, key=lambda kind: abs(ceilings[kind] - ceiling))


def _longest_step(result: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    training = result.get("engine_training")
    if not training:
        raise PageError("the run has no training figures (engine_training)")
    longest = max(int(k) for k in training if k.isdigit())
    return longest, training[str(longest)]


def render_kernel_rates(run: Run) -> str:
    """The longest training step's GEMMs and attention products: GPU time, rate and share of the
    adapter's measured ceiling; the rest of the step's kernels in one row."""
    seq, step = _longest_step(run.data)
    ceilings = run.data["ceilings_tera_ops_per_s"]
    rows = []
    for name, r in step["rates"].items():
        kind = _ceiling_kind(r, ceilings)
        rows.append([f"{KERNELS.get(name, name)} (`{name}`)", f"{step['kernels_us'][name]:,.0f}",
                     f"{r['tera_ops_per_s']:.1f} T{'FLOP' if kind == 'fma' else ' int8 ops'}/s",
                     share(r["share_of_ceiling"])])
    rest = sum(us for name, us in step["kernels_us"].items() if name not in step["rates"])
    rows.append(["every other kernel (norms, RoPE, the adapters' gradients, softmax, split sums, cross-entropy, "
                 "copies)", f"{rest:,.0f}", "", ""])
    rows.append([f"**the step** ({step['dispatches']:,} launches)", f"{step['gpu_ms_profiled'] * 1e3:,.0f}", "", ""])
    head = (f"*Ceilings measured in the same run: {ceilings['fma']:.1f} TFLOP/s float32 (fma), "
            f"{ceilings['dp4a']:.1f} T int8 ops/s (dot4I8Packed).*\n\n")
    return head + _table([f"training step, seq {seq}", "GPU µs", "rate", "share of its ceiling"], rows)


def render_training_bound(run: Run) -> str:
    """What the training target asks of the float32 GEMMs, from the longest step's profile."""
    seq, step = _longest_step(run.data)
    ceilings = run.data["ceilings_tera_ops_per_s"]
    kernels, rates = step["kernels_us"], step["rates"]
    total = step["gpu_ms_profiled"] * 1e3
    counted = sum(kernels[name] for name in rates)
    at_ceiling = sum(kernels[name] * r["share_of_ceiling"] for name, r in rates.items())
    fp32 = [name for name, r in rates.items() if _ceiling_kind(r, ceilings) == "fma"]
    fp32_us = sum(kernels[name] for name in fp32)
    fp32_at_ceiling = sum(kernels[name] * rates[name]["share_of_ceiling"] for name in fp32)
    fp32_ops = sum(kernels[name] * rates[name]["tera_ops_per_s"] for name in fp32)  # µs × T/s = 1e6 ops
    budget = seq / TRAINING_TOK_S * 1e6
    others = total - fp32_us
    best = at_ceiling + total - counted
    text = (f"At {TRAINING_TOK_S:,} tok/s a step of {seq} tokens has {budget / 1e3:.1f} ms; this run's took "
            f"{step['step_s'] * 1e3:.1f} ms ({total / 1e3:.1f} ms of profiled GPU time). Its GEMMs and attention "
            f"products would take {at_ceiling / 1e3:.1f} ms at 100% of their ceilings, and with every other "
            f"kernel as it is ({(total - counted) / 1e3:.1f} ms) a step would take {best / 1e3:.1f} ms, "
            f"{seq / best * 1e6:,.0f} tok/s. ")
    room = budget - others
    if room <= fp32_at_ceiling:
        return text + (f"The int8 GEMM and the other kernels as they are ({others / 1e3:.1f} ms) leave "
                       f"{max(room, 0) / 1e3:.1f} ms for float32 GEMM work that takes {fp32_at_ceiling / 1e3:.1f} ms "
                       f"at the fma ceiling: the target needs more than the ceiling.")
    return text + (f"With the int8 GEMM and the other kernels as they are ({others / 1e3:.1f} ms), the float32 GEMMs "
                   f"({fp32_at_ceiling / 1e3:.1f} ms of work at the fma ceiling, {fp32_us / 1e3:.1f} ms in this run) "
                   f"would have to run at {fp32_ops / room:.1f} TFLOP/s, {share(fp32_at_ceiling / room)} of the "
                   f"measured fma ceiling.")


def render_decode_chain(run: Run) -> str:
    """``decode_chain``'s kinds of launch: their count, marginal cost in the chain and cost alone."""
    data = run.data
    rows = [["**the whole step**", f"{data['dispatches']:,}", f"**{data['token_us']:,.1f}**", ""]]
    for name, kind in sorted(data["kinds"].items(), key=lambda kv: -kv[1]["only_us"]):
        rows.append([f"{DECODE_KINDS.get(name, name)} (`{name}`)", str(kind["launches"]),
                     f"{kind['marginal_us']:,.1f}", f"{kind['only_us']:,.1f}"])
    rows.append([f"{data['dispatches']} one-workgroup copies (dependent launches doing almost nothing)",
                 f"{data['dispatches']:,}", "", f"{data['copy_chain_us']:,.1f}"])
    return _table(["launches of a decoded token", "count", "marginal µs", "that kind alone, µs"], rows)


def render_decode_bound(run: Run) -> str:
    """What the chain of launches puts on the decode rate: the stack's floor, and today's kernels'."""
    data = run.data
    floor = data["copy_chain_us"] / data["dispatches"]
    chain = 5 * data["layers"] * floor  # q/k/v, attention, o_proj, gate/up, down: each reads all of the one before
    kernels = sum(kind["only_us"] for name, kind in data["kinds"].items() if not name.startswith("norm.wgsl:"))
    return (f"A dependent launch that does almost nothing, a one-workgroup copy, costs {floor:.1f} µs in a chain "
            f"({data['dispatches']} copies: {data['copy_chain_us']:,.1f} µs). Even as five dependent launches a layer "
            f"at that cost, one for each step that reads the whole output of the one before, a token's launches "
            f"would cost {chain:,.0f} µs: the launch cost alone does not exclude {DECODE_TOK_S:,} tok/s. Today's "
            f"kernels, each kind alone in a chain, take "
            f"{kernels:,.1f} µs a token without the norm launches (the layers' five kinds, the head, the embedding "
            f"and sampling): at most {1e6 / kernels:,.0f} tok/s with these kernels, even if the norm launches cost "
            f"nothing.")


def render_drop_in(run: Run) -> str:
    """``measure_drop_in``'s figures (alone, or under ``drop_in`` in an engine benchmark's JSON)."""
    data = run.data.get("drop_in", run.data)
    variants = {"wgpu": '`backend="wgpu"`', "torch": '`backend="torch"`', "base": "the base model alone"}
    turns = len(data["wgpu"]["steps_s"])
    rows = [[f"training step, seq {data['seq']} (median of {turns} turns)"]
            + [f"{data[v]['step_s']:.2f} s" for v in variants],
            ["fastest to slowest turn"]
            + [f"{min(data[v]['steps_s']):.2f} to {max(data[v]['steps_s']):.2f} s" for v in variants],
            ["what the adapters add to a step (median over turns of the step less the turn's base step)"]
            + [f"{data[v]['adapters_s']:.3f} s" for v in ("wgpu", "torch")] + [""]]
    if all(data[v].get("page_faults") is not None for v in variants):
        rows.append(["minor page faults a step"] + [f"{data[v]['page_faults']:,.0f}" for v in variants])
    low, high, coverage = data["paired_interval"]
    return (_table(["", *variants.values()], rows)
            + f"\n\nwgpu / torch: {data['wgpu_over_torch']:.3f} (the medians' ratio); {data['paired_ratio']:.3f} "
              f"(the median of the turns' ratios), {low:.3f} to {high:.3f} with {coverage:.0%} confidence. "
              f"The wgpu adapters' autograd nodes took {data['wgpu']['adapter_s']:.3f} s a step, of which "
              f"uploads {data['wgpu']['upload_s']:.3f} s and waits for results {data['wgpu']['wait_s']:.3f} s.")


def render_batched(run: Run) -> str:
    """Training and prefill at each shape of ``benchmarks.engine --batched``: the engine beside
    each HF + PEFT configuration measured, and its ratio to the best of them."""
    data = run.data["batched"]
    anchors = {key: head for key, head in (("hf_eager", "HF + PEFT, eager"),
                                           ("hf_compiled", "HF + PEFT, torch.compile")) if data.get(key)}
    targets = all(run.data.get(k) == v for k, v in BITNET_2B.items())
    rows = []
    for shape, ours in data["engine"].items():
        seqs, seq = (int(n) for n in shape.split("x"))
        for figure, key in (("training", "train_tok_per_s"), ("prefill", "prefill_tok_per_s")):
            theirs = {a: data[a][shape][key] for a in anchors if key in data[a].get(shape, {})}
            best = max(theirs.values(), default=None)
            target = ""
            if targets and figure == "training" and (seqs, seq) == (BATCHED_SEQS, TRAINING_SEQ) and best:
                target = f"≥ {BATCHED_OVER_BEST:g}× the best: {_status(ours[key] >= BATCHED_OVER_BEST * best)}"
            rows.append([f"{figure}, {seqs} × {seq} tokens a step", f"{rate(ours[key])} tok/s"]
                        + [f"{rate(theirs[a])} tok/s" if a in theirs else "" for a in anchors]
                        + [times(ours[key] / best) if best else "", target])
    head = ["", "engine", *anchors.values(), "engine / best HF", "target"]
    return _table(head, rows)


PROFILE_ROW_SHARE = 0.01  # kernels under this share of a batched step's profile share its last row


def render_batched_profile(run: Run) -> str:
    """The engine's training step at each shape of ``benchmarks.engine --batched``, by kernel: the
    per-dispatch profile's GPU ms and share of the step, kernels of less than PROFILE_ROW_SHARE of
    every shape's step in one row."""
    shapes = {key: ours["train_kernels_us"] for key, ours in run.data["batched"]["engine"].items()
              if "train_kernels_us" in ours}
    if not shapes:
        raise PageError("the run's batched steps have no per-dispatch profile (train_kernels_us)")
    totals = {key: sum(kernels.values()) for key, kernels in shapes.items()}
    names = sorted({name for kernels in shapes.values() for name in kernels},
                   key=lambda name: -max(k.get(name, 0.0) / totals[key] for key, k in shapes.items()))
    shown = [name for name in names if any(k.get(name, 0.0) >= PROFILE_ROW_SHARE * totals[key]
                                            for key, k in shapes.items())]

    def cell(key: str, us: float) -> str:
        return f"{us / 1e3:,.1f} ({share(us / totals[key])})"

    rows = [[f"{KERNELS.get(name, name)} (`{name}`)"] + [cell(key, k.get(name, 0.0)) for key, k in shapes.items()]
            for name in shown]
    rows.append([f"every other kernel (under {share(PROFILE_ROW_SHARE)} of the step)"]
                + [cell(key, sum(us for name, us in k.items() if name not in shown)) for key, k in shapes.items()])
    rows.append(["**the step**"] + [f"{totals[key] / 1e3:,.1f}" for key in shapes])
    return _table(["training step, GPU ms (share)", *(f"{k.replace('x', ' × ')} tokens" for k in shapes)], rows)


def render_gemm_rates(run: Run) -> str:
    """An earlier sweep's JSON (``results/h200/subgroup_matrix.json``, from kernels of its own): each GEMM kind's best variant at each shape beside torch's
    own kernel on the same shape in the same run (``torch._int_mm`` for int8, bf16
    ``torch.matmul`` for f16)."""
    torch_rates = {(r["m"], r["n"], r["k"]): r for r in run.data["torch"]}
    best: dict[tuple[str, int, int, int], dict[str, Any]] = {}
    for v in run.data["variants"]:
        key = (v["kind"], v["m"], v["n"], v["k"])
        if v.get("tera_ops_per_s") and (key not in best or v["tera_ops_per_s"] > best[key]["tera_ops_per_s"]):
            best[key] = v
    rows = []
    for (kind, m, n, k), v in sorted(best.items()):
        anchor = torch_rates.get((m, n, k))
        theirs = anchor and anchor["int8_tera_ops_per_s" if kind == "i8" else "bf16_tera_ops_per_s"]
        shape = (f"{v['rows']}×{v['cols']} subgroups of {v['tm']}×{v['tn']} tiles, K step {v['ks']}"
                 + (", prefetch" if v.get("prefetch") else ""))
        rows.append([f"`{kind}` {m}×{n}×{k}", shape, f"{v['us']:,.1f}", f"{v['tera_ops_per_s']:.1f}",
                     f"{theirs:.1f}" if theirs else "", share(v["tera_ops_per_s"] / theirs) if theirs else "",
                     f"≥ {TORCH_SHARE:.0%}: {_status(v['tera_ops_per_s'] >= TORCH_SHARE * theirs)}" if theirs else ""])
    return _table(["GEMM (M×N×K)", "best variant", "µs", "T ops/s", "torch's T ops/s", "share of torch's",
                   "target"], rows)


def render_decode_batches(run: Run) -> str:
    """Greedy decoding of one prompt and of several at once (``benchmarks.engine
    --decode-batches``): every row's new tokens a second, and each row's."""
    data = run.data
    targets = all(data.get(k) == v for k, v in BITNET_2B.items())
    one = data["engine"]["decode"]
    figures = {1: one, **{int(batch): d for batch, d in data.get("decode_batches", {}).items()}}
    rows = []
    for batch, d in sorted(figures.items()):
        goal = DECODE_TOK_S if batch == 1 else DECODE_BATCH_TOK_S.get(batch)
        rows.append([f"{batch} prompt{'s' if batch > 1 else ''} of {d['prompt']} tokens, {d['new_tokens']} new each",
                     f"{rate(d['tok_per_s'])} tok/s", f"{rate(d['tok_per_s'] / batch)} tok/s",
                     f"≥ {goal:,} tok/s: {_status(d['tok_per_s'] >= goal)}" if targets and goal else ""])
    labels = {"eager": "eager", "static_compiled": "static cache, compiled"}
    for mode, runs in data.get("hf_generate", {}).items():  # the anchor, in the same process
        for batch, d in sorted(runs.items(), key=lambda item: int(item[0])):
            ours = figures.get(int(batch))
            rows.append([f"HF + PEFT `generate`, {labels[mode]}: {batch} prompt{'s' if int(batch) > 1 else ''}",
                         f"{rate(d['tok_per_s'])} tok/s", f"{rate(d['tok_per_s'] / int(batch))} tok/s",
                         f"ours {ours['tok_per_s'] / d['tok_per_s']:.2f}×" if ours else ""])
    return _table(["greedy decoding", "all rows", "a row", "target"], rows)


def render_prompts_file(run: Run) -> str:
    """The prompts file's throughput, continuous batching, beside static batches of the same size
    (``benchmarks.engine --prompts-file-batch``): every record's new tokens a second."""
    data = run.data["prompts_file"]
    targets = all(run.data.get(k) == v for k, v in BITNET_2B.items())
    prompt = data["prompt_tokens"]
    what = (f"{data['prompts']} records of {prompt['min']} to {prompt['max']} prompt tokens, up to "
            f"{data['max_new_tokens']} new, {data['batch']} at once")
    rows = []
    for key, label in (("static", "static batches"), ("prompts_file", "prompts file (continuous batching)")):
        d = data[key]
        done = d["completions"]
        rows.append([f"{what}: {label}", f"{rate(d['tok_per_s'])} tok/s",
                     f"{done['mean']:.1f} (max {done['max']}, {done['at_limit']} at the limit)",
                     f"{d['wall_s']:.1f} s"])
    over = data["prompts_file_over_static"]
    rows[1].append(f"{times(over)}" + (f"; ≥ {times(PROMPTS_FILE_OVER_STATIC)}: "
                                       f"{_status(over >= PROMPTS_FILE_OVER_STATIC)}" if targets else ""))
    rows[0].append("")
    return _table(["generation", "all records", "new tokens a record", "wall", "over static"], rows)


def render_matrix_units(run: Run) -> str:
    """``benchmarks.matrix_units``: each GEMM kind at each shape, the general-core kernel and the
    matrix units' best tile, the latter's integer work as a share of the int8 ceiling measured in the
    same run, beside torch's own GEMMs of the shape (bf16 ``torch.matmul``, ``torch._int_mm``)."""
    data = run.data
    ceiling = data["ceiling"]["i8"]["rate"]
    torch_rates = {(r["projection"], r["tokens"], r["dtype"]): r["rate"] for r in data.get("torch", [])}
    cases: dict[tuple[str, str, int], dict[str, dict[str, Any]]] = {}
    for r in data["gemms"]:
        if r["kind"] == "input_grad" and (r.get("tile") or {}).get("digits", 4) < 4:
            continue  # fewer digits: the less exact option, not float32 accuracy
        best = cases.setdefault((r["kind"], r["projection"], r["tokens"]), {})
        if r["variant"] not in best or r["rate"] > best[r["variant"]]["rate"]:
            best[r["variant"]] = r
    rows = []
    for (kind, projection, tokens), best in cases.items():
        mma, general = best.get("matrix_units"), best.get("general")
        any_row = mma or general
        tile = mma and mma["tile"]
        rows.append([f"{kind} `{projection}` {tokens}×{any_row['rows'] if kind == 'projection' else any_row['k']}"
                     f"×{any_row['k'] if kind == 'projection' else any_row['rows']}",
                     f"{general['rate'] / 1e12:.1f}" if general else "",
                     f"{mma['rate'] / 1e12:.1f}" if mma else "",
                     (f"{tile['sub_m']}×{tile['sub_n']} subgroups of {tile['tm']}×{tile['tn']}, K step {tile['kstep']}"
                      if tile else ""),
                     share(mma["integer_rate"] / ceiling) if mma else "",
                     f"{torch_rates[(projection, tokens, 'bf16')] / 1e12:.0f}" if (projection, tokens, "bf16") in torch_rates else "",
                     f"{torch_rates[(projection, tokens, 'int8')] / 1e12:.0f}" if (projection, tokens, "int8") in torch_rates else ""])
    head = ["GEMM (M×N×K)", "general cores, T/s", "matrix units, T/s", "best tile", "share of the int8 ceiling",
            "torch bf16, T/s", "torch int8, T/s"]
    return (f"Ceiling measured in the same run: int8 {ceiling / 1e12:,.0f} T op/s"
            + (f", f16 {data['ceiling']['f16']['rate'] / 1e12:,.0f} TFLOP/s" if "f16" in data["ceiling"] else "")
            + ". Rates are useful work (2·M·N·K) a second; the share counts the integer work the matrix units do "
            "(the input gradient's four digit planes: four times its useful work; its tiles of fewer digits, less exact, "
            "are left out).\n\n" + _table(head, rows))


def render_backend_kernels(run: Run) -> str:
    """The kernels the two WebGPU implementations compile differently, GPU µs on each."""
    kernels = run.data["kernels_us"]
    names = {"rmsnorm_512_lora": "RMSNorm, 512 tokens, quantised, 16 LoRA ranks",
             "rmsnorm_512": "RMSNorm, 512 tokens, quantised", "rmsnorm_1_lora": "RMSNorm, 1 token, 16 LoRA ranks",
             "rmsnorm_1": "RMSNorm, 1 token", "gemv_qkv_1": "q/k/v GEMV, 1 token"}
    columns = list(kernels)
    rows = [[label] + [f"{kernels[c][key]:.1f}" for c in columns] for key, label in names.items()]
    return _table(["kernel (µs)", *columns], rows)


RENDERERS: dict[str, Callable[[Run], str]] = {
    "engine": render_engine, "engine-summary": render_engine_summary, "kernel-rates": render_kernel_rates,
    "training-bound": render_training_bound, "decode-chain": render_decode_chain,
    "decode-bound": render_decode_bound, "drop-in": render_drop_in, "batched": render_batched,
    "batched-profile": render_batched_profile,
    "gemm-rates": render_gemm_rates, "decode-batches": render_decode_batches,
    "matrix-units": render_matrix_units, "backend-kernels": render_backend_kernels,
    "prompts-file": render_prompts_file,
}


def render_page(text: str, folder: Path, name: str = "the page") -> str:
    """``text`` with every marked table rendered again from its results (paths relative to ``folder``)."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        begin = BEGIN.fullmatch(lines[i].strip())
        i += 1
        if not begin:
            continue
        kind, shown = begin.groups()
        if kind not in RENDERERS:
            raise PageError(f"{name}, line {i}: unknown table kind {kind!r} (known: {', '.join(RENDERERS)})")
        end = next((j for j in range(i, len(lines)) if lines[j].strip() == END), None)
        if end is None or any(BEGIN.fullmatch(line.strip()) for line in lines[i:end]):
            raise PageError(f"{name}, line {i}: the table has no {END!r} line before the next table")
        run = load_run(folder / shown)
        try:
            out += [run.label(shown), "", RENDERERS[kind](run)]
        except (KeyError, TypeError, ZeroDivisionError) as e:
            raise PageError(f"{name}, line {i}: {folder / shown} lacks what a {kind!r} table shows ({e!r})") from None
        i = end
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_wgpu_lora.benchmarks.tables",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("pages", nargs="*", default=list(PAGES), help=f"pages to render (default: {' '.join(PAGES)})")
    parser.add_argument("--stamp", nargs=3, action="append", default=[], metavar=("JSON", "COMMIT", "DATE"),
                        help="record that the results file JSON was measured on COMMIT on DATE (YYYY-MM-DD) first")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    if args.check and args.stamp:
        parser.error("--check writes nothing: it cannot --stamp")
    try:
        for path, commit, date in args.stamp:
            stamp(Path(path), commit, date)
        stale = []
        for page in map(Path, args.pages):
            text = page.read_text()
            rendered = render_page(text, page.parent, str(page))
            if rendered != text:
                stale.append(str(page))
                if not args.check:
                    write_atomic(page, rendered.encode())
    except (PageError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
