"""The attention backward kernels (``attention_backward_launches``, wgsl/attention_backward.wgsl)
against float64 torch autograd through ``attention_reference``, fed with the forward kernels'
own ``out`` and ``lse``; and ``attention_backward_reference`` (explicit formulas) against the
same autograd.

Tolerance: float32 kernels against float64, max |ours - ref| <= 1e-4 * max |ref| per gradient.
The kernels recompute P = exp(scale·q·k - lse) from the forward's float32 lse (relative error
~|lse|·6e-8 ~ 1e-6 in P), scores are sums of head_dim <= 128 products, and each gradient sums
up to T·R <= 800 terms in another order than torch: about sqrt(n)·eps plus the lse error, ~1e-6
of the scale (at most ~2e-6 seen in these tests). 1e-4 leaves a wide margin while a masking,
indexing or group-summing bug gives errors of order 1.

Every run poisons the outputs (d_q, d_k, d_v, and the forward's out and lse) with NaN first, so
an element left unwritten fails, and the caches with NaN past each sequence's length, so a read
of a padded key fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_wgpu_lora.engine.kernels.attention import (BackwardTile, attention_backward_launches,
                                                      attention_backward_reference, attention_launches,
                                                      attention_reference, backward_tile, keeps_probabilities,
                                                      kept_scores_bytes, policy, sum_splits)
from torch_wgpu_lora.engine.kernels.attention.flash import BACKWARD_TILES
from torch_wgpu_lora.runtime import Buffer, Recorder, get_device, write

from .helpers import PACKED_ROWS, assert_close, kernel_workspace, nan_fill, nan_past, packed_positions

RTOL = 1e-4  # of the reference's max magnitude; see module docstring


def f32(x: torch.Tensor) -> torch.Tensor:
    """float64 values that float32 holds exactly: kernels and reference see the same inputs."""
    return x.float().double()


def random_case(batch, tokens, heads, kv_heads, head_dim, max_len, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch * tokens, heads * head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, max_len, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, max_len, head_dim, generator=g, dtype=torch.float64)
    d_out = torch.randn(batch * tokens, heads * head_dim, generator=g, dtype=torch.float64)
    return f32(q), f32(k), f32(v), f32(d_out)


def autograd_reference(q, k, v, d_out, pos, lengths, heads, kv_heads, scale, positions=None):
    """(d_q, d_k, d_v) by float64 autograd through the forward reference."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, _ = attention_reference(q, k, v, pos, lengths, heads, kv_heads, scale, positions)
    out.backward(d_out)
    return q.grad, k.grad, v.grad


class Backward:
    """One plan: the forward (prefill, with lse) then the backward, recorded together."""

    def __init__(self, batch, tokens, heads, kv_heads, head_dim, max_len, tile=None, splits=None, from_start=False,
                 keep_p=False, packed=False):
        self.shape = dict(batch=batch, tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                          max_len=max_len)
        scores = Buffer((kept_scores_bytes(batch, heads, tokens) // 4,)) if keep_p else None
        rows, cache = (batch * tokens, heads * head_dim), (batch, kv_heads, max_len, head_dim)
        self.q, self.out, self.d_out, self.d_q = (Buffer(rows) for _ in range(4))
        self.k, self.v, self.d_k, self.d_v = (Buffer(cache) for _ in range(4))
        self.lse = Buffer((batch * tokens, heads))
        self.starts = Buffer((batch,), "u32")
        self.lengths = Buffer((batch,), "u32")
        self.positions = Buffer((batch * tokens,), "u32") if packed else None
        scale, workspace = head_dim ** -0.5, kernel_workspace()
        self.launches = attention_launches(self.q, self.k, self.v, self.out, self.starts, self.lengths, scale=scale,
                                           lse=self.lse, from_start=from_start, scores=scores, workspace=workspace,
                                           positions=self.positions, **self.shape)
        self.launches += attention_backward_launches(self.q, self.k, self.v, self.out, self.lse, self.d_out, self.d_q,
                                                     self.d_k, self.d_v, self.starts, self.lengths, scale=scale,
                                                     tile=tile, splits=splits, from_start=from_start, scores=scores,
                                                     workspace=workspace, positions=self.positions, **self.shape)
        self.kernels = [launch.kernel.name for launch in self.launches]
        # P and dS kept whole (from_start), poisoned too: entries past a row's limit must not be read
        self.saved = [buf for launch in self.launches if launch.kernel.name.startswith("attention_scores")
                      for buf in launch.keep[3:5]]

    def run(self, q, k, v, d_out, pos, lengths, positions=None):
        """One pass, its sequences at ``pos`` (one int: all of them) with ``lengths`` valid keys (and
        a packed plan's position ids [batch, tokens])."""
        if self.positions is not None:
            write(self.positions, positions.numpy().astype(np.uint32).reshape(-1))
        write(self.q, np.ascontiguousarray(q.float().numpy()))
        write(self.d_out, np.ascontiguousarray(d_out.float().numpy()))
        write(self.k, nan_past(k, lengths))
        write(self.v, nan_past(v, lengths))
        write(self.starts, np.asarray(starts_of(pos, len(lengths)), np.uint32))
        write(self.lengths, np.asarray(lengths, np.uint32))
        for buf in (self.out, self.lse, self.d_q, self.d_k, self.d_v, *self.saved):
            nan_fill(buf)
        rec = Recorder()
        for launch in self.launches:
            rec.launch(launch)
        got = []
        for buf in (self.d_q, self.d_k, self.d_v):
            got.append(np.zeros(buf.shape, np.float32))
            rec.read(buf, got[-1])
        rec.submit()
        return got


def starts_of(pos, batch: int) -> list[int]:
    """Each sequence's first position: ``pos`` one int (all of them) or one per sequence."""
    return [pos] * batch if isinstance(pos, int) else list(pos)


def check(plan: Backward, pos, lengths, seed=0, positions=None) -> float:
    """Runs ``plan`` on random inputs; checks every gradient; returns the worst relative error."""
    s = plan.shape
    batch, tokens, heads, kv_heads, head_dim = (s[n] for n in ("batch", "tokens", "heads", "kv_heads", "head_dim"))
    q, k, v, d_out = random_case(batch, tokens, heads, kv_heads, head_dim, s["max_len"], seed)
    d_q, d_k, d_v = plan.run(q, k, v, d_out, pos, lengths, positions)
    ref_q, ref_k, ref_v = autograd_reference(q, k, v, d_out, pos, lengths, heads, kv_heads, head_dim ** -0.5,
                                             positions)
    tag = (f"B={batch} T={tokens} H={heads}/{kv_heads} D={head_dim} pos={pos} lengths={lengths} "
           f"positions={None if positions is None else positions.tolist()}")
    # dQ and dK are sums of scale·dS·k (·q) with dS = P(dO·v − dO·O): all zero when every row sees
    # one key (O = v), a cancellation float32 meets only to its rounding when the two dots are
    # summed in different orders (the GEMM path). Their scale is then that of the terms.
    terms = head_dim ** -0.5 * float(d_out.abs().max() * v.abs().max() * max(q.abs().max(), k.abs().max()))
    errors = [assert_close(d_q, ref_q, RTOL, f"d_q {tag}", terms)]
    for b, (start, n) in enumerate(zip(starts_of(pos, batch), lengths)):
        written = slice(start, start + tokens)  # the key positions of this pass
        errors += [assert_close(d_k[b, :, written], ref_k[b, :, written], RTOL, f"d_k {tag}", terms),
                   assert_close(d_v[b, :, written], ref_v[b, :, written], RTOL, f"d_v {tag}")]
        # padded keys: exactly zero
        assert (d_k[b, :, max(n, start): start + tokens] == 0).all(), f"d_k of padded keys {tag}"
        assert (d_v[b, :, max(n, start): start + tokens] == 0).all(), f"d_v of padded keys {tag}"
        # nothing written outside this pass's key positions (the cache prefix, rows past start + T)
        assert np.isnan(d_k[b, :, :start]).all() and np.isnan(d_v[b, :, :start]).all(), tag
        assert np.isnan(d_k[b, :, start + tokens:]).all() and np.isnan(d_v[b, :, start + tokens:]).all(), tag
    return max(errors)


def check_once(batch, tokens, heads, kv_heads, head_dim, pos, lengths, *, seed=0, max_len=None, tile=None,
               splits=None, from_start=False, positions=None, keep_p=False) -> float:
    plan = Backward(batch, tokens, heads, kv_heads, head_dim, max_len or max(starts_of(pos, batch)) + tokens,
                    tile=tile, splits=splits, from_start=from_start, keep_p=keep_p, packed=positions is not None)
    assert ("attention_apply.wgsl:gemm_tiled" in plan.kernels) == from_start
    assert ("attention_backward.wgsl:dq" in plan.kernels) != from_start
    return check(plan, pos, lengths, seed, positions)


# ---- the reference ----------------------------------------------------------------------------

@pytest.mark.parametrize("heads,kv_heads,pos,lengths", [(4, 4, 0, [9, 1, 5]), (8, 2, 4, [13, 6, 4]),
                                                        (20, 5, 0, [9, 9, 2])])
def test_reference_matches_autograd(heads, kv_heads, pos, lengths):
    dim, tokens, scale = 12, 9, 12 ** -0.5
    q, k, v, d_out = random_case(3, tokens, heads, kv_heads, dim, pos + tokens, seed=heads)
    out, lse = attention_reference(q, k, v, pos, lengths, heads, kv_heads, scale)
    ours = attention_backward_reference(q, k, v, out, lse, d_out, pos, lengths, heads, kv_heads, scale)
    for mine, ref in zip(ours, autograd_reference(q, k, v, d_out, pos, lengths, heads, kv_heads, scale)):
        assert mine.shape == ref.shape
        assert (mine - ref).abs().max() <= 1e-12 * ref.abs().max()


def test_reference_of_packed_rows_matches_autograd():
    dim, heads, kv_heads, scale = 12, 4, 2, 12 ** -0.5
    positions = packed_positions(PACKED_ROWS["short"])
    batch, tokens = positions.shape
    q, k, v, d_out = random_case(batch, tokens, heads, kv_heads, dim, tokens, seed=5)
    lengths = [tokens] * batch
    out, lse = attention_reference(q, k, v, 0, lengths, heads, kv_heads, scale, positions)
    ours = attention_backward_reference(q, k, v, out, lse, d_out, 0, lengths, heads, kv_heads, scale, positions)
    for mine, ref in zip(ours, autograd_reference(q, k, v, d_out, 0, lengths, heads, kv_heads, scale, positions)):
        assert (mine - ref).abs().max() <= 1e-12 * ref.abs().max()


# ---- the kernels --------------------------------------------------------------------------------

CASES = {
    # name: (batch, tokens, heads, kv_heads, head_dim, pos, lengths)
    "padded_gqa2_d12": (3, 37, 4, 2, 12, 0, [37, 1, 20]),  # right padding: lengths T, 1 and between
    "one_token_d8": (2, 1, 2, 2, 8, 0, [1, 1]),  # one key each: d_q = d_k = 0, d_v = d_out
    "one_token_after_prefix_gqa2_d8": (2, 1, 4, 2, 8, 6, [7, 3]),  # key 6 written; sequence 1 padded there
    "few_tokens_gqa4_d8": (3, 5, 4, 1, 8, 0, [5, 1, 3]),
    "mha_d64_200": (1, 200, 2, 2, 64, 0, [200]),
    "padded_gqa4_d64": (2, 130, 8, 2, 64, 0, [130, 67]),
    "bitnet_heads_d128": (2, 70, 20, 5, 128, 0, [70, 1]),
    "gqa2_d128_200": (1, 200, 4, 2, 128, 0, [200]),
    "after_prefix_gqa4_d20": (2, 30, 4, 1, 20, 13, [43, 25]),  # keys pos..pos+T-1 written; one padded
    "rows_at_their_own_positions": (3, 9, 4, 2, 16, [0, 5, 20], [9, 12, 29]),  # one padded
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_matches_autograd(case):
    check_once(*CASES[case])


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("case", ["bitnet_heads_d128", "after_prefix_gqa4_d20", "rows_at_their_own_positions"])
def test_dkdv_split_over_query_tiles(case, splits):
    # each key block's query tiles cut into ranges summed by dkdv_sum: uneven (3) and more ranges
    # than some blocks have tiles (8: empty ranges write zeros), after a cache prefix too
    check_once(*CASES[case], splits=splits)


@pytest.mark.parametrize("splits", [None, 3, 8])
@pytest.mark.parametrize("case", sorted(name for name, c in CASES.items() if c[5] == 0))
def test_gradients_as_gemms_over_p_and_ds_kept_whole(case, splits):
    # passes from position 0 (training): P and dS of every causal pair kept, dV, dK and dQ GEMMs
    # over them; rows of a head past T (padded to 64) and keys a row does not see are never summed.
    # Their sums cut into ranges (GPUs; uneven, and more ranges than some tiles have steps)
    check_once(*CASES[case], from_start=True, splits=splits)


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("case", sorted(name for name, c in CASES.items() if c[5] == 0))
def test_gradients_over_p_kept_from_the_forward(case, splits):
    # a training step's layer keeps the forward's P in its own buffer: the backward reads it (one
    # scores launch, dS, where it would compute S and then P and dS in two)
    plan = Backward(*CASES[case][:5], CASES[case][5] + CASES[case][1], splits=splits, from_start=True, keep_p=True)
    assert plan.kernels.count("attention_scores.wgsl:gemm_tiled") == 2  # the forward's S, the backward's dS
    check(plan, 0, CASES[case][6])


@pytest.mark.parametrize("path", ["flash", "flash, dK/dV split", "kept", "kept, P from the forward"])
@pytest.mark.parametrize("rows,heads,kv_heads,head_dim", [("short", 4, 2, 12), ("short", 2, 2, 8),
                                                          ("long", 8, 2, 64), ("long", 20, 5, 128)])
def test_packed_gradients_stay_within_each_example(rows, heads, kv_heads, head_dim, path):
    # several examples a row, each numbered from 0 (one, two and three a row, of one token, and the
    # padding as one more): every query's P is zero outside its example, so no gradient crosses
    positions = packed_positions(PACKED_ROWS[rows])
    batch, tokens = positions.shape
    check_once(batch, tokens, heads, kv_heads, head_dim, 0, [tokens] * batch, positions=positions, seed=head_dim,
               from_start=path.startswith("kept"), keep_p=path.endswith("forward"),
               splits=3 if path.endswith("split") else None)


def test_a_scores_buffer_is_refused_where_it_would_not_be_used(monkeypatch):
    args = Backward(2, 8, 4, 2, 8, 8, from_start=True)
    shape = dict(batch=2, tokens=8, heads=4, kv_heads=2, head_dim=8, max_len=8)
    common = (args.q, args.k, args.v, args.out, args.starts, args.lengths)
    ws = kernel_workspace()
    with pytest.raises(ValueError, match="scores has 32767 elements, needs 32768"):  # 2 · 4 heads of 64 × 64
        attention_launches(*common, scale=1.0, from_start=True, scores=Buffer((32767,)), workspace=ws, **shape)
    with pytest.raises(ValueError, match="only used by a training pass"):
        attention_launches(*common, scale=1.0, scores=Buffer((32768,)), workspace=ws, **shape)  # not from the start
    with pytest.raises(ValueError, match="only used by a training pass"):
        attention_backward_launches(args.q, args.k, args.v, args.out, args.lse, args.d_out, args.d_q, args.d_k,
                                    args.d_v, args.starts, args.lengths, scale=1.0, scores=Buffer((32768,)),
                                    workspace=ws, **shape)
    monkeypatch.setattr(policy, "SCORES_SCRATCH_BYTES", 4 * 32768 - 4)  # S would not be kept whole
    with pytest.raises(ValueError, match="only used by a training pass"):
        attention_launches(*common, scale=1.0, from_start=True, scores=Buffer((32768,)), workspace=ws, **shape)


def test_a_training_step_keeps_p_while_every_layers_fit_the_budget(monkeypatch):
    assert keeps_probabilities(30, 1, 20, 640) and not keeps_probabilities(30, 1, 20, 704)
    assert not keeps_probabilities(30, 2, 20, 512)  # two sequences: 1.26 GB
    size = kept_scores_bytes(1, 20, 512)
    monkeypatch.setattr(policy, "SCORES_SCRATCH_BYTES", size - 1)  # one layer's P past the scratch
    assert not keeps_probabilities(1, 1, 20, 512)


def test_scores_kept_whole_give_nan_after_a_prefix_and_give_way_past_their_scratch(monkeypatch):
    # P and dS cover only this pass's keys: a pass that does not start at 0 must not look right
    plan = Backward(2, 30, 4, 1, 20, 43, from_start=True)
    q, k, v, d_out = random_case(2, 30, 4, 1, 20, 43, seed=1)
    d_q, d_k, d_v = plan.run(q, k, v, d_out, 13, [43, 25])
    assert np.isnan(d_q).all() and np.isnan(d_k).all() and np.isnan(d_v).all()
    monkeypatch.setattr(policy, "SCORES_SCRATCH_BYTES", 4 * 2 * 8 * 64 * 64 - 4)  # one float short of P
    plan = Backward(2, 40, 8, 2, 16, 40, from_start=True)
    assert "attention_backward.wgsl:dq" in plan.kernels and "attention_apply.wgsl:gemm_tiled" not in plan.kernels
    check(plan, 0, [40, 9])


def test_sum_splits_fill_a_gpu_and_leave_a_cpu_alone():
    class Adapter:
        def __init__(self, is_cpu):
            self.is_cpu = is_cpu
    assert sum_splits(32 * 5, Adapter(False)) == 4  # BitNet-2B at seq 512: 160 workgroups → 640
    assert sum_splits(4096, Adapter(False)) == 1
    assert sum_splits(1, Adapter(False)) == 8
    assert sum_splits(1, Adapter(True)) == 1


def test_every_tile_that_fits_the_adapter():
    # the tiles smaller devices get (WebGPU's default 16 KiB) must be right too, and odd lane counts
    limit = get_device().limits["max-compute-workgroup-storage-size"]
    positions = packed_positions(PACKED_ROWS["long"])  # and packed rows
    for tile in BACKWARD_TILES + (BackwardTile(12, 8, 3), BackwardTile(4, 12, 1)):
        for head_dim, heads, kv_heads in ((64, 8, 2), (20, 3, 3)):
            if tile.workgroup_bytes(head_dim) <= limit:
                check_once(2, 45, heads, kv_heads, head_dim, 0, [45, 7], tile=tile, seed=tile.fixed)
                check_once(*positions.shape, heads, kv_heads, head_dim, 0, [70] * 4, positions=positions, tile=tile)
    assert backward_tile(128).workgroup_bytes(128) <= limit
    assert BACKWARD_TILES[0].workgroup_bytes(128) <= 48 * 1024  # NVIDIA's limit: the big tile for BitNet
    assert any(t.workgroup_bytes(128) <= 16 * 1024 for t in BACKWARD_TILES)  # WebGPU's default limit


def test_plan_reused_with_new_lengths():
    # one plan, the step and lengths buffers rewritten between runs (as the engine does)
    plan = Backward(2, 24, 4, 2, 16, 24)
    for seed, lengths in enumerate(([24, 1], [3, 24], [24, 24])):
        check(plan, 0, lengths, seed=seed)


def test_bad_shapes_are_refused():
    rows, cache = Buffer((4, 40)), Buffer((1, 2, 4, 10))
    bufs = [rows, cache, cache, rows, Buffer((4, 4)), rows, rows, cache, cache, Buffer((4,), "u32"),
            Buffer((1,), "u32")]
    with pytest.raises(ValueError, match="multiple of 4"):
        attention_backward_launches(*bufs, batch=1, tokens=4, heads=4, kv_heads=2, head_dim=10, max_len=4, scale=1.0,
                                    workspace=kernel_workspace())
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        attention_backward_launches(*bufs, batch=1, tokens=4, heads=3, kv_heads=2, head_dim=8, max_len=4, scale=1.0,
                                    workspace=kernel_workspace())
    with pytest.raises(ValueError, match="d_k has|k_cache has"):
        attention_backward_launches(*bufs, batch=1, tokens=4, heads=4, kv_heads=2, head_dim=8, max_len=8, scale=1.0,
                                    workspace=kernel_workspace())
