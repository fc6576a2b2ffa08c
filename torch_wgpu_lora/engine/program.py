"""The engine's program, written once: the launches of a decoder layer's forward, of the final norm
and of the LM head, which every plan emits (``plan.ForwardPlan``: logits, prefill, decode;
``train_plan.TrainPlan``: the forward of a training pass). The plans differ only in the buffers
they hand over (``LayerIO``: what a training pass keeps for its backward gets buffers of its own;
a forward plan reuses one set) and in what their ``PassContext`` allows (decoding's fusions, kept
attention scores, dropout).

Per layer (LoRA, when the model has adapters there, rides along inside the launches: the norms
compute every h = A·x of their site, the projections add s·B·h in their epilogue)::

    norm        input_layernorm (+ int8 codes, + h for q/k/v adapters)
    qkv         q, k, v projections in one launch
    rope        rotate q and k (a packed pass: at each token's position id); k and v into the cache
    attention   causal GQA over the cache (a packed pass: each example to itself)
    norm        attn_sub_norm (+ codes, + h for o)
    o           o_proj, added into the residual stream
    norm        post_attention_layernorm (+ codes, + h for gate/up)
    gate_up     gate and up in one launch; relu(gate)²·up
    norm        ffn_sub_norm (+ codes, + h for down)
    down        down_proj, added into the residual stream

Decoding a ternary model (``PassContext.fused``: a few tokens, the GEMV path) fuses launches,
since a token is a chain of a few hundred dependent launches of a few µs each: the q/k/v GEMV
rotates its output and writes the caches itself (no rope launch); a GEMV whose site has no adapter
normalises and quantises its own input (no norm launch; a site with adapters keeps its norm, which
computes h, and so does a row too long for the GEMV to hold: ``gemv_normalises``); and o_proj's
GEMV that does so merges attention's key-span partials as it reads them (no combine launch).
BitNet-2B with Q/V adapters: 7 launches a layer rather than 11.

Decoding a batch on GEMMs (``PassContext.fuses_batch``: more tokens than the GEMV path takes,
the projections split along K on the matrix units) leaves o_proj's and gate/up's sums to the next
norm's launch, which runs their epilogue (the add, the gate/up products) and then normalises
(``norm.rmsnorm_launch``'s ``split``) where neither site has LoRA; q/k/v's split epilogue rotates
its rows into the queries and the caches (no rope launch); and o_proj's norm merges attention's
key-span partials as it reads them (``attention``): four launches a layer fewer.

A ``Program`` is the launches in order, with the points where activations are quantised marked,
so that ``record(capture=...)`` can copy the int8 codes a pass chose (tests feed them to the
torch model), and named points (``mark``) where a caller may split it over several command
buffers (``record(start=..., stop=...)``: a training step's gradient exchange sends each bucket of
layers as soon as the backward has passed them).

>>> # program = Program(); emit_embedding(program, context, ids)
>>> # for i in range(config.layers): emit_layer(program, context, i, io[i])
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from ..runtime import Buffer, Launch, Recorder, copy_launch
from .adapters import EngineAdapters, Site
from .config import EngineConfig
from .kernels.attention import DecodePartials, attention_launches, decode_partials
from .kernels.bitlinear import bitlinear_launch, bitlinear_split_launch, gemv_normalises, matrix_units_win
from .kernels.embedding import embedding_launches
from .kernels.matmul import head_forward_launches, head_on_matrix_units, matmul_launch
from .kernels.norm import rmsnorm_launch
from .kernels.projection import SplitSums, gemv_max_tokens
from .kernels.rope import RopeTarget, rope_launch
from .weights import EngineWeights, Projection
from .workspace import Workspace

__all__ = ["Indirect", "LayerIO", "PassContext", "Program", "SiteIO", "emit_embedding", "emit_final_norm",
           "emit_head", "emit_layer", "head_chunks", "read_codes"]


@dataclass(frozen=True)
class Indirect:
    """A launch whose grid a buffer sets before each submit (three u32 of ``grids`` at word
    ``at``): the training head's GEMMs, whose token tiles cover the labelled rows only."""

    launch: Launch
    grids: Buffer
    at: int


class Program:
    """Launches (or ``Indirect`` launches) in the order they run, and where activations are quantised."""

    def __init__(self) -> None:
        self.steps: list[Launch | Indirect] = []
        self._quantised: dict[int, tuple[tuple[int, str], Buffer, Buffer]] = {}  # step -> (key, codes, scales_and_sums)
        self.marks: dict[Hashable, int] = {}  # name -> the index of the step added after it was marked

    def add(self, *steps: Launch | Indirect) -> None:
        self.steps.extend(steps)

    def mark(self, name: Hashable) -> None:
        """Name the point before the next step added: ``marks[name]`` is that step's index."""
        self.marks[name] = len(self.steps)

    def quantises(self, key: tuple[int, str], codes: Buffer, scales_and_sums: Buffer) -> None:
        """The next step added quantises the activations of ``key`` = (layer, site) into ``codes`` and
        ``scales_and_sums`` (each row's scale, then each row's code sum)."""
        self._quantised[len(self.steps)] = (key, codes, scales_and_sums)

    @property
    def launches(self) -> list[Launch]:
        """Every step's launch (indirect ones unwrapped)."""
        return [s.launch if isinstance(s, Indirect) else s for s in self.steps]

    def __len__(self) -> int:
        return len(self.steps)

    def record(self, rec: Recorder, capture: dict | None = None, start: int = 0, stop: int | None = None) -> None:
        """Record steps ``start`` to ``stop`` (default: every step) into ``rec``. ``capture``, a dict,
        receives a copy of each activation quantisation: ``capture[(layer, site)] = (codes, scales_and_sums)``
        buffers (``read_codes`` reads them)."""
        stop = len(self.steps) if stop is None else stop
        if not 0 <= start <= stop <= len(self.steps):
            raise ValueError(f"steps {start} to {stop} of a program of {len(self.steps)}")
        for index in range(start, stop):
            step = self.steps[index]
            if isinstance(step, Indirect):
                rec.launch_indirect(step.launch, step.grids, 4 * step.at)
            else:
                rec.launch(step)
            if capture is not None and index in self._quantised:
                key, codes, scales_and_sums = self._quantised[index]
                copies = (Buffer(codes.shape, "u32", codes.device),
                          Buffer(scales_and_sums.shape, "f32", scales_and_sums.device))
                rec.copy(codes, copies[0])
                rec.copy(scales_and_sums, copies[1])
                capture[key] = copies


@dataclass(frozen=True)
class PassContext:
    """What every launch of a pass shares: the model, ``batch`` sequences of ``tokens`` positions,
    the buffers all layers reuse, where the pass stands (``starts``: each sequence's first position;
    ``lengths``: each sequence's valid keys), the caches' ``cache_length``, and what the pass may do:

    * ``decode``: few queries against a long cache (flash decoding); ``fuse``: decoding's fusions
      (the module's docstring; on GPUs: a CPU adapter runs each workgroup's re-reading of a row
      serially, which costs it more than the launches saved);
    * ``gemv``: the projections' GEMV path (None: chosen by the token count; False: always GEMMs);
    * ``from_start``: every pass starts at position 0, so attention may keep its scores whole;
    * ``batch_invariant``: each sequence's values are summed in the same order whatever the batch
      around it (generation's prompt pass: a prompt's tokens are the same alone and in a batch):
      kept attention's sums are not split (``policy.sum_splits`` splits them by the grid's size; the
      plan also keeps float projections on one path, ``gemv`` False);
    * ``dropout``: the pass's LoRA dropout state (``kernels.dropout``), None for none;
    * ``row_adapters``: each token's adapter slot (u32 [rows]) where the adapters serve rows
      (``EngineAdapters.refresh(serve_rows=True)``: a batch of mixed adapters), None for a pass whose rows run the
      adapters in use;
    * ``positions``: a packed pass's position ids (u32 [rows]: several examples in each row, each
      numbered from 0), by which RoPE rotates and attention keeps each example to itself; None
      for a pass whose rows are one sequence each.
    """

    weights: EngineWeights
    adapters: EngineAdapters
    batch: int
    tokens: int
    residual: Buffer  # f32 [rows, hidden64]: the residual stream
    qkv: Buffer  # f32 [rows, q + 2 kv]: the fused q/k/v projection's output
    codes: Buffer | None  # u32 [rows, hidden64 / 4]: int8 codes of a norm's output (quantised flavours)
    ffn_codes: Buffer | None  # u32 [rows, ffn64 / 4]: those of ffn_sub_norm's
    scales_and_sums: Buffer | None  # f32 [2 rows]: the codes' scales, then their sums
    starts: Buffer
    lengths: Buffer
    cache_length: int
    workspace: Workspace
    decode: bool = False
    fuse: bool = False
    gemv: bool | None = None
    from_start: bool = False
    batch_invariant: bool = False
    dropout: Buffer | None = None
    positions: Buffer | None = None
    row_adapters: Buffer | None = None

    @property
    def config(self) -> EngineConfig:
        return self.weights.config

    @property
    def rows(self) -> int:
        return self.batch * self.tokens

    @property
    def fused(self) -> bool:
        """Whether decoding's fusions apply: a ternary model, a few tokens (the GEMV path)."""
        return (self.fuse and self.decode and self.config.quantised
                and self.rows <= gemv_max_tokens(self.workspace.device))

    @property
    def fuses_batch(self) -> bool:
        """Whether decoding a batch fuses launches (a ternary model, more tokens than the GEMV path
        takes): a split projection's sums finished by the next norm's launch, attention's key-span
        partials merged by o_proj's norm (the module's docstring)."""
        return (self.fuse and self.decode and self.config.quantised
                and self.rows > gemv_max_tokens(self.workspace.device))


@dataclass(frozen=True)
class SiteIO:
    """A norm site's outputs: the normalised rows (the adapters' input; with codes, only read by
    the adapters and the float flavour), h = A·x of its adapters, and 1/rms (kept for a backward)."""

    xn: Buffer
    h: Buffer | None = None
    rstd: Buffer | None = None


@dataclass(frozen=True)
class LayerIO:
    """What one layer's forward writes besides the residual stream: its four norm sites, the rotated
    queries, its K/V cache ([batch, kv_heads, cache_length, head_dim]), attention's output, the MLP's
    activation; and what a training pass keeps: attention's lse and P (``scores``), the raw gate/up
    pairs, and the residual stream before attention (copied) and before the MLP (kept by o_proj's
    add epilogue)."""

    attn: SiteIO
    o: SiteIO
    mlp: SiteIO
    down: SiteIO
    queries: Buffer
    keys: Buffer
    values: Buffer
    attention: Buffer
    ffn: Buffer
    lse: Buffer | None = None
    scores: Buffer | None = None
    pairs: Buffer | None = None
    residual_in: Buffer | None = None
    residual_mid: Buffer | None = None


def emit_embedding(program: Program, context: PassContext, ids: Buffer) -> None:
    """The token ids' embedding rows into the residual stream."""
    w, c = context.weights, context.config
    program.add(*embedding_launches(ids, w.embedding, w.embedding_rows, context.residual, tokens=context.rows,
                                    k=c.hidden, bf16=w.bf16, device=context.workspace.device))


def _norm(context: PassContext, x: Buffer, weight: Buffer, site: Site | None, io: SiteIO, codes: Buffer | None,
          k: int, layer: int, name: str, split: SplitSums | None = None,
          attention: DecodePartials | None = None) -> Launch:
    lora = site is not None and site.rank > 0
    serving = lora and context.row_adapters is not None
    dropout = (context.adapters.site_dropout(layer, name, context.dropout) if lora and context.dropout is not None
               else None)
    return rmsnorm_launch(x, weight, io.xn, tokens=context.rows, k=k, eps=context.config.rms_eps, codes=codes,
                          scales_and_sums=context.scales_and_sums if codes is not None else None,
                          lora_a=site.a if lora else None, h=io.h if lora else None, rank=site.rank if lora else 0,
                          rstd=io.rstd, dropout=dropout, device=context.workspace.device,
                          row_adapters=(context.row_adapters, site.columns) if serving else None, split=split,
                          attention=attention)


def _project(context: PassContext, proj: Projection, io: SiteIO, codes: Buffer | None, out: Buffer, mode: str,
             site: Site, saved: Buffer | None = None, norm: tuple[Buffer, Buffer, float] | None = None,
             rope: RopeTarget | None = None, attention: DecodePartials | None = None) -> list[Launch]:
    """Site ``site``'s projection into ``out`` (``mode``: the kernels' epilogue), its LoRA in the
    epilogue; ``saved``: where the epilogue also writes what the backward reads (o_proj's sums, the
    raw gate/up pairs)."""
    lora = (dict(h=io.h, lora_rank=io.h.shape[1], lora=site.table, lora_b=context.adapters.params,
                 segments=site.segments) if site.rank else {})
    device = context.workspace.device
    if context.config.quantised:
        return bitlinear_launch(codes, context.scales_and_sums, proj, out, tokens=context.rows,
                                out_stride=out.shape[-1], mode=mode, saved=saved, gemv=context.gemv, norm=norm, rope=rope,
                                attention=attention, workspace=context.workspace, device=device, **lora)
    return [matmul_launch(io.xn, proj, out, tokens=context.rows, out_stride=out.shape[-1], mode=mode,
                         bf16=context.weights.bf16, saved=saved, gemv=context.gemv, device=device, **lora)]


def emit_layer(program: Program, context: PassContext, index: int, io: LayerIO) -> None:
    """Decoder layer ``index``'s forward (the module's docstring), reading and updating the residual
    stream and writing ``io``."""
    c, w = context.config, context.weights
    layer, sites = w.layers[index], context.adapters.sites[index]
    fused = context.fused

    def normalises(name: str, k: int) -> bool:
        return fused and not sites[name].rank and gemv_normalises(k)

    pending: SplitSums | None = None  # a split projection's sums, which the next norm's launch finishes

    def site(x: Buffer, weight: Buffer, name: str, k: int, proj: Projection, out: Buffer, mode: str,
             codes: Buffer | None, rope: RopeTarget | None = None, attention: DecodePartials | None = None,
             saved: Buffer | None = None, then: str | None = None) -> None:
        """A projection and the norm of its input: one launch where the GEMV normalises (x, or
        ``attention``'s partials merged), else two; ``saved``: ``_project``'s. ``then``: the site
        whose norm follows the projection (its output), which finishes the projection's split sums
        where neither site has LoRA (decoding a batch on GEMMs: ``PassContext.fuses_batch``)."""
        nonlocal pending
        norm = normalises(name, k)
        if codes is not None:  # the next launch quantises: the norm, or the GEMV that normalises
            program.quantises((index, name), codes, context.scales_and_sums)
        if not norm:
            program.add(_norm(context, x, weight, sites[name], getattr(io, name), codes, k, index, name,
                              split=pending, attention=attention))
        pending = None
        if (then is not None and context.fuses_batch and saved is None and not sites[name].rank
                and not sites[then].rank):
            split = bitlinear_split_launch(codes, context.scales_and_sums, proj, out, tokens=context.rows, mode=mode,
                                           workspace=context.workspace)
            if split is not None:
                program.add(split[0])
                pending = split[1]
                return
        program.add(*_project(context, proj, getattr(io, name), codes, out, mode, sites[name], saved=saved,
                             norm=(x, weight, c.rms_eps) if norm else None, rope=rope,
                             attention=attention if norm else None))

    target = RopeTarget(w.rope_cos, w.rope_sin, context.starts, io.keys, io.values, c.heads, c.kv_heads, c.head_dim,
                        context.tokens, context.positions)
    if io.residual_in is not None:  # copied by a kernel: a Recorder.copy would end the compute pass
        program.add(copy_launch(context.residual, io.residual_in))
    # the q/k/v GEMV, or a batch's q/k/v split on the matrix units, rotates in its epilogue (no rope launch)
    rotates = fused or (context.fuses_batch and matrix_units_win(context.workspace.device, context.rows, layer.qkv))
    site(context.residual, layer.input_norm, "attn", c.hidden, layer.qkv, io.queries if rotates else context.qkv,
         "rope" if rotates else "store", context.codes, rope=target if rotates else None)
    if not rotates:
        program.add(rope_launch(context.qkv, io.queries, target, tokens=context.rows, device=context.workspace.device))
    # o_proj's GEMV that normalises its input, or else a batch's o norm, merges attention's partials itself (no
    # combine launch)
    partials = (decode_partials(context.batch, context.tokens, c.heads, c.kv_heads, c.head_dim, context.cache_length,
                                context.workspace) if normalises("o", c.q_size) or context.fuses_batch else None)
    program.add(*attention_launches(io.queries, io.keys, io.values, io.attention, context.starts, context.lengths,
                                    batch=context.batch, tokens=context.tokens, heads=c.heads, kv_heads=c.kv_heads,
                                    head_dim=c.head_dim, max_len=context.cache_length, scale=c.head_dim ** -0.5,
                                    workspace=context.workspace, lse=io.lse, decode=context.decode, partials=partials,
                                    from_start=context.from_start, scores=io.scores,
                                    splits=1 if context.batch_invariant and not context.decode else None,
                                    positions=context.positions))
    site(io.attention, layer.attn_sub_norm, "o", c.q_size, layer.o, context.residual, "add", context.codes,
         attention=partials, saved=io.residual_mid, then="mlp")  # o_proj's add keeps the residual for the backward
    site(context.residual, layer.post_norm, "mlp", c.hidden, layer.gate_up, io.ffn, "gate_up", context.codes,
         saved=io.pairs, then="down")
    site(io.ffn, layer.ffn_sub_norm, "down", c.intermediate, layer.down, context.residual, "add", context.ffn_codes)


def emit_final_norm(program: Program, context: PassContext, x: Buffer, out: Buffer, rows: int,
                    rstd: Buffer | None = None) -> None:
    """The final RMSNorm over ``rows`` rows of ``x`` into ``out`` (keeping 1/rms in ``rstd``)."""
    c = context.config
    program.add(rmsnorm_launch(x, context.weights.final_norm, out, tokens=rows, k=c.hidden, eps=c.rms_eps, rstd=rstd,
                               device=context.workspace.device))


def head_chunks(weights: EngineWeights) -> list[tuple[Projection, int]]:
    """The LM head's vocabulary chunks (each within a storage binding): its weights, and its first
    row of the vocabulary (a column of the logits)."""
    return [(Projection(chunk, None, rows, weights.config.hidden), sum(weights.head_rows[:i]))
            for i, (chunk, rows) in enumerate(zip(weights.head, weights.head_rows))]


def emit_head(context: PassContext, x: Buffer, logits: Buffer, rows: int, mma: bool | None = None) -> list[Launch]:
    """The LM head over ``rows`` rows of ``x`` (the final norm's output) into ``logits`` [rows, at
    least vocab], a launch per vocabulary chunk of the weights; returned for the caller to add (the
    training head makes them indirect). ``mma``: on the f16 matrix units, ``x`` split in place into
    f16 pairs first (``matmul.head_forward_launches``; default: where that is measured faster, for
    bfloat16 weights and more rows than a GEMV serves), else on the general cores."""
    w, ws = context.weights, context.workspace
    chunks = head_chunks(w)
    def exponents() -> Buffer:
        return ws.scratch("LM-head rows' powers of two (matrix units)", (rows,), "i32")

    if mma is None:
        mma = rows > gemv_max_tokens(ws.device) and head_on_matrix_units(
            x, logits, None, exponents(), chunks[0][0], tokens=rows, bf16=w.bf16, workspace=ws)
    if mma:
        return head_forward_launches(x, exponents(), chunks, logits, tokens=rows, workspace=ws)
    return [matmul_launch(x, proj, logits, tokens=rows, out_stride=logits.shape[-1], out_offset=begin, bf16=w.bf16,
                          gemv=context.gemv, device=ws.device) for proj, begin in chunks]


def read_codes(capture: dict, batch: int, tokens: int, config: EngineConfig) -> dict:
    """A pass's captured activation quantisations (``Program.record(capture=...)``, after the submit)
    as {(layer, site): (codes [batch, tokens, K] as floats, scales [batch·tokens])}: what
    ``integrations.quantisation.feeding_codes`` takes."""
    widths = {"attn": config.hidden, "o": config.q_size, "mlp": config.hidden, "down": config.intermediate}
    if not capture:
        return {}
    rec = Recorder(next(iter(capture.values()))[0].device)
    raw = {}
    for key, (codes, scales_and_sums) in capture.items():
        raw[key] = (np.empty(codes.shape, np.uint32), np.empty(scales_and_sums.shape, np.float32))
        rec.read(codes, raw[key][0])
        rec.read(scales_and_sums, raw[key][1])
    rec.submit()
    out = {}
    for (layer, site), (c, m) in raw.items():
        q = c.view(np.int8).reshape(batch * tokens, -1)[:, : widths[site]].astype(np.float32)
        out[(layer, site)] = (torch.from_numpy(q).reshape(batch, tokens, -1), torch.from_numpy(m[: batch * tokens].copy()))
    return out
