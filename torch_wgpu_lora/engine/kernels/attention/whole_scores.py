"""Attention over score matrices kept whole, for passes that start at position 0 (a prompt, a
training pass) whose S fits ``policy.SCORES_SCRATCH_BYTES``: GEMMs on the shared 8 × 8 tile where
the flash kernels run at about a tenth to an eighth of the float32 rate.

Forward: S = q·Kᵀ (``attention_scores.wgsl``), a softmax over its rows in place giving P and the
rows' lse (``attention_softmax.wgsl``), O = P·V (``attention_apply.wgsl``). Backward, after
``flash.row_dot_launch``: P and dS (``attention_scores.wgsl``: S again, then P and dS; only dS
where the forward's P was kept), dV = Pᵀ dO and dK = scale · dSᵀ q (``attention_kv_grad.wgsl``),
dQ = scale · dS k (``attention_apply.wgsl``), each GEMM's sum cut into ``policy.sum_splits``
ranges added up by a ``split_sum`` launch.

A packed pass (``WholeScores.positions``: several examples in a row) masks in the softmax and in
the backward's P: each query's P is zero outside its own example, and the GEMMs, which read P
and dS, follow from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....runtime import Buffer, Device, Launch, kernel
from ...workspace import Workspace
from .. import bound_positions, dummy
from .policy import kept_scores_bytes, sum_splits

__all__ = ["WholeScores", "backward_launches", "forward_launches"]


@dataclass(frozen=True)
class WholeScores:
    """The shapes and scratch of a pass whose score matrices are kept whole (``from_start``):
    S or P, and the backward's dS, ``[batch·heads·padded, padded]`` (the workspace's scratch, shared
    by the layers of a step, which run one after another), with ``padded`` = tokens rounded up to 64.
    ``probabilities``: the caller's buffer for S and P instead, which holds P from the forward
    until the backward (a training step's, one a layer). ``positions``: a packed pass's position
    ids (u32 [batch·tokens]), which keep each query to the keys of its own example."""

    batch: int
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    max_len: int
    scale: float
    workspace: Workspace
    probabilities: Buffer | None = None
    positions: Buffer | None = None

    @property
    def device(self) -> Device:
        return self.workspace.device

    @property
    def packed(self) -> bool:
        return self.positions is not None

    def bound_positions(self) -> Buffer:
        """What the launches bind as position ids (``kernels.bound_positions``)."""
        return bound_positions(self.positions, self.batch * self.tokens, self.device)

    @property
    def padded(self) -> int:
        return -(-self.tokens // 64) * 64

    def scratch(self, grads: bool = False) -> Buffer:
        """S or P (``probabilities`` where given; ``grads``: dS), the workspace's scratch."""
        if self.probabilities is not None and not grads:
            return self.probabilities
        size = kept_scores_bytes(self.batch, self.heads, self.tokens) // 4
        return self.workspace.scratch("attention score gradients" if grads else "attention scores", (size,))

    def scores(self, mode: int, a: Buffer, cache: Buffer, lengths: Buffer, lse: Buffer, rd: Buffer) -> Launch:
        """``attention_scores.wgsl``: S = q·Kᵀ (mode 0; dS is not written) or dP = dO·Vᵀ, turning S
        into P and dS (mode 1) or, where the scores hold P already, into dS (mode 2). A packed pass's
        mode 1 masks P to each query's example (the forward's softmax did, for the P mode 2 reads)."""
        sc, ds = self.scratch(), (self.scratch(grads=True) if mode else dummy(self.device, "score_grads"))
        params = dict(tokens=self.batch * self.heads * self.padded, rows=self.head_dim, a_stride=self.head_dim,
                      padded=self.padded, seq=self.tokens, heads=self.heads, kv_heads=self.kv_heads,
                      max_len=self.max_len, scale=float(self.scale))
        grid = (self.padded // 64, self.batch * self.heads * self.padded // 64, 1)
        return Launch.build(kernel("attention_scores.wgsl", "gemm_tiled", self.device, MODE=mode,
                                   PACKED=self.packed and mode == 1),
                            grid, (lengths, a, cache, sc, ds, lse, rd, self.bound_positions()), params)

    def softmax(self, starts: Buffer, lengths: Buffer, lse: Buffer) -> Launch:
        """``attention_softmax.wgsl``: S into P in place, and the rows' lse."""
        params = dict(seq=self.tokens, heads=self.heads, padded=self.padded, max_len=self.max_len,
                      scale=float(self.scale))
        return Launch.build(kernel("attention_softmax.wgsl", "rows", self.device, PACKED=self.packed),
                            (self.tokens, self.batch * self.heads, 1),
                            (starts, lengths, self.scratch(), lse, self.bound_positions()), params)

    def gemm(self, file: str, rows: int, buffers: tuple[Buffer, ...], params: dict,
             splits: int | None) -> list[Launch]:
        """``file``'s GEMM over ``rows`` output rows, its sums split where that fills a GPU;
        ``buffers``: (starts, lengths, the kept P or dS, the other operand, the output)."""
        grid = (-(-self.head_dim // 64), rows // 64)
        count = splits or sum_splits(grid[0] * grid[1], self.device)
        part = dummy(self.device, "part")
        if count > 1:
            part = self.workspace.scratch("attention GEMM partial sums", (count * rows * self.head_dim,))
        out = [Launch.build(kernel(file, "gemm_tiled", self.device, SPLITS=count), (*grid, count),
                            (*buffers, part), params)]
        if count > 1:
            groups = -(-rows * self.head_dim // (4 * 256))  # an invocation a vec4
            limit = self.device.max_workgroups
            out.append(Launch.build(kernel(file, "split_sum", self.device, SPLITS=count),
                                    (min(groups, limit), -(-groups // limit), 1),
                                    {1: buffers[0], 5: buffers[4], 6: part}, params))  # starts, the output
        return out

    def apply(self, scores: Buffer, cache: Buffer, out: Buffer, starts: Buffer, lengths: Buffer, scale: float,
              splits: int | None) -> list[Launch]:
        """``attention_apply.wgsl``: out = scale · scores·cache (O = P·V, dQ = scale · dS·K)."""
        rows = self.batch * self.heads * self.padded
        return self.gemm("attention_apply.wgsl", rows, (starts, lengths, scores, cache, out),
                         dict(tokens=rows, rows=self.tokens, a_stride=self.padded, padded=self.padded,
                              heads=self.heads, kv_heads=self.kv_heads, max_len=self.max_len,
                              head_dim=self.head_dim, scale=float(scale)), splits)

    def kv_grad(self, scores: Buffer, x: Buffer, out: Buffer, starts: Buffer, lengths: Buffer, scale: float,
                splits: int | None) -> list[Launch]:
        """``attention_kv_grad.wgsl``: out = scale · scoresᵀ·x (dV = Pᵀ dO, dK = scale · dSᵀ q)."""
        rows = self.batch * self.kv_heads * self.padded
        return self.gemm("attention_kv_grad.wgsl", rows, (starts, lengths, scores, x, out),
                         dict(tokens=rows, rows=self.tokens * (self.heads // self.kv_heads), a_stride=self.padded,
                              padded=self.padded, seq=self.tokens, heads=self.heads, kv_heads=self.kv_heads,
                              max_len=self.max_len, head_dim=self.head_dim, scale=float(scale)), splits)


def forward_launches(whole: WholeScores, q: Buffer, k_cache: Buffer, v_cache: Buffer, out: Buffer,
                    starts: Buffer, lengths: Buffer, lse: Buffer) -> list[Launch]:
    """S = q·Kᵀ kept whole, its rows' softmax in place (P, and lse), then O = P·V: a GEMM, a row
    kernel and a GEMM on the shared 8 × 8 tile where the flash kernel runs at about 13% of the
    float32 rate."""
    unused = dummy(whole.device)
    return [whole.scores(0, q, k_cache, lengths, unused, unused), whole.softmax(starts, lengths, lse),
            *whole.apply(whole.scratch(), v_cache, out, starts, lengths, 1.0, None)]


def backward_launches(whole: WholeScores, q: Buffer, k_cache: Buffer, v_cache: Buffer, lse: Buffer,
                      d_out: Buffer, d_q: Buffer, d_k: Buffer, d_v: Buffer, starts: Buffer, lengths: Buffer,
                      rd: Buffer, splits: int | None) -> list[Launch]:
    """After row_dot: P and dS of every causal pair kept whole (two launches of
    ``attention_scores.wgsl``: S again, then P and dS; one, dS, where ``whole.probabilities`` holds the
    forward's P), then dV = Pᵀ dO, dK = scale · dSᵀ q (``attention_kv_grad.wgsl``) and
    dQ = scale · dS k (``attention_apply.wgsl``), each a GEMM on the shared 8 × 8 tile whose sum is
    cut into ``splits`` ranges (``sum_splits`` by default) added up by a ``split_sum`` launch."""
    sc, ds = whole.scratch(), whole.scratch(grads=True)
    if whole.probabilities is not None:
        scores = [whole.scores(2, d_out, v_cache, lengths, lse, rd)]
    else:
        scores = [whole.scores(0, q, k_cache, lengths, lse, rd), whole.scores(1, d_out, v_cache, lengths, lse, rd)]
    return [*scores,
            *whole.kv_grad(sc, d_out, d_v, starts, lengths, 1.0, splits),
            *whole.kv_grad(ds, q, d_k, starts, lengths, whole.scale, splits),
            *whole.apply(ds, k_cache, d_q, starts, lengths, whole.scale, splits)]
