"""The causal GQA attention kernels (engine/kernels/attention/: flash, decode, kept scores) against
``attention_reference`` in float64, and the reference against transformers' eager attention.

Tolerance: float32 kernels against float64 torch, max |ours - ref| <= 1e-4 * max |ref| per
output. float32 keeps 24 bits (eps 6e-8); a score is a sum of head_dim <= 128 products, the
softmax renormalises in a different order (online, tile by tile) and the output is a sum of
up to ~300 weighted values, so rounding grows to about sqrt(n)·eps ~ 1e-6 of the scale
(at most 4.4e-7 in these tests); 1e-4 leaves a wide margin while any masking, indexing
or rescaling bug gives errors of order 1.

Every run poisons the outputs with NaN first (so an element left unwritten fails) and the
caches with NaN past each sequence's length (so a key read past the length fails).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_wgpu_lora.engine.kernels.attention import (PrefillTile, attention_launches, attention_reference,
                                                      kept_scores_bytes, policy, prefill_tile)
from torch_wgpu_lora.engine.kernels.attention.flash import PREFILL_TILES
from torch_wgpu_lora.runtime import Buffer, Recorder, get_device, write

from .helpers import PACKED_ROWS, assert_close, kernel_workspace, nan_fill, nan_past, packed_positions

RTOL = 1e-4  # of the reference's max magnitude; see module docstring


def random_case(batch, tokens, heads, kv_heads, head_dim, max_len, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch * tokens, heads * head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, max_len, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, max_len, head_dim, generator=g, dtype=torch.float64)
    return q, k, v


class Attention:
    """Buffers and launches of one attention plan; ``run`` writes inputs, records, reads back."""

    def __init__(self, batch, tokens, heads, kv_heads, head_dim, max_len, *, decode=False, lse=True, packed=False,
                 **kw):
        self.shape = dict(batch=batch, tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                          max_len=max_len)
        self.q = Buffer((batch * tokens, heads * head_dim))
        self.k = Buffer((batch, kv_heads, max_len, head_dim))
        self.v = Buffer((batch, kv_heads, max_len, head_dim))
        self.out = Buffer((batch * tokens, heads * head_dim))
        self.lse = Buffer((batch * tokens, heads)) if lse else None
        self.starts = Buffer((batch,), "u32")
        self.lengths = Buffer((batch,), "u32")
        self.positions = Buffer((batch * tokens,), "u32") if packed else None
        self.launches = attention_launches(self.q, self.k, self.v, self.out, self.starts, self.lengths,
                                           scale=head_dim ** -0.5, lse=self.lse, decode=decode,
                                           positions=self.positions, workspace=kernel_workspace(), **self.shape, **kw)

    def set_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, poison_from) -> None:
        write(self.q, np.ascontiguousarray(q.float().numpy()))
        write(self.k, nan_past(k, poison_from))
        write(self.v, nan_past(v, poison_from))

    def run(self, starts, lengths, positions=None) -> tuple[np.ndarray, np.ndarray | None]:
        """One pass, its sequences at ``starts`` (one int: all of them) with ``lengths`` valid keys
        (and a packed plan's position ids [batch, tokens])."""
        starts = [starts] * self.shape["batch"] if isinstance(starts, int) else starts
        write(self.starts, np.asarray(starts, np.uint32))
        write(self.lengths, np.asarray(lengths, np.uint32))
        if self.positions is not None:
            write(self.positions, positions.numpy().astype(np.uint32).reshape(-1))
        nan_fill(self.out)
        out = np.zeros(self.out.shape, np.float32)
        lse = None
        rec = Recorder()
        for launch in self.launches:
            rec.launch(launch)
        rec.read(self.out, out)
        if self.lse is not None:
            nan_fill(self.lse)
            lse = np.zeros(self.lse.shape, np.float32)
            rec.read(self.lse, lse)
        rec.submit()
        return out, lse


def check_once(batch, tokens, heads, kv_heads, head_dim, pos, lengths, *, decode=False, seed=0, max_len=None,
               positions=None, **kw):
    """The kernels against the reference, the sequences at ``pos`` (one int, or one per sequence);
    ``positions``: a packed pass's position ids [batch, tokens]."""
    max_len = max_len or max(np.max(pos) + tokens, max(lengths))
    q, k, v = random_case(batch, tokens, heads, kv_heads, head_dim, max_len, seed)
    attn = Attention(batch, tokens, heads, kv_heads, head_dim, max_len, decode=decode,
                     packed=positions is not None, **kw)
    attn.set_inputs(q, k, v, lengths)
    out, lse = attn.run(pos, lengths, positions)
    ref_out, ref_lse = attention_reference(q, k, v, pos, lengths, heads, kv_heads, head_dim ** -0.5, positions)
    tag = (f"B={batch} T={tokens} H={heads}/{kv_heads} D={head_dim} pos={pos} lengths={lengths} decode={decode} "
           f"positions={None if positions is None else positions.tolist()} {kw}")
    return assert_close(out, ref_out, RTOL, f"out {tag}"), assert_close(lse, ref_lse, RTOL, f"lse {tag}")


# ---- the reference --------------------------------------------------------------------------

@pytest.mark.parametrize("heads,kv_heads,pos", [(4, 4, 0), (8, 2, 5), (20, 5, 3)])
def test_reference_matches_transformers_eager_attention(heads, kv_heads, pos):
    from transformers.models.bitnet.modeling_bitnet import eager_attention_forward

    batch, tokens, dim = 3, 9, 16
    lengths = [pos + tokens, pos + 1, pos + 4]  # right padding: one full, one of a single token
    q, k, v = random_case(batch, tokens, heads, kv_heads, dim, pos + tokens, seed=heads)
    ref_out, ref_lse = attention_reference(q, k, v, pos, lengths, heads, kv_heads, dim ** -0.5)

    # HF's 4-D additive mask for causal + right padding: key j is seen by query i (at position
    # pos + i) when j <= pos + i and j is not padding (j < length).
    keys = torch.arange(pos + tokens)
    allowed = (keys[None, None, :] <= (pos + torch.arange(tokens))[None, :, None]) & \
        (keys[None, None, :] < torch.tensor(lengths)[:, None, None])
    mask = torch.zeros(batch, 1, tokens, pos + tokens, dtype=torch.float64)
    mask.masked_fill_(~allowed[:, None], torch.finfo(torch.float64).min)
    module = torch.nn.Module().eval()
    module.num_key_value_groups = heads // kv_heads
    query = q.view(batch, tokens, heads, dim).transpose(1, 2)
    hf_out, hf_weights = eager_attention_forward(module, query, k, v, mask, scaling=dim ** -0.5)
    # HF's softmax runs in float32 whatever the input dtype: agreement to float32 rounding
    hf_out = hf_out.reshape(batch * tokens, heads * dim)
    assert (hf_out - ref_out).abs().max() <= 1e-6 * ref_out.abs().max()
    # the lse is the log of the softmax's denominator: exp(s - lse) are HF's weights
    scores = (query @ k.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2)) * dim ** -0.5
    weights = torch.exp(scores - ref_lse.view(batch, tokens, heads).transpose(1, 2)[..., None]) * allowed[:, None]
    assert (weights - hf_weights).abs().max() <= 1e-6


# ---- prefill -------------------------------------------------------------------------------

PREFILL_CASES = {
    # name: (batch, tokens, heads, kv_heads, head_dim, pos, lengths)
    "padded_gqa2_d20": (3, 37, 4, 2, 20, 0, [37, 1, 20]),  # lengths T, 1 and in between
    "one_token_d8": (2, 1, 2, 2, 8, 0, [1, 1]),
    "after_prefix_gqa4_d12": (2, 50, 8, 2, 12, 13, [63, 40]),  # keys 0..pos+T-1; one padded
    "long_mha_d64": (1, 300, 4, 4, 64, 0, [300]),
    "long_gqa4_d64": (2, 260, 8, 2, 64, 0, [260, 131]),
    "bitnet_heads_d128": (2, 70, 20, 5, 128, 6, [76, 33]),
    "rows_at_their_own_positions": (3, 9, 4, 2, 16, [0, 5, 20], [9, 12, 29]),  # one padded
}


@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_matches_reference(case):
    check_once(*PREFILL_CASES[case])


def test_prefill_every_tile_that_fits_the_adapter():
    # the tiles smaller devices get (16 KiB of workgroup memory) must be right too
    limit = get_device().limits["max-compute-workgroup-storage-size"]
    chosen = prefill_tile(64)
    positions = packed_positions(PACKED_ROWS["long"])  # and packed rows
    for tile in PREFILL_TILES + (PrefillTile(2, 16, 4),):  # and 4 key lanes (odd D4: one lane idle)
        for head_dim in (64, 20):
            if tile.workgroup_bytes(head_dim) <= limit:
                check_once(2, 45, 8, 2, head_dim, 3, [48, 7], tile=tile)
                check_once(*positions.shape, 8, 2, head_dim, 0, [70] * 4, positions=positions, tile=tile)
    assert chosen.workgroup_bytes(64) <= limit
    assert PREFILL_TILES[0].workgroup_bytes(128) <= 48 * 1024  # NVIDIA's limit: the big tile for BitNet
    assert any(t.workgroup_bytes(128) <= 16 * 1024 for t in PREFILL_TILES)  # WebGPU's default limit


FROM_START_CASES = {name: case for name, case in PREFILL_CASES.items() if np.max(case[5]) == 0}


@pytest.mark.parametrize("case", sorted(FROM_START_CASES))
def test_a_pass_from_position_0_keeps_its_scores_whole(case):
    # training's forward: S, its softmax in place and O = P·V as GEMMs, not the flash kernel
    batch, tokens, heads, kv_heads, head_dim, pos, lengths = FROM_START_CASES[case]
    attn = Attention(batch, tokens, heads, kv_heads, head_dim, tokens, from_start=True)
    assert [launch.kernel.name for launch in attn.launches][:2] == ["attention_scores.wgsl:gemm_tiled",
                                                                    "attention_softmax.wgsl:rows"]
    check_once(*FROM_START_CASES[case], from_start=True)
    check_once(*FROM_START_CASES[case], from_start=True, max_len=tokens + 5)  # a cache longer than the pass


def test_a_pass_from_start_gives_nan_after_a_prefix_and_gives_way_past_its_scratch(monkeypatch):
    q, k, v = random_case(2, 30, 4, 2, 20, 43, seed=3)
    attn = Attention(2, 30, 4, 2, 20, 43, from_start=True)
    attn.set_inputs(q, k, v, [43, 25])
    out, lse = attn.run([0, 13], [30, 25])  # keys before the pass have no scores: NaN, not a wrong value
    assert np.isnan(out[30:]).all() and np.isnan(lse[30:]).all()
    ref_out, ref_lse = attention_reference(q[:30], k[:1], v[:1], 0, [30], 4, 2, 20 ** -0.5)
    assert_close(out[:30], ref_out, RTOL, "the sequence from position 0")
    monkeypatch.setattr(policy, "SCORES_SCRATCH_BYTES", kept_scores_bytes(2, 8, 40) - 4)
    attn = Attention(2, 40, 8, 2, 16, 40, from_start=True)
    assert [launch.kernel.name for launch in attn.launches] == ["attention.wgsl:prefill"]
    check_once(2, 40, 8, 2, 16, 0, [40, 9], from_start=True)


def test_prefill_without_lse_and_rows_not_filling_a_block():
    # 3 queries x 1 head: 3 rows in a 32-row block; no lse buffer given
    q, k, v = random_case(2, 3, 3, 3, 16, 3, seed=1)
    for from_start in (False, True):
        attn = Attention(2, 3, 3, 3, 16, 3, lse=False, from_start=from_start)
        attn.set_inputs(q, k, v, [3, 2])
        out, lse = attn.run(0, [3, 2])
        assert lse is None
        assert_close(out, attention_reference(q, k, v, 0, [3, 2], 3, 3, 0.25)[0], RTOL,
                     f"out from_start={from_start}")


# ---- packed passes ---------------------------------------------------------------------------

def test_the_reference_keeps_packed_examples_apart_as_transformers_masks_do():
    # transformers' own mask for packed position ids (no attention mask): each query sees the
    # causal keys of its own example; the reference's lse is the log of that softmax's denominator
    from transformers import BitNetConfig
    from transformers.masking_utils import create_causal_mask
    from transformers.models.bitnet.modeling_bitnet import eager_attention_forward

    heads, kv_heads, dim = 4, 2, 8
    positions = packed_positions(PACKED_ROWS["short"])
    batch, tokens = positions.shape
    q, k, v = random_case(batch, tokens, heads, kv_heads, dim, tokens, seed=11)
    config = BitNetConfig(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=kv_heads)
    config._attn_implementation = "eager"
    mask = create_causal_mask(config=config, inputs_embeds=torch.zeros(batch, tokens, 1, dtype=torch.float64),
                              attention_mask=None, cache=None, position_ids=positions)
    module = torch.nn.Module().eval()
    module.num_key_value_groups = heads // kv_heads
    query = q.view(batch, tokens, heads, dim).transpose(1, 2)
    hf_out, _ = eager_attention_forward(module, query, k, v, mask, scaling=dim ** -0.5)
    ref_out, _ = attention_reference(q, k, v, 0, [tokens] * batch, heads, kv_heads, dim ** -0.5, positions)
    # HF's softmax runs in float32 whatever the input dtype: agreement to float32 rounding
    assert (hf_out.reshape(batch * tokens, heads * dim) - ref_out).abs().max() <= 1e-6 * ref_out.abs().max()
    unpacked, _ = attention_reference(q, k, v, 0, [tokens] * batch, heads, kv_heads, dim ** -0.5)
    assert (unpacked - ref_out).abs().max() > 0.1  # attention across the examples would differ


@pytest.mark.parametrize("from_start", [False, True])  # the flash kernel; the scores kept whole
@pytest.mark.parametrize("rows,heads,kv_heads,head_dim", [("short", 4, 2, 20), ("short", 2, 2, 8),
                                                          ("long", 8, 2, 64), ("long", 20, 5, 128)])
def test_packed_queries_attend_within_their_own_example(rows, heads, kv_heads, head_dim, from_start):
    # several examples a row, each numbered from 0: a query sees the causal keys of its own example
    # only; the rows run over their whole length (the padding is one more example)
    positions = packed_positions(PACKED_ROWS[rows])
    batch, tokens = positions.shape
    check_once(batch, tokens, heads, kv_heads, head_dim, 0, [tokens] * batch, positions=positions,
               from_start=from_start, seed=head_dim)


def test_position_ids_are_refused_when_decoding():
    with pytest.raises(ValueError, match="position_ids .packed passes. are a prompt's or a training pass's"):
        Attention(1, 1, 4, 2, 8, 8, decode=True, packed=True)


# ---- decode --------------------------------------------------------------------------------

@pytest.mark.parametrize("splits", [None, 3, 5])  # None: the default (1 on a CPU adapter)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 8, 2, 64), (3, 4, 2, 20)])
def test_decode_steps_record_the_same_launches(splits, tokens, heads, kv_heads, head_dim):
    # One plan; per step the host rewrites only the step and lengths buffers. Sequence 0 grows
    # with pos; sequence 1 stopped at length 40 (its queries then see keys 0..39); sequence 2
    # grows too. Steps cross 64-key tile and split boundaries.
    batch, max_len = 3, 300
    q, k, v = random_case(batch, tokens, heads, kv_heads, head_dim, max_len, seed=tokens + head_dim)
    attn = Attention(batch, tokens, heads, kv_heads, head_dim, max_len, decode=True, splits=splits)
    last = 200 + tokens
    attn.set_inputs(q, k, v, [last, 40, last])  # NaN past the longest length any step uses
    previous = None
    for pos in (0, 39, 63, 64, 127, 150, 200):
        lengths = [pos + tokens, min(40, pos + tokens), pos + tokens]
        out, lse = attn.run(pos, lengths)
        ref_out, ref_lse = attention_reference(q, k, v, pos, lengths, heads, kv_heads, head_dim ** -0.5)
        assert_close(out, ref_out, RTOL, f"out pos={pos} splits={splits}")
        assert_close(lse, ref_lse, RTOL, f"lse pos={pos} splits={splits}")
        if previous is not None:
            assert not np.allclose(out[:tokens], previous[:tokens]), f"pos={pos}: output did not change"
        previous = out


def test_decode_rows_at_their_own_positions_and_a_finished_row():
    # Sequences of different lengths decode together, each at its own position; a finished row
    # (length 0, as the sampler leaves it) is read as one key: attention costs it one tile.
    starts, lengths = [3, 70, 0, 130, 9], [4, 71, 1, 131, 0]
    q, k, v = random_case(5, 1, 8, 2, 64, 160, seed=4)
    attn = Attention(5, 1, 8, 2, 64, 160, decode=True)
    attn.set_inputs(q, k, v, [4, 71, 1, 131, 1])  # NaN past each length: the finished row's past key 0
    out, lse = attn.run(starts, lengths)
    ref_out, ref_lse = attention_reference(q, k, v, starts, [4, 71, 1, 131, 1], 8, 2, 64 ** -0.5)
    assert_close(out, ref_out, RTOL, "out")
    assert_close(lse, ref_lse, RTOL, "lse")


def test_a_sequences_decode_output_does_not_depend_on_its_batch():
    # The key spans are chosen per sequence: alone (its own cache length) or beside others (a
    # longer cache), a sequence's keys are summed in the same spans, so its output is bitwise
    # the same (what makes generation's tokens independent of the batch).
    heads, kv_heads, d, n = 4, 2, 32, 150
    q, k, v = random_case(3, 1, heads, kv_heads, d, 400, seed=6)
    together = Attention(3, 1, heads, kv_heads, d, 400, decode=True)
    together.set_inputs(q, k, v, [300, n, 400])
    out, lse = together.run([299, n - 1, 399], [300, n, 400])
    alone = Attention(1, 1, heads, kv_heads, d, n, decode=True)
    alone.set_inputs(q[1:2], k[1:2, :, :n], v[1:2, :, :n], [n])
    out_alone, lse_alone = alone.run(n - 1, [n])
    assert np.array_equal(out[1:2], out_alone) and np.array_equal(lse[1:2], lse_alone)


def test_decode_bitnet_shape_long_cache():
    # BitNet-2B's heads (20 query, 5 KV, head_dim 128), a long cache, batch 2 of unequal lengths
    check_once(2, 1, 20, 5, 128, 999, [1000, 321], decode=True, max_len=1024)


def test_one_token_against_a_long_cache_by_the_flash_and_the_decoding_kernels():
    for decode in (False, True):
        check_once(2, 1, 4, 2, 32, 89, [90, 61], decode=decode, seed=7, **(dict(splits=3) if decode else {}))


# ---- coverage and errors ----------------------------------------------------------------------

def test_every_output_element_is_written():
    # shapes whose rows fill no block evenly (R=2, T=5: 10 rows; D=12: 3 vec4 columns, CT=1); run()
    # poisons out and lse with NaN first, and assert_close refuses any element not finite
    for decode in (False, True):
        check_once(3, 5, 6, 3, 12, 15, [20, 1, 9], decode=decode, seed=3, max_len=20)


def test_bad_shapes_are_refused():
    bufs = [Buffer((4, 40)), Buffer((1, 2, 4, 10)), Buffer((1, 2, 4, 10)), Buffer((4, 40)), Buffer((4,), "u32"),
            Buffer((1,), "u32")]
    with pytest.raises(ValueError, match="multiple of 4"):
        attention_launches(*bufs, batch=1, tokens=4, heads=4, kv_heads=2, head_dim=10, max_len=4, scale=1.0, workspace=kernel_workspace())
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        attention_launches(*bufs, batch=1, tokens=4, heads=3, kv_heads=2, head_dim=8, max_len=4, scale=1.0, workspace=kernel_workspace())
    with pytest.raises(ValueError, match="k_cache has"):
        attention_launches(*bufs, batch=1, tokens=4, heads=4, kv_heads=2, head_dim=8, max_len=8, scale=1.0, workspace=kernel_workspace())
