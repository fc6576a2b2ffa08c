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

With ``packed`` each slot's rows hold several examples (position ids restarting at 0 at each, as
training packs them): each slot has a positions buffer (``write_inputs`` writes it), by which RoPE
and its backward rotate, and attention, forward and backward, keeps each example to itself.

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
``kernels.projection.split_k_ranges``).

The forward is ``program``'s emitter (the one the forward plans use); what a training pass keeps
for its backward are the buffers its ``LayerIO`` hands the emitter, each allocated in the plan's
``Workspace`` under the role "saved for the backward".

>>> # plan = TrainPlan(weights, adapters, batch=4, tokens=256, slots=2, scratch=engine.scratch)
>>> # loss, grads = plan.loss_and_grads(ids, labels, lengths)     # one micro-batch, one submit
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..loss import IGNORE_INDEX, shifted_targets
from ..runtime import Buffer, Launch, Recorder, copy_launch, write
from .adapters import EngineAdapters, Site
from .config import pad
from .kernels.attention import attention_backward_launches, keeps_probabilities, kept_scores_bytes
from .kernels.bitlinear import bitlinear_t_launch
from .kernels.cross_entropy import cross_entropy_launch
from .kernels.dropout import SiteDropout, dropout_state
from .kernels.embedding import gather_rows_launch
from .kernels.ffn import relu2_backward_launch
from .kernels.lora_grad import da_launch, db_launch, dh_launch
from .kernels.gemms import default_tile, mma_shape
from .kernels.matmul import (f16_pairs_launch, head_forward_launches, head_on_matrix_units, matmul_t_launch,
                             matmul_t_mma_launches)
from .kernels.norm import rmsnorm_backward_launch
from .kernels.rope import rope_backward_launch
from .program import (Indirect, LayerIO, PassContext, Program, SiteIO, emit_embedding, emit_final_norm, emit_head,
                      emit_layer, head_chunks, read_codes)
from .weights import EngineWeights, Projection
from .workspace import Workspace

_NONE = 2**32 - 1  # no row: gather_rows_launch leaves (labelled) or zeroes (inverse) it
_SAVED = "saved for the backward"


@dataclass
class _Slot:
    """One micro-batch's inputs, written before the submit, and its program."""

    ids: Buffer
    targets: Buffer  # i32: the labelled positions' targets in order, then IGNORE_INDEX
    lengths: Buffer
    losses: Buffer  # a view of the plan's losses buffer: this slot's rows
    labelled: Buffer  # u32: the positions with a target, in order, then 2**32 - 1
    inverse: Buffer  # u32: each position's row among the labelled ones, or 2**32 - 1
    grids: Buffer  # u32: the head GEMMs' grids over the labelled rows, three words each
    dropout: Buffer | None  # u32 [4]: the slot's dropout state (kernels.dropout.dropout_state)
    positions: Buffer | None  # u32: packed plans: each token's position id
    program: Program = field(default_factory=Program)
    # (word in grids, grid x, grid z, first labelled row of its token chunk, the chunk's rows, rows a
    # workgroup along y covers)
    head_grids: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)


class TrainPlan:
    """Buffers and launches of a forward + loss + backward of ``slots`` micro-batch shapes
    (``packed``: of packed rows). ``workspace``: the plan's own buffers (``scratch``, the engine's
    workspace of scratch shared between plans, if given)."""

    def __init__(self, weights: EngineWeights, adapters: EngineAdapters, batch: int, tokens: int,
                 slots: int = 1, dropout: bool = False, packed: bool = False, workspace: Workspace | None = None,
                 scratch: Workspace | None = None) -> None:
        c, device = weights.config, adapters.device
        self.config, self.weights, self.adapters, self.device = c, weights, adapters, device
        self.batch, self.tokens, self.rows = batch, tokens, batch * tokens
        self.dropout, self.packed = dropout, packed
        self.workspace = ws = workspace or Workspace(device, shared=scratch)
        n = self.rows
        H, F, Q = pad(c.hidden, 64), pad(c.intermediate, 64), pad(c.q_size, 64)
        quant = c.quantised

        def alloc(role: str, *shape: int, dtype: str = "f32") -> Buffer:
            return ws.alloc(role, shape, dtype)

        self.starts = alloc("inputs", batch, dtype="u32")
        write(self.starts, np.zeros(batch, np.uint32))  # training passes start at position 0
        self.scale = alloc("inputs", 1)
        stride = pad(n, 64)  # slot views start on 256-byte boundaries
        self.losses = alloc("loss", slots * stride)
        write(self.losses, np.zeros(slots * stride, np.float32))  # rows between slots stay zero
        per = min(n, max(64, device.max_binding // (4 * c.vocab) // 64 * 64))  # chunk views stay aligned
        self.token_chunks = [(r, min(per, n - r)) for r in range(0, n, per)]
        head_launches = 2 * len(self.token_chunks) * (len(weights.head) + 1)  # GEMMs, and the f16 splits
        self.slots = [_Slot(alloc("inputs", n, dtype="u32"), alloc("inputs", n, dtype="i32"),
                            alloc("inputs", batch, dtype="u32"), self.losses.slice(s * stride, (n,)),
                            alloc("inputs", n, dtype="u32"), alloc("inputs", n, dtype="u32"),
                            alloc("inputs", 3 * head_launches, dtype="u32"),
                            alloc("inputs", 4, dtype="u32") if dropout else None,
                            alloc("inputs", n, dtype="u32") if packed else None)
                      for s in range(slots)]
        # the forward's buffers every layer reuses
        self.residual, self.qkv = alloc("activations", n, H), alloc("activations", n, c.q_size + 2 * c.kv_size)
        self.codes = alloc("activations", n, H // 4, dtype="u32") if quant else None
        self.ffn_codes = alloc("activations", n, F // 4, dtype="u32") if quant else None
        self.scales_and_sums = alloc("activations", 2 * n) if quant else None
        xn, ffn_xn = alloc("activations", n, H), alloc("activations", n, F)
        # kept for the backward, per layer
        shape_kv = (batch, c.kv_heads, tokens, c.head_dim)
        keep_p = keeps_probabilities(c.layers, batch, c.heads, tokens)
        self.layers: list[LayerIO] = []
        for index in range(c.layers):
            sites = adapters.sites[index]

            def site(name: str, width: int, shared: Buffer) -> SiteIO:
                """A site's input kept where it has adapters (the gradient of A reads it), its h, its 1/rms."""
                rank = sites[name].rank
                return SiteIO(alloc(_SAVED, n, width) if rank else shared, alloc(_SAVED, n, rank) if rank else None,
                              alloc(_SAVED, n))

            self.layers.append(LayerIO(
                site("attn", H, xn), site("o", H, xn), site("mlp", H, xn), site("down", F, ffn_xn),
                queries=alloc(_SAVED, n, c.q_size), keys=alloc(_SAVED, *shape_kv), values=alloc(_SAVED, *shape_kv),
                attention=alloc(_SAVED, n, c.q_size), ffn=alloc(_SAVED, n, F), lse=alloc(_SAVED, n, c.heads),
                scores=alloc(_SAVED, kept_scores_bytes(batch, c.heads, tokens) // 4) if keep_p else None,
                pairs=alloc(_SAVED, n, 2 * c.intermediate), residual_in=alloc(_SAVED, n, H),
                residual_mid=alloc(_SAVED, n, H)))
        self.resid_final, self.xn_final, self.rstd_final = alloc(_SAVED, n, H), alloc(_SAVED, n, H), alloc(_SAVED, n)
        # backward scratch
        g = "gradients"
        self.d_resid, self.d_xn, self.d_final = alloc(g, n, H), alloc(g, n, H), alloc(g, n, H)
        self.d_xn_o, self.d_o, self.d_q = alloc(g, n, Q), alloc(g, n, c.q_size), alloc(g, n, c.q_size)
        self.d_k, self.d_v = alloc(g, *shape_kv), alloc(g, *shape_kv)
        self.d_qkv = alloc(g, n, c.q_size + 2 * c.kv_size)
        self.d_ffn_xn, self.d_h = alloc(g, n, F), alloc(g, n, c.intermediate)
        self.d_pairs, self.dh = alloc(g, n, 2 * c.intermediate), alloc(g, n, max(adapters.max_rank, 1))
        self.grads = adapters.grads()
        # the labelled rows' final norm output and its gradient, and one token chunk's logits
        self.x_head, self.d_head = alloc("loss", n, H), alloc("loss", n, H)
        self.logits = alloc("loss", self.token_chunks[0][1], c.vocab)
        # on f16 matrix units (bfloat16 weights), x_head and the logits' gradient are split in place
        # into f16 pairs, each row with its power of two (matmul_mma.wgsl)
        self.head_exponents = alloc("loss", self.token_chunks[0][1], dtype="i32")
        count = self.token_chunks[0][1]
        self.head_mma = head_on_matrix_units(self.x_head.rows(0, count), self.logits, self.d_head.rows(0, count),
                                             self.head_exponents, head_chunks(weights)[0][0], tokens=count,
                                             bf16=weights.bf16, workspace=ws)
        for slot in self.slots:
            context = PassContext(weights, adapters, batch, tokens, residual=self.residual, qkv=self.qkv,
                                  codes=self.codes, ffn_codes=self.ffn_codes, scales_and_sums=self.scales_and_sums,
                                  starts=self.starts, lengths=slot.lengths, cache_length=tokens, workspace=ws,
                                  gemv=False, from_start=True, dropout=slot.dropout, positions=slot.positions)
            self._assemble(slot, context)

    # -- the backward's pieces ---------------------------------------------------------------------

    def _site_dropout(self, context: PassContext, layer: int, site: str) -> SiteDropout | None:
        return self.adapters.site_dropout(layer, site, context.dropout) if context.dropout is not None else None

    def _project_t(self, context: PassContext, proj: Projection, dy: Buffer, out: Buffer, k: int, site: Site,
                   layer: int, name: str) -> list[Launch]:
        lora = (dict(dh=self.dh, lora_a=site.a, lora_rank=site.rank, dropout=self._site_dropout(context, layer, name))
                if site.rank else {})
        if self.config.quantised:
            return bitlinear_t_launch(dy, proj, out, tokens=self.rows, k=k, workspace=self.workspace, **lora)
        return matmul_t_launch(dy, proj, out, tokens=self.rows, k=k, bf16=self.weights.bf16,
                               workspace=self.workspace, **lora)

    def _adapter_grads(self, context: PassContext, site: Site, dy: Buffer, io: SiteIO, layer: int,
                       name: str) -> list[Launch]:
        """dh and dB of every adapter of the site, then dA of the site's stacked A."""
        if not site.rank:
            return []
        launches = []
        for a in site.adapters:
            m = a.module
            launches.append(dh_launch(dy, self.adapters.params, self.dh, tokens=self.rows, rows=a.rows, rank=m.r,
                                      h_col=a.a_row, b_offset=a.b_offset, scale=m.scaling, device=self.device))
            launches.append(db_launch(dy, io.h, self.grads, tokens=self.rows, rows=a.rows, rank=m.r, h_col=a.a_row,
                                      b_offset=a.b_offset, scale=m.scaling, device=self.device))
        launches.append(da_launch(self.dh, io.xn, self.grads, tokens=self.rows, rank=site.rank, k=site.k,
                                  a_offset=site.a_offset, dropout=self._site_dropout(context, layer, name),
                                  device=self.device))
        return launches

    # -- the program ------------------------------------------------------------------------------

    def _assemble(self, slot: _Slot, context: PassContext) -> None:
        """The slot's whole program: the forward (``program``'s emitter), the loss over the labelled
        rows, the backward."""
        c, w, a, d = self.config, self.weights, self.adapters, self.device
        out = slot.program
        emit_embedding(out, context, slot.ids)
        for index, io in enumerate(self.layers):
            emit_layer(out, context, index, io)
        out.add(copy_launch(self.residual, self.resid_final))
        emit_final_norm(out, context, self.residual, self.xn_final, self.rows, rstd=self.rstd_final)
        # the LM head and the loss over the labelled rows only, gathered in order, chunk by chunk
        out.add(gather_rows_launch(slot.labelled, self.xn_final, self.x_head, tokens=self.rows,
                                   k=self.x_head.shape[1], zero_missing=False, device=d))
        for first, count in self.token_chunks:
            self._head(slot, context, first, count)
        out.add(gather_rows_launch(slot.inverse, self.d_head, self.d_final, tokens=self.rows,
                                   k=self.d_final.shape[1], zero_missing=True, device=d),
                rmsnorm_backward_launch(self.d_final, self.resid_final, self.rstd_final, w.final_norm,
                                        self.d_resid, tokens=self.rows, k=c.hidden, device=d))
        for index in reversed(range(c.layers)):
            layer, sites, io = w.layers[index], a.sites[index], self.layers[index]
            out.mark(("backward", index))
            out.add(*self._adapter_grads(context, sites["down"], self.d_resid, io.down, index, "down"),
                    *self._project_t(context, layer.down, self.d_resid, self.d_ffn_xn, c.intermediate, sites["down"],
                                     index, "down"),
                    rmsnorm_backward_launch(self.d_ffn_xn, io.ffn, io.down.rstd, layer.ffn_sub_norm, self.d_h,
                                            tokens=self.rows, k=c.intermediate, device=d),
                    relu2_backward_launch(self.d_h, io.pairs, self.d_pairs, tokens=self.rows,
                                          features=c.intermediate, device=d),
                    *self._adapter_grads(context, sites["mlp"], self.d_pairs, io.mlp, index, "mlp"),
                    *self._project_t(context, layer.gate_up, self.d_pairs, self.d_xn, c.hidden, sites["mlp"],
                                     index, "mlp"),
                    rmsnorm_backward_launch(self.d_xn, io.residual_mid, io.mlp.rstd, layer.post_norm, self.d_resid,
                                            tokens=self.rows, k=c.hidden, accumulate=True, device=d),
                    *self._adapter_grads(context, sites["o"], self.d_resid, io.o, index, "o"),
                    *self._project_t(context, layer.o, self.d_resid, self.d_xn_o, c.q_size, sites["o"], index, "o"),
                    rmsnorm_backward_launch(self.d_xn_o, io.attention, io.o.rstd, layer.attn_sub_norm, self.d_o,
                                            tokens=self.rows, k=c.q_size, device=d),
                    *attention_backward_launches(io.queries, io.keys, io.values, io.attention, io.lse, self.d_o,
                                                 self.d_q, self.d_k, self.d_v, self.starts, slot.lengths,
                                                 batch=self.batch, tokens=self.tokens, heads=c.heads,
                                                 kv_heads=c.kv_heads, head_dim=c.head_dim, max_len=self.tokens,
                                                 scale=c.head_dim ** -0.5, workspace=self.workspace,
                                                 from_start=True, scores=io.scores,  # training passes start at 0
                                                 positions=slot.positions),
                    rope_backward_launch(self.d_q, self.d_k, self.d_v, w.rope_cos, w.rope_sin, self.starts, self.d_qkv,
                                         tokens=self.rows, tokens_per_seq=self.tokens, heads=c.heads,
                                         kv_heads=c.kv_heads, head_dim=c.head_dim, cache_len=self.tokens,
                                         positions=slot.positions, device=d),
                    *self._adapter_grads(context, sites["attn"], self.d_qkv, io.attn, index, "attn"))
            if index > 0:  # below layer 0 the input gradient reaches no trainable parameter
                out.add(*self._project_t(context, layer.qkv, self.d_qkv, self.d_xn, c.hidden, sites["attn"], index,
                                         "attn"),
                        rmsnorm_backward_launch(self.d_xn, io.residual_in, io.attn.rstd, layer.input_norm,
                                                self.d_resid, tokens=self.rows, k=c.hidden, accumulate=True, device=d))

    def _head(self, slot: _Slot, context: PassContext, first: int, count: int) -> None:
        """The LM head over the labelled rows ``first`` .. ``first + count``, the loss and its gradient,
        and the head's input gradient into d_head: on the general cores (``matmul``), or on f16 matrix
        units from f16 pairs of x_head and of the logits' gradient (``matmul_mma``)."""
        c, w, ws, out = self.config, self.weights, self.workspace, slot.program
        logits, x, d_head = self.logits.rows(0, count), self.x_head.rows(first, count), self.d_head.rows(first, count)
        chunks = head_chunks(w)
        if self.head_mma:
            exps = self.head_exponents.rows(0, count)
            split, *gemms = head_forward_launches(x, exps, chunks, logits, tokens=count, workspace=ws)
            forward_rows = mma_shape(ws.device, default_tile("lm_head", count), "f16").block_tokens
            grad_rows = mma_shape(ws.device, default_tile("lm_head_grad"), "f16").block_tokens
            out.add(self._labelled_rows(slot, split, first, count, 1),
                    *(self._labelled_rows(slot, gemm, first, count, forward_rows) for gemm in gemms))
        else:
            out.add(*(self._labelled_rows(slot, gemm, first, count, 64)
                      for gemm in emit_head(context, x, logits, count, mma=False)))
        out.add(cross_entropy_launch(logits, slot.targets.rows(first, count), self.scale,
                                     slot.losses.rows(first, count), rows=count, vocab=c.vocab, device=ws.device))
        if self.head_mma:
            out.add(self._labelled_rows(slot, f16_pairs_launch(logits, exps, rows=count, width=c.vocab,
                                                               device=ws.device), first, count, 1))
        for i, (proj, begin) in enumerate(chunks):
            if self.head_mma:
                gemm, *sums = matmul_t_mma_launches(logits, exps, proj, d_head, tokens=count, k=c.hidden, a_col=begin,
                                                    accumulate=i > 0, workspace=ws)
                out.add(self._labelled_rows(slot, gemm, first, count, grad_rows), *sums)
            else:
                gemm, *sums = matmul_t_launch(logits, proj, d_head, tokens=count, k=c.hidden, bf16=w.bf16,
                                              accumulate=i > 0, dy_col=begin, workspace=ws)
                out.add(self._labelled_rows(slot, gemm, first, count, 64), *sums)

    def _labelled_rows(self, slot: _Slot, launch: Launch, first: int, count: int, per: int) -> Indirect:
        """``launch`` (a head launch over ``count`` rows from labelled row ``first``, ``per`` rows a
        workgroup along its grid's y) with that grid set at each step to cover the chunk's labelled
        rows only."""
        at = 3 * len(slot.head_grids)
        slot.head_grids.append((at, launch.grid[0], launch.grid[2], first, count, per))
        return Indirect(launch, slot.grids, at)

    # -- running ----------------------------------------------------------------------------------

    def write_inputs(self, slot: int, ids: torch.Tensor, labels: torch.Tensor, lengths: list[int],
                     positions: torch.Tensor | None = None) -> int:
        """Write micro-batch ``slot``'s token ids and labels [batch, tokens] (and a packed plan's
        position ids, int64 [batch, tokens]: each row's examples one after another, each counting
        0, 1, …, with ``lengths`` the whole rows); returns its labelled positions (those whose next
        label is not IGNORE_INDEX), the rows the LM head then runs over."""
        s = self.slots[slot]
        if (positions is None) != (s.positions is None):
            raise ValueError("a packed plan runs with position_ids, and only a packed plan takes them")
        if positions is not None:
            if list(lengths) != [self.tokens] * self.batch:
                raise ValueError(f"packed rows attend over their whole length ({self.tokens}), got lengths {lengths}")
            write(s.positions, positions.numpy().astype(np.uint32).reshape(-1))
        targets = shifted_targets(labels.long()).numpy().reshape(-1)
        positions = np.flatnonzero(targets >= 0)
        count = len(positions)
        compact = np.full(self.rows, IGNORE_INDEX, np.int32)
        compact[:count] = targets[positions]
        labelled = np.full(self.rows, _NONE, np.uint32)
        labelled[:count] = positions
        inverse = np.full(self.rows, _NONE, np.uint32)
        inverse[positions] = np.arange(count, dtype=np.uint32)
        grids = np.zeros(s.grids.numel, np.uint32)
        for at, x, z, first, rows, per in s.head_grids:
            grids[at:at + 3] = (x, -(-min(max(count - first, 0), rows) // per), z)
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

    def record(self, rec: Recorder, slot: int, capture: dict | None = None, start: int = 0,
               stop: int | None = None) -> None:
        """Forward, loss and backward of micro-batch ``slot`` (gradients add into ``grads``), or its
        steps ``start`` to ``stop`` (``backward_done``). ``capture`` as ``Program.record``'s."""
        self.slots[slot].program.record(rec, capture, start, stop)

    def backward_done(self, layer: int) -> int:
        """The index of the step, in every slot's program, after which the backward has passed
        decoder layer ``layer``: its adapters' gradients are complete (the next layer down's
        backward starts there; the program ends after layer 0's)."""
        program = self.slots[0].program
        if not 0 <= layer < self.config.layers:
            raise ValueError(f"layer {layer} of a model of {self.config.layers} layers")
        return program.marks[("backward", layer - 1)] if layer > 0 else len(program)

    def loss_and_grads(self, ids: torch.Tensor, labels: torch.Tensor, lengths: list[int],
                       dropout: tuple[int, float] | None = None, codes: dict | None = None,
                       positions: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[torch.Tensor, torch.Tensor]]:
        """One micro-batch (slot 0) in one submit: the adapters synced, the inputs written, the pass
        recorded; returns the mean loss over labelled tokens and every adapter Parameter's gradient
        of it. ``dropout``: (seed, probability) of the pass's LoRA dropout. ``codes``, a dict,
        receives the pass's int8 activation codes (``program.read_codes``' format). ``positions``:
        a packed plan's position ids (``write_inputs``)."""
        self.adapters.sync()
        if dropout is not None:
            self.set_dropout(0, *dropout)
        count = self.write_inputs(0, ids, labels, lengths, positions)
        if count == 0:
            raise ValueError("the labels hold no labelled token (all -100 after the shift): no loss to compute")
        self.set_scale(1.0 / count)
        losses = np.empty(self.rows, np.float32)
        rec = Recorder(self.device)
        rec.clear(self.grads)
        capture = {} if codes is not None else None
        self.record(rec, 0, capture=capture)
        rec.read(self.slots[0].losses, losses)
        grads = self.adapters.read(self.grads, rec)
        rec.submit()
        if codes is not None:
            codes.update(read_codes(capture, self.batch, self.tokens, self.config))
        return torch.tensor(float(losses.astype(np.float64).sum()) / count, dtype=torch.float32), grads

    @property
    def dispatches(self) -> int:
        return len(self.slots[0].program)

    def roles(self) -> dict[str, int]:
        """Bytes the plan's workspace holds, by role."""
        return self.workspace.roles()
