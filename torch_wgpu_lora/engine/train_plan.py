"""A training pass of the whole model planned once per shape: forward keeping what the backward
needs, the loss fused with the LM head over token chunks, and the backward into the adapters'
gradients, all as launches recorded into the caller's command buffer.

``slots`` micro-batches of one shape (``batch`` sequences × ``tokens``) share the activation
buffers; each slot has its own inputs (token ids, shifted targets, lengths), written before
the submit, so one command buffer can hold every micro-batch of an optimizer step. Gradients
add into ``adapters.grads()`` (clear it at the start of a step).

Kept from the forward, per layer: the residual stream before the attention and before the MLP,
each norm's 1/rms, the queries, keys, values, attention output and log-sum-exp, the raw
gate/up pairs and the MLP activation, and, where a site has adapters, its normalised input and
its h. Nothing is recomputed. At BitNet-2B shapes that is about 70 MB per layer at 512 tokens;
and the attention probabilities P, 21 MB a layer, where every layer's fit the attention kernels'
budget (``keeps_probabilities``: a sequence of up to 640 tokens at BitNet-2B shapes; past it, each
backward computes S again).

With ``dropout`` the plan applies LoRA dropout: each slot has a dropout state buffer
(``set_dropout`` writes its seed and probability before the submit) from which the norms'
h, the gradients of A and the adapters' input gradients derive each adapter's mask.

The loss: position t of a sequence predicts label t + 1 (transformers' shift). Only positions
with a label reach the LM head: their final-norm rows are gathered in order (``write_inputs``
writes the positions, and the head GEMMs' grids as indirect dispatch arguments, so instruction
tuning's prompt tokens and padding cost no head work); per chunk of those rows the head writes
the logits, ``cross_entropy.wgsl`` turns them into the loss and its gradient (scaled by the
``scale`` buffer: 1 / labelled tokens of the step), the head's transposed matmul sends it back,
and the rows are scattered to their positions (zeros elsewhere). The [tokens, vocab] logits are
never stored whole.

Backward per layer, in reverse: through down_proj (+ its adapters), ffn_sub_norm, relu²·up,
gate/up (+ adapters), post_attention_layernorm (added into the residual gradient), o_proj
(+ adapters), attn_sub_norm, attention, RoPE, q/k/v (+ adapters), input_layernorm (added);
layer 0 stops at the q/k/v adapters' gradients (below it no parameter trains). The input
gradients through the projections sum over their rows in ranges on GPUs (split-K:
``input_grad_splits``).

>>> # plan = TrainPlan(weights, adapters, batch=4, tokens=256, slots=2)
>>> # plan.write_inputs(0, ids, labels, lengths); rec = Recorder(); plan.record(rec, 0); rec.submit()
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..runtime import Buffer, Launch, Recorder, copy_launch, write
from .adapters import EngineAdapters, Site
from .config import pad
from .kernels.attention import (attention_backward_launches, attention_launches, keeps_probabilities,
                                kept_scores_bytes)
from .kernels.bitlinear import bitlinear_launch, bitlinear_t_launch
from .kernels.cross_entropy import cross_entropy_launch, shifted_targets
from .kernels.dropout import SiteDropout, dropout_state
from .kernels.embedding import embedding_launches, gather_rows_launch
from .kernels.ffn import relu2_backward_launch
from .kernels.lora_grad import da_launch, db_launch, dh_launch
from .kernels.matmul import matmul_launch, matmul_t_launch
from .kernels.norm import rmsnorm_backward_launch, rmsnorm_launch
from .kernels.rope import RopeTarget, rope_backward_launch, rope_launch
from .weights import EngineWeights, Projection


_NONE = 2**32 - 1  # no row: gather_rows_launch leaves (labelled) or zeroes (inverse) it


@dataclass
class _Slot:
    ids: Buffer
    targets: Buffer  # i32: the labelled positions' targets in order, then -100
    lengths: Buffer
    losses: Buffer  # a view of the plan's losses buffer: this slot's rows
    labelled: Buffer  # u32: the positions with a target, in order, then 2**32 - 1
    inverse: Buffer  # u32: each position's row among the labelled ones, or 2**32 - 1
    grids: Buffer  # u32: the head GEMMs' grids over the labelled rows, three words each
    dropout: Buffer | None  # u32 [4]: the slot's dropout state (kernels.dropout.dropout_state)
    launches: list = field(default_factory=list)  # Launch or _Indirect
    points: dict[int, tuple] = field(default_factory=dict)  # id(quantising norm launch) -> ((layer, site), codes)
    # (word in grids, grid x, grid z, first labelled row of its token chunk, the chunk's rows)
    head_grids: list[tuple[int, int, int, int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class _Indirect:
    """A launch whose grid ``write_inputs`` sets at each step (three u32 of ``grids`` at word
    ``at``): the LM head's GEMMs, whose token tiles cover the labelled rows only."""

    launch: Launch
    grids: Buffer
    at: int


@dataclass
class _SiteSaved:
    xn: Buffer  # the norm's output (the adapters' input), own buffer only when the site has adapters
    h: Buffer | None
    rstd: Buffer


class TrainPlan:
    """Buffers and launches of a forward + loss + backward of ``slots`` micro-batch shapes."""

    def __init__(self, weights: EngineWeights, adapters: EngineAdapters, batch: int, tokens: int,
                 slots: int = 1, dropout: bool = False) -> None:
        c, device = weights.config, adapters.device
        self.config, self.weights, self.adapters, self.device = c, weights, adapters, device
        self.batch, self.tokens, self.rows = batch, tokens, batch * tokens
        self.dropout = dropout
        n = self.rows
        H, F, Q = pad(c.hidden, 64), pad(c.intermediate, 64), pad(c.q_size, 64)
        quant = c.quantised
        B = lambda *shape, dtype="f32": Buffer(shape, dtype, device)  # noqa: E731 - every activation its own buffer
        self.step = B(4, dtype="u32")
        write(self.step, np.zeros(4, np.uint32))  # training passes start at position 0
        self.scale = B(1)
        stride = pad(n, 64)  # slot views start on 256-byte boundaries
        self.losses = B(slots * stride)
        write(self.losses, np.zeros(slots * stride, np.float32))  # rows between slots stay zero
        per = min(n, max(64, device.max_binding // (4 * c.vocab) // 64 * 64))  # chunk views stay aligned
        self.token_chunks = [(r, min(per, n - r)) for r in range(0, n, per)]
        head_gemms = 2 * len(self.token_chunks) * len(weights.head)
        self.slots = [_Slot(B(n, dtype="u32"), B(n, dtype="i32"), B(batch, dtype="u32"),
                            self.losses.slice(s * stride, (n,)),
                            B(n, dtype="u32"), B(n, dtype="u32"), B(3 * head_gemms, dtype="u32"),
                            B(4, dtype="u32") if dropout else None)
                      for s in range(slots)]
        # forward scratch
        self.residual, self.xn, self.qkv = B(n, H), B(n, H), B(n, c.q_size + 2 * c.kv_size)
        self.codes = B(n, H // 4, dtype="u32") if quant else None
        self.ffn_codes = B(n, F // 4, dtype="u32") if quant else None
        self.meta = B(2 * n) if quant else None
        self.ffn_xn = B(n, F)
        # kept for the backward, per layer
        shape_kv = (batch, c.kv_heads, tokens, c.head_dim)
        keep_p = keeps_probabilities(c.layers, batch, c.heads, tokens)
        self.saved = []
        for index in range(c.layers):
            sites = adapters.sites[index]

            def site_saved(site: str, width: int, scratch: Buffer) -> _SiteSaved:
                rank = sites[site].rank
                return _SiteSaved(B(n, width) if rank else scratch, B(n, rank) if rank else None, B(n))

            self.saved.append(dict(
                resid_in=B(n, H), resid_mid=B(n, H), q=B(n, c.q_size), k=B(*shape_kv), v=B(*shape_kv),
                o=B(n, c.q_size), lse=B(n, c.heads), pairs=B(n, 2 * c.intermediate), ffn=B(n, F),
                p=B(kept_scores_bytes(batch, c.heads, tokens) // 4) if keep_p else None,
                attn=site_saved("attn", H, self.xn), o_site=site_saved("o", H, self.xn),
                mlp=site_saved("mlp", H, self.xn), down=site_saved("down", F, self.ffn_xn)))
        self.resid_final, self.xn_final, self.rstd_final = B(n, H), B(n, H), B(n)
        # backward scratch
        self.d_resid, self.d_xn, self.d_final = B(n, H), B(n, H), B(n, H)
        self.d_xn_o, self.d_o, self.d_q = B(n, Q), B(n, c.q_size), B(n, c.q_size)
        self.d_k, self.d_v = B(*shape_kv), B(*shape_kv)
        self.d_qkv = B(n, c.q_size + 2 * c.kv_size)
        self.d_ffn_xn, self.d_h, self.d_pairs = B(n, F), B(n, c.intermediate), B(n, 2 * c.intermediate)
        self.dh = B(n, max(adapters.max_rank, 1))
        self.grads = adapters.grads()
        self.x_head, self.d_head = B(n, H), B(n, H)  # the labelled rows' final norm output, its gradient
        self.logits = B(self.token_chunks[0][1], c.vocab)
        for slot in self.slots:
            self._points = slot.points  # filled by _norm while the slot's program is built
            self._slot = slot  # its dropout state: read by _site_dropout while the program is built
            slot.launches = self._assemble(slot)

    # -- helpers --------------------------------------------------------------------------------

    def _site_dropout(self, layer: int, site: str) -> SiteDropout | None:
        return self.adapters.site_dropout(layer, site, self._slot.dropout) if self.dropout else None

    def _norm(self, x: Buffer, weight: Buffer, site: Site, saved: _SiteSaved, codes: Buffer | None, k: int,
              point: tuple[int, str]) -> Launch:
        lora = site.rank > 0
        launch = rmsnorm_launch(x, weight, saved.xn, tokens=self.rows, k=k, eps=self.config.rms_eps, codes=codes,
                                meta=self.meta if codes is not None else None, lora_a=site.a if lora else None,
                                h=saved.h if lora else None, rank=site.rank, rstd=saved.rstd,
                                dropout=self._site_dropout(*point), device=self.device)
        if codes is not None:
            self._points[id(launch)] = (point, codes)
        return launch

    def _project(self, proj: Projection, saved: _SiteSaved, codes: Buffer | None, out: Buffer, mode: str, site: Site,
                 aux: Buffer | None = None) -> Launch:
        lora = (dict(h=saved.h, lora_rank=site.rank, lora=site.table, lora_b=self.adapters.params,
                     segments=site.segments) if site.rank else {})
        if self.config.quantised:
            return bitlinear_launch(codes, self.meta, proj, out, tokens=self.rows, out_stride=out.shape[-1], mode=mode,
                                    aux=aux, gemv=False, device=self.device, **lora)
        return matmul_launch(saved.xn, proj, out, tokens=self.rows, out_stride=out.shape[-1], mode=mode,
                             bf16=self.weights.bf16, aux=aux, gemv=False, device=self.device, **lora)

    def _project_t(self, proj: Projection, dy: Buffer, out: Buffer, k: int, site: Site,
                   point: tuple[int, str]) -> list[Launch]:
        lora = (dict(dh=self.dh, lora_a=site.a, lora_rank=site.rank, dropout=self._site_dropout(*point))
                if site.rank else {})
        if self.config.quantised:
            return bitlinear_t_launch(dy, proj, out, tokens=self.rows, k=k, device=self.device, **lora)
        return matmul_t_launch(dy, proj, out, tokens=self.rows, k=k, bf16=self.weights.bf16, device=self.device,
                               **lora)

    def _adapter_grads(self, site: Site, dy: Buffer, saved: _SiteSaved, point: tuple[int, str]) -> list[Launch]:
        """dh and dB of every adapter of the site, then dA of the site's stacked A."""
        if not site.rank:
            return []
        launches = []
        for a in site.adapters:
            m = a.module
            launches.append(dh_launch(dy, self.adapters.params, self.dh, tokens=self.rows, rows=a.rows, rank=m.r,
                                      h_col=a.a_row, b_offset=a.b_offset, scale=m.scaling, device=self.device))
            launches.append(db_launch(dy, saved.h, self.grads, tokens=self.rows, rows=a.rows, rank=m.r, h_col=a.a_row,
                                      b_offset=a.b_offset, scale=m.scaling, device=self.device))
        launches.append(da_launch(self.dh, saved.xn, self.grads, tokens=self.rows, rank=site.rank, k=site.k,
                                  a_offset=site.a_offset, dropout=self._site_dropout(*point), device=self.device))
        return launches

    # -- the program ------------------------------------------------------------------------------

    def _assemble(self, slot: _Slot) -> list:
        """The slot's whole program (the saved residuals copied by kernels: a ``Recorder.copy``
        would end the compute pass, 61 times a step at 30 layers)."""
        c, w, a = self.config, self.weights, self.adapters
        d = self.device
        out: list = embedding_launches(slot.ids, w.embedding, w.embedding_rows, self.residual, tokens=self.rows,
                                       k=c.hidden, bf16=w.bf16, device=d)
        for index, layer in enumerate(w.layers):
            sites, s = a.sites[index], self.saved[index]
            out += [
                copy_launch(self.residual, s["resid_in"]),
                self._norm(self.residual, layer.input_norm, sites["attn"], s["attn"], self.codes, c.hidden,
                           (index, "attn")),
                self._project(layer.qkv, s["attn"], self.codes, self.qkv, "store", sites["attn"]),
                rope_launch(self.qkv, s["q"], RopeTarget(w.rope_cos, w.rope_sin, self.step, s["k"], s["v"], c.heads,
                                                         c.kv_heads, c.head_dim, self.tokens), tokens=self.rows, device=d),
                *attention_launches(s["q"], s["k"], s["v"], s["o"], self.step, slot.lengths, batch=self.batch,
                                    tokens=self.tokens, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
                                    max_len=self.tokens, scale=c.head_dim ** -0.5, lse=s["lse"], device=d,
                                    from_start=True, scores=s["p"]),  # training passes start at position 0
                self._norm(s["o"], layer.attn_sub_norm, sites["o"], s["o_site"], self.codes, c.q_size, (index, "o")),
                self._project(layer.o, s["o_site"], self.codes, self.residual, "add", sites["o"]),
                copy_launch(self.residual, s["resid_mid"]),
                self._norm(self.residual, layer.post_norm, sites["mlp"], s["mlp"], self.codes, c.hidden,
                           (index, "mlp")),
                self._project(layer.gate_up, s["mlp"], self.codes, s["ffn"], "gate_up", sites["mlp"], aux=s["pairs"]),
                self._norm(s["ffn"], layer.ffn_sub_norm, sites["down"], s["down"], self.ffn_codes, c.intermediate,
                           (index, "down")),
                self._project(layer.down, s["down"], self.ffn_codes, self.residual, "add", sites["down"]),
            ]
        out.append(copy_launch(self.residual, self.resid_final))
        out.append(rmsnorm_launch(self.residual, w.final_norm, self.xn_final, tokens=self.rows, k=c.hidden,
                                  eps=c.rms_eps, rstd=self.rstd_final, device=d))
        # the LM head and the loss over the labelled rows only, gathered in order, chunk by chunk
        out.append(gather_rows_launch(slot.labelled, self.xn_final, self.x_head, tokens=self.rows,
                                      k=self.x_head.shape[1], zero_missing=False, device=d))
        for first, count in self.token_chunks:
            x = self.x_head.rows(first, count)
            logits = self.logits.rows(0, count)
            begin = 0
            for chunk, rows in zip(w.head, w.head_rows):
                out.append(self._labelled_rows(slot, matmul_launch(
                    x, Projection(chunk, None, rows, c.hidden), logits, tokens=count, out_stride=c.vocab,
                    out_offset=begin, bf16=w.bf16, gemv=False, device=d), first, count))
                begin += rows
            out.append(cross_entropy_launch(logits, slot.targets.rows(first, count), self.scale,
                                            slot.losses.rows(first, count), rows=count, vocab=c.vocab,
                                            device=d))
            begin = 0
            for i, (chunk, rows) in enumerate(zip(w.head, w.head_rows)):
                gemm, *sums = matmul_t_launch(logits, Projection(chunk, None, rows, c.hidden),
                                              self.d_head.rows(first, count), tokens=count, k=c.hidden,
                                              bf16=w.bf16, accumulate=i > 0, dy_col=begin, device=d)
                out += [self._labelled_rows(slot, gemm, first, count), *sums]
                begin += rows
        out.append(gather_rows_launch(slot.inverse, self.d_head, self.d_final, tokens=self.rows,
                                      k=self.d_final.shape[1], zero_missing=True, device=d))
        out.append(rmsnorm_backward_launch(self.d_final, self.resid_final, self.rstd_final, w.final_norm,
                                           self.d_resid, tokens=self.rows, k=c.hidden, device=d))
        for index in reversed(range(c.layers)):
            layer, sites, s = w.layers[index], a.sites[index], self.saved[index]
            out += self._adapter_grads(sites["down"], self.d_resid, s["down"], (index, "down"))
            out += [
                *self._project_t(layer.down, self.d_resid, self.d_ffn_xn, c.intermediate, sites["down"],
                                 (index, "down")),
                rmsnorm_backward_launch(self.d_ffn_xn, s["ffn"], s["down"].rstd, layer.ffn_sub_norm, self.d_h,
                                        tokens=self.rows, k=c.intermediate, device=d),
                relu2_backward_launch(self.d_h, s["pairs"], self.d_pairs, tokens=self.rows, features=c.intermediate,
                                      device=d),
            ]
            out += self._adapter_grads(sites["mlp"], self.d_pairs, s["mlp"], (index, "mlp"))
            out += [
                *self._project_t(layer.gate_up, self.d_pairs, self.d_xn, c.hidden, sites["mlp"], (index, "mlp")),
                rmsnorm_backward_launch(self.d_xn, s["resid_mid"], s["mlp"].rstd, layer.post_norm, self.d_resid,
                                        tokens=self.rows, k=c.hidden, accumulate=True, device=d),
            ]
            out += self._adapter_grads(sites["o"], self.d_resid, s["o_site"], (index, "o"))
            out += [
                *self._project_t(layer.o, self.d_resid, self.d_xn_o, c.q_size, sites["o"], (index, "o")),
                rmsnorm_backward_launch(self.d_xn_o, s["o"], s["o_site"].rstd, layer.attn_sub_norm, self.d_o,
                                        tokens=self.rows, k=c.q_size, device=d),
                *attention_backward_launches(s["q"], s["k"], s["v"], s["o"], s["lse"], self.d_o, self.d_q, self.d_k,
                                             self.d_v, self.step, slot.lengths, batch=self.batch, tokens=self.tokens,
                                             heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
                                             max_len=self.tokens, scale=c.head_dim ** -0.5, device=d,
                                             from_start=True, scores=s["p"]),  # training passes start at 0
                rope_backward_launch(self.d_q, self.d_k, self.d_v, w.rope_cos, w.rope_sin, self.step, self.d_qkv,
                                     tokens=self.rows, tokens_per_seq=self.tokens, heads=c.heads, kv_heads=c.kv_heads,
                                     head_dim=c.head_dim, cache_len=self.tokens, device=d),
            ]
            out += self._adapter_grads(sites["attn"], self.d_qkv, s["attn"], (index, "attn"))
            if index > 0:  # below layer 0 the input gradient reaches no trainable parameter
                out += [
                    *self._project_t(layer.qkv, self.d_qkv, self.d_xn, c.hidden, sites["attn"], (index, "attn")),
                    rmsnorm_backward_launch(self.d_xn, s["resid_in"], s["attn"].rstd, layer.input_norm, self.d_resid,
                                            tokens=self.rows, k=c.hidden, accumulate=True, device=d),
                ]
        return out

    def _labelled_rows(self, slot: _Slot, launch: Launch, first: int, count: int) -> _Indirect:
        """``launch`` (a head GEMM over ``count`` rows from labelled row ``first``) with its grid's
        token tiles set at each step to cover that chunk's labelled rows only."""
        at = 3 * len(slot.head_grids)
        slot.head_grids.append((at, launch.grid[0], launch.grid[2], first, count))
        return _Indirect(launch, slot.grids, at)

    # -- running ----------------------------------------------------------------------------------

    def write_inputs(self, slot: int, ids: torch.Tensor, labels: torch.Tensor, lengths: list[int]) -> int:
        """Write micro-batch ``slot``'s token ids and labels [batch, tokens]; returns its labelled
        positions (those whose next label is not -100), the rows the LM head then runs over."""
        s = self.slots[slot]
        targets = shifted_targets(labels.long()).numpy().reshape(-1)
        positions = np.flatnonzero(targets >= 0)
        count = len(positions)
        compact = np.full(self.rows, -100, np.int32)
        compact[:count] = targets[positions]
        labelled = np.full(self.rows, _NONE, np.uint32)
        labelled[:count] = positions
        inverse = np.full(self.rows, _NONE, np.uint32)
        inverse[positions] = np.arange(count, dtype=np.uint32)
        grids = np.zeros(s.grids.numel, np.uint32)
        for at, x, z, first, rows in s.head_grids:
            grids[at:at + 3] = (x, -(-min(max(count - first, 0), rows) // 64), z)
        write(s.ids, ids.numpy().astype(np.uint32).reshape(-1))
        write(s.targets, compact)
        write(s.lengths, np.asarray(lengths, np.uint32))
        write(s.labelled, labelled)
        write(s.inverse, inverse)
        write(s.grids, grids)
        return count

    def set_dropout(self, slot: int, seed: int, p: float) -> None:
        """Micro-batch ``slot``'s LoRA dropout for its next pass: masks from ``seed``, probability ``p``."""
        if not self.dropout:
            raise ValueError("this plan was built without dropout (TrainPlan(..., dropout=True))")
        write(self.slots[slot].dropout, dropout_state(seed, p))

    def set_scale(self, scale: float) -> None:
        """The loss gradient's factor per labelled token (1 / the step's labelled tokens)."""
        write(self.scale, np.array([scale], np.float32))

    def record(self, rec: Recorder, slot: int, capture: dict | None = None) -> None:
        """Forward, loss and backward of micro-batch ``slot`` (gradients add into ``grads``).
        ``capture`` receives copies of the activation codes, as ``ForwardPlan.record``'s."""
        points = self.slots[slot].points if capture is not None else {}
        for item in self.slots[slot].launches:
            if isinstance(item, _Indirect):
                rec.launch_indirect(item.launch, item.grids, 4 * item.at)
            else:
                rec.launch(item)
            if id(item) in points:
                point, codes = points[id(item)]
                copies = (Buffer(codes.shape, "u32", self.device), Buffer(self.meta.shape, "f32", self.device))
                rec.copy(codes, copies[0])
                rec.copy(self.meta, copies[1])
                capture[point] = copies

    @property
    def dispatches(self) -> int:
        return len(self.slots[0].launches)
