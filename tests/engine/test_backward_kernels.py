"""The engine's backward kernel families against the torch references beside them (float64
autograd where the math is a derivative): transposed projections (ternary and float, with the
LoRA input gradient), RMSNorm, relu², RoPE, cross-entropy, LoRA gradients.

Tolerance: float32 kernels against float64, max error ≤ 1e-5 of the reference's largest
magnitude (sums of up to a few thousand float32 terms in another order: ~√K·6e-8 ≈ 3e-6 at
worst; an indexing or sign bug gives O(1) errors).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_wgpu_lora.engine.config import pad
from torch_wgpu_lora.engine.kernels.bitlinear import (bitlinear_t_launch, bitlinear_t_reference, transposed_weights,
                                                    transposed_weights_reference)
from torch_wgpu_lora.engine.kernels.cross_entropy import cross_entropy_launch, cross_entropy_reference
from torch_wgpu_lora.engine.kernels.ffn import relu2_backward_launch, relu2_backward_reference
from torch_wgpu_lora.engine.kernels.lora_grad import da_launch, db_launch, dh_launch, lora_grad_reference
from torch_wgpu_lora.engine.kernels.matmul import matmul_t_launch, matmul_t_reference
from torch_wgpu_lora.engine.kernels.norm import rmsnorm_backward_launch, rmsnorm_backward_reference
from torch_wgpu_lora.engine.kernels.rope import rope_backward_launch, rope_backward_reference
from torch_wgpu_lora.engine.weights import Projection, float_rows, pack_ternary
from torch_wgpu_lora.engine.workspace import Workspace
from torch_wgpu_lora.runtime import Buffer, get_device, upload

from .helpers import PACKED_ROWS, assert_close, kernel_workspace, packed_positions, padded, poisoned, run

RTOL = 1e-5


@pytest.mark.parametrize("rows,k", [(1, 8), (70, 100), (1000, 130), (64, 192)])
def test_transposed_ternary_weights(rows, k):
    # the input gradient's weights on the matrix units: each column of the packed weights a packed
    # row, rows past the weights' padded with zeros, equal to torch's transpose packed (integers);
    # made once per source buffer, kept in the shared workspace under its role
    g = torch.Generator().manual_seed(rows + k)
    values = torch.randint(-1, 2, (rows, k), generator=g, dtype=torch.int8)
    proj = Projection(upload(pack_ternary(values)), None, rows, k)
    shared = Workspace(get_device())
    plan = Workspace(get_device(), shared=shared)
    got = transposed_weights(proj, plan)
    (bits,) = run([], got)
    assert np.array_equal(bits.numpy().view(np.uint32), transposed_weights_reference(values))
    assert transposed_weights(proj, shared) is got and plan.nbytes == 0
    assert shared.roles() == {"ternary weights transposed (input gradients)": got.gpu.size}
    other = Projection(upload(pack_ternary(values)), None, rows, k)
    assert transposed_weights(other, plan) is not got


@pytest.mark.parametrize("splits", [1, 3], ids=["one-range", "split-k"])  # 3 ranges: some empty at 8 and 40 rows
@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("tokens,rows,k", [(1, 8, 64), (37, 70, 100), (64, 96, 192), (130, 40, 2560)])
def test_bitlinear_input_gradient_with_lora(divide, tokens, rows, k, splits):
    g = torch.Generator().manual_seed(tokens + rows + k)
    dy = torch.randn(tokens, rows, generator=g)
    values = torch.randint(-1, 2, (rows, k), generator=g, dtype=torch.int8)
    scales = torch.rand(rows, generator=g) + 0.5
    proj = Projection(upload(pack_ternary(values)), upload(scales.numpy()), rows, k, divide)
    rank = 5
    dh, A = torch.randn(tokens, rank, generator=g), torch.randn(rank, k, generator=g)
    base = torch.randn(tokens, pad(k, 64), generator=g)
    out = upload(base.numpy().copy())
    launches = bitlinear_t_launch(upload(dy.numpy()), proj, out, tokens=tokens, k=k, accumulate=True,
                                  dh=upload(dh.numpy()), lora_a=upload(padded(A, pad(k, 64))), lora_rank=rank,
                                  splits=splits, workspace=kernel_workspace())
    assert len(launches) == (2 if splits > 1 else 1)
    (got,) = run(launches, out)
    ref = base[:, :k].double() + bitlinear_t_reference(dy, values, scales, divide) + dh.double() @ A.double()
    assert_close(got[:, :k], ref, RTOL, "dx")
    assert torch.equal(got[:, k:], base[:, k:])  # padding columns untouched


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("tokens,rows,k", [(3, 9, 64), (70, 130, 100), (5, 12, 98)])
def test_matmul_input_gradient(bf16, tokens, rows, k):
    g = torch.Generator().manual_seed(tokens + rows)
    dy = torch.randn(tokens, rows, generator=g)
    weight = torch.randn(rows, k, generator=g)
    if bf16:
        weight = weight.bfloat16()
    proj = Projection(upload(float_rows(weight, bf16)), None, rows, k)
    out = poisoned((tokens, pad(k, 64)))
    (got,) = run([*matmul_t_launch(upload(dy.numpy()), proj, out, tokens=tokens, k=k, bf16=bf16,
                                   workspace=kernel_workspace())], out)
    assert_close(got[:, :k], matmul_t_reference(dy, weight), RTOL, "dx")
    assert np.isnan(got[:, k:]).all()  # padding columns untouched, a vec4 shared with the last features too


@pytest.mark.parametrize("splits", [1, 2], ids=["one-range", "split-k"])
@pytest.mark.parametrize("bf16", [False, True])
def test_matmul_input_gradient_of_a_vocabulary_chunk_adds_with_lora(bf16, splits):
    # The LM head's use: columns [dy_col, dy_col + rows) of a wider dlogits, accumulated.
    g = torch.Generator().manual_seed(7)
    tokens, rows, k, dy_col, rank = 65, 96, 130, 13, 3
    dlogits = torch.randn(tokens, dy_col + rows + 5, generator=g)
    weight = torch.randn(rows, k, generator=g)
    if bf16:
        weight = weight.bfloat16()
    proj = Projection(upload(float_rows(weight, bf16)), None, rows, k)
    dh, A = torch.randn(tokens, rank, generator=g), torch.randn(rank, k, generator=g)
    base = torch.randn(tokens, pad(k, 64), generator=g)
    out = upload(base.numpy().copy())
    (got,) = run([*matmul_t_launch(upload(dlogits.numpy()), proj, out, tokens=tokens, k=k, bf16=bf16, accumulate=True,
                                  dy_col=dy_col, dh=upload(dh.numpy()), lora_a=upload(padded(A, pad(k, 64))),
                                  lora_rank=rank, splits=splits, workspace=kernel_workspace())], out)
    dy = dlogits[:, dy_col:dy_col + rows]
    ref = base[:, :k].double() + matmul_t_reference(dy, weight) + dh.double() @ A.double()
    assert_close(got[:, :k], ref, RTOL, "dx")
    assert torch.equal(got[:, k:], base[:, k:])


def test_input_gradients_refuse_rows_they_cannot_access_as_vec4s():
    proj = Projection(upload(np.zeros((8, 4), np.uint32)), upload(np.ones(8, np.float32)), 8, 64)
    dense = Projection(upload(np.zeros((8, 64), np.float32)), None, 8, 63)
    dy, dh = Buffer((2, 8)), Buffer((2, 1))
    for out, lora_a, wrong in ((Buffer((2, 64)), Buffer((1, 63)), "lora_a"), (Buffer((2, 63)), None, "out")):
        lora = dict(dh=dh, lora_a=lora_a, lora_rank=1) if lora_a is not None else {}
        with pytest.raises(ValueError, match=f"{wrong}'s rows must be padded to a multiple of 4 floats"):
            bitlinear_t_launch(dy, proj, out, tokens=2, k=63, workspace=kernel_workspace(), **lora)
        with pytest.raises(ValueError, match=f"{wrong}'s rows must be padded to a multiple of 4 floats"):
            matmul_t_launch(dy, dense, out, tokens=2, k=63, workspace=kernel_workspace(), **lora)


@pytest.mark.parametrize("k", [100, 99], ids=["vec4-rows", "scalar-rows"])  # the workgroup kernel's two forms
@pytest.mark.parametrize("per_row", [False, True], ids=["workgroup-a-row", "invocation-a-row"])
def test_rmsnorm_backward_adds_into_a_residual_gradient(per_row, k, reductions):
    g = torch.Generator().manual_seed(1)
    tokens = 5
    x = torch.randn(tokens, k, generator=g)
    w = torch.rand(k, generator=g) + 0.5
    dy = torch.randn(tokens, k, generator=g)
    dx = rmsnorm_backward_reference(dy, x, w, 1e-5)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-5)
    base = torch.randn(tokens, 128, generator=g)
    out = upload(base.numpy().copy())
    launch = rmsnorm_backward_launch(upload(padded(dy, 128)), upload(padded(x, 128)), upload(rstd.numpy()),
                                     upload(w.numpy()), out, tokens=tokens, k=k, accumulate=True, per_row=per_row)
    assert launch.kernel.name.endswith("rmsnorm_backward_rows" if per_row else
                                       "rmsnorm_backward4" if k % 4 == 0 else "rmsnorm_backward")
    (got,) = run([launch], out)
    assert_close(got[:, :k], base[:, :k].double() + dx, RTOL, "d residual")
    assert torch.equal(torch.as_tensor(got[:, k:]), base[:, k:])  # columns past k untouched


def test_relu2_backward():
    g = torch.Generator().manual_seed(2)
    tokens, f = 6, 50
    pairs = torch.randn(tokens, 2 * f, generator=g)
    dh = torch.randn(tokens, f, generator=g)
    ref = relu2_backward_reference(dh, pairs)
    out = poisoned((tokens, 2 * f))
    (got,) = run([relu2_backward_launch(upload(dh.numpy()), upload(pairs.numpy()), out, tokens=tokens, features=f)],
                 out)
    assert_close(got, ref, RTOL, "d gate/up")


@pytest.mark.parametrize("packed", [False, True], ids=["rows at their own starts", "packed rows"])
def test_rope_backward_is_the_transpose_of_rope(packed):
    # each sequence at its own start and rotated there, or a packed pass: each token rotated at its
    # own position id (restarting at each example) and stored at its row of the pass
    from transformers import BitNetConfig
    from transformers.models.bitnet.modeling_bitnet import BitNetRotaryEmbedding

    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, context = 4, 2, 8, 12
    if packed:
        positions = packed_positions(PACKED_ROWS["short"])
        (batch, T), starts = positions.shape, [0] * positions.shape[0]
        S = T
    else:
        positions, batch, T, S, starts = None, 2, 4, 10, [2, 5]
    cos, sin = BitNetRotaryEmbedding(BitNetConfig(hidden_size=heads * d, num_attention_heads=heads,
                                                  max_position_embeddings=context))(torch.zeros(1),
                                                                                    torch.arange(context)[None])
    cos, sin = cos[0], sin[0]
    dq = torch.randn(batch * T, heads * d, generator=g)
    dk = torch.randn(batch, kv_heads, S, d, generator=g)
    dv = torch.randn(batch, kv_heads, S, d, generator=g)
    out = poisoned((batch * T, (heads + 2 * kv_heads) * d))
    launch = rope_backward_launch(upload(dq.numpy()), upload(dk.numpy()), upload(dv.numpy()),
                                  upload(cos[:, : d // 2].contiguous().numpy()),
                                  upload(sin[:, : d // 2].contiguous().numpy()), upload(np.array(starts, np.uint32)),
                                  out, tokens=batch * T, tokens_per_seq=T, heads=heads, kv_heads=kv_heads, head_dim=d,
                                  cache_len=S,
                                  positions=None if positions is None else upload(positions.numpy().astype(np.uint32)))
    (got,) = run([launch], out)
    ref = rope_backward_reference(dq, dk, dv, cos, sin, starts, T, heads, kv_heads, positions)
    rotated = (heads + kv_heads) * d
    # a rotation's transpose: sums of two float32 products against float64
    assert_close(got[:, :rotated], ref[:, :rotated], 1e-6, "dq, dk")
    # the values' gradient is copied as it is: bit for bit
    assert torch.equal(got[:, rotated:].double(), ref[:, rotated:])
    if packed:  # the position ids matter
        assert (rope_backward_reference(dq, dk, dv, cos, sin, starts, T, heads, kv_heads) - ref).abs().max() > 0.1


def test_cross_entropy_rows_loss_and_gradient_in_place(reductions):
    g = torch.Generator().manual_seed(4)
    rows, vocab = 7, 1000
    logits = torch.randn(rows, vocab, generator=g) * 4
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[[1, 5]] = -100
    losses = poisoned((rows,))
    buf = upload(logits.numpy().copy())
    got_grad, got_loss = run([cross_entropy_launch(buf, upload(targets.numpy().astype(np.int32)),
                                                   upload(np.array([0.25], np.float32)), losses, rows=rows,
                                                   vocab=vocab)], buf, losses)
    ref_loss, ref_grad = cross_entropy_reference(logits, targets, 0.25)
    assert_close(got_loss, ref_loss, 1e-6, "loss")
    labelled = targets >= 0
    assert_close(got_grad[labelled], ref_grad[labelled], RTOL, "gradient")
    assert torch.equal(got_grad[~labelled], logits[~labelled])  # rows without a label: not touched


@pytest.mark.parametrize("per_row", [False, True], ids=["workgroup-a-token", "invocation-a-token"])
@pytest.mark.parametrize("tokens, rank", [(9, 4), (77, 6)])  # 77: token slices of unequal length; 6: a partial rank quad
def test_lora_gradients_for_an_interleaved_segment_and_a_stacked_site(per_row, tokens, rank, reductions):
    # An "up" adapter: rows 1, 3, 5, … of a fused gate/up output; its h at column 3 of H.
    g = torch.Generator().manual_seed(5)
    f, k, scale = 12, 70, 0.75
    x = torch.randn(tokens, k, generator=g)
    A, B = torch.randn(rank, k, generator=g), torch.randn(f, rank, generator=g)
    dy_pairs = torch.randn(tokens, 2 * f, generator=g)
    dy = dy_pairs[:, 1::2]
    width = 12  # the site's stacked ranks: this adapter's at columns 3.. of H
    h = torch.zeros(tokens, width)
    h[:, 3:3 + rank] = x @ A.T
    b_offset, a_offset = 64, 192
    lb = np.zeros(a_offset + width * pad(k, 64), np.float32)
    lb[b_offset:b_offset + f * rank] = B.numpy().ravel()
    grads = upload(np.zeros_like(lb))
    dh = upload(np.zeros((tokens, width), np.float32))
    rows = (1, 2 * f, 2)
    launches = [dh_launch(upload(dy_pairs.numpy()), upload(lb), dh, tokens=tokens, rows=rows, rank=rank, h_col=3,
                          b_offset=b_offset, scale=scale, per_row=per_row),
                db_launch(upload(dy_pairs.numpy()), upload(h.numpy()), grads, tokens=tokens, rows=rows, rank=rank,
                          h_col=3, b_offset=b_offset, scale=scale),
                da_launch(dh, upload(padded(x, pad(k, 64))), grads, tokens=tokens, rank=width, k=k, a_offset=a_offset)]
    got_grads, got_dh = run(launches, grads, dh)
    dA_ref, dB_ref, _ = lora_grad_reference(x, dy, A, B, scale)
    assert_close(got_dh[:, 3:3 + rank], scale * dy.double() @ B.double(), RTOL, "dh")
    assert_close(got_grads[b_offset:b_offset + f * rank].reshape(f, rank), dB_ref, RTOL, "dB")
    dA = got_grads[a_offset:a_offset + width * pad(k, 64)].reshape(width, -1)
    assert_close(dA[3:3 + rank, :k], dA_ref, RTOL, "dA")
    assert not dA[:3].any() and not dA[3 + rank:].any()  # h columns of other adapters are zero here


def test_da_refuses_rows_it_cannot_read_as_words():
    with pytest.raises(ValueError, match="multiple of 4 floats"):
        da_launch(poisoned((3, 8)), poisoned((3, 70)), poisoned((8 * 128,)), tokens=3, rank=8, k=70, a_offset=0)
