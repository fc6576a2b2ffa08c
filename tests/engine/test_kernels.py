"""The engine's kernel families against their torch references: packing, BitLinear (gemv and
gemm, every epilogue, LoRA segments), float matmuls (f32 and bf16 weights), RMSNorm with
activation quantisation and LoRA down-projections, embedding gather, RoPE, rows scattered into
chosen rows (a prompt's KV cache and decode state joining a running generation).

Tolerances. Integer paths are exact: the ternary × int8 dots must equal the float64 reference
to the last bit before scaling, so BitLinear outputs are compared at 2e-6 relative (one or two
float32 roundings of the scale step). Float paths (float32 kernels against float64 torch, sums
of up to a few thousand terms in another order) at 1e-5 of the reference's largest magnitude:
about 30× the expected √K·eps, while any indexing bug gives O(1) errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_wgpu_lora.engine.config import pad
from torch_wgpu_lora.engine.kernels.bitlinear import bitlinear_launch, bitlinear_reference
from torch_wgpu_lora.engine.kernels.embedding import (embedding_launches, embedding_reference, gather_rows_launch,
                                                      gather_rows_reference)
from torch_wgpu_lora.engine.kernels.ffn import gate_up_reference
from torch_wgpu_lora.engine.kernels.matmul import matmul_launch, matmul_reference
from torch_wgpu_lora.engine.kernels.norm import quantise_reference, rmsnorm_launch, rmsnorm_reference
from torch_wgpu_lora.engine.kernels.projection import lora_table
from torch_wgpu_lora.engine.kernels.rope import RopeTarget, rope_launch, rope_reference
from torch_wgpu_lora.engine.kernels.scatter import (kv_rows_launch, move_rows_launch, move_rows_reference,
                                                    scatter_rows_launch, scatter_rows_reference)
from torch_wgpu_lora.engine.weights import Projection, float_rows, pack_ternary, unpack_hf, unpack_ternary
from torch_wgpu_lora.runtime import upload

from .helpers import PACKED_ROWS, assert_close, assert_codes_round, kernel_workspace, nan_fill, packed_positions, poisoned, run

FLOAT_RTOL = 1e-5  # see module docstring
INT_RTOL = 2e-6


# -- packing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 16, 63, 64, 100, 2560])
def test_ternary_packing_round_trips(k):
    g = torch.Generator().manual_seed(k)
    values = torch.randint(-1, 2, (5, k), generator=g, dtype=torch.int8)
    packed = pack_ternary(values)
    assert packed.shape == (5, pad(k, 64) // 16) and packed.dtype == np.uint32
    assert torch.equal(unpack_ternary(packed, k), values)
    assert torch.equal(unpack_ternary(packed, pad(k, 64))[:, k:], torch.zeros(5, pad(k, 64) - k, dtype=torch.int8))


def test_our_reading_of_transformers_packed_weights_is_theirs():
    from transformers.integrations.bitnet import pack_weights, unpack_weights

    g = torch.Generator().manual_seed(0)
    values = torch.randint(-1, 2, (24, 40), generator=g).float()
    packed = pack_weights(values.clone())
    assert torch.equal(unpack_hf(packed, 24), values.to(torch.int8))
    with torch.compiler.set_stance("force_eager"):
        assert torch.equal(unpack_weights(packed, torch.float32), values)


# -- BitLinear ----------------------------------------------------------------------------------

def _codes(tokens: int, k: int, g: torch.Generator):
    """Random int8 codes as norm.wgsl lays them out: packed rows, scales, sums."""
    codes = torch.randint(-128, 128, (tokens, k), generator=g, dtype=torch.int32)
    codes[0, : min(k, 3)] = torch.tensor([-128, 127, 0])[: min(k, 3)]  # the extremes
    padded = np.zeros((tokens, pad(k, 64)), np.int8)
    padded[:, :k] = codes.numpy()
    scales = (torch.rand(tokens, generator=g) * 3 + 0.1).float()
    meta = np.concatenate([scales.numpy(), codes.sum(1).numpy().astype(np.int32).view(np.float32)])
    return codes, scales, upload(padded.view(np.uint32).copy()), upload(meta.astype(np.float32))


# BitLinear's two kernels, gemm with each of its tiles (gemm_tile_tokens: 32 tokens on GPUs, 64 on CPU adapters)
PATHS = {"gemv": dict(gemv=True), "gemm": dict(gemv=False, tile_tokens=64), "gemm32": dict(gemv=False, tile_tokens=32)}


def _projection(values: torch.Tensor, row_scales: torch.Tensor, divide: bool) -> Projection:
    return Projection(upload(pack_ternary(values)), upload(row_scales.numpy().astype(np.float32)), values.shape[0],
                      values.shape[1], divide)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("tokens,k,rows", [(1, 64, 8), (3, 100, 37), (70, 2560, 130), (5, 6912, 24)])
def test_bitlinear_store_matches_the_exact_integer_reference(path, divide, tokens, k, rows):
    g = torch.Generator().manual_seed(tokens * 1000 + k + rows)
    codes, scales, xq, xm = _codes(tokens, k, g)
    values = torch.randint(-1, 2, (rows, k), generator=g, dtype=torch.int8)
    row_scales = torch.rand(rows, generator=g) + 0.5
    out = poisoned((tokens, rows + 3))
    (launch,) = bitlinear_launch(xq, xm, _projection(values, row_scales, divide), out, tokens=tokens,
                                 out_stride=rows + 3, out_offset=2, **PATHS[path])
    (got,) = run([launch], out)
    ref = bitlinear_reference(codes, scales, values, row_scales, divide)
    assert_close(got[:, 2:rows + 2], ref, INT_RTOL, "bitlinear")
    assert torch.isnan(got[:, :2]).all() and torch.isnan(got[:, rows + 2:]).all()  # only its columns written


@pytest.mark.parametrize("path", list(PATHS))
def test_bitlinear_adds_into_a_residual_stream(path):
    g = torch.Generator().manual_seed(1)
    tokens, k, rows = 9, 192, 40
    codes, scales, xq, xm = _codes(tokens, k, g)
    values = torch.randint(-1, 2, (rows, k), generator=g, dtype=torch.int8)
    row_scales = torch.rand(rows, generator=g) + 0.5
    residual = torch.randn(tokens, rows, generator=g)
    out = upload(residual.numpy())
    (launch,) = bitlinear_launch(xq, xm, _projection(values, row_scales, True), out, tokens=tokens, out_stride=rows,
                                 mode="add", **PATHS[path])
    (got,) = run([launch, launch], out)  # twice: it adds, never overwrites
    assert_close(got, residual.double() + 2 * bitlinear_reference(codes, scales, values, row_scales, True), INT_RTOL,
                 "residual")
    # with aux (rows padded past the output's width), the sums are kept there too: the same values
    out, aux = upload(residual.numpy()), poisoned((tokens, rows + 24))
    (keep,) = bitlinear_launch(xq, xm, _projection(values, row_scales, True), out, tokens=tokens, out_stride=rows,
                               mode="add", saved=aux, **PATHS[path])
    got, kept = run([keep], out, aux)
    assert_close(got, residual.double() + bitlinear_reference(codes, scales, values, row_scales, True), INT_RTOL,
                 "residual")
    assert torch.equal(kept[:, :rows], got) and kept[:, rows:].isnan().all()


@pytest.mark.parametrize("path", list(PATHS))
def test_bitlinear_gate_up_pairs_with_lora_and_saved_pairs(path):
    g = torch.Generator().manual_seed(2)
    tokens, k, f, rank = 6, 128, 20, 3
    codes, scales, xq, xm = _codes(tokens, k, g)
    values = torch.randint(-1, 2, (2 * f, k), generator=g, dtype=torch.int8)  # gate j at 2j, up j at 2j+1
    row_scales = torch.rand(2 * f, generator=g) + 0.5
    h = torch.randn(tokens, 2 * rank, generator=g)
    B_gate, B_up = torch.randn(f, rank, generator=g), torch.randn(f, rank, generator=g)
    lb = np.concatenate([np.zeros(5, np.float32), B_gate.numpy().ravel(), B_up.numpy().ravel()])
    table = lora_table([(0, 2 * f, 2, 0, 0.5, 5, rank), (1, 2 * f, 2, rank, 2.0, 5 + f * rank, rank)])
    out, aux = poisoned((tokens, f)), poisoned((tokens, 2 * f))
    (launch,) = bitlinear_launch(xq, xm, _projection(values, row_scales, False), out, tokens=tokens, out_stride=f,
                                 mode="gate_up", h=upload(h.numpy()), lora_rank=2 * rank, lora=upload(table),
                                 lora_b=upload(lb),
                                 segments=2, saved=aux, **PATHS[path])
    got, saved = run([launch], out, aux)
    raw = bitlinear_reference(codes, scales, values, row_scales, False)
    raw[:, 0::2] += 0.5 * h[:, :rank].double() @ B_gate.double().T
    raw[:, 1::2] += 2.0 * h[:, rank:].double() @ B_up.double().T
    assert_close(saved, raw, 1e-5, "saved gate/up")
    assert_close(got, gate_up_reference(raw), 1e-5, "relu² gate · up")


@pytest.mark.parametrize("path", list(PATHS))
def test_bitlinear_lora_segments_on_a_fused_qkv(path):
    # q rows [0, 8), k [8, 12), v [12, 16): adapters on q and v read columns 0.. and 4.. of h.
    g = torch.Generator().manual_seed(3)
    tokens, k = 5, 64
    codes, scales, xq, xm = _codes(tokens, k, g)
    values = torch.randint(-1, 2, (16, k), generator=g, dtype=torch.int8)
    row_scales = torch.rand(16, generator=g) + 0.5
    h = torch.randn(tokens, 6, generator=g)
    Bq, Bv = torch.randn(8, 4, generator=g), torch.randn(4, 2, generator=g)
    lb = np.concatenate([Bv.numpy().ravel(), Bq.numpy().ravel()])  # any offsets into LB
    table = lora_table([(0, 8, 1, 0, 1.5, Bv.numel(), 4), (12, 16, 1, 4, 0.25, 0, 2)])
    out = poisoned((tokens, 16))
    (launch,) = bitlinear_launch(xq, xm, _projection(values, row_scales, True), out, tokens=tokens, out_stride=16,
                                 h=upload(h.numpy()), lora_rank=6, lora=upload(table), lora_b=upload(lb), segments=2,
                                 **PATHS[path])
    (got,) = run([launch], out)
    ref = bitlinear_reference(codes, scales, values, row_scales, True)
    ref[:, :8] += 1.5 * h[:, :4].double() @ Bq.double().T
    ref[:, 12:] += 0.25 * h[:, 4:].double() @ Bv.double().T
    assert_close(got, ref, 1e-5, "qkv with LoRA")


# -- decoding's fused GEMV: its own RMSNorm and quantisation, the RoPE epilogue ------------------

def _norm_module(k: int, g: torch.Generator):
    from transformers.models.bitnet.modeling_bitnet import BitNetRMSNorm

    norm = BitNetRMSNorm(k, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=g) + 0.5)
    return norm


def _assert_codes_round(codes: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> None:
    """The kernel's codes are transformers' y rounded at the kernel's own scale, except at ties: our
    sum of squares runs in another order, so y may differ from torch's by a few ulps (≤ 1e-6
    relative), which moves y·s (|y·s| ≤ 127) by at most 2e-4, and a code may round the other
    way only where y·s is that close to a half."""
    v = y.double() * scale.double()[:, None]
    exact = v.round().clamp(-128, 127)
    flips = codes != exact
    near_half = ((v - v.floor()) - 0.5).abs() < 2e-4
    assert not (flips & ~near_half).any(), f"{int((flips & ~near_half).sum())} codes differ away from a tie"
    assert (codes - exact).abs().max() <= 1


@pytest.mark.parametrize("mode", ["store", "add"])
@pytest.mark.parametrize("tokens,k,rows", [(1, 64, 8), (3, 100, 37), (2, 2560, 130), (1, 4096, 24), (2, 6912, 20)])
def test_gemv_normalises_and_quantises_its_own_input(tokens, k, rows, mode, reductions):
    g = torch.Generator().manual_seed(tokens + k + rows)
    x = torch.randn(tokens, k + 5, generator=g) * 3  # rows of k + 5: only the first k are features
    norm = _norm_module(k, g)
    values = torch.randint(-1, 2, (rows, k), generator=g, dtype=torch.int8)
    row_scales = torch.rand(rows, generator=g) + 0.5
    residual = torch.randn(tokens, rows, generator=g)
    out = upload(residual.numpy()) if mode == "add" else poisoned((tokens, rows))
    codes, meta = poisoned((tokens, pad(k, 64) // 4), "u32"), poisoned((2 * tokens,))
    (launch,) = bitlinear_launch(codes, meta, _projection(values, row_scales, True), out, tokens=tokens, out_stride=rows,
                                 mode=mode, gemv=True,
                                 norm=(upload(x.numpy()), upload(norm.weight.detach().numpy()), 1e-5))
    got, got_codes, got_meta = run([launch], out, codes, meta)
    with torch.no_grad():
        y = norm(x[:, :k])  # transformers' own module
    ours = torch.from_numpy(got_codes.numpy().view(np.int8).reshape(tokens, -1).astype(np.int64))
    assert not ours[:, k:].any()  # the padding's codes are zero
    ours, scale = ours[:, :k], got_meta[:tokens]
    assert_close(scale, quantise_reference(y)[1], 1e-6, "scales")  # 127 / max|y|: the few ulps above
    _assert_codes_round(ours, y, scale)
    assert np.array_equal(got_meta[tokens:].numpy().view(np.int32), ours.sum(1).numpy())
    ref = bitlinear_reference(ours, scale, values, row_scales, True)
    if mode == "add":
        ref += residual.double()
    assert_close(got, ref, INT_RTOL, "projection of its own codes")


@pytest.mark.parametrize("path", ["codes", "norm"])
def test_gemv_rope_epilogue_rotates_q_and_fills_the_caches(path):
    rope_epilogue_case(path)


def rope_epilogue_case(path: str) -> None:
    """Two sequences of two tokens, at positions 3, 4 and 7, 8: q, k rotated by transformers' rule,
    k and v into the caches, with Q/V adapters on the fused rows (as a decoding q/k/v projection),
    against float64. ``path``: the GEMV on given codes ("codes"), the GEMV normalising its input
    ("norm"), the matrix units' GEMM in three ranges of K, rotated by its split epilogue
    ("matrix-units")."""
    from transformers import BitNetConfig
    from transformers.models.bitnet.modeling_bitnet import BitNetRotaryEmbedding, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(8)
    batch, T, heads, kv_heads, d, cache_len, starts, k = 2, 2, 4, 2, 16, 12, [3, 7], 128
    q_size, kv_size = heads * d, kv_heads * d
    rows = q_size + 2 * kv_size
    config = BitNetConfig(hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=cache_len)
    cos, sin = BitNetRotaryEmbedding(config)(torch.zeros(1), torch.arange(cache_len)[None])
    values = torch.randint(-1, 2, (rows, k), generator=g, dtype=torch.int8)
    row_scales = torch.rand(rows, generator=g) + 0.5
    h = torch.randn(batch * T, 6, generator=g)
    Bq, Bv = torch.randn(q_size, 4, generator=g), torch.randn(kv_size, 2, generator=g)
    lb = np.concatenate([Bv.numpy().ravel(), Bq.numpy().ravel()])
    table = lora_table([(0, q_size, 1, 0, 1.5, Bv.numel(), 4), (q_size + kv_size, rows, 1, 4, 0.25, 0, 2)])
    k_cache, v_cache = (upload(np.zeros((batch, kv_heads, cache_len, d), np.float32)) for _ in range(2))
    target = RopeTarget(upload(cos[0, :, : d // 2].contiguous().numpy()),
                        upload(sin[0, :, : d // 2].contiguous().numpy()), upload(np.array(starts, np.uint32)),
                        k_cache, v_cache, heads, kv_heads, d, T)
    q_rot = poisoned((batch * T, q_size))
    options = dict(tokens=batch * T, out_stride=q_size, mode="rope", rope=target, h=upload(h.numpy()),
                   lora_rank=6, lora=upload(table), lora_b=upload(lb), segments=2,
                   **(dict(gemv=False, mma=True, splits=3, workspace=kernel_workspace()) if path == "matrix-units"
                      else dict(gemv=True)))
    if path == "norm":
        x = torch.randn(batch * T, k, generator=g)
        norm = _norm_module(k, g)
        xq, xm = poisoned((batch * T, k // 4), "u32"), poisoned((2 * batch * T,))
        (launch,) = bitlinear_launch(xq, xm, _projection(values, row_scales, True), q_rot,
                                     norm=(upload(x.numpy()), upload(norm.weight.detach().numpy()), 1e-5), **options)
        got_q, got_k, got_v, got_codes, got_meta = run([launch], q_rot, k_cache, v_cache, xq, xm)
        codes = torch.from_numpy(got_codes.numpy().view(np.int8).reshape(batch * T, -1).astype(np.int64))
        scales = got_meta[:batch * T]
        with torch.no_grad():
            _assert_codes_round(codes, norm(x), scales)
    else:
        codes, scales, xq, xm = _codes(batch * T, k, g)
        launches = bitlinear_launch(xq, xm, _projection(values, row_scales, True), q_rot, **options)
        assert [launch.kernel.name for launch in launches] == (
            ["bitlinear_mma.wgsl:gemm", "bitlinear_mma.wgsl:split_epilogue_rope"] if path == "matrix-units"
            else ["bitlinear.wgsl:gemv_rope"])
        got_q, got_k, got_v = run(launches, q_rot, k_cache, v_cache)
    raw = bitlinear_reference(codes, scales, values, row_scales, True)
    raw[:, :q_size] += 1.5 * h[:, :4].double() @ Bq.double().T
    raw[:, q_size + kv_size:] += 0.25 * h[:, 4:].double() @ Bv.double().T
    q = raw[:, :q_size].reshape(batch, T, heads, d).transpose(1, 2)
    k_ = raw[:, q_size:q_size + kv_size].reshape(batch, T, kv_heads, d).transpose(1, 2)
    v = raw[:, q_size + kv_size:].reshape(batch, T, kv_heads, d).transpose(1, 2)
    got_q = got_q.reshape(batch, T, heads, d).transpose(1, 2)
    for b, pos in enumerate(starts):
        positions = slice(pos, pos + T)
        q_ref, k_ref = apply_rotary_pos_emb(q[b:b + 1], k_[b:b + 1], cos[:, positions].double(),
                                            sin[:, positions].double())
        assert_close(got_q[b:b + 1], q_ref, 1e-5, f"q of sequence {b}")
        assert_close(got_k[b:b + 1, :, positions], k_ref, 1e-5, f"k of sequence {b}")
        assert_close(got_v[b, :, positions], v[b], 1e-5, f"v of sequence {b}")
        assert not got_k[b, :, :pos].any() and not got_k[b, :, pos + T:].any()  # nothing outside its positions
        assert not got_v[b, :, :pos].any() and not got_v[b, :, pos + T:].any()


DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM = 4, 2, 16


def _decoded_attention(keys: list[int], g: torch.Generator):
    """A decode step's attention for len(keys) sequences, each query at the end of its keys, over 4
    key spans (with few keys some are empty: their partials must weigh 0, though the scratch starts
    as NaN): the partials, the one launch writing them (their reader merges them: no combine
    launch), and the float64 attention output."""
    from torch_wgpu_lora.engine.kernels.attention import attention_launches, attention_reference, decode_partials

    batch, heads, kv_heads, d, max_len = len(keys), DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM, 256
    q = torch.randn(batch, heads * d, generator=g)
    caches = [torch.randn(batch, kv_heads, max_len, d, generator=g) for _ in range(2)]
    starts, lengths = upload(np.array(keys, np.uint32) - 1), upload(np.array(keys, np.uint32))
    workspace = kernel_workspace()
    partials = decode_partials(batch, 1, heads, kv_heads, d, max_len, workspace, splits=4)
    for buf in (partials.o, partials.ml):
        nan_fill(buf)
    attend = attention_launches(upload(q.numpy()), *(upload(c.numpy()) for c in caches), poisoned((batch, heads * d)),
                                starts, lengths, batch=batch, tokens=1, heads=heads, kv_heads=kv_heads, head_dim=d,
                                max_len=max_len, scale=d ** -0.5, decode=True, partials=partials, workspace=workspace)
    assert len(attend) == 1
    attended, _ = attention_reference(q.double(), caches[0].double(), caches[1].double(),
                                      [n - 1 for n in keys], keys, heads, kv_heads, d ** -0.5)
    return partials, attend, attended


@pytest.mark.parametrize("rank", [0, 5])
@pytest.mark.parametrize("length", [5, 200])
def test_rmsnorm_normalises_attention_partials_merged_as_it_reads_them(length, rank):
    # the o norm of a decoded batch fed attention's decode partials over 4 key spans (at length 5
    # three are empty, weighing 0 though the scratch starts as NaN): the merged rows normalised,
    # their codes and, with LoRA, h against float64 attention and transformers' module
    batch, heads, d = 6, DECODE_HEADS, DECODE_HEAD_DIM
    g = torch.Generator().manual_seed(length + rank)
    partials, attend, attended = _decoded_attention([max(1, length - i) for i in range(batch)], g)
    norm = _norm_module(heads * d, g)
    A = torch.randn(max(rank, 1), heads * d, generator=g)
    xn, codes, meta, h = (poisoned((batch, heads * d)), poisoned((batch, heads * d // 4), "u32"),
                          poisoned((2 * batch,)), poisoned((batch, max(rank, 1))))
    launch = rmsnorm_launch(poisoned((batch, heads * d)), upload(norm.weight.detach().numpy()), xn, tokens=batch,
                            k=heads * d, eps=1e-5, codes=codes, scales_and_sums=meta, lora_a=upload(A.numpy()), h=h,
                            rank=rank, attention=partials)
    assert launch.kernel.name == "norm.wgsl:rmsnorm_partials"
    got_xn, got_codes, got_meta, got_h = run(attend + [launch], xn, codes, meta, h)
    with torch.no_grad():
        y = norm(attended.float())  # transformers' module on the merged output (float32)
    # attention's float32 output differs from float64 torch by ~1e-6 relative (the existing GEMV
    # merge's test): the normalised rows within 1e-5 of their largest
    assert_close(got_xn, y, 1e-5, "normalised merged rows")
    assert_codes_round(got_codes, got_meta, got_xn, heads * d)
    if rank:
        assert_close(got_h, y.double() @ A.double().T, 1e-5, "h = y·Aᵀ")
    with pytest.raises(ValueError, match="attention partials"):
        rmsnorm_launch(xn, upload(norm.weight.detach().numpy()), xn, tokens=batch, k=heads * d - 4, eps=1e-5,
                       codes=codes, scales_and_sums=meta, attention=partials)


@pytest.mark.parametrize("length", [5, 70, 200])
def test_gemv_normalises_attention_partials_merged_as_it_reads_them(length):
    # o_proj's decode GEMV fed attention's decode partials over 4 key spans: at length 5 three
    # are empty (their partials must weigh 0: the scratch starts as NaN), at 200 none is
    batch, heads, d, rows = 2, DECODE_HEADS, DECODE_HEAD_DIM, 24
    g = torch.Generator().manual_seed(length)
    partials, attend, attended = _decoded_attention([length, max(1, length - 3)], g)
    norm = _norm_module(heads * d, g)
    values = torch.randint(-1, 2, (rows, heads * d), generator=g, dtype=torch.int8)
    row_scales = torch.rand(rows, generator=g) + 0.5
    codes, meta = poisoned((batch, heads * d // 4), "u32"), poisoned((2 * batch,))
    out = poisoned((batch, rows))
    (project,) = bitlinear_launch(codes, meta, _projection(values, row_scales, True), out, tokens=batch, out_stride=rows,
                                  gemv=True, norm=(poisoned((batch, heads * d)), upload(norm.weight.detach().numpy()),
                                                1e-5), attention=partials)
    got, got_codes, got_meta = run(attend + [project], out, codes, meta)
    with torch.no_grad():
        y = norm(attended.float())  # transformers' module on the merged output (float32)
    ours = torch.from_numpy(got_codes.numpy().view(np.int8).reshape(batch, -1).astype(np.int64))
    scale = got_meta[:batch]
    assert_close(scale, quantise_reference(y)[1], 1e-5, "scales")  # the merge's rounding moves max|y| by ~1e-6
    v = y.double() * scale.double()[:, None]
    flips = ours != v.round().clamp(-128, 127)
    # attention's float32 output differs from float64 torch by ~1e-6 relative: y·s by < 2e-3 code units
    assert not (flips & ((v - v.floor() - 0.5).abs() >= 2e-3)).any()
    assert flips.sum() <= 2 and (ours - v.round()).abs().max() <= 1
    assert_close(got, bitlinear_reference(ours, scale, values, row_scales, True), INT_RTOL, "projection of the merged codes")
    with pytest.raises(ValueError, match="attention partials"):
        bitlinear_launch(codes, meta, _projection(values, row_scales, True), out, tokens=batch, out_stride=rows,
                         gemv=True, attention=partials)


# -- the GEMV's token groups: each token's values are the one-token GEMV's, bit for bit ----------

GROUPED_TOKENS, GROUPED_K = 11, 640  # groups of 3 or 8 leave a short last one; 10 weight words a row


def _grouped_case(kind: str):
    """A GEMV launch of ``kind`` (an entry point and epilogue) over GROUPED_TOKENS tokens, inputs
    fixed: returns make(**shape) -> the launch's outputs (fresh poisoned buffers each call), for
    ``shape`` = bitlinear_launch's gemv options (lanes, group, spread)."""
    from torch_wgpu_lora.engine.kernels.attention import DecodePartials

    g = torch.Generator().manual_seed(len(kind))
    tokens, k = GROUPED_TOKENS, GROUPED_K
    codes, scales, xq, xm = _codes(tokens, k, g)
    heads, kv_heads, d = 4, 2, 16  # rope: 128 fused rows
    rows = {"gate_up": 40, "rope": 128, "norm_rope": 128}.get(kind, 37)  # 37: past the workgroups' edge
    projection = _projection(torch.randint(-1, 2, (rows, k), generator=g, dtype=torch.int8),
                             torch.rand(rows, generator=g) + 0.5, kind != "add")
    h = upload(torch.randn(tokens, 6, generator=g).numpy())
    b = upload(torch.randn(rows * 6, generator=g).numpy())
    # two adapters' segments: every other row (gate or up) from 0, and a span past the first workgroup
    table = upload(lora_table([(0, rows, 2, 0, 0.5, 0, 4), (rows - 13, rows, 1, 4, 1.5, 4 * rows, 2)]))
    lora = dict(h=h, lora_rank=6, lora=table, lora_b=b, segments=2)
    width = rows // 2 if kind == "gate_up" else rows
    residual = torch.randn(tokens, width, generator=g).numpy()
    x = upload((torch.randn(tokens, k + 5, generator=g) * 3).numpy())
    weight = upload((torch.rand(k, generator=g) + 0.5).numpy())
    cos, sin = (upload(torch.randn(12, d // 2, generator=g).numpy()) for _ in range(2))
    starts = upload(torch.randint(0, 12, (tokens,), generator=g).numpy().astype(np.uint32))  # a token a sequence
    splits = 3  # combine: attention's partials over 3 key spans of 5 heads of 128 (K = 640), the last span empty
    ml = torch.stack([torch.randn(splits, tokens * 5, generator=g) * 4, torch.rand(splits, tokens * 5, generator=g) + 0.5], -1)
    ml[-1] = torch.tensor([-1e30, 0.0])
    po = torch.randn(splits, tokens * 5, 128, generator=g)
    po[-1] = 0.0
    partials = DecodePartials(upload(po.numpy()), upload(ml.numpy()), splits, 5, 128)

    def make(**shape) -> list[torch.Tensor]:
        out = upload(residual.copy()) if kind in ("add", "norm_add") else poisoned((tokens, width + 3))
        reads, options = [out], dict(shape, gemv=True)
        if kind in ("add", "gate_up"):
            options["saved"] = poisoned((tokens, rows + 5))
            reads.append(options["saved"])
        if kind in ("rope", "norm_rope"):
            caches = [upload(np.zeros((tokens, kv_heads, 12, d), np.float32)) for _ in range(2)]
            options.update(mode="rope", rope=RopeTarget(cos, sin, starts, *caches, heads, kv_heads, d))
            reads += caches
        else:
            options["mode"] = {"gate_up": "gate_up", "add": "add", "norm_add": "add"}.get(kind, "store")
        launch_codes, launch_meta = xq, xm
        if kind.startswith("norm") or kind == "combine":
            launch_codes, launch_meta = poisoned((tokens, k // 4), "u32"), poisoned((2 * tokens,))
            options["norm"] = (x, weight, 1e-5)
            options["attention"] = partials if kind == "combine" else None
            reads += [launch_codes, launch_meta]
        return run(bitlinear_launch(launch_codes, launch_meta, projection, out, tokens=tokens,
                                     out_stride=out.shape[1], **options, **lora), *reads)

    return make


@pytest.mark.parametrize("kind", ["store", "add", "gate_up", "rope", "norm_store", "norm_add", "norm_rope", "combine"])
def test_gemv_token_groups_give_each_token_the_one_token_gemvs_values(kind):
    # A workgroup serving a group of tokens from one read of its weights (held as 2-bit words or
    # decoded): every output of every token, bit for bit, that of the one-token GEMV (group 1: a
    # workgroup a token, the batch-1 decode's kernel): the stores, kept sums and pairs, LoRA
    # segments, rotated rows and caches, and the codes and meta a normalising GEMV writes. 11
    # tokens (short last groups), rows past the workgroups' edge, 1 to 3 weight words a lane.
    # The values themselves: the tests above, against the references.
    make = _grouped_case(kind)
    alone = make(group=1, spread=False, lanes=4)
    for shape in (dict(group=3, spread=True, lanes=4), dict(group=8, spread=False, lanes=4),
                  dict(group=8, spread=True, lanes=32), {}):  # {}: the rules' choice
        for ours, theirs in zip(make(**shape), alone):
            assert torch.equal(ours.isnan(), theirs.isnan()), (kind, shape)  # NaN: unwritten in both
            assert torch.equal(ours.nan_to_num(), theirs.nan_to_num()), (kind, shape)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("mode", ["store", "add", "gate_up"])
def test_float_gemv_token_groups_sum_each_token_as_alone(bf16, mode):
    # The float GEMV (the LM head's) reading each weight word once for a group of tokens: each
    # token's sums in the order of the one-token GEMV, so its outputs are bit for bit that
    # GEMV's (11 tokens, groups of 3 with a short last one and of all 11, rows past the edge,
    # LoRA segments, kept sums or pairs); against float64 torch in test_matmul_matches_float64.
    g = torch.Generator().manual_seed(bf16 + len(mode))
    tokens, k, rows = 11, 320, 38
    x = upload(torch.randn(tokens, k, generator=g).numpy())
    weight = torch.randn(rows, k, generator=g)
    proj = Projection(upload(float_rows(weight.bfloat16() if bf16 else weight, bf16)), None, rows, k)
    table = upload(lora_table([(0, rows, 2, 0, 0.5, 0, 3), (5, rows, 1, 3, 2.0, 3 * rows, 2)]))
    lora = dict(h=upload(torch.randn(tokens, 5, generator=g).numpy()), lora_rank=5, lora=table,
                lora_b=upload(torch.randn(5 * rows, generator=g).numpy()), segments=2)
    width = rows // 2 if mode == "gate_up" else rows
    residual = torch.randn(tokens, width, generator=g).numpy()

    def outputs(group: int | None) -> list[torch.Tensor]:
        out = upload(residual.copy()) if mode == "add" else poisoned((tokens, width))
        aux = poisoned((tokens, rows + 2))
        launch = matmul_launch(x, proj, out, tokens=tokens, out_stride=width, mode=mode, bf16=bf16,
                               saved=None if mode == "store" else aux, gemv=True, group=group, **lora)
        return run([launch], out, aux)

    alone = outputs(1)
    for group in (3, None):  # None: the rule's choice, all 11 in one group
        for ours, theirs in zip(outputs(group), alone):
            assert torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(ours.nan_to_num(), theirs.nan_to_num())


def test_gemv_shapes_are_checked():
    g = torch.Generator().manual_seed(10)
    codes, scales, xq, xm = _codes(2, 640, g)
    proj = _projection(torch.randint(-1, 2, (8, 640), generator=g, dtype=torch.int8), torch.ones(8), True)
    out = poisoned((2, 8))
    with pytest.raises(ValueError, match="lanes must be a power of two from 1 to 64, not 6"):
        bitlinear_launch(xq, xm, proj, out, tokens=2, out_stride=8, gemv=True, lanes=6)
    with pytest.raises(ValueError, match="640 features take at least 4 lanes with spread weights, not 2"):
        bitlinear_launch(xq, xm, proj, out, tokens=2, out_stride=8, gemv=True, lanes=2, spread=True)
    bitlinear_launch(xq, xm, proj, out, tokens=2, out_stride=8, gemv=True, lanes=2, spread=False)  # 2-bit words fit
    with pytest.raises(ValueError, match="at least one token, not group=0"):
        bitlinear_launch(xq, xm, proj, out, tokens=2, out_stride=8, gemv=True, group=0)
    x = upload(np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="1 to 64 tokens, not group=65"):
        matmul_launch(x, Projection(upload(float_rows(torch.zeros(8, 64), False)), None, 8, 64), out, tokens=2,
                      out_stride=8, gemv=True, group=65)


def test_gemv_fusions_refuse_what_they_cannot_do():
    g = torch.Generator().manual_seed(9)
    codes, scales, xq, xm = _codes(2, 64, g)
    proj = _projection(torch.randint(-1, 2, (8, 64), generator=g, dtype=torch.int8), torch.ones(8), True)
    out, x, w = poisoned((2, 8)), poisoned((2, 64)), poisoned((64,))
    with pytest.raises(ValueError, match="norm is gemv's fusion"):
        bitlinear_launch(xq, xm, proj, out, tokens=2, out_stride=8, gemv=False, norm=(x, w, 1e-5))
    with pytest.raises(ValueError, match="gemm tiles hold 32 or 64 tokens, not 16"):
        bitlinear_launch(xq, xm, proj, out, tokens=2, out_stride=8, gemv=False, mma=False, tile_tokens=16)
    with pytest.raises(ValueError, match="mode 'rope' and a RopeTarget go together"):
        bitlinear_launch(xq, xm, proj, out, tokens=2, out_stride=8, mode="rope")
    from torch_wgpu_lora.engine.kernels.attention import decode_partials

    target = RopeTarget(*(poisoned((4,)) for _ in range(5)), heads=4, kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="mode 'rope' is the epilogue of gemv's and of the matrix units'"):
        bitlinear_launch(xq, xm, proj, out, tokens=2, out_stride=8, mode="rope", rope=target, gemv=False, mma=False)
    with pytest.raises(ValueError, match="attention partials feed o_proj and mode 'rope' is the q/k/v projection's"):
        bitlinear_launch(xq, xm, proj, out, tokens=2, out_stride=8, mode="rope", rope=target, norm=(x, w, 1e-5),
                         attention=decode_partials(2, 1, 4, 2, 16, 8, kernel_workspace()))
    big = _projection(torch.zeros(4, 8256, dtype=torch.int8), torch.ones(4), True)
    with pytest.raises(ValueError, match="up to 8192 features, not 8256"):
        bitlinear_launch(poisoned((1, 8256 // 4), "u32"), xm, big, out, tokens=1, out_stride=8,
                         norm=(poisoned((1, 8256)), poisoned((8256,)), 1e-5))


# -- float matmul -------------------------------------------------------------------------------

@pytest.mark.parametrize("gemv", [True, False])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("tokens,k,rows", [(1, 64, 9), (4, 100, 33), (67, 320, 70)])
def test_matmul_matches_float64(gemv, bf16, tokens, k, rows):
    g = torch.Generator().manual_seed(tokens + k + rows)
    x = torch.zeros(tokens, pad(k, 64))
    x[:, :k] = torch.randn(tokens, k, generator=g)
    weight = torch.randn(rows, k, generator=g)
    if bf16:
        weight = weight.bfloat16()
    w = float_rows(weight, bf16)
    proj = Projection(upload(w), None, rows, k)
    out = poisoned((tokens, rows))
    (got,) = run([matmul_launch(upload(x.numpy()), proj, out, tokens=tokens, out_stride=rows, bf16=bf16,
                                gemv=gemv)], out)
    assert_close(got, matmul_reference(x[:, :k], weight.float()), FLOAT_RTOL, "matmul")


def test_matmul_gate_up_and_add():
    g = torch.Generator().manual_seed(4)
    tokens, k, f = 70, 128, 12
    x = torch.randn(tokens, k, generator=g)
    weight = torch.randn(2 * f, k, generator=g)
    proj = Projection(upload(float_rows(weight, False)), None, 2 * f, k)
    out = poisoned((tokens, f))
    (got,) = run([matmul_launch(upload(x.numpy()), proj, out, tokens=tokens, out_stride=f, mode="gate_up")], out)
    assert_close(got, gate_up_reference(matmul_reference(x, weight)), FLOAT_RTOL, "gate_up")
    residual = torch.randn(tokens, 2 * f, generator=g)
    res = upload(residual.numpy())
    (got,) = run([matmul_launch(upload(x.numpy()), proj, res, tokens=tokens, out_stride=2 * f, mode="add")], res)
    assert_close(got, residual.double() + matmul_reference(x, weight), FLOAT_RTOL, "add")
    res, aux = upload(residual.numpy()), poisoned((tokens, 2 * f + 8))
    got, kept = run([matmul_launch(upload(x.numpy()), proj, res, tokens=tokens, out_stride=2 * f, mode="add",
                                   saved=aux)], res, aux)
    assert_close(got, residual.double() + matmul_reference(x, weight), FLOAT_RTOL, "add keeping the sums")
    assert torch.equal(kept[:, : 2 * f], got) and kept[:, 2 * f:].isnan().all()  # the sums, in rows of aux's width


# -- RMSNorm, quantisation, LoRA down -------------------------------------------------------------

@pytest.mark.parametrize("per_row", [False, True], ids=["workgroup-a-row", "invocation-a-row"])
def test_rmsnorm_lora_down_gives_each_token_its_own_adapters_columns(per_row):
    # three adapters stacked (ranks 3, 5, 2; slots 0, 1, 2) and tokens running slot 1, 0, none
    # (NO_ADAPTER), 2, 1: each token's h is y·Aᵀ in its adapter's columns and exactly 0 elsewhere
    from torch_wgpu_lora.engine.adapters import NO_ADAPTER

    g = torch.Generator().manual_seed(3)
    tokens, k, ranks = 5, 200, (3, 5, 2)
    rank = sum(ranks)
    x = torch.randn(tokens, k, generator=g)
    weight = torch.rand(k, generator=g) + 0.5
    A = torch.randn(rank, k, generator=g)
    A[ranks[0]] = float("nan")  # slot 1's first rank: never in the h of a token of another adapter
    a = np.zeros((rank, pad(k, 64)), np.float32)
    a[:, :k] = A.numpy()
    rows = np.array([1, 0, NO_ADAPTER, 2, 1], np.uint32)
    columns = np.repeat(np.arange(3, dtype=np.uint32), ranks)
    xn, h = poisoned((tokens, pad(k, 64))), poisoned((tokens, rank))
    launch = rmsnorm_launch(upload(x.numpy()), upload(weight.numpy()), xn, tokens=tokens, k=k, eps=1e-5,
                            lora_a=upload(a), h=h, rank=rank, per_row=per_row,
                            row_adapters=(upload(rows), upload(columns)))
    (got,) = run([launch], h)
    y = rmsnorm_reference(x, weight, 1e-5).double()
    own = torch.from_numpy(rows.astype(np.int64))[:, None] == torch.from_numpy(columns.astype(np.int64))[None, :]
    ref = torch.where(own, y @ A.double().T, torch.zeros((), dtype=torch.float64))
    assert torch.equal(got[~own], torch.zeros(int((~own).sum())))  # exactly 0, NaN rank included
    assert got[0, ranks[0]].isnan() and got[4, ranks[0]].isnan()  # slot 1's tokens keep their NaN
    keep = own & ref.isfinite()
    assert_close(got[keep], ref[keep], FLOAT_RTOL, "h = y·Aᵀ in each token's adapter's columns")


@pytest.mark.parametrize("per_row", [False, True], ids=["workgroup-a-row", "invocation-a-row"])
@pytest.mark.parametrize("tokens,k,rank", [(1, 64, 6), (3, 100, 19), (17, 2560, 6), (2, 6912, 8), (70, 300, 6),
                                          (1, 9000, 6), (1, 2048, 30)])
def test_rmsnorm_quantise_and_lora_down(tokens, k, rank, per_row, reductions):
    # 19 ranks: more than one pass of 16; (6912, 8), (9000, 6), (2048, 30): an invocation-a-row
    # kernel that walked every rank itself read the tail of A's last row as zeros on lavapipe
    from transformers.models.bitnet.modeling_bitnet import BitNetRMSNorm

    g = torch.Generator().manual_seed(tokens + k)
    x = torch.randn(tokens, k, generator=g) * 3
    norm = BitNetRMSNorm(k, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=g) + 0.5)
    A = torch.randn(rank, k, generator=g)
    a = np.zeros((rank, pad(k, 64)), np.float32)
    a[:, :k] = A.numpy()
    stride = pad(k, 64)
    xn, codes, meta, h, rstd = (poisoned((tokens, stride)), poisoned((tokens, stride // 4), "u32"),
                                poisoned((2 * tokens,)), poisoned((tokens, rank)), poisoned((tokens,)))
    launch = rmsnorm_launch(upload(x.numpy()), upload(norm.weight.detach().numpy()), xn, tokens=tokens, k=k, eps=1e-5,
                            codes=codes, scales_and_sums=meta, lora_a=upload(a), h=h, rank=rank, rstd=rstd, per_row=per_row)
    got_xn, got_codes, got_meta, got_h, got_rstd = run([launch], xn, codes, meta, h, rstd)
    with torch.no_grad():
        y = norm(x)  # transformers' own module
    assert_close(got_xn[:, :k], y, 1e-6, "normalised")
    assert torch.equal(got_xn[:, k:], torch.zeros(tokens, stride - k))
    assert_close(got_h, y.double() @ A.double().T, FLOAT_RTOL, "h = y·Aᵀ")
    assert_close(got_rstd, torch.rsqrt(x.double().pow(2).mean(-1) + 1e-5), 1e-6, "1/rms")
    assert_codes_round(got_codes, got_meta, got_xn, k)


def test_rows_too_long_for_one_invocation_are_refused_by_the_row_kernel():
    x, w, out = poisoned((1, 16448)), poisoned((16448,)), poisoned((1, 16448))
    with pytest.raises(ValueError, match="16448 features"):
        rmsnorm_launch(x, w, out, tokens=1, k=16448, eps=1e-5, per_row=True)
    rmsnorm_launch(x, w, out, tokens=1, k=16448, eps=1e-5)  # the default picks the workgroup kernel


def test_rmsnorm_without_quantisation_reads_a_strided_input():
    g = torch.Generator().manual_seed(5)
    tokens, k = 4, 48
    x = torch.randn(tokens, 50, generator=g)  # rows of 50: only the first 48 are features
    weight = torch.rand(k, generator=g) + 0.5
    out = poisoned((tokens, 64))
    (got,) = run([rmsnorm_launch(upload(x.numpy()), upload(weight.numpy()), out, tokens=tokens, k=k, eps=1e-6)], out)
    assert_close(got[:, :k], rmsnorm_reference(x[:, :k], weight, 1e-6), 1e-6, "final norm")


# -- embedding, RoPE ------------------------------------------------------------------------------

@pytest.mark.parametrize("bf16", [False, True])
def test_embedding_gather_over_vocabulary_chunks(bf16):
    g = torch.Generator().manual_seed(6)
    vocab, k = 50, 70
    weight = torch.randn(vocab, k, generator=g)
    if bf16:
        weight = weight.bfloat16()
    chunks = [upload(float_rows(weight[:30], bf16)), upload(float_rows(weight[30:], bf16))]
    ids = torch.tensor([0, 29, 30, 49, 7, 7])
    out = upload(np.zeros((6, 128), np.float32))
    (got,) = run(embedding_launches(upload(ids.numpy().astype(np.uint32)), chunks, [30, 20], out, tokens=6, k=k,
                                    bf16=bf16), out)
    assert torch.equal(got[:, :k], embedding_reference(ids, weight))


@pytest.mark.parametrize("zero_missing", [False, True])
def test_gather_rows_by_index_leaves_or_zeroes_rows_past_the_table(zero_missing):
    g = torch.Generator().manual_seed(8)
    table = torch.randn(9, 64, generator=g)
    index = torch.tensor([4, 0, 2**32 - 1, 8, 9, 4])  # past the 9 rows: 2**32 - 1 and 9
    before = torch.randn(6, 64, generator=g)
    out = upload(before.numpy().copy())
    (got,) = run([gather_rows_launch(upload(index.numpy().astype(np.uint32)), upload(table.numpy()), out, tokens=6,
                                     k=60, zero_missing=zero_missing)], out)
    # a copy of float32 values: equal bit for bit to the reference's copy
    ref = gather_rows_reference(index, table[:, :60], before[:, :60], zero_missing)
    assert torch.equal(got[:, :60], ref)
    assert torch.equal(got[:, 60:], before[:, 60:])  # features past k untouched


@pytest.mark.parametrize("width", [3, 300])  # within one workgroup, and over two
def test_scatter_rows_writes_the_chosen_rows_and_leaves_the_others(width):
    # Rows of 2 blocks go to rows 3 and 0 of a destination whose blocks are longer: each block's
    # first words are the source's, bit for bit (NaN payloads too: a copy of words), the rest stays.
    g = torch.Generator().manual_seed(9)
    src = torch.randn(2, 2, width, generator=g)
    src[1, 0, 0] = float("nan")
    before = torch.randn(4, 2, width + 5, generator=g)
    rows = torch.tensor([3, 0])
    dst = upload(before.numpy().copy())
    (got,) = run([scatter_rows_launch(upload(src.numpy()), upload(rows.numpy().astype(np.uint32)), dst, count=2,
                                      blocks=2, width=width, dst_block=width + 5, dst_row=2 * (width + 5))], dst)
    ref = scatter_rows_reference(src, rows, before)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("width", [3, 300])  # within one workgroup, and over two
def test_moved_rows_take_the_places_given_and_the_others_stay(width):
    # Rows 5 and 3 of six go to rows 1 and 0, bit for bit (NaN payloads too); every other row stays.
    g = torch.Generator().manual_seed(12)
    before = torch.randn(6, width, generator=g)
    before[5, 0] = float("nan")
    buf = upload(before.numpy().copy())
    moves = upload(np.array([5, 3, 1, 0], np.uint32))  # from 5 and 3, to 1 and 0
    (got,) = run([move_rows_launch(buf, moves, count=2)], buf)
    ref = move_rows_reference(before, [5, 3], [1, 0])
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    assert not torch.equal(ref[0], before[0])


def test_kv_rows_go_into_the_first_positions_of_a_longer_caches_sequences():
    g = torch.Generator().manual_seed(10)
    src = torch.randn(3, 2, 5, 8, generator=g)  # 3 sequences, 2 KV heads, 5 positions, head_dim 8
    before = torch.randn(4, 2, 12, 8, generator=g)
    dst = upload(before.numpy().copy())
    rows = upload(np.array([2, 1, 9], np.uint32))  # the third is not copied (count 2)
    (got,) = run([kv_rows_launch(upload(src.numpy()), rows, dst, count=2)], dst)
    ref = before.clone()
    ref[2, :, :5], ref[1, :, :5] = src[0], src[1]
    assert torch.equal(got, ref)
    with pytest.raises(ValueError, match=r"KV rows of \(3, 2, 5, 8\) do not fit a cache of \(4, 2, 4, 8\)"):
        kv_rows_launch(upload(src.numpy()), rows, upload(np.zeros((4, 2, 4, 8), np.float32)), count=2)


def test_rope_matches_transformers_and_fills_the_caches():
    from transformers import BitNetConfig
    from transformers.models.bitnet.modeling_bitnet import BitNetRotaryEmbedding, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(7)
    batch, T, heads, kv_heads, d, cache_len, starts = 2, 5, 4, 2, 16, 12, [3, 6]  # each sequence at its own start
    config = BitNetConfig(hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=cache_len)
    cos, sin = BitNetRotaryEmbedding(config)(torch.zeros(1), torch.arange(cache_len)[None])
    q_size, kv_size = heads * d, kv_heads * d
    qkv = torch.randn(batch * T, q_size + 2 * kv_size + 3, generator=g)  # +3: a row stride past the features
    q_rot = poisoned((batch * T, q_size))
    k_cache, v_cache = (upload(np.zeros((batch, kv_heads, cache_len, d), np.float32)) for _ in range(2))
    target = RopeTarget(upload(cos[0, :, : d // 2].contiguous().numpy()),
                        upload(sin[0, :, : d // 2].contiguous().numpy()), upload(np.array(starts, np.uint32)),
                        k_cache, v_cache, heads, kv_heads, d, T)
    launch = rope_launch(upload(qkv.numpy()), q_rot, target, tokens=batch * T)
    got_q, got_k, got_v = run([launch], q_rot, k_cache, v_cache)
    q = qkv[:, :q_size].reshape(batch, T, heads, d).transpose(1, 2)
    k = qkv[:, q_size:q_size + kv_size].reshape(batch, T, kv_heads, d).transpose(1, 2)
    v = qkv[:, q_size + kv_size:q_size + 2 * kv_size].reshape(batch, T, kv_heads, d).transpose(1, 2)
    got_q = got_q.reshape(batch, T, heads, d).transpose(1, 2)
    for b, pos in enumerate(starts):
        positions = slice(pos, pos + T)
        q_ref, k_ref = apply_rotary_pos_emb(q[b:b + 1], k[b:b + 1], cos[:, positions], sin[:, positions])
        assert_close(got_q[b:b + 1], q_ref, 1e-6, f"q of sequence {b}")
        assert_close(got_k[b:b + 1, :, positions], k_ref, 1e-6, f"k of sequence {b}")
        assert torch.equal(got_v[b, :, positions], v[b])
        assert not got_k[b, :, :pos].any() and not got_k[b, :, pos + T:].any()  # nothing outside its positions
        assert_close(rope_reference(q[b], cos[0, positions], sin[0, positions]), q_ref[0], 1e-7, "reference")


def test_packed_rope_rotates_each_token_at_its_position_id_and_stores_it_at_its_row():
    # a packed pass: tokens rotated at their own position ids (restarting at each example, as
    # transformers rotates packed rows), keys and values stored at their rows of the pass
    from transformers import BitNetConfig
    from transformers.models.bitnet.modeling_bitnet import BitNetRotaryEmbedding, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(9)
    positions = packed_positions(PACKED_ROWS["short"])
    (batch, T), heads, kv_heads, d, context = positions.shape, 4, 2, 16, 12
    config = BitNetConfig(hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=context)
    cos, sin = BitNetRotaryEmbedding(config)(torch.zeros(1), positions)  # [batch, T, d]
    table_cos, table_sin = BitNetRotaryEmbedding(config)(torch.zeros(1), torch.arange(context)[None])
    q_size, kv_size = heads * d, kv_heads * d
    qkv = torch.randn(batch * T, q_size + 2 * kv_size, generator=g)
    q_rot = poisoned((batch * T, q_size))
    k_cache, v_cache = poisoned((batch, kv_heads, T, d)), poisoned((batch, kv_heads, T, d))
    target = RopeTarget(upload(table_cos[0, :, : d // 2].contiguous().numpy()),
                        upload(table_sin[0, :, : d // 2].contiguous().numpy()),
                        upload(np.zeros(batch, np.uint32)), k_cache, v_cache, heads, kv_heads, d, T,
                        positions=upload(positions.numpy().astype(np.uint32).reshape(-1)))
    got_q, got_k, got_v = run([rope_launch(upload(qkv.numpy()), q_rot, target, tokens=batch * T)], q_rot, k_cache,
                              v_cache)
    q = qkv[:, :q_size].reshape(batch, T, heads, d).transpose(1, 2)
    k = qkv[:, q_size:q_size + kv_size].reshape(batch, T, kv_heads, d).transpose(1, 2)
    v = qkv[:, q_size + kv_size:].reshape(batch, T, kv_heads, d).transpose(1, 2)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    assert_close(got_q.reshape(batch, T, heads, d).transpose(1, 2), q_ref, 1e-6, "q")
    assert_close(got_k, k_ref, 1e-6, "k")
    assert torch.equal(got_v, v)
    with pytest.raises(ValueError, match="a packed pass's position ids are rope_launch's"):
        bitlinear_launch(poisoned((2, 4), "u32"), poisoned((4,)), Projection(poisoned((8, 1), "u32"), poisoned((1,)), 8,
                         16), q_rot, tokens=2, out_stride=8, mode="rope", rope=target, gemv=True)


# -- BitLinear on the matrix units: tests/engine/test_matrix_units.py; here, their refusal where there are none --


def test_the_matrix_units_are_refused_where_the_device_has_none():
    from torch_wgpu_lora.engine.kernels.bitlinear import matrix_units_win
    from torch_wgpu_lora.engine.kernels.gemms import int8_matrix_units
    from torch_wgpu_lora.runtime import get_device

    device = get_device()
    g = torch.Generator().manual_seed(0)
    codes, scales, xq, xm = _codes(4, 64, g)
    proj = _projection(torch.randint(-1, 2, (8, 64), generator=g, dtype=torch.int8), torch.ones(8), True)
    if int8_matrix_units(device):
        assert isinstance(matrix_units_win(device, 4, proj), bool)
        return
    assert not matrix_units_win(device, 4, proj)
    with pytest.raises(ValueError, match="the matrix units need int8 subgroup matrices"):
        bitlinear_launch(xq, xm, proj, poisoned((4, 8)), tokens=4, out_stride=8, gemv=False, mma=True)
    previous = device.configure(gemms="matrix_units")  # asked for where there are none: said, not ignored
    try:
        with pytest.raises(ValueError, match="asks for the matrix units, and this device .* has no int8"):
            bitlinear_launch(xq, xm, proj, poisoned((4, 8)), tokens=4, out_stride=8, gemv=False)
    finally:
        device.configure(previous)


def test_the_gemms_setting_picks_the_variant_the_measured_rule_would_weigh():
    from torch_wgpu_lora.engine.kernels.gemms import fastest
    from torch_wgpu_lora.runtime import get_device

    device = get_device()
    built = []
    candidates = {name: (lambda name=name: built.append(name) or []) for name in ("matrix_units", "general")}
    previous = device.configure(gemms="general")
    try:
        assert fastest(device, "projection", (1, 2, 3), candidates) == "general"
        assert built == []  # nothing timed
        device.configure(gemms="matrix_units")
        with pytest.raises(ValueError, match="asks for 'matrix_units' input_grad GEMMs"):
            fastest(device, "input_grad", (1, 2, 3), {"general": candidates["general"]})
    finally:
        device.configure(previous)


def test_a_gemm_timing_runs_its_work_for_the_warm_up_before_it_times_it():
    # an idle GPU's clock drops while a kernel compiles: the measured rule and the benchmark time
    # GEMMs only after running them for WARM_UP_S, and the median of the timed submits is the answer
    import time

    from torch_wgpu_lora.engine.kernels import gemms
    from torch_wgpu_lora.runtime import get_device

    device = get_device()
    g = torch.Generator().manual_seed(0)
    codes, scales, xq, xm = _codes(4, 64, g)
    proj = _projection(torch.randint(-1, 2, (8, 64), generator=g, dtype=torch.int8), torch.rand(8, generator=g) + 0.5,
                       True)
    (launch,) = bitlinear_launch(xq, xm, proj, poisoned((4, 8)), tokens=4, out_stride=8, gemv=False, mma=False)
    started = time.perf_counter()
    seconds = gemms.gpu_seconds(device, [launch], repeats=3, inner=2)
    assert time.perf_counter() - started >= gemms.WARM_UP_S
    assert 0 < seconds < gemms.WARM_UP_S
