"""Flash decoding (``attention.wgsl`` ``decode_partial`` and ``decode_combine``): few query tokens
(typically 1) against a long cache, split over the keys so that a GPU is filled even with 5 KV
heads and one sequence.

The partial launch has a grid of (``splits``, 4-row blocks × KV heads, batch) workgroups of 256
threads; each attends to one span of the keys in 64-key tiles (8 threads per key for the scores,
one thread per (key lane, vec4 column) for P·V, every cache read coalesced) and writes unnormalised
sums and (max, sum) pairs (``DecodePartials``). The combine launch (a workgroup per output row)
merges the spans, unless the partials' reader merges them as it reads them (o_proj's GEMV,
``bitlinear_launch(attention=...)``).

How the keys are split: the split *count* is fixed at plan time (``decode_splits``, from
``max_len`` and the workgroups the adapter wants), and the span *size* is computed on the GPU at
every step from the lengths buffer, ``ceil(n / splits)`` rounded up to a 64-key tile (``n``: the
keys the row block sees). So every split takes a share of the current length, instead of fixed
slices of ``max_len`` where all but the first few workgroups would exit at short lengths, and no
indirect dispatch is needed. Workgroups whose span starts past ``n`` write neutral partials (zero
sums, max −1e30: weight 0) and exit, so a merge reads every span.

The split count is chosen for one sequence, whatever the batch, so that a sequence's keys are cut
into the same spans, and summed in the same order, alone and in a batch of any size (with
``max_len`` at least the sequence's own: a count capped by ``max_len`` gives 64-key spans, which
any larger count gives too). A sequence's generated tokens then do not depend on the batch it is
decoded in (``engine.generate``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ....runtime import Buffer, Device, Launch, get_device, kernel
from ...workspace import Workspace
from .. import dummy

__all__ = ["DecodePartials", "decode_launches", "decode_partials", "decode_splits"]

FILE = "attention.wgsl"
_DECODE_KEYS = 64  # decode_partial's key tile (DBK): spans are rounded up to it


def decode_splits(kv_heads: int, row_blocks: int, max_len: int, device: Device | None = None) -> int:
    """Key spans per decode row block: enough workgroups to fill the adapter (about 512 on a
    GPU, a few on a CPU adapter) with one sequence, at most one 64-key tile of ``max_len`` each."""
    device = device or get_device()
    target = 4 if device.is_cpu else 512
    want = -(-target // max(1, kv_heads * row_blocks))
    return max(1, min(want, -(-max_len // _DECODE_KEYS)))


@dataclass(frozen=True)
class DecodePartials:
    """What decode_partial writes for each of ``splits`` key spans: each row's unnormalised sums
    ``o`` (f32 [splits, rows, head_dim]) and (max, sum) pairs ``ml`` (f32 [splits, rows, 2]), rows
    in q's order (batch·tokens·heads; an empty span's are zeros and (−1e30, 0))."""

    o: Buffer
    ml: Buffer
    splits: int
    heads: int
    head_dim: int


def decode_partials(batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, max_len: int,
                    workspace: Workspace, splits: int | None = None) -> DecodePartials:
    """The partials' buffers of a decode pass (the workspace's scratch: the layers of a pass run one
    after another), with the split count ``decode_splits`` chooses."""
    splits = splits or decode_splits(kv_heads, -(-tokens * (heads // kv_heads) // 4), max_len, workspace.device)
    rows = batch * tokens * heads
    return DecodePartials(workspace.scratch("attention decode partial sums", (splits, rows, head_dim)),
                          workspace.scratch("attention decode partial maxima", (splits, rows, 2)),
                          splits, heads, head_dim)


def _decode_shape(d4: int) -> dict[str, int]:
    """decode_partial's override constants: 256 threads (more for head_dim > 1024), 8 lanes per
    key in the score phase, 64-key tiles, and the PV phase's key lanes."""
    threads = max(256, 1 << (d4 - 1).bit_length())  # D4 <= DNT: one PV column per thread
    lanes = 8
    while _DECODE_KEYS * lanes < threads:  # dRed also holds one row of the final reduction
        lanes *= 2
    return {"DNT": threads, "LPK": lanes, "DBK": _DECODE_KEYS, "DKL": min(threads // d4, _DECODE_KEYS)}


def decode_launches(q: Buffer, k_cache: Buffer, v_cache: Buffer, out: Buffer, starts: Buffer, lengths: Buffer,
                    lse: Buffer | None, *, batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int,
                    max_len: int, scale: float, splits: int | None, partials: DecodePartials | None,
                    workspace: Workspace) -> list[Launch]:
    """The partial launch, and the combine launch unless ``partials`` are given (their reader merges
    them: ``out`` is then not written)."""
    device = workspace.device
    group, d4 = heads // kv_heads, head_dim // 4
    merged = partials is None
    if partials is None:
        partials = decode_partials(batch, tokens, heads, kv_heads, head_dim, max_len, workspace, splits)
    elif lse is not None or (partials.heads, partials.head_dim) != (heads, head_dim) or \
            partials.o.numel < partials.splits * batch * tokens * heads * head_dim:
        raise ValueError(f"attention: partials for {partials.heads} heads of {partials.head_dim} do not fit "
                         f"{batch}×{tokens} rows of {heads} heads of {head_dim} (and give no lse)")
    splits, rows_total = partials.splits, batch * tokens * heads
    params = (batch, tokens, kv_heads, max_len, splits, int(lse is not None), float(scale))
    part = kernel(FILE, "decode_partial", device, D4=d4, R=group, **_decode_shape(d4))
    launches = [Launch.build(part, (splits, kv_heads * -(-tokens * group // 4), batch),
                             (starts, lengths, q, k_cache, v_cache, partials.o, partials.ml), params)]
    if merged:
        cwg = max(64, 1 << (d4 - 1).bit_length())
        combine = kernel(FILE, "decode_combine", device, D4=d4, R=group, CWG=cwg, CL=cwg // d4)
        limit = device.max_workgroups
        launches.append(Launch.build(combine, (min(rows_total, limit), -(-rows_total // limit), 1),
                                     {3: partials.o, 4: partials.ml, 5: out, 6: lse or dummy(device, "lse")},
                                     params))
    return launches
