"""The engine's backward kernel families against torch references (float64 autograd where the
math is a derivative): transposed projections (ternary and float, with the LoRA input
gradient), RMSNorm, relu², RoPE, cross-entropy, LoRA gradients, the clipped AdamW step.

Tolerance: float32 kernels against float64, max error ≤ 1e-5 of the reference's largest
magnitude (sums of up to a few thousand float32 terms in another order: ~√K·6e-8 ≈ 3e-6 at
worst; an indexing or sign bug gives O(1) errors).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_wgpu_lora.engine.config import pad
from torch_wgpu_lora.engine.kernels.bitlinear import bitlinear_t_launch, bitlinear_t_reference, gate_up_reference
from torch_wgpu_lora.engine.kernels.cross_entropy import cross_entropy_launch, cross_entropy_reference
from torch_wgpu_lora.engine.kernels.ffn import relu2_backward_launch
from torch_wgpu_lora.engine.kernels.lora_grad import da_launch, db_launch, dh_launch, lora_grad_reference
from torch_wgpu_lora.engine.kernels.matmul import matmul_t_launch
from torch_wgpu_lora.engine.kernels.norm import rmsnorm_backward_launch, rmsnorm_reference
from torch_wgpu_lora.engine.kernels.optimizer import clip_launches
from torch_wgpu_lora.ops.adamw import adamw_launch, adamw_scalars
from torch_wgpu_lora.engine.kernels.rope import rope_backward_launch, rope_reference
from torch_wgpu_lora.engine.weights import Projection, float_rows, pack_ternary
from torch_wgpu_lora.ops.adamw import adamw_reference
from torch_wgpu_lora.runtime import Buffer, upload

from .test_kernels import close, poisoned, run

RTOL = 1e-5


def padded(x: torch.Tensor, width: int) -> np.ndarray:
    out = np.zeros((x.shape[0], width), np.float32)
    out[:, : x.shape[1]] = x.numpy()
    return out


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
                                  splits=splits)
    assert len(launches) == (2 if splits > 1 else 1)
    (got,) = run(launches, out)
    ref = base[:, :k].double() + bitlinear_t_reference(dy, values, scales, divide) + dh.double() @ A.double()
    close(got[:, :k], ref, RTOL, "dx")
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
    (got,) = run([*matmul_t_launch(upload(dy.numpy()), proj, out, tokens=tokens, k=k, bf16=bf16)], out)
    close(got[:, :k], dy.double() @ weight.double(), RTOL, "dx")
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
                                  lora_rank=rank, splits=splits)], out)
    dy = dlogits[:, dy_col:dy_col + rows]
    ref = base[:, :k].double() + dy.double() @ weight.double() + dh.double() @ A.double()
    close(got[:, :k], ref, RTOL, "dx")
    assert torch.equal(got[:, k:], base[:, k:])


def test_input_gradients_refuse_rows_they_cannot_access_as_vec4s():
    proj = Projection(upload(np.zeros((8, 4), np.uint32)), upload(np.ones(8, np.float32)), 8, 64)
    dense = Projection(upload(np.zeros((8, 64), np.float32)), None, 8, 63)
    dy, dh = Buffer((2, 8)), Buffer((2, 1))
    for out, lora_a, wrong in ((Buffer((2, 64)), Buffer((1, 63)), "lora_a"), (Buffer((2, 63)), None, "out")):
        lora = dict(dh=dh, lora_a=lora_a, lora_rank=1) if lora_a is not None else {}
        with pytest.raises(ValueError, match=f"{wrong}'s rows must be padded to a multiple of 4 floats"):
            bitlinear_t_launch(dy, proj, out, tokens=2, k=63, **lora)
        with pytest.raises(ValueError, match=f"{wrong}'s rows must be padded to a multiple of 4 floats"):
            matmul_t_launch(dy, dense, out, tokens=2, k=63, **lora)


@pytest.mark.parametrize("k", [100, 99], ids=["vec4-rows", "scalar-rows"])  # the workgroup kernel's two forms
@pytest.mark.parametrize("per_row", [False, True], ids=["workgroup-a-row", "invocation-a-row"])
def test_rmsnorm_backward_adds_into_a_residual_gradient(per_row, k, reductions):
    g = torch.Generator().manual_seed(1)
    tokens = 5
    x = torch.randn(tokens, k, generator=g)
    w = torch.rand(k, generator=g) + 0.5
    dy = torch.randn(tokens, k, generator=g)
    x64 = x.double().requires_grad_()
    (dx,) = torch.autograd.grad(rmsnorm_reference(x64, w.double(), 1e-5).double(), x64, dy.double())
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-5)
    base = torch.randn(tokens, 128, generator=g)
    out = upload(base.numpy().copy())
    launch = rmsnorm_backward_launch(upload(padded(dy, 128)), upload(padded(x, 128)), upload(rstd.numpy()),
                                     upload(w.numpy()), out, tokens=tokens, k=k, accumulate=True, per_row=per_row)
    assert launch.kernel.name.endswith("rmsnorm_backward_rows" if per_row else
                                       "rmsnorm_backward4" if k % 4 == 0 else "rmsnorm_backward")
    (got,) = run([launch], out)
    close(got[:, :k], base[:, :k].double() + dx, RTOL, "d residual")
    assert torch.equal(torch.as_tensor(got[:, k:]), base[:, k:])  # columns past k untouched


def test_relu2_backward():
    g = torch.Generator().manual_seed(2)
    tokens, f = 6, 50
    pairs = torch.randn(tokens, 2 * f, generator=g)
    dh = torch.randn(tokens, f, generator=g)
    p64 = pairs.double().requires_grad_()
    (ref,) = torch.autograd.grad(gate_up_reference(p64), p64, dh.double())
    out = poisoned((tokens, 2 * f))
    (got,) = run([relu2_backward_launch(upload(dh.numpy()), upload(pairs.numpy()), out, tokens=tokens, features=f)],
                 out)
    close(got, ref, RTOL, "d gate/up")


def test_rope_backward_is_the_transpose_of_rope():
    from transformers import BitNetConfig
    from transformers.models.bitnet.modeling_bitnet import BitNetRotaryEmbedding

    g = torch.Generator().manual_seed(3)
    batch, T, heads, kv_heads, d, S, pos = 2, 4, 4, 2, 8, 10, 2
    cos, sin = BitNetRotaryEmbedding(BitNetConfig(hidden_size=heads * d, num_attention_heads=heads,
                                                  max_position_embeddings=S))(torch.zeros(1), torch.arange(S)[None])
    cos, sin = cos[0], sin[0]
    dq = torch.randn(batch * T, heads * d, generator=g)
    dk = torch.randn(batch, kv_heads, S, d, generator=g)
    dv = torch.randn(batch, kv_heads, S, d, generator=g)
    out = poisoned((batch * T, (heads + 2 * kv_heads) * d))
    launch = rope_backward_launch(upload(dq.numpy()), upload(dk.numpy()), upload(dv.numpy()),
                                  upload(cos[:, : d // 2].contiguous().numpy()),
                                  upload(sin[:, : d // 2].contiguous().numpy()), upload(np.array([pos, 0, 0, 0], np.uint32)),
                                  out, tokens=batch * T, tokens_per_seq=T, heads=heads, kv_heads=kv_heads, head_dim=d,
                                  cache_len=S)
    (got,) = run([launch], out)
    positions = slice(pos, pos + T)
    q = torch.zeros(batch, T, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.zeros(batch, kv_heads, T, d, dtype=torch.float64, requires_grad=True)
    rq = rope_reference(q.transpose(1, 2), cos[positions].double(), sin[positions].double())
    rk = rope_reference(k, cos[positions].double(), sin[positions].double())
    dq_ref, dk_ref = torch.autograd.grad((rq, rk), (q, k), (dq.double().reshape(batch, T, heads, d).transpose(1, 2),
                                                            dk[:, :, positions].double()))
    close(got[:, : heads * d], dq_ref.reshape(batch * T, -1), 1e-6, "dq")
    close(got[:, heads * d:(heads + kv_heads) * d].reshape(batch, T, kv_heads, d).transpose(1, 2), dk_ref, 1e-6, "dk")
    assert torch.equal(got[:, (heads + kv_heads) * d:].reshape(batch, T, kv_heads, d).transpose(1, 2),
                       dv[:, :, positions])


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
    close(got_loss, ref_loss, 1e-6, "loss")
    labelled = targets >= 0
    close(got_grad[labelled], ref_grad[labelled], RTOL, "gradient")
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
    close(got_dh[:, 3:3 + rank], scale * dy.double() @ B.double(), RTOL, "dh")
    close(got_grads[b_offset:b_offset + f * rank].reshape(f, rank), dB_ref, RTOL, "dB")
    dA = got_grads[a_offset:a_offset + width * pad(k, 64)].reshape(width, -1)
    close(dA[3:3 + rank, :k], dA_ref, RTOL, "dA")
    assert not dA[:3].any() and not dA[3 + rank:].any()  # h columns of other adapters are zero here


def test_da_refuses_rows_it_cannot_read_as_words():
    with pytest.raises(ValueError, match="multiple of 4 floats"):
        da_launch(poisoned((3, 8)), poisoned((3, 70)), poisoned((8 * 128,)), tokens=3, rank=8, k=70, a_offset=0)


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
def test_clipped_adamw_step_matches_torch(max_norm, reductions):
    g = torch.Generator().manual_seed(6)
    n = 3000
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    m, v = torch.randn(n, generator=g) * 0.01, torch.rand(n, generator=g) * 1e-3
    losses = torch.rand(10, generator=g)
    P, G, M, V = (upload(t.numpy().copy()) for t in (p, grad, m, v))
    stats, partials = poisoned((4,)), Buffer((256,))
    options = dict(step=3, lr=1e-2, betas=(0.9, 0.999), eps=1e-7, weight_decay=0.01)
    launches = clip_launches(G, upload(losses.numpy()), stats, partials, n=n, rows=10, max_norm=max_norm)
    launches.append(adamw_launch(P, G, M, V, adamw_scalars(**options), stats=stats, n=n))
    got_p, got_m, got_v, got_stats = run(launches, P, M, V, stats)
    norm = grad.double().norm().item()
    coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
    assert abs(got_stats[0].item() - norm) <= 1e-5 * norm and abs(got_stats[1].item() - coef) <= 1e-5
    assert got_stats[2].item() == 0.0 and abs(got_stats[3].item() - losses.sum().item()) <= 1e-5
    p_ref, m_ref, v_ref = p.clone(), m.clone(), v.clone()
    adamw_reference(p_ref, grad * coef, m_ref, v_ref, **options)
    for got, ref, name in ((got_p, p_ref, "param"), (got_m, m_ref, "exp_avg"), (got_v, v_ref, "exp_avg_sq")):
        close(got, ref, 1e-6, name)


def test_a_non_finite_loss_or_gradient_skips_the_update():
    n = 100
    for bad in ("loss", "grad"):
        p = torch.ones(n)
        grad = torch.full((n,), 0.1)
        losses = torch.ones(3)
        if bad == "loss":
            losses[1] = float("nan")
        else:
            grad[7] = float("inf")
        P, G, M, V = upload(p.numpy().copy()), upload(grad.numpy()), upload(np.zeros(n, np.float32)), \
            upload(np.zeros(n, np.float32))
        stats = Buffer((4,))
        launches = clip_launches(G, upload(losses.numpy()), stats, Buffer((256,)), n=n, rows=3, max_norm=1.0)
        launches.append(adamw_launch(P, G, M, V, adamw_scalars(1, 0.1, (0.9, 0.999), 1e-8, 0.0), stats=stats, n=n))
        got_p, got_stats = run(launches, P, stats)
        assert got_stats[2].item() == 1.0 and torch.equal(got_p, p), bad
