"""A forward pass of the whole model planned once per shape: activations in one arena, every
launch built once (bind groups and uniforms fixed), recorded on every call.

Activations and caches are each their own wgpu buffer: WebGPU checks a launch's usages per
buffer, so two views of one arena buffer cannot be bound when the launch writes either. (The
frozen weights, which kernels only read, do share arena buffers.)

A pass processes ``tokens`` positions of each of ``batch`` sequences (a prompt, a training
batch, or one decoded token) against a ``KVCache`` that holds ``length`` positions. What
changes between calls lives in GPU buffers the plan binds: the token ids, the step buffer
(the first position of the pass) and the valid lengths, all owned by the cache so that a
prefill plan and a decode plan of one generation share them.

Per layer (LoRA, when the model has adapters there, rides along inside the launches: the
norms compute every h = A·x of their site, the projections add s·B·h in their epilogue)::

    norm        input_layernorm (+ int8 codes, + h for q/k/v adapters)
    qkv         q, k, v projections in one launch
    rope        rotate q and k; k and v into the cache at their positions
    attention   causal GQA over the cache (split over keys when decoding)
    norm        attn_sub_norm (+ codes, + h for o)
    o           o_proj, added into the residual stream
    norm        post_attention_layernorm (+ codes, + h for gate/up)
    gate_up     gate and up in one launch; relu(gate)²·up
    norm        ffn_sub_norm (+ codes, + h for down)
    down        down_proj, added into the residual stream

then the final norm and the LM head (over vocabulary chunks) for the positions asked for.

Decoding a ternary model (``decode``, a few tokens: the GEMV path) fuses launches, since a
token is a chain of a few hundred dependent launches of a few µs each: the q/k/v GEMV rotates
its output and writes the caches itself (no rope launch), a GEMV whose site has no adapter
normalises and quantises its own input (no norm launch; a site with adapters keeps its norm,
which computes h, and so does a row too long for the GEMV to hold: ``gemv_normalises``), and
o_proj's GEMV that does so merges attention's key-span partials as it reads them (no combine
launch). BitNet-2B with Q/V adapters: 7 launches a layer rather than 11.

>>> # cache = KVCache(weights.config, batch=1, length=64); plan = ForwardPlan(weights, adapters, cache, tokens=16)
>>> # rec = Recorder(); plan.record(rec); rec.submit()
"""

from __future__ import annotations

import numpy as np
import torch

from ..runtime import Buffer, Device, Launch, Recorder, write
from .adapters import EngineAdapters, Site
from .config import EngineConfig, pad
from .kernels import STEP_POS, STEP_TOKEN_COUNT
from .kernels.attention import DecodePartials, attention_launches, decode_partials
from .kernels.bitlinear import bitlinear_launch, gemv_max_tokens, gemv_normalises
from .kernels.dropout import SiteDropout, dropout_state
from .kernels.embedding import embedding_launches
from .kernels.matmul import matmul_launch
from .kernels.norm import rmsnorm_launch
from .kernels.rope import RopeTarget, rope_launch
from .weights import EngineWeights, Projection

LOGITS = ("all", "last", "none")


class KVCache:
    """Keys and values of every layer for ``batch`` sequences of up to ``length`` positions, with
    the buffers that say where a pass stands: ``step`` (u32 [4]: first position, seed, tokens
    generated, reserved), ``lengths`` (u32 [batch]: valid positions per sequence)."""

    def __init__(self, config: EngineConfig, batch: int, length: int, device: Device) -> None:
        if not 1 <= length <= config.max_positions:
            raise ValueError(f"a KV cache of {length} positions; the model takes 1 to {config.max_positions} "
                             "(max_position_embeddings)")
        self.config, self.batch, self.length, self.device = config, batch, length, device
        shape = (batch, config.kv_heads, length, config.head_dim)
        self.keys = [Buffer(shape, device=device) for _ in range(config.layers)]
        self.values = [Buffer(shape, device=device) for _ in range(config.layers)]
        self.step = Buffer((4,), "u32", device)
        self.lengths = Buffer((batch,), "u32", device)

    def set_position(self, pos: int, lengths: list[int], seed: int = 0, generated: int = 0) -> None:
        """Write where the next pass starts: its first position and each sequence's valid length."""
        if len(lengths) != self.batch or not all(0 < n <= self.length for n in lengths):
            raise ValueError(f"lengths {lengths} for a cache of {self.batch} sequences × {self.length} positions")
        step = np.zeros(4, np.uint32)
        step[STEP_POS], step[STEP_TOKEN_COUNT] = pos, generated
        step[1] = seed & 0xFFFFFFFF
        write(self.step, step)
        write(self.lengths, np.asarray(lengths, np.uint32))


class _Buffers:
    """Activations: each its own wgpu buffer. (Views of one arena buffer cannot be bound
    together when a launch writes one of them: WebGPU checks usage per buffer, not per range.)"""

    def __init__(self, device: Device) -> None:
        self.device = device

    def alloc(self, shape: tuple[int, ...], dtype: str = "f32") -> Buffer:
        return Buffer(shape, dtype, self.device)


class ForwardPlan:
    """Every buffer and launch of one forward pass shape.

    ``logits``: ``"all"`` positions ([batch·tokens, vocab]), ``"last"`` (the last position of
    the single sequence, [1, vocab]: generation), or ``"none"``. ``decode`` splits attention
    over the keys (few query tokens against a long cache) and, with ``fuse``, makes the fused
    launches of the module's docstring (default: on GPUs; a CPU adapter runs each workgroup's
    re-reading of the row serially, which costs it more than the launches saved). ``ids`` is a
    u32 [batch·tokens] buffer the caller writes, or another plan's (a sampler's next-token buffer).
    ``dropout``: the adapters apply LoRA dropout (a training-mode forward), with masks from the
    state ``set_dropout`` writes before each pass; decoding plans take none. ``from_start``: the
    caller promises that every pass starts at position 0 (a prompt, a batch's logits), so
    attention keeps its scores whole and runs as GEMMs (``attention_launches``); such a plan run
    at another position gives NaN.
    """

    def __init__(self, weights: EngineWeights, adapters: EngineAdapters, cache: KVCache, tokens: int,
                 logits: str = "all", decode: bool = False, ids: Buffer | None = None,
                 fuse: bool | None = None, dropout: bool = False, from_start: bool = False) -> None:
        if logits not in LOGITS:
            raise ValueError(f"logits must be one of {LOGITS}, got {logits!r}")
        if dropout and decode:
            raise ValueError("decoding plans apply no LoRA dropout")
        if from_start and decode:
            raise ValueError("decoding plans continue a cache: they cannot promise to start at position 0")
        if logits == "last" and cache.batch != 1:
            raise ValueError("logits='last' plans take one sequence")
        config, device = weights.config, cache.device
        self.config, self.weights, self.adapters, self.cache = config, weights, adapters, cache
        self.tokens, self.batch, self.device = tokens, cache.batch, device
        n = self.rows = cache.batch * tokens
        H, F = pad(config.hidden, 64), pad(config.intermediate, 64)
        a = _Buffers(device)
        self.ids = ids if ids is not None else a.alloc((n,), "u32")
        self.residual = a.alloc((n, H))
        quant = config.quantised
        rank = adapters.max_rank
        self.xn = a.alloc((n, H))
        self.codes = a.alloc((n, H // 4), "u32") if quant else None
        self.meta = a.alloc((2 * n,)) if quant else None
        self.h = a.alloc((n, max(rank, 1)))
        self.qkv = a.alloc((n, config.q_size + 2 * config.kv_size))
        self.q = a.alloc((n, config.q_size))
        self.attn = a.alloc((n, config.q_size))
        self.ffn = a.alloc((n, F))
        self.ffn_xn = a.alloc((n, F))
        self.ffn_codes = a.alloc((n, F // 4), "u32") if quant else None
        self.logits_mode = logits
        self.logits = self._logits_buffers(a, n, logits)
        self.dropout = a.alloc((4,), "u32") if dropout else None
        # (index of a quantising launch, layer, site, its codes, its meta) for ``record(capture=...)``
        self.quant_points: list[tuple[int, int, str, Buffer, Buffer]] = []
        self.from_start = from_start
        self.launches = self._build(decode, not device.is_cpu if fuse is None else fuse)

    def _logits_buffers(self, a: "_Buffers", n: int, mode: str) -> list[tuple[int, Buffer]]:
        """(first row, buffer) chunks of the logits, each within one storage binding."""
        if mode == "none":
            return []
        rows = n if mode == "all" else 1
        per = max(1, self.device.max_binding // (4 * self.config.vocab))
        return [(r, a.alloc((min(per, rows - r), self.config.vocab))) for r in range(0, rows, per)]

    # -- building ---------------------------------------------------------------------------------

    def _norm(self, x: Buffer, weight: Buffer, site: Site | None, out: Buffer, codes: Buffer | None, k: int,
              dropout: SiteDropout | None = None) -> Launch:
        lora = site is not None and site.rank > 0
        return rmsnorm_launch(x, weight, out, tokens=self.rows, k=k, eps=self.config.rms_eps,
                              codes=codes, meta=self.meta if codes is not None else None,
                              lora_a=site.a if lora else None, h=self.h if lora else None,
                              rank=site.rank if lora else 0, dropout=dropout, device=self.device)

    def _project(self, proj: Projection, x: Buffer, codes: Buffer | None, out: Buffer, mode: str, site: Site,
                 norm: tuple[Buffer, Buffer, float] | None = None, rope: RopeTarget | None = None,
                 attention: DecodePartials | None = None) -> Launch:
        lora = (dict(h=self.h, lora_rank=self.h.shape[1], lora=site.table, lora_b=self.adapters.params,
                     segments=site.segments) if site.rank else {})
        if self.config.quantised:
            return bitlinear_launch(codes, self.meta, proj, out, tokens=self.rows, out_stride=out.shape[1], mode=mode,
                                    norm=norm, rope=rope, attention=attention, device=self.device, **lora)
        return matmul_launch(x, proj, out, tokens=self.rows, out_stride=out.shape[1], mode=mode,
                             bf16=self.weights.bf16, device=self.device, **lora)

    def _build(self, decode: bool, fuse: bool) -> list[Launch]:
        c, w, cache = self.config, self.weights, self.cache
        launches = embedding_launches(self.ids, w.embedding, w.embedding_rows, self.residual, tokens=self.rows,
                                      k=c.hidden, bf16=w.bf16, device=self.device)
        # see the module's docstring
        fused = fuse and decode and c.quantised and self.rows <= gemv_max_tokens(self.device)
        for index, layer in enumerate(w.layers):
            sites = self.adapters.sites[index]

            def normalises(name: str, k: int) -> bool:
                return fused and not sites[name].rank and gemv_normalises(k)

            def site(x: Buffer, weight: Buffer, name: str, xn: Buffer, codes: Buffer | None, k: int, proj: Projection,
                     out: Buffer, mode: str, rope: RopeTarget | None = None,
                     attention: DecodePartials | None = None) -> None:
                """A projection and the norm of its input: one launch where the GEMV normalises (x, or
                ``attention``'s partials merged), else two."""
                norm = normalises(name, k)
                if codes is not None:  # the next launch quantises: the norm, or the GEMV that normalises
                    self.quant_points.append((len(launches), index, name, codes, self.meta))
                if not norm:
                    dropout = (self.adapters.site_dropout(index, name, self.dropout) if self.dropout is not None
                               else None)
                    launches.append(self._norm(x, weight, sites[name], xn, codes, k, dropout))
                launches.append(self._project(proj, xn, codes, out, mode, sites[name],
                                              norm=(x, weight, c.rms_eps) if norm else None, rope=rope,
                                              attention=attention if norm else None))

            target = RopeTarget(w.rope_cos, w.rope_sin, cache.step, cache.keys[index], cache.values[index], c.heads,
                                c.kv_heads, c.head_dim, self.tokens)
            site(self.residual, layer.input_norm, "attn", self.xn, self.codes, c.hidden, layer.qkv,
                 self.q if fused else self.qkv, "rope" if fused else "store", target if fused else None)
            if not fused:
                launches.append(rope_launch(self.qkv, self.q, target, tokens=self.rows, device=self.device))
            # o_proj's GEMV that normalises its input merges attention's partials itself (no combine launch)
            partials = (decode_partials(self.batch, self.tokens, c.heads, c.kv_heads, c.head_dim, cache.length,
                                        self.device) if normalises("o", c.q_size) else None)
            launches += attention_launches(self.q, cache.keys[index], cache.values[index], self.attn, cache.step,
                                           cache.lengths, batch=self.batch, tokens=self.tokens, heads=c.heads,
                                           kv_heads=c.kv_heads, head_dim=c.head_dim, max_len=cache.length,
                                           scale=c.head_dim ** -0.5, decode=decode, device=self.device,
                                           partials=partials, from_start=self.from_start)
            site(self.attn, layer.attn_sub_norm, "o", self.xn, self.codes, c.q_size, layer.o, self.residual, "add",
                 attention=partials)
            site(self.residual, layer.post_norm, "mlp", self.xn, self.codes, c.hidden, layer.gate_up, self.ffn,
                 "gate_up")
            site(self.ffn, layer.ffn_sub_norm, "down", self.ffn_xn, self.ffn_codes, c.intermediate, layer.down,
                 self.residual, "add")
        if self.logits_mode == "none":
            return launches
        if self.logits_mode == "last":  # the single sequence's last position only
            source, target = self.residual.rows(self.rows - 1, 1), self.xn.rows(self.rows - 1, 1)
            launches.append(rmsnorm_launch(source, w.final_norm, target, tokens=1, k=c.hidden, eps=c.rms_eps,
                                           device=self.device))
            heads = [(0, 1, target)]
        else:
            launches.append(self._norm(self.residual, w.final_norm, None, self.xn, None, c.hidden))
            heads = []
            for first, buf in self.logits:
                heads.append((first, buf.shape[0], self.xn.rows(first, buf.shape[0])))
        for (first, count, x), (_, logits) in zip(heads, self.logits):
            begin = 0
            for chunk, rows in zip(w.head, w.head_rows):
                proj = Projection(chunk, None, rows, c.hidden)
                launches.append(matmul_launch(x, proj, logits, tokens=count, out_stride=c.vocab, out_offset=begin,
                                              bf16=w.bf16, device=self.device))
                begin += rows
        return launches

    # -- running ----------------------------------------------------------------------------------

    def record(self, rec: Recorder, capture: dict | None = None) -> None:
        """Record the whole pass (the caller has written ids, step and lengths).

        ``capture``, a dict, receives a copy of every activation quantisation the pass makes:
        ``capture[(layer, site)] = (codes, meta)`` buffers (sites as in ``engine.adapters``), for
        tests that feed the engine's int8 codes to the torch model."""
        after = {at: (layer, site, codes, meta) for at, layer, site, codes, meta in self.quant_points}
        for i, launch in enumerate(self.launches):
            rec.launch(launch)
            if capture is not None and i in after:
                layer, site, codes, meta = after[i]
                copies = (Buffer(codes.shape, "u32", self.device), Buffer(meta.shape, "f32", self.device))
                rec.copy(codes, copies[0])
                rec.copy(meta, copies[1])
                capture[(layer, site)] = copies

    def set_dropout(self, seed: int, p: float) -> None:
        """The LoRA dropout of the next pass: masks from ``seed``, probability ``p``."""
        if self.dropout is None:
            raise ValueError("this plan was built without dropout (ForwardPlan(..., dropout=True))")
        write(self.dropout, dropout_state(seed, p))

    def read_logits(self, rec: Recorder, out: np.ndarray) -> None:
        """After the pass, copy the logits into ``out`` (float32 [rows, vocab])."""
        for first, buf in self.logits:
            rec.read(buf, out[first:first + buf.shape[0]])

    @property
    def dispatches(self) -> int:
        return len(self.launches)


def read_codes(capture: dict, batch: int, tokens: int, config: EngineConfig) -> dict:
    """A pass's captured activation quantisations (``record(rec, capture=...)``, after the submit)
    as {(layer, site): (codes [batch, tokens, K] as floats, scales [batch·tokens])}: what
    ``integrations.quantisation.feeding_codes`` takes."""
    widths = {"attn": config.hidden, "o": config.q_size, "mlp": config.hidden, "down": config.intermediate}
    rec = Recorder(capture and next(iter(capture.values()))[0].device)
    raw = {}
    for key, (codes, meta) in capture.items():
        raw[key] = (np.empty(codes.shape, np.uint32), np.empty(meta.shape, np.float32))
        rec.read(codes, raw[key][0])
        rec.read(meta, raw[key][1])
    rec.submit()
    out = {}
    for (layer, site), (c, m) in raw.items():
        q = c.view(np.int8).reshape(batch * tokens, -1)[:, : widths[site]].astype(np.float32)
        out[(layer, site)] = (torch.from_numpy(q).reshape(batch, tokens, -1), torch.from_numpy(m[: batch * tokens].copy()))
    return out
