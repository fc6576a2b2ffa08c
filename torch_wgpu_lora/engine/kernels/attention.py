"""Causal grouped-query attention over a KV cache (``attention.wgsl``), and its torch reference.

The math is transformers' ``eager_attention_forward`` with ``repeat_kv``, in float32: for
sequence ``b``, query token ``i`` at absolute position ``p = pos + i`` (``pos`` read from the
step buffer at ``STEP_POS``) and query head ``h`` (KV head ``g = h // (heads // kv_heads)``)::

    lim    = min(p, lengths[b] - 1)                       # the last key the query sees
    s_j    = scale * q[b, i, h] · K[b, g, j]              for j in 0..lim
    out    = softmax(s) · V[b, g, 0..lim]                 lse = logsumexp(s)  (natural log)

``lengths[b]`` counts the valid key positions of sequence ``b``, cache included: with right
padding it is the real length, and a padded query then attends to every real key (HF's
causal + padding mask); when decoding it is ``pos + 1``. The kernels read it clamped to
``1..max_len``, so no read leaves the sequence's cache rows.

Layouts (float32): ``q`` and ``out`` ``[batch*tokens, heads*head_dim]`` (``q.view(B, T, H, D)``);
``k_cache`` and ``v_cache`` ``[batch, kv_heads, max_len, head_dim]``; ``lse``
``[batch*tokens, heads]``; ``step`` u32 (``STEP_FIELDS``), ``lengths`` u32 ``[batch]``.
``head_dim`` must be a multiple of 4 (kernels load vec4s).

Launch shapes, built once per plan (``attention_launches``); positions and lengths reach the
kernels only through the step and lengths buffers, so a plan records the same ``Launch``
objects at every step:

* **prefill** (``decode=False``, any ``tokens``): one workgroup per (block of ``4*RG`` rows,
  KV head, sequence), where a row is one (query, head of the KV group) pair: the block's
  queries *and* the ``heads // kv_heads`` heads that share the KV head read every K/V tile
  once from workgroup memory. A loop over key tiles of ``BK`` keys keeps an online
  (flash-attention) softmax, so memory stays bounded for any length; causality bounds the
  loop per block (a block stops at its last row's key), and the heaviest blocks launch first.
  Thread (kl, rg, ct) holds 4 rows x 4 vec4 columns of the output in named registers (16 vec4
  accumulators, no arrays); scores are computed in 4-row x 4-key register blocks from q and k
  in workgroup memory. ``KL`` key lanes split the head dim for the scores and the tile's keys
  for P·V, summed once at the end. Tile loads keep four vec4 loads in flight per thread. The
  tile (``PrefillTile``: RG, BK, KL) is the first of ``_PREFILL_TILES`` whose workgroup memory
  fits ``max-compute-workgroup-storage-size`` (48 KiB on NVIDIA: 32 rows x 32 keys in 2 key
  lanes, 128 threads; 32 KiB on lavapipe; WebGPU's default 16 KiB gets 16 rows x 8 keys).
* **decode** (``decode=True``, few tokens, typically 1): flash-decoding in two launches. The
  partial launch has a grid of (``splits``, 4-row blocks x KV heads, batch) workgroups of 256
  threads; each attends to one span of the keys in 64-key tiles (8 threads per key for the
  scores, one thread per (key lane, vec4 column) for P·V, every cache read coalesced) and
  writes unnormalised sums and (max, sum) pairs into scratch buffers the builder allocates
  (kept alive by the Launch's ``keep``). The combine launch (a workgroup per output row)
  merges the spans.

  How the keys are split: the split *count* is fixed at plan time (``decode_splits``: from
  ``max_len`` and the workgroups the adapter wants, enough to fill a GPU even with 5 KV heads
  and batch 1), and the span *size* is computed on the GPU at every step from the lengths
  buffer, ``ceil(n / splits)`` rounded up to a 64-key tile (``n``: the keys the row block
  sees). So every split takes a share of the current length, instead of fixed slices of
  ``max_len`` where all but the first few workgroups would exit at short lengths, and no
  indirect dispatch or grid kernel is needed. Workgroups whose span starts past ``n`` (short
  lengths, where tile rounding leaves spans empty) write neutral partials (zero sums, max
  −1e30: weight 0) and exit, so a merge reads every span.

Measured on an H200 through Vulkan, BitNet-2B heads (20 query, 5 KV, head_dim 128), one
layer: prefill of 4096 tokens 6.8 ms (12.6 TFLOP/s) with shader checks off, 9.4 ms with
wgpu's full runtime checks (the default); decode of one token against 4096 keys 18 us (27 us
with full checks), batch 8 against 4096 keys 89 us (1.9 TB/s of K/V).

Scores are kept in the log2 domain (q is scaled by ``scale * log2(e)`` as it is loaded) and
masked probabilities are forced to 0 with ``select``; cache rows past a sequence's length
are never read (tile loads clamp to the last valid key), so stale or NaN cache contents there
cannot leak into the results. No subgroup operations: the portable path is the only one.

>>> # launches = attention_launches(q, k_cache, v_cache, out, step, lengths, batch=B, tokens=T,
>>> #                               heads=20, kv_heads=5, head_dim=128, max_len=S, scale=128 ** -0.5)
>>> # for launch in launches: rec.launch(launch)      # every step, after writing step/lengths

The backward (``attention_backward_launches``) takes the same layouts and masking and recomputes
the probabilities from the forward's ``lse``: flash-attention-2 style in tiles
(``attention_backward.wgsl``), or, for passes that start at position 0 (training) and whose
probabilities fit ``SCORES_SCRATCH_BYTES``, with P and dS kept whole and dV, dK, dQ as GEMMs over
them (``attention_scores.wgsl``, ``attention_kv_grad.wgsl``, ``attention_apply.wgsl``). Such passes'
forward (``from_start``) keeps S whole too: a GEMM, a softmax over its rows
(``attention_softmax.wgsl``) and O = P·V (``attention_apply.wgsl``); a training step whose layers'
P fit ``KEPT_PROBABILITIES_BYTES`` keeps each layer's P for its backward, which then does not
compute S again.
``attention_backward_reference`` is the torch reference of both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...runtime import Buffer, Device, Launch, get_device, kernel
from . import dummy

__all__ = ["BackwardTile", "DecodePartials", "PrefillTile", "attention_backward_launches",
           "attention_backward_reference", "attention_launches", "attention_reference", "backward_tile",
           "backward_tiles", "decode_partials", "decode_splits", "keeps_probabilities", "prefill_tile",
           "prefill_tiles", "scores_kept_whole"]

FILE = "attention.wgsl"

# decode_partial's key tile (DBK): spans are rounded up to it
_DECODE_KEYS = 64


@dataclass(frozen=True)
class PrefillTile:
    """A prefill workgroup's shape: ``row_quads`` (RG: 4*RG rows of (query, head) pairs),
    ``key_tile`` (BK: keys per tile, a multiple of 4 and of 2*KL) and ``key_lanes`` (KL: threads
    sharing a (row quad, column) cell, splitting the head dim for scores and the keys for PV)."""

    row_quads: int
    key_tile: int
    key_lanes: int = 1

    def columns(self, head_dim: int) -> int:
        """Column threads (CT): each owns 4 of the head's ``head_dim // 4`` vec4 columns."""
        return -(-(head_dim // 4) // 4)

    def threads(self, head_dim: int) -> int:
        return self.row_quads * self.columns(head_dim) * self.key_lanes

    def workgroup_bytes(self, head_dim: int) -> int:
        """Workgroup memory of the prefill kernel with this tile (Qs, KVs, Ps, As, Mrun, Lrun)."""
        d4, rg, bk = head_dim // 4, self.row_quads, self.key_tile
        return 16 * (4 * rg * (d4 + 1) + bk * (d4 + 1) + bk * rg * self.key_lanes + 3 * rg)

    def valid(self) -> bool:
        return self.key_tile % 4 == 0 and self.key_tile % (2 * self.key_lanes) == 0 and self.row_quads > 0


# In order of preference: the first whose workgroup memory fits the adapter's limit is used.
# Measured on an H200 through Vulkan (BitNet-2B heads, one layer, in long passes of back-to-back
# launches), µs at T = 512 / 1024 / 4096 with the default bounds checks: (8,32,2) 158 / 514 /
# 7,211; (16,16,1) 182 / 625 / 7,437; (8,16,2) 204 / 682 / 9,416; (4,16,2) 217 / 784 / 10,597.
# (At T=4096 with wgpu's full checks (16,16,1) led: 9.4 ms against 13.1.) Sizes at head_dim
# 128: 41.4 KiB for (8,32,2), 46.0 for (16,16,1), 29.1 for (8,16,2); the tiles from (4, 8, 2)
# on fit WebGPU's default 16 KiB.
_PREFILL_TILES = (PrefillTile(8, 32, 2), PrefillTile(16, 16), PrefillTile(8, 16, 2), PrefillTile(8, 16),
                  PrefillTile(4, 16, 2), PrefillTile(4, 8, 2), PrefillTile(4, 8), PrefillTile(2, 8),
                  PrefillTile(1, 8), PrefillTile(1, 4))


def _fitting(tiles: tuple, head_dim: int, device: Device | None) -> list:
    """``tiles`` (in order) whose workgroup memory and thread count fit ``device``."""
    device = device or get_device()
    limit = int(device.limits["max-compute-workgroup-storage-size"])
    threads = min(int(device.limits["max-compute-invocations-per-workgroup"]),
                  int(device.limits["max-compute-workgroup-size-x"]))
    return [t for t in tiles if t.workgroup_bytes(head_dim) <= limit and t.threads(head_dim) <= threads]


def _first(tiles: list, what: str, head_dim: int) -> Any:
    if not tiles:
        raise ValueError(f"head_dim={head_dim}: no {what} tile fits this adapter's workgroup memory")
    return tiles[0]


def prefill_tiles(head_dim: int, device: Device | None = None) -> list[PrefillTile]:
    """Every prefill tile that fits ``device``, in order of preference (``benchmarks.launches`` times them)."""
    return _fitting(_PREFILL_TILES, head_dim, device)


def prefill_tile(head_dim: int, device: Device | None = None) -> PrefillTile:
    """The first prefill tile (in order of preference) whose workgroup memory and thread count fit ``device``."""
    return _first(prefill_tiles(head_dim, device), "prefill", head_dim)


def decode_splits(batch: int, kv_heads: int, row_blocks: int, max_len: int, device: Device | None = None) -> int:
    """Key spans per decode row block: enough workgroups to fill the adapter (about 512 on a
    GPU, a few on a CPU adapter), at most one 64-key tile of ``max_len`` each."""
    device = device or get_device()
    target = 4 if device.is_cpu else 512
    want = -(-target // max(1, batch * kv_heads * row_blocks))
    return max(1, min(want, -(-max_len // _DECODE_KEYS)))


@dataclass(frozen=True)
class DecodePartials:
    """What decode_partial writes for each of ``splits`` key spans: each row's unnormalised sums
    ``o`` (f32 [splits, rows, head_dim]) and (max, sum) pairs ``ml`` (f32 [splits, rows, 2]), rows
    in q's order (batch·tokens·heads; an empty span's are zeros and (−1e30, 0)). The combine launch
    merges them, or a consumer of attention's output that merges them as it reads them
    (``bitlinear_launch(attention=...)``: o_proj's GEMV)."""

    o: Buffer
    ml: Buffer
    splits: int
    heads: int
    head_dim: int


def decode_partials(batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, max_len: int,
                    device: Device | None = None, splits: int | None = None) -> DecodePartials:
    """The partials' buffers of a decode pass, with the split count ``decode_splits`` chooses."""
    device = device or get_device()
    splits = splits or decode_splits(batch, kv_heads, -(-tokens * (heads // kv_heads) // 4), max_len, device)
    rows = batch * tokens * heads
    return DecodePartials(Buffer((splits, rows, head_dim), "f32", device), Buffer((splits, rows, 2), "f32", device),
                          splits, heads, head_dim)


def _decode_shape(d4: int) -> dict[str, int]:
    """decode_partial's override constants: 256 threads (more for head_dim > 1024), 8 lanes per
    key in the score phase, 64-key tiles, and the PV phase's key lanes."""
    threads = max(256, 1 << (d4 - 1).bit_length())  # D4 <= DNT: one PV column per thread
    lanes = 8
    while _DECODE_KEYS * lanes < threads:  # dRed also holds one row of the final reduction
        lanes *= 2
    return {"DNT": threads, "LPK": lanes, "DBK": _DECODE_KEYS, "DKL": min(threads // d4, _DECODE_KEYS)}


def _check_scores(scores: Buffer | None, kept_path: bool, batch: int, heads: int, tokens: int) -> None:
    if scores is None:
        return
    if not kept_path:
        raise ValueError("attention: a scores buffer is only used by a training pass (from_start, not decoding) "
                         f"whose scores fit SCORES_SCRATCH_BYTES ({SCORES_SCRATCH_BYTES} bytes)")
    _check_size("scores", scores, kept_scores_bytes(batch, heads, tokens) // 4)


def _check_size(name: str, buf: Buffer, numel: int) -> None:
    if buf.numel < numel:
        raise ValueError(f"attention: {name} has {buf.numel} elements, needs {numel}")


def attention_launches(q: Buffer, k_cache: Buffer, v_cache: Buffer, out: Buffer, step: Buffer, lengths: Buffer, *,
                       batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, max_len: int, scale: float,
                       lse: Buffer | None = None, decode: bool = False, device: Device | None = None,
                       tile: PrefillTile | None = None, splits: int | None = None,
                       partials: DecodePartials | None = None, from_start: bool = False,
                       scores: Buffer | None = None) -> list[Launch]:
    """The launches of one attention call, to record in order at every step.

    ``q``/``out`` f32 ``[batch*tokens, heads*head_dim]``; ``k_cache``/``v_cache`` f32
    ``[batch, kv_heads, max_len, head_dim]``; ``step`` u32 (position at ``STEP_POS``);
    ``lengths`` u32 ``[batch]``; ``lse`` (optional) f32 ``[batch*tokens, heads]``. The
    caches must hold keys 0..lengths[b]-1 of every sequence when the launches run.

    ``decode=False``: one prefill launch (any ``tokens``). ``decode=True``: a partial launch
    and a combine launch (flash-decoding) for few tokens; its scratch buffers are allocated
    here and kept alive by the launches, or given as ``partials`` (``decode_partials``), which
    leaves out the combine launch: ``out`` is not written, the partials' reader merges them.
    ``tile`` and ``splits`` override the chosen prefill tile and the decode split count (tests
    and benchmarks).

    ``from_start`` (not decoding): the caller promises that the pass's queries start at position 0
    (training; a pass that does not gets NaN in ``out`` and ``lse``). Then, where S of the pass
    fits ``SCORES_SCRATCH_BYTES``, S is kept whole and turned into P in place, and O = P·V is a
    GEMM (``_forward_from_kept_scores``: three launches, four with a split sum) in place of the
    flash kernel (BitNet-2B at seq 512, one layer on the H200: see benchmarks/RESULTS.md).
    ``scores`` (f32, ``kept_scores_bytes`` of the pass): the caller's buffer for S, which then
    holds P, to give to ``attention_backward_launches`` (``keeps_probabilities`` says when a
    training step does); without it S lives in device-owned scratch the next pass overwrites.

    >>> # launches = attention_launches(q, kc, vc, out, step, lengths, batch=1, tokens=1, heads=20,
    >>> #                               kv_heads=5, head_dim=128, max_len=4096, scale=128 ** -0.5,
    >>> #                               decode=True)
    >>> # rec = Recorder(); [rec.launch(x) for x in launches]; rec.read(out, dst); rec.submit()
    """
    device = device or get_device()
    if head_dim % 4 or head_dim <= 0:
        raise ValueError(f"attention: head_dim must be a positive multiple of 4, got {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"attention: heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if min(batch, tokens, max_len) <= 0:
        raise ValueError("attention: batch, tokens and max_len must be positive")
    group, d4 = heads // kv_heads, head_dim // 4
    _check_size("q", q, batch * tokens * heads * head_dim)
    _check_size("out", out, batch * tokens * heads * head_dim)
    _check_size("k_cache", k_cache, batch * kv_heads * max_len * head_dim)
    _check_size("v_cache", v_cache, batch * kv_heads * max_len * head_dim)
    _check_size("lengths", lengths, batch)
    if lse is not None:
        _check_size("lse", lse, batch * tokens * heads)
    kept_path = not decode and from_start and scores_kept_whole(batch, heads, tokens)
    _check_scores(scores, kept_path, batch, heads, tokens)
    if kept_path:
        kept = _KeptScores(batch, tokens, heads, kv_heads, head_dim, max_len, scale, device, scores)
        lse_rows = lse if lse is not None else device.owned(
            f"attention_lse_{batch * tokens * heads}", lambda: Buffer((batch * tokens * heads,), "f32", device))
        return _forward_from_kept_scores(kept, q, k_cache, v_cache, out, step, lengths, lse_rows)
    lse_buf = lse if lse is not None else Buffer((4,), "f32", device)
    rows = tokens * group

    if not decode:
        tile = tile or prefill_tile(head_dim, device)
        ct = tile.columns(head_dim)
        if not tile.valid() or tile.workgroup_bytes(head_dim) > device.limits["max-compute-workgroup-storage-size"]:
            raise ValueError(f"attention: prefill tile {tile} does not fit head_dim={head_dim} on this adapter")
        kern = kernel(FILE, "prefill", device, D4=d4, R=group, RG=tile.row_quads, CT=ct,
                      KL=tile.key_lanes, BK=tile.key_tile)
        params = (batch, tokens, kv_heads, max_len, 1, int(lse is not None), float(scale))
        grid = (-(-rows // (4 * tile.row_quads)), kv_heads, batch)
        return [Launch.build(kern, grid, (step, lengths, q, k_cache, v_cache, out, lse_buf), params)]

    shape = _decode_shape(d4)
    blocks = -(-rows // 4)
    merged = partials is None
    if partials is None:
        partials = decode_partials(batch, tokens, heads, kv_heads, head_dim, max_len, device, splits)
    elif lse is not None or (partials.heads, partials.head_dim) != (heads, head_dim) or \
            partials.o.numel < partials.splits * batch * tokens * heads * head_dim:
        raise ValueError(f"attention: partials for {partials.heads} heads of {partials.head_dim} do not fit "
                         f"{batch}×{tokens} rows of {heads} heads of {head_dim} (and give no lse)")
    splits, rows_total = partials.splits, batch * tokens * heads
    params = (batch, tokens, kv_heads, max_len, splits, int(lse is not None), float(scale))
    part = kernel(FILE, "decode_partial", device, D4=d4, R=group, **shape)
    launches = [Launch.build(part, (splits, kv_heads * blocks, batch),
                             (step, lengths, q, k_cache, v_cache, partials.o, partials.ml), params)]
    if merged:
        cwg = max(64, 1 << (d4 - 1).bit_length())
        combine = kernel(FILE, "decode_combine", device, D4=d4, R=group, CWG=cwg, CL=cwg // d4)
        limit = device.max_workgroups
        launches.append(Launch.build(combine, (min(rows_total, limit), -(-rows_total // limit), 1),
                                     {3: partials.o, 4: partials.ml, 5: out, 6: lse_buf}, params))
    return launches


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int,
                        lengths: torch.Tensor | Sequence[int], heads: int, kv_heads: int,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch attention in the kernels' layouts and masking, in ``q``'s dtype (float64
    for tests): ``q`` ``[B*T, H*D]``, ``k``/``v`` ``[B, KVH, S, D]`` (S >= the longest length);
    returns ``out`` ``[B*T, H*D]`` and ``lse`` ``[B*T, H]``.

    Written as matmul + mask + softmax, independently of the kernels.

    >>> q, k = torch.randn(2 * 3, 4 * 8), torch.randn(2, 2, 5, 8)
    >>> out, lse = attention_reference(q, k, k, 0, [3, 2], heads=4, kv_heads=2, scale=8 ** -0.5)
    >>> out.shape, lse.shape
    (torch.Size([6, 32]), torch.Size([6, 4]))
    """
    batch, _, keys, dim = k.shape
    tokens = q.shape[0] // batch
    lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(batch)
    qh = q.reshape(batch, tokens, heads, dim).transpose(1, 2)  # [B, H, T, D]
    kh = k.repeat_interleave(heads // kv_heads, dim=1)  # [B, H, S, D]
    vh = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * scale  # [B, H, T, S]
    last = torch.minimum(pos + torch.arange(tokens).view(1, tokens, 1), (lengths - 1).view(batch, 1, 1))
    allowed = torch.arange(keys).view(1, 1, keys) <= last  # [B, T, S]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, T]
    out = torch.softmax(scores, dim=-1) @ vh  # [B, H, T, D]
    return (out.transpose(1, 2).reshape(batch * tokens, heads * dim),
            lse.transpose(1, 2).reshape(batch * tokens, heads))


# ---- backward ---------------------------------------------------------------------------------

BACKWARD_FILE = "attention_backward.wgsl"


@dataclass(frozen=True)
class BackwardTile:
    """The tile of the backward kernels (``attention_backward.wgsl``): ``fixed`` rows (``dq``)
    or keys (``dkdv``) a workgroup owns, ``looped`` keys (``dq``) or rows (``dkdv``) per tile of
    its loop, and ``lanes`` (KL) splitting the head dim in the score phase. Both kernels use
    ``(fixed / 4) * ceil(head_dim / 8)`` threads and the same workgroup memory: q and dO of the
    rows, k and v of the keys, the lanes' partial scores, P and dS."""

    fixed: int
    looped: int
    lanes: int

    def column_threads(self, head_dim: int) -> int:
        return (head_dim // 4 + 1) // 2

    def threads(self, head_dim: int) -> int:
        return self.fixed // 4 * self.column_threads(head_dim)

    def workgroup_bytes(self, head_dim: int) -> int:
        """Workgroup memory of ``dkdv`` (``dq``'s is a little less: no Pm)."""
        rows, keys = self.fixed, self.looped  # symmetric in rows and keys
        qst = head_dim // 4 + 1
        return 16 * qst * 2 * (rows + keys) + 4 * rows * keys * (2 * self.lanes + 2) + 12 * max(rows, keys)

    def valid(self) -> bool:
        return self.fixed % 4 == 0 and self.looped % 4 == 0 and self.fixed > 0 and self.looped > 0 and self.lanes > 0


# In order of preference, the first that fits the adapter is used. Sizes at head_dim 128:
# 43.2 KiB (NVIDIA's 48 KiB), 29.9 KiB (lavapipe's 32 KiB), 14.7 KiB (WebGPU's default 16 KiB).
# At head_dim 128 both kernels have 64 threads; the score phase has 4x4 blocks x lanes units:
# 64, 32 and 16 of them.
_BACKWARD_TILES = (BackwardTile(16, 16, 4), BackwardTile(16, 8, 4), BackwardTile(8, 4, 8), BackwardTile(4, 4, 8),
                   BackwardTile(4, 4, 4))


def backward_tiles(head_dim: int, device: Device | None = None) -> list[BackwardTile]:
    """Every backward tile that fits ``device``, in order of preference."""
    return _fitting(_BACKWARD_TILES, head_dim, device)


def backward_tile(head_dim: int, device: Device | None = None) -> BackwardTile:
    """The first backward tile whose workgroup memory and thread count fit ``device``."""
    return _first(backward_tiles(head_dim, device), "attention backward", head_dim)


def attention_backward_launches(q: Buffer, k_cache: Buffer, v_cache: Buffer, out: Buffer, lse: Buffer, d_out: Buffer,
                                d_q: Buffer, d_k: Buffer, d_v: Buffer, step: Buffer, lengths: Buffer, *, batch: int,
                                tokens: int, heads: int, kv_heads: int, head_dim: int, max_len: int, scale: float,
                                device: Device | None = None, tile: BackwardTile | None = None,
                                splits: int | None = None, from_start: bool = False,
                                scores: Buffer | None = None) -> list[Launch]:
    """The launches of one attention backward, to record in order.

    Inputs in the forward's layouts: ``q``, ``out`` (the forward's output) and ``d_out`` f32
    ``[batch*tokens, heads*head_dim]``; ``k_cache``/``v_cache`` f32 ``[batch, kv_heads, max_len,
    head_dim]``; ``lse`` f32 ``[batch*tokens, heads]`` (the forward's, natural log); ``step``
    u32 (position at ``STEP_POS``); ``lengths`` u32 ``[batch]``. Same masking as the forward.

    Outputs: ``d_q`` ``[batch*tokens, heads*head_dim]``, every row written; ``d_k``/``d_v``
    ``[batch, kv_heads, max_len, head_dim]``, written at key positions ``pos .. pos+tokens-1``
    (below ``max_len``) of every sequence, the sums over the group's query heads and every
    query of the pass (zero where no query attends, e.g. positions >= lengths[b]). Gradients of
    cache keys before ``pos`` are not computed.

    Flash-attention-2 style, three launches (four with splits): ``row_dot`` (D = rowsum(dO * O),
    into a scratch buffer allocated here and kept alive by the launches), ``dq`` (a workgroup per
    block of ``tile.fixed`` (query, head) rows of a KV head, looping over key tiles) and ``dkdv``
    (a workgroup per block of ``tile.fixed`` keys of a KV head, looping over every query tile of
    the group's heads that sees it: no atomics), cut into ``splits`` ranges of query tiles
    (``sum_splits`` by default), whose partial sums a fourth launch, ``dkdv_sum``, adds up.
    ``tile`` and ``splits`` override the chosen ones (tests, benchmarks); ``splits`` is also the
    GEMMs' below.

    ``from_start``: the caller promises that the pass's queries start at position 0 (training;
    a pass that does not gets NaN in every output). Then, where P of a pass fits
    ``SCORES_SCRATCH_BYTES``, P and dS are kept whole and dV, dK and dQ are GEMMs over them on the
    shared 8 × 8 tile (``_backward_from_saved_scores``: five launches after ``row_dot``, more with
    split sums), in place of ``dq`` and ``dkdv``, which recompute S and dP in tiles at about a
    tenth of the H200's float32 rate (BitNet-2B at seq 512, one layer on the H200: 360 µs against
    650). ``scores``: the buffer the forward's ``attention_launches`` kept P in; the backward then
    reads it instead of computing S again.
    """
    device = device or get_device()
    if head_dim % 4 or head_dim <= 0:
        raise ValueError(f"attention backward: head_dim must be a positive multiple of 4, got {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"attention backward: heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if min(batch, tokens, max_len) <= 0:
        raise ValueError("attention backward: batch, tokens and max_len must be positive")
    group, d4 = heads // kv_heads, head_dim // 4
    rows_total = batch * tokens * heads
    for name, buf in (("q", q), ("out", out), ("d_out", d_out), ("d_q", d_q)):
        _check_size(name, buf, rows_total * head_dim)
    for name, buf in (("k_cache", k_cache), ("v_cache", v_cache), ("d_k", d_k), ("d_v", d_v)):
        _check_size(name, buf, batch * kv_heads * max_len * head_dim)
    _check_size("lse", lse, rows_total)
    _check_size("lengths", lengths, batch)
    tile = tile or backward_tile(head_dim, device)
    if not tile.valid() or tile.workgroup_bytes(head_dim) > device.limits["max-compute-workgroup-storage-size"]:
        raise ValueError(f"attention backward: tile {tile} does not fit head_dim={head_dim} on this adapter")

    params = (batch, tokens, kv_heads, max_len, float(scale))
    rd = Buffer((rows_total,), "f32", device)
    lanes_per_row, row_threads = 8, 256
    row_dot = kernel(BACKWARD_FILE, "row_dot", device, D4=d4, R=group, RL=lanes_per_row, RW=row_threads)
    limit = device.max_workgroups

    def grid(workgroups: int) -> tuple[int, int, int]:  # a 1-D count as a 2-D grid within the limit
        return min(workgroups, limit), -(-workgroups // limit), 1

    launches = [Launch.build(row_dot, grid(-(-rows_total // (row_threads // lanes_per_row))),
                             {6: d_out, 12: out, 13: rd}, params)]
    kept_path = from_start and scores_kept_whole(batch, heads, tokens)
    _check_scores(scores, kept_path, batch, heads, tokens)
    if kept_path:
        kept = _KeptScores(batch, tokens, heads, kv_heads, head_dim, max_len, scale, device, scores)
        return launches + _backward_from_kept_scores(kept, q, k_cache, v_cache, lse, d_out, d_q, d_k, d_v, step,
                                                     lengths, rd, splits)
    ct = tile.column_threads(head_dim)
    key_blocks = -(-tokens // tile.fixed)
    splits = splits or sum_splits(key_blocks * kv_heads * batch, device)
    shape = dict(D4=d4, R=group, KL=tile.lanes, CT=ct, NT=tile.threads(head_dim))
    dq = kernel(BACKWARD_FILE, "dq", device, BQ=tile.fixed, BK=tile.looped, **shape)
    dkdv = kernel(BACKWARD_FILE, "dkdv", device, BQ=tile.looped, BK=tile.fixed, SPLITS=splits, **shape)
    common = {1: step, 2: lengths, 3: q, 4: k_cache, 5: v_cache, 6: d_out, 7: lse, 8: rd}
    launches.append(Launch.build(dq, (-(-tokens * group // tile.fixed), kv_heads, batch), {**common, 9: d_q}, params))
    if splits == 1:
        return launches + [Launch.build(dkdv, (key_blocks, kv_heads, batch), {**common, 10: d_k, 11: d_v}, params)]
    # each split's partial dK, dV in a slice of device-owned scratch (one per size: the layers of a
    # step run one after another), then summed into d_k, d_v
    size = batch * kv_heads * max_len * head_dim
    parts = device.owned(f"attention_dkdv_partials_{splits}x{size}",
                         lambda: (Buffer((splits * size,), "f32", device), Buffer((splits * size,), "f32", device)))
    total = kernel(BACKWARD_FILE, "dkdv_sum", device, D4=d4, SPLITS=splits)
    return launches + [
        Launch.build(dkdv, (key_blocks, kv_heads, batch * splits), {**common, 10: parts[0], 11: parts[1]}, params),
        Launch.build(total, grid(-(-size // (4 * 256))), {1: step, 10: d_k, 11: d_v, 14: parts[0], 15: parts[1]},
                     params),
    ]


@dataclass(frozen=True)
class _KeptScores:
    """The shapes and scratch of a pass whose score matrices are kept whole (``from_start``):
    S or P, and the backward's dS, ``[batch·heads·padded, padded]`` (device-owned, shared by the
    layers of a step, which run one after another), with ``padded`` = tokens rounded up to 64.
    ``probabilities``: the caller's buffer for S and P instead, which holds P from the forward
    until the backward (a training step's, one a layer)."""

    batch: int
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    max_len: int
    scale: float
    device: Device
    probabilities: Buffer | None = None

    @property
    def padded(self) -> int:
        return -(-self.tokens // 64) * 64

    def scratch(self, grads: bool = False) -> Buffer:
        """S or P (``probabilities`` where given; ``grads``: dS), device-owned per size."""
        if self.probabilities is not None and not grads:
            return self.probabilities
        size = kept_scores_bytes(self.batch, self.heads, self.tokens) // 4
        name = f"attention_{'score_grads' if grads else 'scores'}_{size}"
        return self.device.owned(name, lambda: Buffer((size,), "f32", self.device))

    def scores(self, mode: int, a: Buffer, cache: Buffer, lengths: Buffer, lse: Buffer, rd: Buffer) -> Launch:
        """``attention_scores.wgsl``: S = q·Kᵀ (mode 0; dS is not written) or dP = dO·Vᵀ, turning S
        into P and dS (mode 1) or, where the scores hold P already, into dS (mode 2)."""
        sc, ds = self.scratch(), (self.scratch(grads=True) if mode else dummy(self.device, "score_grads"))
        params = dict(tokens=self.batch * self.heads * self.padded, rows=self.head_dim, a_stride=self.head_dim,
                      padded=self.padded, seq=self.tokens, heads=self.heads, kv_heads=self.kv_heads,
                      max_len=self.max_len, scale=float(self.scale))
        grid = (self.padded // 64, self.batch * self.heads * self.padded // 64, 1)
        return Launch.build(kernel("attention_scores.wgsl", "gemm_tiled", self.device, MODE=mode), grid,
                            (lengths, a, cache, sc, ds, lse, rd), params)

    def softmax(self, step: Buffer, lengths: Buffer, lse: Buffer) -> Launch:
        """``attention_softmax.wgsl``: S into P in place, and the rows' lse."""
        params = dict(seq=self.tokens, heads=self.heads, padded=self.padded, max_len=self.max_len,
                      scale=float(self.scale))
        return Launch.build(kernel("attention_softmax.wgsl", "rows", self.device),
                            (self.tokens, self.batch * self.heads, 1), (step, lengths, self.scratch(), lse), params)

    def gemm(self, file: str, rows: int, buffers: tuple[Buffer, ...], params: dict,
             splits: int | None) -> list[Launch]:
        """``file``'s GEMM over ``rows`` output rows, its sums split where that fills a GPU;
        ``buffers``: (step, lengths, the kept P or dS, the other operand, the output)."""
        grid = (-(-self.head_dim // 64), rows // 64)
        count = splits or sum_splits(grid[0] * grid[1], self.device)
        part = dummy(self.device, "part")
        if count > 1:
            partials = count * rows * self.head_dim
            part = self.device.owned(f"attention_gemm_partials_{partials}",
                                     lambda: Buffer((partials,), "f32", self.device))
        out = [Launch.build(kernel(file, "gemm_tiled", self.device, SPLITS=count), (*grid, count),
                            (*buffers, part), params)]
        if count > 1:
            groups = -(-rows * self.head_dim // (4 * 256))  # an invocation a vec4
            limit = self.device.max_workgroups
            out.append(Launch.build(kernel(file, "split_sum", self.device, SPLITS=count),
                                    (min(groups, limit), -(-groups // limit), 1),
                                    {1: buffers[0], 5: buffers[4], 6: part}, params))  # step, the output
        return out

    def apply(self, scores: Buffer, cache: Buffer, out: Buffer, step: Buffer, lengths: Buffer, scale: float,
              splits: int | None) -> list[Launch]:
        """``attention_apply.wgsl``: out = scale · scores·cache (O = P·V, dQ = scale · dS·K)."""
        rows = self.batch * self.heads * self.padded
        return self.gemm("attention_apply.wgsl", rows, (step, lengths, scores, cache, out),
                         dict(tokens=rows, rows=self.tokens, a_stride=self.padded, padded=self.padded,
                              heads=self.heads, kv_heads=self.kv_heads, max_len=self.max_len,
                              head_dim=self.head_dim, scale=float(scale)), splits)

    def kv_grad(self, scores: Buffer, x: Buffer, out: Buffer, step: Buffer, lengths: Buffer, scale: float,
                splits: int | None) -> list[Launch]:
        """``attention_kv_grad.wgsl``: out = scale · scoresᵀ·x (dV = Pᵀ dO, dK = scale · dSᵀ q)."""
        rows = self.batch * self.kv_heads * self.padded
        return self.gemm("attention_kv_grad.wgsl", rows, (step, lengths, scores, x, out),
                         dict(tokens=rows, rows=self.tokens * (self.heads // self.kv_heads), a_stride=self.padded,
                              padded=self.padded, seq=self.tokens, heads=self.heads, kv_heads=self.kv_heads,
                              max_len=self.max_len, head_dim=self.head_dim, scale=float(scale)), splits)


def _forward_from_kept_scores(kept: _KeptScores, q: Buffer, k_cache: Buffer, v_cache: Buffer, out: Buffer,
                              step: Buffer, lengths: Buffer, lse: Buffer) -> list[Launch]:
    """S = q·Kᵀ kept whole, its rows' softmax in place (P, and lse), then O = P·V: a GEMM, a row
    kernel and a GEMM on the shared 8 × 8 tile where the flash kernel runs at about 13% of the
    float32 rate."""
    unused = dummy(kept.device)
    return [kept.scores(0, q, k_cache, lengths, unused, unused), kept.softmax(step, lengths, lse),
            *kept.apply(kept.scratch(), v_cache, out, step, lengths, 1.0, None)]


def _backward_from_kept_scores(kept: _KeptScores, q: Buffer, k_cache: Buffer, v_cache: Buffer, lse: Buffer,
                               d_out: Buffer, d_q: Buffer, d_k: Buffer, d_v: Buffer, step: Buffer, lengths: Buffer,
                               rd: Buffer, splits: int | None) -> list[Launch]:
    """After row_dot: P and dS of every causal pair kept whole (two launches of
    ``attention_scores.wgsl``: S again, then P and dS; one, dS, where ``kept.probabilities`` holds the
    forward's P), then dV = Pᵀ dO, dK = scale · dSᵀ q (``attention_kv_grad.wgsl``) and
    dQ = scale · dS k (``attention_apply.wgsl``), each a GEMM on the shared 8 × 8 tile whose sum is
    cut into ``splits`` ranges (``sum_splits`` by default) added up by a ``split_sum`` launch."""
    sc, ds = kept.scratch(), kept.scratch(grads=True)
    if kept.probabilities is not None:
        scores = [kept.scores(2, d_out, v_cache, lengths, lse, rd)]
    else:
        scores = [kept.scores(0, q, k_cache, lengths, lse, rd), kept.scores(1, d_out, v_cache, lengths, lse, rd)]
    return [*scores,
            *kept.kv_grad(sc, d_out, d_v, step, lengths, 1.0, splits),
            *kept.kv_grad(ds, q, d_k, step, lengths, kept.scale, splits),
            *kept.apply(ds, k_cache, d_q, step, lengths, kept.scale, splits)]


SCORES_SCRATCH_BYTES = 256 << 20  # a pass's largest S or P (and dS) kept whole (BitNet-2B at seq 512: 21 MB)
# The most a training step keeps of its layers' P from the forward to the backward, which then does
# not compute S again (BitNet-2B at seq 512: 30 layers × 21 MB; from 704 tokens, 1.2 GB, it recomputes)
KEPT_PROBABILITIES_BYTES = 1 << 30


def kept_scores_bytes(batch: int, heads: int, tokens: int) -> int:
    """Bytes of a pass's S or P (and of its dS) kept whole: a row of ``tokens`` rounded up to 64
    keys for each (sequence, head, query), the queries rounded up alike."""
    padded = -(-tokens // 64) * 64
    return 4 * batch * heads * padded * padded


def scores_kept_whole(batch: int, heads: int, tokens: int) -> bool:
    """Whether a pass from position 0 keeps its S or P whole (GEMMs over them) rather than running
    the flash kernels: where they fit ``SCORES_SCRATCH_BYTES``."""
    return kept_scores_bytes(batch, heads, tokens) <= SCORES_SCRATCH_BYTES


def keeps_probabilities(layers: int, batch: int, heads: int, tokens: int) -> bool:
    """Whether a training pass of ``layers`` layers keeps each layer's P for its backward (the
    ``scores`` buffers of ``attention_launches`` and ``attention_backward_launches``)."""
    return (scores_kept_whole(batch, heads, tokens)
            and layers * kept_scores_bytes(batch, heads, tokens) <= KEPT_PROBABILITIES_BYTES)


SPLIT_WORKGROUPS = 512  # workgroups a split sum aims at on a GPU (see sum_splits)


def sum_splits(workgroups: int, device: Device) -> int:
    """Into how many ranges a launch of ``workgroups`` cuts its long sums (``dkdv``'s query
    tiles, the backward GEMMs' reductions), each range's partial sums added up by another
    launch: on a GPU, the fewest (a power of two, at most 8) that give about SPLIT_WORKGROUPS
    workgroups; 1 on a CPU adapter, whose few cores the unsplit grid already fills.

    >>> # sum_splits(32 * 5, device)  # dkdv of BitNet-2B at seq 512 (32 key blocks × 5 KV heads): 4
    """
    if device.is_cpu:
        return 1
    splits = 1
    while splits < 8 and workgroups * splits < SPLIT_WORKGROUPS:
        splits *= 2
    return splits


def attention_backward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                 lse: torch.Tensor, d_out: torch.Tensor, pos: int,
                                 lengths: torch.Tensor | Sequence[int], heads: int, kv_heads: int,
                                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention backward from explicit formulas, in the kernels' layouts and ``q``'s dtype:
    ``q``, ``out``, ``d_out`` ``[B*T, H*D]``, ``k``/``v`` ``[B, KVH, S, D]``, ``lse`` ``[B*T, H]``;
    returns ``(d_q, d_k, d_v)``, ``d_k``/``d_v`` over all ``S`` key positions (zero where no
    query attends). P is recomputed from ``lse``, as the kernels do::

        P = exp(scale q·k - lse) (masked)   dV = Pᵀ dO   dS = P ∘ (dO vᵀ - rowsum(dO ∘ O))
        dQ = scale dS k                     dK = scale dSᵀ q    (summed over each group's heads)

    >>> q, k = torch.randn(2 * 3, 4 * 8, dtype=torch.float64), torch.randn(2, 2, 5, 8, dtype=torch.float64)
    >>> out, lse = attention_reference(q, k, k, 0, [3, 2], 4, 2, 8 ** -0.5)
    >>> dq, dk, dv = attention_backward_reference(q, k, k, out, lse, torch.ones_like(out), 0, [3, 2], 4, 2, 8 ** -0.5)
    >>> dq.shape, dk.shape, bool(dk[1, :, 2:].abs().max() == 0)
    (torch.Size([6, 32]), torch.Size([2, 2, 5, 8]), True)
    """
    batch, _, keys, dim = k.shape
    tokens, group = q.shape[0] // batch, heads // kv_heads
    lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(batch)

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [B*T, H*D] -> [B, H, T, D]
        return x.reshape(batch, tokens, heads, dim).transpose(1, 2)

    qh, oh, doh = heads_first(q), heads_first(out), heads_first(d_out)
    kh = k.repeat_interleave(group, dim=1)  # [B, H, S, D]
    vh = v.repeat_interleave(group, dim=1)
    last = torch.minimum(pos + torch.arange(tokens).view(1, tokens, 1), (lengths - 1).view(batch, 1, 1))
    allowed = (torch.arange(keys).view(1, 1, keys) <= last)[:, None]  # [B, 1, T, S]
    lse_h = lse.reshape(batch, tokens, heads).transpose(1, 2)[..., None]  # [B, H, T, 1]
    probs = torch.where(allowed, torch.exp(qh @ kh.transpose(-1, -2) * scale - lse_h), 0.0)
    d_v = probs.transpose(-1, -2) @ doh  # [B, H, S, D]
    delta = (doh * oh).sum(-1, keepdim=True)
    d_s = probs * (doh @ vh.transpose(-1, -2) - delta)
    d_q = scale * d_s @ kh
    d_k = scale * d_s.transpose(-1, -2) @ qh
    d_k = d_k.reshape(batch, kv_heads, group, keys, dim).sum(2)
    d_v = d_v.reshape(batch, kv_heads, group, keys, dim).sum(2)
    return d_q.transpose(1, 2).reshape(batch * tokens, heads * dim), d_k, d_v
