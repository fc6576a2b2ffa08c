"""The whole model at BitNet-2B-4T shapes: the engine against HF transformers + PEFT, one process.

Random weights built in memory (nothing is downloaded): the packed flavour of
microsoft/bitnet-b1.58-2B-4T (ternary ``BitLinear`` layers, bf16 embeddings, tied head) for
the engine; for the user's alternative, the same shapes as a dense bf16 ``BitNetForCausalLM``
with PEFT's LoRA on CUDA when torch has CUDA. Both carry r=8 adapters on q_proj and v_proj.

Figures: prefill tok/s (the prompt pass of generation, last position's logits), decode tok/s
(``new_tokens`` greedy tokens after a ``prompt``-token prompt), GPU time per pass and per
kernel family from timestamp queries, dispatches per layer and per decoded token, host time
per decoded token not hidden behind GPU work, and memory (the engine's own allocations;
torch's peak on CUDA).

>>> # python -m torch_wgpu_lora.benchmarks.engine --out $OUT/engine --layers 30
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..engine import TOKENS_PER_SUBMIT, BitNetEngine, GenerationRequest
from ..engine.kernels.attention import keeps_probabilities, scores_kept_whole
from ..integrations.bitnet import (PROJECTIONS, add_lora_layers, lora_modules, lora_parameters, projection, set_backend,
                                   swapped_dropout)
from ..ops import lora as lora_ops
from ..ops.optimizer import WgpuAdamW
from ..runtime import Recorder, get_device, recorder, synchronize, write
from ..runtime.buffers import pool_for
from .report import write_json
from .timing import arithmetic_rate, median_interval

Log = Callable[[str], None]
# Seconds of prefill passes before the first timed one: a GPU just started runs its first passes at
# a lower clock (benchmarks/RESULTS.md, "What is measured, and how", gives what it cost).
WARM_UP_S = 1.0
DROPOUT = 0.05  # the LoRA dropout of the "<seq>_dropout" training figures (common in Alpaca recipes)


def bitnet_2b_config(layers: int = 30, **overrides: Any) -> Any:
    """BitNet-2B-4T's shapes: hidden 2560, 20 heads / 5 KV heads, FFN 6912, vocab 128256."""
    from transformers import BitNetConfig

    settings = dict(hidden_size=2560, intermediate_size=6912, num_hidden_layers=layers, num_attention_heads=20,
                    num_key_value_heads=5, vocab_size=128256, max_position_embeddings=4096, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, hidden_act="relu2")  # RoPE θ: BitNetConfig's default, 500000
    settings.update(overrides)
    return BitNetConfig(**settings)


def small_config(layers: int) -> Any:
    """A small BitNet for a CPU adapter: hidden 256, 4 heads / 2 KV heads, FFN 512, vocab 4096."""
    return bitnet_2b_config(layers, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=4096, bos_token_id=0, eos_token_id=1)


@torch.no_grad()
def packed_model(config: Any, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    """A ``BitNetForCausalLM`` with packed ternary ``BitLinear`` projections and random weights,
    built in memory without initialising the dense weights it replaces."""
    from transformers import BitNetForCausalLM
    from transformers.integrations.bitnet import BitLinear
    from transformers.models.bitnet.modeling_bitnet import BitNetRotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = BitNetForCausalLM(config)
        for layer in model.model.layers:
            for name in PROJECTIONS:
                dense = projection(layer, name)
                parent = layer.self_attn if name in PROJECTIONS[:4] else layer.mlp
                setattr(parent, name, BitLinear(dense.in_features, dense.out_features, bias=False, dtype=dtype))
    model.to_empty(device="cpu")  # every tensor is now allocated, none initialised: fill each below
    for layer in model.model.layers:
        for name in PROJECTIONS:
            packed = projection(layer, name)
            codes = torch.randint(0, 3, (4, *packed.weight.shape), generator=g, dtype=torch.uint8)
            packed.weight.copy_(codes[0] | (codes[1] << 2) | (codes[2] << 4) | (codes[3] << 6))
            packed.weight_scale.fill_(packed.in_features ** 0.5 / 8)  # keeps activations O(1) through 30 layers
    model.model.embed_tokens.weight.copy_((torch.randn(model.model.embed_tokens.weight.shape, generator=g) * 0.02)
                                          .to(model.model.embed_tokens.weight.dtype))
    model.to(dtype)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.weight.fill_(1.0)
    model.model.rotary_emb = BitNetRotaryEmbedding(config)
    model.tie_weights()
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=g) * 0.02)
    return model.eval()


def with_adapters(model: torch.nn.Module, rank: int, seed: int) -> torch.nn.Module:

    add_lora_layers(model, r=rank, lora_alpha=2 * rank, target_modules=("q_proj", "v_proj"), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    return model


@contextmanager
def _lora_dropout(model: torch.nn.Module, p: float) -> Iterator[None]:
    """The model's adapters with dropout ``p``, in training mode, for the duration."""
    modules = lora_modules(model)
    with swapped_dropout(modules, {name: torch.nn.Dropout(p) for name in modules}):
        for m in modules.values():
            m.train()
        try:
            yield
        finally:
            for m in modules.values():
                m.eval()


def _families(kernel_times: list[tuple[str, float]]) -> dict[str, float]:
    """GPU µs by kernel entry point."""
    out: dict[str, float] = defaultdict(float)
    for name, seconds in kernel_times:
        out[name] += seconds * 1e6
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def kernel_work(config: Any, seq: int, training: bool) -> dict[str, tuple[float, str]]:
    """{kernel entry point: (operations, ceiling)} of one pass over ``seq`` tokens (batch 1) of a
    packed BitNet ``config``: the int8 operations of the ternary GEMMs (ceiling "dp4a") and the
    float32 flops of the rest ("fma"), a multiply-add counted as two; the forward (prefill,
    last position's logits only) or a training step (logits of every position, the backward).
    Attention counts the causal pairs only. Both passes start at position 0: where S of the pass
    fits its scratch, the forward computes S (``attention_scores``) and O = P·V
    (``attention_apply``), and a training step's backward dP (``attention_scores``; S again too
    where the layers' P are not kept, ``keeps_probabilities``), dV, dK (``attention_kv_grad``) and
    dQ (``attention_apply``) once each; else the flash kernels:
    ``prefill``, then ``dq`` recomputing S and dP for dQ and ``dkdv`` both for dV and dK. Layer 0's
    q/k/v input gradient is not computed."""
    h, f, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    d = h // config.num_attention_heads
    kv = config.num_key_value_heads * d
    projections = [(h + 2 * kv) * h, h * h, 2 * f * h, h * f]  # qkv, o, gate/up, down: rows × features
    ternary = 2 * seq * layers * sum(projections)
    product = 2 * seq * (seq + 1) // 2 * d * config.num_attention_heads * layers  # one over the causal pairs
    if scores_kept_whole(1, config.num_attention_heads, seq):
        scores = 2 if keeps_probabilities(layers, 1, config.num_attention_heads, seq) else 3
        products = ({"attention_scores.wgsl:gemm_tiled": scores, "attention_apply.wgsl:gemm_tiled": 2,
                     "attention_kv_grad.wgsl:gemm_tiled": 2} if training else
                    {"attention_scores.wgsl:gemm_tiled": 1, "attention_apply.wgsl:gemm_tiled": 1})
    else:
        products = ({"attention.wgsl:prefill": 2, "attention_backward.wgsl:dq": 3, "attention_backward.wgsl:dkdv": 4}
                    if training else {"attention.wgsl:prefill": 2})
    work = {"bitlinear.wgsl:gemm": (ternary, "dp4a")}
    work.update({name: (count * product, "fma") for name, count in products.items()})
    if training:
        work.update({"bitlinear_t.wgsl:gemm_tiled": (ternary - 2 * seq * projections[0], "fma"),
                     "matmul.wgsl:gemm_tiled": (2 * seq * vocab * h, "fma"),
                     "matmul_t.wgsl:gemm_tiled": (2 * seq * vocab * h, "fma")})
    return work


SAME_WORK = {"bitlinear.wgsl:gemm": ("bitlinear_mma.wgsl:gemm",)}  # kernels that share one work count


def kernel_rates(kernels_us: dict[str, float], work: dict[str, tuple[float, str]],
                 ceilings: dict[str, float | None]) -> dict[str, dict[str, float]]:
    """For each kernel in ``work`` that ran: its operations/s (from the per-dispatch profile's
    µs) and, where its ceiling was measured, that rate's share of it. The ternary forward's work
    is that of its two kernels together (``SAME_WORK``: the GEMM on the matrix units where the
    device chose it for a projection)."""
    out = {}
    for name, (ops, ceiling) in work.items():
        us = sum(kernels_us.get(k, 0.0) for k in (name, *SAME_WORK.get(name, ())))
        if us:
            rate = ops / (us * 1e-6)
            out[name] = {"tera_ops_per_s": rate / 1e12}
            if ceilings.get(ceiling):
                out[name]["share_of_ceiling"] = rate / ceilings[ceiling]
    return out


def measure_engine(engine: Any, prompt: int, new_tokens: int, prefill_tokens: int, repeats: int,
                   tokens_per_submit: int, log: Log) -> dict[str, Any]:
    """Prefill and decode figures of ``engine`` (see the module docstring)."""
    device = engine.device
    vocab = engine.engine_config.vocab
    out: dict[str, Any] = {}

    # prefill: a prompt of prefill_tokens, last position's logits, as generation runs it
    s = engine.decode_session(1, prefill_tokens, 1)
    g = torch.Generator().manual_seed(1)
    s.start([torch.randint(0, vocab, (prefill_tokens,), generator=g).tolist()], [0], ())
    start = time.perf_counter()
    while time.perf_counter() - start < WARM_UP_S:
        rec = Recorder(device)
        s.prefill.record(rec)
        rec.submit()
        synchronize(device)  # a submit without readbacks does not wait: unwaited, a second of them queues
        # tens of seconds of passes that the first timed one then waits behind
    gpu, wall = [], []
    for _ in range(repeats):
        rec = Recorder(device, timestamps=True)
        t0 = time.perf_counter()
        s.prefill.record(rec)
        gpu.append(rec.submit())
        wall.append(time.perf_counter() - t0)
    out["prefill"] = {"tokens": prefill_tokens, "wall_ms": statistics.median(wall) * 1e3,
                      "gpu_ms": statistics.median(gpu) * 1e3 if gpu[0] else None,
                      "tok_per_s": prefill_tokens / statistics.median(wall), "dispatches": s.prefill.dispatches}
    rec = Recorder(device, per_dispatch=True)
    s.prefill.record(rec)
    rec.submit()
    out["prefill"]["kernels_us"] = _families(rec.kernel_times)
    log(f"prefill {prefill_tokens}: {out['prefill']}")
    del s
    engine.release_plans()
    gc.collect()

    # decode: new_tokens greedy tokens after a prompt of `prompt` tokens
    prompt_ids = torch.randint(0, vocab, (prompt,), generator=g).tolist()
    request = GenerationRequest([prompt_ids], new_tokens, tokens_per_submit=tokens_per_submit)
    engine.generate_batch(request)  # warm-up
    walls = []
    for _ in range(max(1, repeats // 2)):
        t0 = time.perf_counter()
        engine.generate_batch(request)
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    step = decode_step_profile(engine, [prompt_ids], new_tokens)
    per_token_gpu = step["gpu_ms_per_step"] / 1e3 if step["gpu_ms_per_step"] else None
    out["decode"] = {"prompt": prompt, "new_tokens": new_tokens, "wall_s": wall, "tok_per_s": new_tokens / wall,
                     "tokens_per_submit": tokens_per_submit, "gpu_ms_per_token": step["gpu_ms_per_step"],
                     "encode_ms_per_token": step["encode_ms_per_step"],
                     "dispatches_per_token": step["dispatches_per_step"],
                     "dispatches_per_layer": step["dispatches_per_layer"], "kernels_us": step["kernels_us"]}
    if per_token_gpu:
        hidden = max(0.0, wall / new_tokens - per_token_gpu)
        out["decode"]["host_ms_not_hidden_per_token"] = hidden * 1e3
        out["decode"]["host_share_of_token_wall"] = hidden / (wall / new_tokens)
    log(f"decode: {out['decode']}")
    return out


def response_only(ids: torch.Tensor) -> torch.Tensor:
    """Labels of an instruction-tuning batch: the first half of each row a prompt (-100), the
    rest the response."""
    labels = ids.clone()
    labels[:, : ids.shape[1] // 2] = -100
    return labels


def hf_peft_model(config: Any, device: str = "cuda") -> torch.nn.Module:
    """transformers' ``BitNetForCausalLM`` of ``config`` (random weights) in bf16 on ``device``,
    with PEFT's r=8 LoRA (alpha 16) on q_proj and v_proj: the model every HF + PEFT figure here
    measures.

    >>> # model = hf_peft_model(bitnet_2b_config()).eval()
    """
    from peft import LoraConfig, get_peft_model
    from transformers import BitNetForCausalLM

    with torch.device(device):
        model = BitNetForCausalLM(config).to(torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


class HFPeftTraining:
    """HF transformers + PEFT training on CUDA in bf16, batch 1 (r=8 LoRA on q_proj and v_proj,
    AdamW on the adapters, clipping at 1): ``set_dropout(p)`` sets the adapters' dropout,
    ``step(ids, labels)`` is one optimizer step, synchronised; ``peak_memory_bytes`` torch's peak
    since this was built."""
    def __init__(self, config: Any) -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.model = hf_peft_model(config)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)

    def set_dropout(self, p: float) -> None:
        for layer in self.model.modules():  # PEFT's LoRA layers
            if isinstance(getattr(layer, "lora_dropout", None), torch.nn.ModuleDict):
                layer.lora_dropout["default"] = torch.nn.Dropout(p) if p else torch.nn.Identity()

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> None:
        loss = self.model(input_ids=ids.cuda(), labels=labels.cuda()).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        torch.cuda.synchronize()

    @property
    def peak_memory_bytes(self) -> int:
        return torch.cuda.max_memory_allocated()


def measure_training(model: torch.nn.Module, engine: Any, seqs: tuple[int, ...], steps: int, log: Log,
                     hf: HFPeftTraining | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Training tok/s of whole optimizer steps (batch 1, every token labelled; for the longest
    ``seqs`` also with ``response_only`` labels, under key ``"<seq>_response_only"``, and with
    LoRA dropout ``DROPOUT``, ``"<seq>_dropout"``), GPU time per step, per kernel and per
    dispatch in program order, and the runtime's peak GPU memory; with ``hf``, the same steps of
    HF + PEFT, taking turns with the engine's step by step (so a drift in the host's speed, which
    moved HF's figure by up to 1.6× between runs, weighs on both alike). Returns (engine's, HF's)."""

    optimizer = WgpuAdamW(lora_parameters(model), lr=1e-4)
    g = torch.Generator().manual_seed(2)
    out: dict[str, Any] = {}
    theirs: dict[str, Any] | None = {} if hf is not None else None
    engine.release_plans()  # the generation plans' buffers: not part of training's memory
    gc.collect()
    pool_for(engine.device).release()
    engine.device.reset_peak()

    def timed(key: str, seq: int, micro: list[dict[str, torch.Tensor]], dropout: float = 0.0) -> tuple[float, dict]:
        """Median wall time of ``steps`` engine optimizer steps after two unmeasured, and the
        last's result; HF's steps in turn, into ``theirs[key]``."""
        ids, labels = micro[0]["input_ids"], micro[0]["labels"]
        if hf is not None:
            hf.set_dropout(dropout)
        for _ in range(2):  # warm-up: the engine's plan, pipelines and step encoded ahead; torch's caches
            engine.train_step(micro, optimizer, 1.0)
            if hf is not None:
                hf.step(ids, labels)
        walls, hf_walls = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            done = engine.train_step(micro, optimizer, 1.0)
            walls.append(time.perf_counter() - t0)
            if hf is not None:
                t0 = time.perf_counter()
                hf.step(ids, labels)
                hf_walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls)
        log(f"engine training seq {key}: {seq / wall:.0f} tok/s ({wall * 1e3:.1f} ms/step)")
        if theirs is not None:
            hf_wall = statistics.median(hf_walls)
            theirs[key] = {"step_s": hf_wall, "tok_per_s": seq / hf_wall}
            log(f"HF + PEFT training seq {key}: {seq / hf_wall:.0f} tok/s ({hf_wall * 1e3:.1f} ms/step)")
        return wall, done

    plain_peak = 0
    for seq in seqs:
        ids = torch.randint(0, engine.engine_config.vocab, (1, seq), generator=g)
        micro = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}]
        wall, done = timed(str(seq), seq, micro)
        plan = engine.train_plan(1, seq, 1)
        kernels, rec = training_profile(engine, plan)
        gpu_us = sum(kernels.values())
        lora_us = sum(us for name, us in kernels.items() if name.startswith("lora_grad"))
        out[str(seq)] = {"step_s": wall, "tok_per_s": seq / wall, "loss": done["loss"],
                         "dispatches": plan.dispatches, "gpu_ms_profiled": gpu_us / 1e3,
                         "lora_grad_kernels_share": lora_us / gpu_us if gpu_us else None, "kernels_us": kernels,
                         "dispatches_us": [[name, round(seconds * 1e6, 2)] for name, seconds in rec.kernel_times]}
        if seq == max(seqs):
            key = f"{seq}_response_only"
            wall, _ = timed(key, seq, [{**micro[0], "labels": response_only(ids)}])
            out[key] = {"step_s": wall, "tok_per_s": seq / wall}
            plain_peak = engine.device.peak_allocated  # the figure of the plain steps: dropout's plan is another
            key = f"{seq}_dropout"
            with _lora_dropout(model, DROPOUT):
                wall, _ = timed(key, seq, micro, DROPOUT)
            kernels, _ = training_profile(engine, engine.train_plan(1, seq, 1, dropout=True))  # its masks as the last step's
            out[key] = {"step_s": wall, "tok_per_s": seq / wall, "kernels_us": kernels}
            engine.release_plans()  # the dropout plan's buffers go before the next length's plan is made
            gc.collect()
            pool_for(engine.device).release()
            engine.device.reset_peak()
    out["peak_gpu_bytes"] = max(plain_peak, engine.device.peak_allocated)
    if theirs is not None:
        theirs["peak_memory_bytes"] = hf.peak_memory_bytes
    return out, theirs


def _minor_faults() -> int | None:
    """This process's minor page faults so far (None where the platform has no ``resource``)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@contextmanager
def _base_alone(model: torch.nn.Module) -> Iterator[None]:
    """``model`` with its adapters bypassed (each ``LoRALinear`` calls its base layer alone) and its
    embeddings' output requiring grad, so that a backward still runs through every layer: what
    the adapters add to a training step is that step's time less this one's."""
    modules = list(lora_modules(model).values())
    for m in modules:
        m.forward = m.base_layer.__call__  # a bound method, kept in the instance's __dict__: found first
    hook = model.get_input_embeddings().register_forward_hook(lambda _m, _i, out: out.detach().requires_grad_())
    try:
        yield
    finally:
        hook.remove()
        for m in modules:
            del m.forward


def measure_drop_in(config: Any, seq: int, steps: int, log: Log) -> dict[str, Any]:
    """The drop-in path: a CPU torch model (packed BitNet, float32) whose Q/V adapters are
    ``LoRALinear(backend="wgpu")``, against the same with ``backend="torch"``: one training step's
    wall time (forward, backward, AdamW on the adapters), batch 1. A third variant, ``base``, is
    the same step with the adapters bypassed (``_base_alone``). The three take turns, step by
    step, each turn in a rotated order, so that a drift in the host's speed weighs on all alike.

    Per backend: ``step_s`` (the median), ``steps_s``, ``adapters_s`` (the median over turns of
    the step less the same turn's base step: what its adapters cost a step) and ``page_faults``
    (minor page faults a step, None without ``resource``: a CPU step's time moves with them).
    ``paired_ratio`` is the median of each turn's wgpu / torch and ``paired_interval`` its
    distribution-free interval (``timing.median_interval``: low, high, coverage): the host's
    step-to-step noise is larger than the gap between the backends, and this says whether the
    turns resolve it. For the WebGPU steps: the seconds a step's adapter calls spent uploading
    (x and dY) and waiting for results (the GPU time the base layer's CPU work did not hide, and
    the copies out of the readbacks), and ``adapter_s``, all the time spent in the adapters'
    autograd nodes (those two, recording and submitting)."""

    model = with_adapters(packed_model(config, dtype=torch.float32), 8, seed=0)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(3))
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=1e-4)
    variants = ("wgpu", "torch", "base")
    walls: dict[str, list[float]] = {v: [] for v in variants}
    faults: dict[str, list[int | None]] = {v: [] for v in variants}
    spent = {"upload_s": 0.0, "wait_s": 0.0, "adapter_s": 0.0}
    exposed: dict[str, list[float]] = {key: [] for key in spent}  # the WebGPU steps'

    def timed(fn: Callable, key: str) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0
        return wrapper

    def step(variant: str) -> tuple[float, int | None]:
        if variant != "base":
            set_backend(model, variant)
        with _base_alone(model) if variant == "base" else nullcontext():
            faults0, t0 = _minor_faults(), time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()  # with the adapters bypassed it has no gradients and skips them
            optimizer.zero_grad()
            wall, faults1 = time.perf_counter() - t0, _minor_faults()
        return wall, None if faults0 is None else faults1 - faults0

    upload, wait = lora_ops.to_gpu, recorder.Pending.wait
    nodes = [(cls, name, getattr(cls, name)) for cls in (lora_ops._Start, lora_ops._Finish)
             for name in ("forward", "backward")]
    with torch.compiler.set_stance("force_eager"):
        for turn in range(steps + 1):  # the first turn warms up
            for variant in variants[turn % 3:] + variants[:turn % 3]:
                spent.update({key: 0.0 for key in spent})
                lora_ops.to_gpu, recorder.Pending.wait = timed(upload, "upload_s"), timed(wait, "wait_s")
                for cls, name, fn in nodes:  # autograd looks a Function's forward and backward up at each call
                    setattr(cls, name, staticmethod(timed(fn, "adapter_s")))
                try:
                    wall, step_faults = step(variant)
                finally:
                    lora_ops.to_gpu, recorder.Pending.wait = upload, wait
                    for cls, name, fn in nodes:
                        setattr(cls, name, staticmethod(fn))
                if turn:
                    walls[variant].append(wall)
                    faults[variant].append(step_faults)
                    if variant == "wgpu":
                        for key in exposed:
                            exposed[key].append(spent[key])
    out: dict[str, Any] = {"seq": seq}
    for variant in variants:
        wall = statistics.median(walls[variant])
        page_faults = None if None in faults[variant] else statistics.median(faults[variant])
        out[variant] = {"step_s": wall, "tok_per_s": seq / wall, "steps_s": walls[variant], "page_faults": page_faults}
        if variant != "base":
            out[variant]["adapters_s"] = statistics.median(w - b for w, b in zip(walls[variant], walls["base"]))
        log(f"drop-in training step, {variant}: {wall:.2f} s (steps: {', '.join(f'{w:.2f}' for w in walls[variant])}), "
            f"{page_faults} minor page faults a step")
    out["wgpu"].update({key: statistics.median(values) for key, values in exposed.items()})
    log(f"drop-in, adapters on wgpu: {out['wgpu']['adapter_s']:.3f} s a step in the adapters' nodes, of which "
        f"{out['wgpu']['upload_s']:.3f} s uploading and {out['wgpu']['wait_s']:.3f} s waiting for results")
    log(f"drop-in, what the adapters add to a step (median over turns of the step less the base step): "
        f"wgpu {out['wgpu']['adapters_s']:.3f} s, torch {out['torch']['adapters_s']:.3f} s")
    out["wgpu_over_torch"] = out["wgpu"]["step_s"] / out["torch"]["step_s"]
    turns = [w / t for w, t in zip(walls["wgpu"], walls["torch"])]
    out["paired_ratio"] = statistics.median(turns)
    out["paired_interval"] = median_interval(turns)
    low, high, coverage = out["paired_interval"]
    log(f"drop-in, wgpu / torch: {out['wgpu_over_torch']:.3f} (medians), {out['paired_ratio']:.3f} (median of turns; "
        f"{low:.3f} to {high:.3f} with {coverage:.0%} confidence)")
    return out


BATCHED = "1x512,8x512"  # (sequences)x(tokens) a step of the batched comparison


class HFPeftAnchor:
    """HF transformers + PEFT in bf16 on CUDA with ``attn_implementation="sdpa"`` (r=8 LoRA on
    q_proj and v_proj, AdamW on the adapters, clipping at 1): ``train(ids)`` is one optimizer step
    and ``prefill(ids)`` one forward to the last position's logits, each synchronised.
    ``compile()`` compiles each decoder layer (regional compilation: the 30 identical layers
    compile once), torch's advice for language models."""

    def __init__(self, config: Any) -> None:
        torch.cuda.empty_cache()
        self.model = hf_peft_model(type(config).from_dict({**config.to_dict(), "_attn_implementation": "sdpa"}))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)

    def compile(self) -> None:
        for layer in self.model.base_model.model.model.layers:
            layer.compile()

    def train(self, ids: torch.Tensor) -> None:
        self.model.train()
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        torch.cuda.synchronize()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> None:
        self.model.eval()
        self.model(input_ids=ids, logits_to_keep=1)
        torch.cuda.synchronize()


def _median_wall(fn: Callable[[], Any], warm: int, steps: int) -> float:
    for _ in range(warm):
        fn()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def batched_shapes(text: str) -> list[tuple[int, int]]:
    """``"1x512,8x512"`` → [(1, 512), (8, 512)]."""
    try:
        return [tuple(int(x) for x in part.split("x")) for part in text.split(",") if part]  # type: ignore[misc]
    except ValueError:
        raise ValueError(f"shapes are SEQUENCESxTOKENS, comma-separated, e.g. {BATCHED}; got {text!r}") from None


def training_profile(engine: Any, plan: Any) -> tuple[dict[str, float], Recorder]:
    """A pass of the training ``plan`` timed per dispatch: GPU µs per kernel family, and the recorder."""
    rec = Recorder(engine.device, per_dispatch=True)
    rec.clear(plan.grads)
    plan.record(rec, 0)
    rec.submit()
    return _families(rec.kernel_times), rec


def measure_batched(engine: Any, config: Any, shapes: list[tuple[int, int]], steps: int, log: Log,
                    hf: bool) -> dict[str, Any]:
    """Training steps and prefill passes of ``shapes`` (sequences, tokens; every token labelled): the
    engine's, and with ``hf`` HF + PEFT's (sdpa, bf16) eager and with its decoder layers compiled, in
    one process. Keys ``"<batch>x<tokens>"``; tok/s counts every sequence's tokens; the engine's
    training step's per-dispatch profile as in ``measure_training``."""
    g = torch.Generator().manual_seed(3)
    optimizer = WgpuAdamW(lora_parameters(engine.model), lr=1e-4)
    out: dict[str, Any] = {"engine": {}}
    for batch, seq in shapes:
        key, tokens = f"{batch}x{seq}", batch * seq
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        micro = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}]
        train = _median_wall(lambda: engine.train_step(micro, optimizer, 1.0), 2, steps)
        # the plan the steps ran (cached), holding the last step's inputs: its labelled rows size the LM head's grid
        kernels, _ = training_profile(engine, engine.train_plan(batch, seq, 1))
        plan = engine.plan(batch, seq, logits="none")
        lengths = [seq] * batch

        def prefill_pass() -> None:  # a pass without logits reads nothing back: wait for the GPU
            plan.run(ids, lengths)
            synchronize(engine.device)

        prefill = _median_wall(prefill_pass, 2, steps)
        out["engine"][key] = {"train_step_s": train, "train_tok_per_s": tokens / train,
                              "train_gpu_ms_profiled": sum(kernels.values()) / 1e3, "train_kernels_us": kernels,
                              "prefill_s": prefill, "prefill_tok_per_s": tokens / prefill}
        log(f"engine {key}: " + ", ".join(f"{k} {v:.4g}" for k, v in out["engine"][key].items() if k != "train_kernels_us"))
        engine.release_plans()
        gc.collect()
    if hf and torch.cuda.is_available():
        out.update(_measure_hf_batched(config, shapes, steps, log, g))
    return out


def decode_step_profile(engine: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """One decode step of ``prompts`` (all of one length) at once, on its own, in the session a
    generation of ``new_tokens`` uses: its GPU time (the median of four timed submits after two),
    the host's time to record it, its dispatches, and each kernel's time from a run with a
    timestamp pair a dispatch (those add each dispatch's own start-up, so they sum to more than the
    step's GPU time)."""
    device, batch, prompt = engine.device, len(prompts), len(prompts[0])
    s = engine.decode_session(batch, prompt, new_tokens)
    s.start(prompts, [0] * batch, ())
    s.cache.set_position(prompt + 1, [prompt + 2] * batch)
    write(s.next_token, np.zeros(batch, np.uint32))
    step_gpu, encode = [], []
    for _ in range(6):
        rec = Recorder(device, timestamps=True)
        t0 = time.perf_counter()
        s.record(rec, 1, prefill=False)
        encode.append(time.perf_counter() - t0)
        step_gpu.append(rec.submit())
    rec = Recorder(device, per_dispatch=True)
    s.record(rec, 1, prefill=False)
    rec.submit()
    return {"gpu_ms_per_step": statistics.median(step_gpu[2:]) * 1e3 if step_gpu[0] else None,
            "encode_ms_per_step": statistics.median(encode[2:]) * 1e3,
            "dispatches_per_step": s.decode.dispatches + len(s.decode_sampling),
            "dispatches_per_layer": (s.decode.dispatches - 1 - 2) / engine.engine_config.layers,
            "kernels_us": _families(rec.kernel_times)}


def measure_decode_batches(engine: Any, batches: list[int], prompt: int, new_tokens: int, repeats: int,
                           tokens_per_submit: int, log: Log) -> dict[str, Any]:
    """Greedy decoding of ``batch`` prompts of ``prompt`` random tokens at once, ``new_tokens``
    each, for each of ``batches``: one unmeasured generation, then the median wall time of
    ``repeats``; tok/s counts every row's new tokens. Keys: the batch sizes."""
    g = torch.Generator().manual_seed(5)
    out: dict[str, Any] = {}
    for batch in batches:
        prompts = torch.randint(0, engine.engine_config.vocab, (batch, prompt), generator=g).tolist()

        def generation() -> None:
            engine.generate_batch(GenerationRequest(prompts, new_tokens, tokens_per_submit=tokens_per_submit))

        wall = _median_wall(generation, 1, repeats)
        out[str(batch)] = {"prompt": prompt, "new_tokens": new_tokens, "wall_s": wall,
                           "tok_per_s": batch * new_tokens / wall, "step": decode_step_profile(engine, prompts, new_tokens)}
        log(f"decode, {batch} prompts at once: {out[str(batch)]}")
        engine.release_plans()
        gc.collect()
    return out


# Prompts of the prompts-file figure: 4 to 48 of these words each, drawn from a seeded generator.
PROMPT_WORDS = ("name", "a", "primary", "colour", "add", "the", "numbers", "translate", "word", "into", "french",
                "count", "to", "three", "write", "short", "poem", "about", "sea", "explain", "why", "sky", "is", "blue",
                "list", "planets", "summarise", "this", "paragraph", "in", "one", "sentence", "give", "example")
PROMPT_WORDS_RANGE = (4, 48)
COMPLETION_SHARE = 4  # completions average about max_new_tokens / 4 tokens (measure_prompts_file)


class _CountingGenerate:
    """Wraps ``engine.generate_batch`` to count what each call generates: the tokens and each
    prompt's completion length."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.real, self.lengths = engine, engine.generate_batch, []

    def __call__(self, request: GenerationRequest) -> Any:
        results = self.real(request)
        self.lengths += [len(r.tokens) for r in results]
        return results

    def __enter__(self) -> "_CountingGenerate":
        self.engine.generate_batch = self
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.engine.generate_batch  # the instance attribute: the method shows again


def measure_prompts_file(engine: Any, batch: int, count: int, new_tokens: int, tokens_per_submit: int,
                         log: Log) -> dict[str, Any]:
    """The prompts file's throughput (``prompts_file.generate_file``: ``batch`` rows, a finished row
    taking the next record) beside static batches of the same size (``generation.generate`` on
    ``batch`` records at a time, as the prompts file ran them before, each batch waiting for its
    longest row), on ``count`` records of mixed lengths: each prompt 4 to 48 random words (a
    seeded generator; a byte-level BPE tokenizer trained on them, built offline), then sampled
    completions (temperature 1, the whole vocabulary) of up to ``new_tokens`` tokens that end at
    any of ``vocab × 4 / new_tokens`` EOS tokens drawn at random. With random weights the model's
    next-token distribution is near uniform (logits of about 0.3 to 1 standard deviation), so a
    completion ends at each token with a probability of about 4 / new_tokens: lengths near
    geometric, of mean about new_tokens / 4, some running to the limit, as real completions mix
    short and long. Record i samples with seed i either way, so both generate the same completions
    (but where a batch past ``gemv_max_tokens`` rounds a logit otherwise). tok/s counts every new
    token (``completions``: their lengths). One unmeasured run of each first (sessions and plans
    built), then one measured. ``tokens_per_submit``: both runs' decode steps a command buffer."""
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    from ..generation import generate
    from ..integrations.tiny import build_tiny_tokenizer
    from ..prompts_file import generate_file

    g = np.random.default_rng(7)
    low, high = PROMPT_WORDS_RANGE
    texts = [" ".join(g.choice(PROMPT_WORDS, size=int(g.integers(low, high + 1)))) for _ in range(count)]
    vocab = engine.engine_config.vocab
    share = min(vocab - 3, max(1, vocab * COMPLETION_SHARE // new_tokens))  # of the ids past bos, eos, pad
    eos = sorted(int(t) for t in g.choice(np.arange(3, vocab), size=share, replace=False))
    options = dict(max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                   eos_token_id=eos, use_template=False, tokens_per_submit=tokens_per_submit)
    out: dict[str, Any] = {"prompts": count, "batch": batch, "max_new_tokens": new_tokens, "eos_tokens": len(eos),
                           "tokens_per_submit": tokens_per_submit}
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_tokenizer(Path(folder) / "tokenizer", texts))
        lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
        out["prompt_tokens"] = {"min": min(lengths), "mean": statistics.mean(lengths), "max": max(lengths)}
        prompts = Path(folder) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
        results = Path(folder) / "results.jsonl"

        def prompts_file() -> None:
            results.unlink(missing_ok=True)
            generate_file(engine, tokenizer, prompts, results, batch_size=batch, progress=False, seed=0, **options)

        def static() -> None:
            for start in range(0, count, batch):
                generate(engine, tokenizer, texts[start:start + batch], seed=start, **options)

        for name, run in (("static", static), ("prompts_file", prompts_file)):
            run()  # unmeasured: sessions and plans built
            with _CountingGenerate(engine) as counted:
                t0 = time.perf_counter()
                run()
                wall = time.perf_counter() - t0
            new = sum(counted.lengths)
            out[name] = {"wall_s": wall, "new_tokens": new, "tok_per_s": new / wall,
                         "completions": {"mean": statistics.mean(counted.lengths), "max": max(counted.lengths),
                                         "at_limit": sum(n == new_tokens for n in counted.lengths)}}
            log(f"{count} records, {batch} at once, {name}: {out[name]}")
            engine.release_plans()
            gc.collect()
    out["prompts_file_over_static"] = out["prompts_file"]["tok_per_s"] / out["static"]["tok_per_s"]
    log(f"prompts file over static batches: {out['prompts_file_over_static']:.2f}×")
    return out


def _measure_hf_batched(config: Any, shapes: list[tuple[int, int]], steps: int, log: Log,
                        g: torch.Generator) -> dict[str, Any]:
    """``measure_batched``'s HF + PEFT part."""
    out: dict[str, Any] = {}
    torch.cuda.reset_peak_memory_stats()
    anchor = HFPeftAnchor(config)
    for mode in ("eager", "compiled"):
        if mode == "compiled":
            t0 = time.perf_counter()
            anchor.compile()
            out["hf_compile_started_s"] = time.perf_counter() - t0
        out[f"hf_{mode}"] = {}
        for batch, seq in shapes:
            key, tokens = f"{batch}x{seq}", batch * seq
            ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g).cuda()
            try:
                t0 = time.perf_counter()
                anchor.train(ids)  # the first (compiling) step, timed apart
                first = time.perf_counter() - t0
                train = _median_wall(lambda: anchor.train(ids), 1, steps)
                anchor.prefill(ids)
                prefill = _median_wall(lambda: anchor.prefill(ids), 1, steps)
            except Exception as e:  # a configuration torch cannot run here: recorded, the rest goes on
                out[f"hf_{mode}"][key] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                continue
            out[f"hf_{mode}"][key] = {"first_step_s": first, "train_step_s": train, "train_tok_per_s": tokens / train,
                                      "prefill_s": prefill, "prefill_tok_per_s": tokens / prefill}
            log(f"HF + PEFT {mode} {key}: {out[f'hf_{mode}'][key]}")
    out["hf_peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return out


def measure_hf_peft(config: Any, prompt: int, new_tokens: int, prefill_tokens: int, repeats: int,
                    log: Log) -> dict[str, Any] | None:
    """HF transformers + PEFT on torch CUDA in bf16 (dense BitNet shapes), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.reset_peak_memory_stats()
    model = hf_peft_model(config).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, prefill_tokens), generator=g).cuda()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    with torch.no_grad():
        for _ in range(2):
            model(input_ids=ids, logits_to_keep=1)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out["prefill"] = {"tokens": prefill_tokens, "wall_ms": statistics.median(times) * 1e3,
                          "tok_per_s": prefill_tokens / statistics.median(times)}
        short = ids[:, :prompt]
        model.generate(input_ids=short, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(input_ids=short, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    out["decode"] = {"prompt": prompt, "new_tokens": new_tokens, "wall_s": wall, "tok_per_s": new_tokens / wall}
    out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    log(f"HF + PEFT ({out['device']}): {out}")
    del model
    torch.cuda.empty_cache()
    return out


HF_GENERATE_MODES = ("eager", "static_compiled")  # transformers compiles the forward itself on a static cache


def measure_hf_generate(config: Any, batches: list[int], prompt: int, new_tokens: int, log: Log,
                        device: str = "cuda", modes: tuple[str, ...] = HF_GENERATE_MODES) -> dict[str, Any]:
    """HF transformers + PEFT ``generate`` (bf16, r=8 Q/V adapters), greedy, ``new_tokens`` after
    ``prompt`` random tokens, at each batch size, in each of ``modes``: ``"eager"`` (the dynamic
    cache) and ``"static_compiled"`` (``cache_implementation="static"``, on which transformers
    compiles the forward on CUDA). Each batch's first generation (where compilation happens) is
    timed apart as ``first_s``; tok/s counts every row's new tokens of the second."""
    model = hf_peft_model(config, device).eval()
    g = torch.Generator().manual_seed(6)
    out: dict[str, Any] = {}
    for mode in modes:
        options = {"cache_implementation": "static"} if mode == "static_compiled" else {}
        out[mode] = {}
        for batch in batches:
            ids = torch.randint(0, config.vocab_size, (batch, prompt), generator=g).to(device)
            walls = []
            for _ in range(2):
                t0 = time.perf_counter()
                with torch.no_grad():
                    tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                            max_new_tokens=new_tokens, min_new_tokens=new_tokens, **options)
                if device == "cuda":
                    torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
            if tokens.shape != (batch, prompt + new_tokens):
                raise RuntimeError(f"HF generate returned {tuple(tokens.shape)}, not {(batch, prompt + new_tokens)}")
            out[mode][str(batch)] = {"prompt": prompt, "new_tokens": new_tokens, "first_s": walls[0],
                                     "wall_s": walls[1], "tok_per_s": batch * new_tokens / walls[1]}
            log(f"HF + PEFT generate, {mode}, {batch} prompts: {out[mode][str(batch)]}")
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_wgpu_lora.benchmarks.engine", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/out/engine", help="folder for engine.json")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (default: BitNet-2B's 30)")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill figure")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens before decoding")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens decoded")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--tokens-per-submit", type=int, default=TOKENS_PER_SUBMIT,
                        help="decode steps a command buffer (default: %(default)s)")
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers + PEFT")
    parser.add_argument("--train", default="512,256", help="training sequence lengths ('' to skip)")
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--batched", default="", metavar="SHAPES",
                        help=f"also training and prefill at these SEQUENCESxTOKENS a step (e.g. {BATCHED}), beside "
                        "HF + PEFT (sdpa) eager and compiled")
    parser.add_argument("--decode-batches", default="", metavar="SIZES",
                        help="also greedy decoding of this many prompts at once, comma-separated (e.g. 16,64)")
    parser.add_argument("--prompts-file-batch", type=int, default=0, metavar="ROWS",
                        help="also the prompts file's throughput (continuous batching, ROWS at once) beside static "
                        "batches of ROWS, on --prompts-file-count records of mixed lengths, up to --new-tokens each")
    parser.add_argument("--prompts-file-count", type=int, default=256, metavar="RECORDS",
                        help="records of the prompts-file figure (default: %(default)s)")
    parser.add_argument("--hf-generate", default="", metavar="SIZES",
                        help="also HF + PEFT generate at these batch sizes (e.g. 1,16), eager and on a static cache "
                        "compiled")
    parser.add_argument("--checks", default="", help="shader-check modes to measure the engine in, e.g. "
                        "bounds,full (default: the device's, TORCH_WGPU_LORA_SHADER_CHECKS; on Dawn that one only); "
                        "the first is measured beside HF + PEFT, the others' results are keyed with a suffix")
    parser.add_argument("--drop-in", type=int, default=0, metavar="SEQ",
                        help="also time the drop-in path (CPU model, LoRALinear on WebGPU vs torch) at SEQ tokens")
    parser.add_argument("--drop-in-steps", type=int, default=3, help="timed drop-in steps per backend (default: 3)")
    parser.add_argument("--small", action="store_true", help="a small model (for a CPU adapter): hidden 256, "
                        "FFN 512, vocab 4096, --layers layers")
    args = parser.parse_args(argv)
    log = print
    device = get_device()
    config = small_config(args.layers) if args.small else bitnet_2b_config(args.layers)
    log(f"adapter: {device.name}; model: {config.num_hidden_layers} layers, hidden {config.hidden_size}")
    result: dict[str, Any] = {"adapter": device.name, "layers": config.num_hidden_layers,
                              "hidden": config.hidden_size, "vocab": config.vocab_size}
    t0 = time.perf_counter()
    model = with_adapters(packed_model(config), 8, seed=0)
    log(f"packed model built in {time.perf_counter() - t0:.1f} s")
    def save() -> None:  # after every part: a run stopped by a time limit keeps what it measured
        write_json(args.out, "engine.json", result)

    seqs = tuple(int(x) for x in args.train.split(",") if x)
    start = time.perf_counter()
    engine = BitNetEngine(model)
    result["engine_build"] = {"upload_s": time.perf_counter() - start, "weights_bytes": engine.weights.nbytes,
                              "adapter_bytes": engine.adapters.params.nbytes}
    log(f"engine built: {result['engine_build']}")
    ceilings = {"fma": arithmetic_rate("fma_chain"), "dp4a": arithmetic_rate("dp4a_chain")}
    result["ceilings_tera_ops_per_s"] = {k: v / 1e12 if v else None for k, v in ceilings.items()}
    log(f"ceilings (T ops/s): {result['ceilings_tera_ops_per_s']}")

    def rates(kernels_us: dict[str, float], seq: int, training: bool, what: str) -> dict[str, dict[str, float]]:
        out = kernel_rates(kernels_us, kernel_work(config, seq, training), ceilings)
        log(f"{what}: " + ", ".join(f"{name} {r['tera_ops_per_s']:.3g} T/s ({r.get('share_of_ceiling', 0):.0%})"
                                    for name, r in out.items()))
        return out

    default_settings = engine.device.settings
    modes = args.checks.split(",") if args.checks else [device.settings.shader_checks]
    result["shader_checks"] = modes[0]  # the mode of the unsuffixed figures, beside HF + PEFT's
    for checks in modes:  # kernels and plans are keyed on the mode: each gets its own
        engine.device.configure(shader_checks=checks)
        engine.release_plans()
        suffix = "" if checks == modes[0] else f"_{checks}"
        result["engine" + suffix] = measure_engine(engine, args.prompt, args.new_tokens, args.prefill, args.repeats,
                                                   args.tokens_per_submit, log)
        prefill = result["engine" + suffix]["prefill"]
        prefill["rates"] = rates(prefill["kernels_us"], args.prefill, False, f"prefill {args.prefill} kernel rates")
        save()
        if seqs:  # HF + PEFT's steps take turns with the engine's, in the default mode
            hf = HFPeftTraining(config) if not suffix and not args.no_hf and torch.cuda.is_available() else None
            training, theirs = measure_training(model, engine, seqs, args.train_steps, log, hf)
            del hf
            for seq in seqs:
                step = training[str(seq)]
                step["rates"] = rates(step["kernels_us"], seq, True, f"training seq {seq} kernel rates")
            result["engine_training" + suffix] = training
            if theirs is not None:
                result["hf_peft_training"] = theirs
            save()
    engine.device.configure(default_settings)
    decode_batches = [int(x) for x in args.decode_batches.split(",") if x]
    if decode_batches:
        result["decode_batches"] = measure_decode_batches(engine, decode_batches, args.prompt, args.new_tokens,
                                                          max(1, args.repeats // 2), args.tokens_per_submit, log)
        save()
    if args.prompts_file_batch:
        result["prompts_file"] = measure_prompts_file(engine, args.prompts_file_batch, args.prompts_file_count,
                                                      args.new_tokens, args.tokens_per_submit, log)
        save()
    shapes = batched_shapes(args.batched)
    if shapes:
        result["batched"] = measure_batched(engine, config, shapes, args.train_steps, log, hf=False)
        save()
    del model, engine
    gc.collect()
    if not args.no_hf:
        result["hf_peft"] = measure_hf_peft(config, args.prompt, args.new_tokens, args.prefill, args.repeats, log)
        save()
        hf_generate = [int(x) for x in args.hf_generate.split(",") if x]
        if hf_generate and torch.cuda.is_available():
            result["hf_generate"] = measure_hf_generate(config, hf_generate, args.prompt, args.new_tokens, log)
            save()
        if shapes and torch.cuda.is_available():  # last: compiling takes the longest
            result["batched"].update(_measure_hf_batched(config, shapes, args.train_steps, log,
                                                         torch.Generator().manual_seed(4)))
            save()
    if args.drop_in:
        result["drop_in"] = measure_drop_in(config, args.drop_in, args.drop_in_steps, log)
        save()
    hf, hf_train = result.get("hf_peft"), result.get("hf_peft_training")
    ratios = {}
    if hf:
        ratios["prefill_tok_per_s"] = result["engine"]["prefill"]["tok_per_s"] / hf["prefill"]["tok_per_s"]
        ratios["decode_tok_per_s"] = result["engine"]["decode"]["tok_per_s"] / hf["decode"]["tok_per_s"]
    if hf_train:
        for key in [str(seq) for seq in seqs] + [f"{max(seqs)}_response_only", f"{max(seqs)}_dropout"]:
            ratios[f"training_tok_per_s_{key}"] = (result["engine_training"][key]["tok_per_s"]
                                                   / hf_train[key]["tok_per_s"])
        ratios["peak_memory"] = result["engine_training"]["peak_gpu_bytes"] / hf_train["peak_memory_bytes"]
    result["ratios"] = ratios
    save()
    log(json.dumps(ratios, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
