"""Causal grouped-query attention over a KV cache, forward and backward: three algorithms, one
module each, chosen here per call.

The math is transformers' ``eager_attention_forward`` with ``repeat_kv``, in float32: for
sequence ``b``, query token ``i`` at absolute position ``p = starts[b] + i`` (the sequence's
first position in this pass) and query head ``h`` (KV head ``g = h // (heads // kv_heads)``)::

    lim    = min(p, lengths[b] - 1)                       # the last key the query sees
    s_j    = scale * q[b, i, h] · K[b, g, j]              for j in 0..lim
    out    = softmax(s) · V[b, g, 0..lim]                 lse = logsumexp(s)  (natural log)

A packed pass (``positions``, u32 ``[batch*tokens]``: each token's position id, several examples
in a row each numbered from 0; not decoding) also keeps each query to the keys of its own
example: ``j >= p - positions[b*T + i]``, as transformers' masks do for packed position ids.

``lengths[b]`` counts the valid key positions of sequence ``b``, cache included: with right
padding it is the real length, and a padded query then attends to every real key (HF's causal +
padding mask); when decoding it is ``starts[b] + 1``. The kernels read it clamped to ``1..max_len``, so
no read leaves the sequence's cache rows; cache rows past a sequence's length are never read, so
stale or NaN cache contents there cannot leak into the results. Scores are kept in the log2
domain (q is scaled by ``scale * log2(e)`` as it is loaded) and masked probabilities are forced
to 0 with ``select``. No subgroup operations: the portable path is the only one.

Layouts (float32): ``q`` and ``out`` ``[batch*tokens, heads*head_dim]`` (``q.view(B, T, H, D)``);
``k_cache`` and ``v_cache`` ``[batch, kv_heads, max_len, head_dim]``; ``lse``
``[batch*tokens, heads]``; ``starts`` and ``lengths`` u32 ``[batch]``. ``head_dim`` must be a
multiple of 4 (kernels load vec4s). Positions and lengths reach the kernels only through the
starts and lengths buffers, so a plan records the same ``Launch`` objects at every step.

The algorithms:

* ``flash``: tiles with an online softmax, forward and backward; any position, any length;
* ``decode``: flash decoding, split over the keys, for few query tokens;
* ``whole_scores``: S, P and dS kept whole with GEMMs over them, for passes from position 0 whose
  scores fit ``policy.SCORES_SCRATCH_BYTES`` (``policy`` says when, and when a training step
  keeps every layer's P for its backward).

``reference`` holds the torch references of the forward and the backward.

>>> # launches = attention_launches(q, k_cache, v_cache, out, starts, lengths, batch=B, tokens=T, heads=20,
>>> #                               kv_heads=5, head_dim=128, max_len=S, scale=128 ** -0.5, workspace=ws)
>>> # for launch in launches: rec.launch(launch)      # every step, after writing step/lengths
"""

from __future__ import annotations

from ....runtime import Buffer, Launch
from ...workspace import Workspace
from . import decode as decoding
from . import flash, whole_scores
from .decode import DecodePartials, decode_partials, decode_splits
from .flash import BackwardTile, PrefillTile, backward_tile, backward_tiles, prefill_tile, prefill_tiles
from .policy import SCORES_SCRATCH_BYTES, keeps_probabilities, kept_scores_bytes, scores_kept_whole, sum_splits
from .reference import attention_backward_reference, attention_reference

__all__ = ["BackwardTile", "DecodePartials", "PrefillTile", "attention_backward_launches",
           "attention_backward_reference", "attention_launches", "attention_reference", "backward_tile",
           "backward_tiles", "decode_partials", "decode_splits", "keeps_probabilities", "kept_scores_bytes",
           "prefill_tile", "prefill_tiles", "scores_kept_whole", "sum_splits"]


def _check_shape(what: str, heads: int, kv_heads: int, head_dim: int, batch: int, tokens: int, max_len: int) -> None:
    if head_dim % 4 or head_dim <= 0:
        raise ValueError(f"{what}: head_dim must be a positive multiple of 4, got {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"{what}: heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if min(batch, tokens, max_len) <= 0:
        raise ValueError(f"{what}: batch, tokens and max_len must be positive")


def _check_size(name: str, buf: Buffer, numel: int) -> None:
    if buf.numel < numel:
        raise ValueError(f"attention: {name} has {buf.numel} elements, needs {numel}")


def _check_scores(scores: Buffer | None, kept_path: bool, batch: int, heads: int, tokens: int) -> None:
    if scores is None:
        return
    if not kept_path:
        raise ValueError("attention: a scores buffer is only used by a training pass (from_start, not decoding) "
                         f"whose scores fit SCORES_SCRATCH_BYTES ({SCORES_SCRATCH_BYTES} bytes)")
    _check_size("scores", scores, kept_scores_bytes(batch, heads, tokens) // 4)


def attention_launches(q: Buffer, k_cache: Buffer, v_cache: Buffer, out: Buffer, starts: Buffer, lengths: Buffer, *,
                       batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, max_len: int, scale: float,
                       workspace: Workspace, lse: Buffer | None = None, decode: bool = False,
                       tile: PrefillTile | None = None, splits: int | None = None,
                       partials: DecodePartials | None = None, from_start: bool = False,
                       scores: Buffer | None = None, positions: Buffer | None = None) -> list[Launch]:
    """The launches of one attention call, to record in order at every step.

    ``q``/``out`` f32 ``[batch*tokens, heads*head_dim]``; ``k_cache``/``v_cache`` f32
    ``[batch, kv_heads, max_len, head_dim]``; ``starts`` (each sequence's first position) and
    ``lengths`` u32 ``[batch]``; ``lse`` (optional) f32 ``[batch*tokens, heads]``. The
    caches must hold keys 0..lengths[b]-1 of every sequence when the launches run. Scratch and
    the buffers the launches need of their own come from ``workspace``.

    ``decode=False``: the flash forward (one launch, any ``tokens``). ``decode=True``: flash
    decoding for few tokens, a partial launch and a combine launch, or given ``partials``
    (``decode_partials``) the partial launch alone: ``out`` is then not written, the partials'
    reader merges them. ``tile`` and ``splits`` override the chosen prefill tile and the decode
    split count (tests and benchmarks).

    ``from_start`` (not decoding): the caller promises that the pass's queries start at position 0
    (training, a prompt; a pass that does not gets NaN in ``out`` and ``lse``). Then, where S fits
    ``SCORES_SCRATCH_BYTES``, attention runs over S kept whole (``whole_scores``). ``scores`` (f32,
    ``kept_scores_bytes`` of the pass): the caller's buffer for S, which then holds P, to give to
    ``attention_backward_launches`` (``keeps_probabilities`` says when a training step does);
    without it S lives in the workspace's scratch, which the next layer overwrites.

    ``positions`` (u32 ``[batch*tokens]``, not decoding): a packed pass's position ids; each
    query then attends to its own example's keys only (the module's docstring), on either path.
    """
    _check_shape("attention", heads, kv_heads, head_dim, batch, tokens, max_len)
    _check_size("q", q, batch * tokens * heads * head_dim)
    _check_size("out", out, batch * tokens * heads * head_dim)
    _check_size("k_cache", k_cache, batch * kv_heads * max_len * head_dim)
    _check_size("v_cache", v_cache, batch * kv_heads * max_len * head_dim)
    _check_size("lengths", lengths, batch)
    if lse is not None:
        _check_size("lse", lse, batch * tokens * heads)
    if positions is not None and decode:
        raise ValueError("attention: decoding continues each sequence at its start; position_ids (packed passes) "
                         "are a prompt's or a training pass's")
    shape = dict(batch=batch, tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, max_len=max_len,
                 scale=scale)
    kept_path = not decode and from_start and scores_kept_whole(batch, heads, tokens)
    _check_scores(scores, kept_path, batch, heads, tokens)
    if kept_path:
        scores_of = whole_scores.WholeScores(batch, tokens, heads, kv_heads, head_dim, max_len, scale, workspace,
                                             scores, positions)
        lse_rows = lse if lse is not None else workspace.scratch("attention lse", (batch * tokens * heads,))
        return whole_scores.forward_launches(scores_of, q, k_cache, v_cache, out, starts, lengths, lse_rows)
    if decode:
        return decoding.decode_launches(q, k_cache, v_cache, out, starts, lengths, lse, splits=splits,
                                        partials=partials, workspace=workspace, **shape)
    return [flash.prefill_launch(q, k_cache, v_cache, out, starts, lengths, lse, tile=tile, device=workspace.device,
                                 positions=positions, **shape)]


def attention_backward_launches(q: Buffer, k_cache: Buffer, v_cache: Buffer, out: Buffer, lse: Buffer, d_out: Buffer,
                                d_q: Buffer, d_k: Buffer, d_v: Buffer, starts: Buffer, lengths: Buffer, *, batch: int,
                                tokens: int, heads: int, kv_heads: int, head_dim: int, max_len: int, scale: float,
                                workspace: Workspace, tile: BackwardTile | None = None, splits: int | None = None,
                                from_start: bool = False, scores: Buffer | None = None,
                                positions: Buffer | None = None) -> list[Launch]:
    """The launches of one attention backward, to record in order.

    Inputs in the forward's layouts: ``q``, ``out`` (the forward's output) and ``d_out`` f32
    ``[batch*tokens, heads*head_dim]``; ``k_cache``/``v_cache`` f32 ``[batch, kv_heads, max_len,
    head_dim]``; ``lse`` f32 ``[batch*tokens, heads]`` (the forward's, natural log); ``starts``
    and ``lengths`` u32 ``[batch]``; ``positions`` as the forward's. Same masking as the forward.

    Outputs: ``d_q`` ``[batch*tokens, heads*head_dim]``, every row written; ``d_k``/``d_v``
    ``[batch, kv_heads, max_len, head_dim]``, written at key positions ``starts[b] ..
    starts[b]+tokens-1`` (below ``max_len``) of every sequence ``b``, the sums over the group's
    query heads and every query of the pass (zero where no query attends, e.g. positions >=
    lengths[b]). Gradients of cache keys before ``starts[b]`` are not computed.

    ``row_dot`` first, then the flash backward (``dq``, ``dkdv``; ``tile`` and ``splits`` override
    its choices, ``splits`` also the GEMMs'), or, for a pass ``from_start`` whose P fits
    ``SCORES_SCRATCH_BYTES``, the kept-scores GEMMs (``whole_scores``), reading the forward's P from
    ``scores`` where it was kept there instead of computing S again.
    """
    _check_shape("attention backward", heads, kv_heads, head_dim, batch, tokens, max_len)
    rows_total = batch * tokens * heads
    for name, buf in (("q", q), ("out", out), ("d_out", d_out), ("d_q", d_q)):
        _check_size(name, buf, rows_total * head_dim)
    for name, buf in (("k_cache", k_cache), ("v_cache", v_cache), ("d_k", d_k), ("d_v", d_v)):
        _check_size(name, buf, batch * kv_heads * max_len * head_dim)
    _check_size("lse", lse, rows_total)
    _check_size("lengths", lengths, batch)
    shape = dict(batch=batch, tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, max_len=max_len,
                 scale=scale)
    kept_path = from_start and scores_kept_whole(batch, heads, tokens)
    _check_scores(scores, kept_path, batch, heads, tokens)
    row_dot, rd = flash.row_dot_launch(out, d_out, workspace=workspace, **shape)
    if kept_path:
        scores_of = whole_scores.WholeScores(batch, tokens, heads, kv_heads, head_dim, max_len, scale, workspace,
                                             scores, positions)
        return [row_dot, *whole_scores.backward_launches(scores_of, q, k_cache, v_cache, lse, d_out, d_q, d_k, d_v,
                                                         starts, lengths, rd, splits)]
    return [row_dot, *flash.backward_launches(q, k_cache, v_cache, lse, d_out, d_q, d_k, d_v, starts, lengths, rd,
                                              tile=tile, splits=splits, workspace=workspace, positions=positions,
                                              **shape)]
