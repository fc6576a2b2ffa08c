"""LoRA dropout in the engine: the masks' hash (its torch reference's statistics), the kernels that
apply it (norm's h, dA, the adapters' input gradient) against float64 torch with the reference's
masks, and the whole engine's gradients against autograd with the same masks.

Tolerances: as ``test_kernels`` and ``test_backward_kernels`` (float32 sums against float64,
1e-5 of the reference's largest magnitude) and ``test_train`` (``ParityCheck``). Statistics: a
count of n independent draws kept with probability q lies within 6 standard deviations of n·q
(a false failure about once in 10⁹ runs); a mask that ignored a key, a token, a feature or the
seed, or a wrong threshold, misses that by hundreds of standard deviations.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from torch_wgpu_lora import BitNetEngine
from torch_wgpu_lora.engine.config import pad
from torch_wgpu_lora.engine.kernels.bitlinear import bitlinear_t_launch, bitlinear_t_reference
from torch_wgpu_lora.engine.kernels.dropout import (NO_SPLIT, SiteDropout, dropout_mask_reference, dropout_state,
                                                     threshold_and_scale)
from torch_wgpu_lora.engine.kernels.lora_grad import da_launch, db_launch, dh_launch, lora_grad_reference
from torch_wgpu_lora.engine.kernels.matmul import matmul_t_launch
from torch_wgpu_lora.engine.kernels.norm import rmsnorm_launch, rmsnorm_reference
from torch_wgpu_lora.engine.weights import Projection, float_rows, pack_ternary
from torch_wgpu_lora.integrations.bitnet import lora_modules, lora_parameters
from torch_wgpu_lora.integrations.gradcheck import (check_parity, engine_dropout_masks, randomize_lora_B,
                                                    replayed_dropout)
from torch_wgpu_lora.integrations.tiny import FLAVOURS
from torch_wgpu_lora.loss import causal_lm_loss, labelled_tokens
from torch_wgpu_lora.runtime import upload

from .helpers import (LOGIT_RTOL, LOSS_RTOL, assert_close, assert_parity, assert_twins_agree, kernel_workspace,
                      labelled_batch, micro_batches, padded, poisoned, run, tiny_model, torch_logits, twins)

RTOL = 1e-5  # float32 kernels against float64 sums: test_backward_kernels' tolerance

SIGMAS = 6


def within(count: int, n: int, q: float, what: str) -> None:
    sd = (n * q * (1 - q)) ** 0.5
    assert abs(count - n * q) <= SIGMAS * sd, f"{what}: {count} of {n}, expected {n * q:.0f} ± {sd:.0f}"


# -- the masks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.05, 0.5])
def test_masks_keep_one_minus_p_independently_per_adapter_token_feature_and_seed(p):
    rows, k = 256, 1000  # features 4w..4w+3 are one hash's four words
    kept = {name: dropout_mask_reference(seed, key, rows, k, p) > 0
            for name, seed, key in (("base", 1, 0), ("other key", 1, 1), ("next seed", 2, 0))}
    base = kept["base"]
    n, q = base.numel(), 1 - p
    within(int(base.sum()), n, q, "kept")
    for name in ("other key", "next seed"):
        within(int((base & kept[name]).sum()), n, q * q, f"kept in both, {name}")
    within(int((base[1:] & base[:-1]).sum()), n - k, q * q, "kept at neighbouring tokens")
    within(int((base[:, 1:] & base[:, :-1]).sum()), n - rows, q * q, "kept at neighbouring features")
    values = set(dropout_mask_reference(1, 0, 4, 8, p).flatten().tolist())
    assert values <= {0.0, float(np.float32(1 / (1 - p)))}


def test_dropout_probability_outside_zero_to_one_is_refused():
    for p in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="dropout probability must be in"):
            threshold_and_scale(p)
    assert threshold_and_scale(0.0) == (0, 1.0)


# -- the kernels ----------------------------------------------------------------------------------

def site(ranks: tuple[int, ...], p: float, seed: int, key: int = 40) -> SiteDropout:
    starts = list(np.cumsum(ranks)[:-1]) + [NO_SPLIT, NO_SPLIT]
    return SiteDropout(upload(dropout_state(seed, p)), key, (int(starts[0]), int(starts[1])))


def masks(ranks: tuple[int, ...], p: float, seed: int, tokens: int, k: int, key: int = 40) -> list[torch.Tensor]:
    return [dropout_mask_reference(seed, key + i, tokens, k, p) for i in range(len(ranks))]


@pytest.mark.parametrize("per_row", [False, True], ids=["workgroup-a-row", "invocation-a-row"])
@pytest.mark.parametrize("tokens,k,ranks", [(5, 100, (3, 5)), (70, 300, (4, 4)), (3, 2560, (2, 3, 3)), (2, 6912, (8,))])
def test_rmsnorm_h_drops_each_adapters_input_with_its_own_mask(tokens, k, ranks, per_row):
    # (3, 5) and (2, 3, 3): rank quads that span adapters
    g = torch.Generator().manual_seed(tokens + k)
    x, weight = torch.randn(tokens, k, generator=g) * 3, torch.rand(k, generator=g) + 0.5
    rank = sum(ranks)
    A = torch.randn(rank, k, generator=g)
    stride = pad(k, 64)
    xn, h = poisoned((tokens, stride)), poisoned((tokens, rank))
    launch = rmsnorm_launch(upload(x.numpy()), upload(weight.numpy()), xn, tokens=tokens, k=k, eps=1e-5,
                            lora_a=upload(padded(A, stride)), h=h, rank=rank, per_row=per_row,
                            dropout=site(ranks, 0.3, seed=9))
    got_xn, got_h = run([launch], xn, h)
    y = rmsnorm_reference(x.double(), weight.double(), 1e-5)
    assert_close(got_xn[:, :k], y, 1e-6, "normalised (no dropout)")
    first = 0
    for r, m in zip(ranks, masks(ranks, 0.3, 9, tokens, k)):
        assert 0 < int((m == 0).sum()) < m.numel()
        assert_close(got_h[:, first:first + r], (y * m.double()) @ A[first:first + r].double().T, 1e-5, f"h {first}..")
        first += r


@pytest.mark.parametrize("splits", [1, 3], ids=["one-range", "split-k"])
@pytest.mark.parametrize("kind", ["bitlinear", "matmul"])
def test_adapter_backward_with_dropout_matches_autograd(kind, splits):
    """A fused projection of 40 rows read by two adapters (rows 0..23 rank 3, rows 24..39 rank 5,
    so a rank quad spans both): dh, dB, dA and the input gradient with each adapter's dropout,
    against float64 autograd of y = x·Wᵀ + Σ s·B·A·(m ⊙ x) with the reference's masks."""
    g = torch.Generator().manual_seed(11)
    tokens, rows, k, scale, p, seed = 37, 40, 100, 0.75, 0.25, 5
    adapters = [((0, 24, 1), 3), ((24, 40, 1), 5)]
    ranks = tuple(r for _, r in adapters)
    x, dy = torch.randn(tokens, k, generator=g), torch.randn(tokens, rows, generator=g)
    As = [torch.randn(r, k, generator=g) for r in ranks]
    Bs = [torch.randn(end - begin, r, generator=g) for (begin, end, _), r in adapters]
    ms = masks(ranks, p, seed, tokens, k)
    h = torch.cat([(x * m) @ A.T for A, m in zip(As, ms)], 1)
    b_offsets, a_offset = (0, 128), 256
    lb = np.zeros(a_offset + 8 * pad(k, 64), np.float32)
    for off, B in zip(b_offsets, Bs):
        lb[off:off + B.numel()] = B.numpy().ravel()
    stacked = torch.cat(As)
    grads, dh = upload(np.zeros_like(lb)), upload(np.zeros((tokens, 8), np.float32))
    drop = site(ranks, p, seed)
    launches, col = [], 0
    for ((span, r), off) in zip(adapters, b_offsets):
        launches.append(dh_launch(upload(dy.numpy()), upload(lb), dh, tokens=tokens, rows=span, rank=r, h_col=col,
                                  b_offset=off, scale=scale))
        launches.append(db_launch(upload(dy.numpy()), upload(h.numpy()), grads, tokens=tokens, rows=span, rank=r,
                                  h_col=col, b_offset=off, scale=scale))
        col += r
    launches.append(da_launch(dh, upload(padded(x, pad(k, 64))), grads, tokens=tokens, rank=8, k=k,
                              a_offset=a_offset, dropout=drop))
    out = poisoned((tokens, pad(k, 64)))
    lora = dict(dh=dh, lora_a=upload(padded(stacked, pad(k, 64))), lora_rank=8, splits=splits, dropout=drop)
    if kind == "bitlinear":
        values = torch.randint(-1, 2, (rows, k), generator=g, dtype=torch.int8)
        scales = torch.rand(rows, generator=g) + 0.5
        proj = Projection(upload(pack_ternary(values)), upload(scales.numpy()), rows, k, True)
        launches += bitlinear_t_launch(upload(dy.numpy()), proj, out, tokens=tokens, k=k, workspace=kernel_workspace(),
                                       **lora)
        dx_base = bitlinear_t_reference(dy, values, scales, True)
    else:
        weight = torch.randn(rows, k, generator=g)
        proj = Projection(upload(float_rows(weight, False)), None, rows, k)
        launches += matmul_t_launch(upload(dy.numpy()), proj, out, tokens=tokens, k=k, workspace=kernel_workspace(),
                                    **lora)
        dx_base = dy.double() @ weight.double()
    got_grads, got_dx = run(launches, grads, out)
    dx_ref = dx_base.clone()
    for ((begin, end, _), r), off, A, B, m, first in zip(adapters, b_offsets, As, Bs, ms, (0, 3)):
        dA_ref, dB_ref, dx_lora = lora_grad_reference(x, dy[:, begin:end], A, B, scale, m)
        assert_close(got_grads[off:off + B.numel()].reshape(B.shape), dB_ref, RTOL, f"dB rows {begin}..")
        at = a_offset + first * pad(k, 64)
        assert_close(got_grads[at:at + r * pad(k, 64)].reshape(r, -1)[:, :k], dA_ref, RTOL, f"dA rows {begin}..")
        dx_ref += dx_lora
    assert_close(got_dx[:, :k], dx_ref, RTOL, "dx")


# -- the engine -----------------------------------------------------------------------------------

def with_dropout(model: nn.Module, p: float) -> nn.Module:
    for m in lora_modules(model).values():
        m.lora_dropout = nn.Dropout(p)
    return model


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_adapter_gradient_with_dropout_matches_autograd_with_the_same_masks(flavour):
    model = with_dropout(tiny_model(flavour, adapters=True, seed=1), 0.3)
    randomize_lora_B(model, seed=2)
    engine = BitNetEngine(model)
    data = labelled_batch(model, [11, 6, 9])
    parity = check_parity(model, data, engine=engine, dropout_seed=1234)
    assert_parity(parity, flavour)
    without = check_parity(model, data, engine=engine)  # eval mode: no dropout
    loss = parity.report.loss_torch
    assert abs(without.report.loss_torch - loss) > 100 * LOSS_RTOL * abs(loss)


def test_training_mode_logits_and_loss_drop_with_seeds_from_torchs_generator():
    """In training mode the engine's forward drops, seeded from torch's generator: the same
    torch.manual_seed repeats a pass, the next draw changes it, the loss and the logits of one
    call share their masks, and torch fed those masks gives the same logits (dense: no int8
    rounding between them; tolerance as test_model's)."""
    model = with_dropout(tiny_model("dense", adapters=True, seed=3), 0.5).train()
    engine = BitNetEngine(model)
    data = labelled_batch(model, [10, 7])
    ids, mask, labels = data["input_ids"], data["attention_mask"], data["labels"]

    def call(seed=None):
        if seed is not None:
            torch.manual_seed(seed)
        return engine(ids, attention_mask=mask, labels=labels, return_logits=True)

    first, following, repeated = call(0), call(), call(0)
    assert torch.equal(first.logits, repeated.logits) and first.loss.item() == repeated.loss.item()
    assert first.loss.item() != following.loss.item()
    assert abs(causal_lm_loss(first.logits, labels).item() - first.loss.item()) <= LOSS_RTOL * first.loss.item()
    torch.manual_seed(0)
    seed = int(torch.randint(0, 2**32, (), dtype=torch.int64))  # the engine's draw after manual_seed(0)
    modules = lora_modules(model)
    with replayed_dropout(modules, engine_dropout_masks(engine, modules, seed, *ids.shape)):
        reference = torch_logits(model.eval(), ids, mask)
    assert_close(first.logits, reference, LOGIT_RTOL, "logits")
    with torch.no_grad():
        assert not torch.equal(engine(ids, attention_mask=mask).logits, reference)  # eval: no dropout
        model.train()
        torch.manual_seed(0)
        assert torch.equal(engine(ids, attention_mask=mask).logits, first.logits)  # no autograd, still dropped


def test_generation_with_dropout_active_is_refused():
    model = with_dropout(tiny_model("packed", adapters=True), 0.1).train()
    with pytest.raises(ValueError, match="call model.eval"):
        BitNetEngine(model).decode_session(1, 4, 4)


def test_adapters_that_would_drop_differently_are_refused():
    model = with_dropout(tiny_model("dense", adapters=True), 0.1).train()
    next(iter(lora_modules(model).values())).lora_dropout = nn.Dropout(0.2)
    engine = BitNetEngine(model)
    data = labelled_batch(model, [6])
    with pytest.raises(ValueError, match="one LoRA dropout probability"):
        engine(data["input_ids"], labels=data["labels"])
    next(iter(lora_modules(model).values())).lora_dropout = nn.AlphaDropout(0.1)
    with pytest.raises(ValueError, match="AlphaDropout"):
        engine(data["input_ids"], labels=data["labels"])


def test_engine_steps_with_dropout_match_torch_steps_with_the_same_masks():
    """Five one-submit optimizer steps of two micro-batches (padded to one shape on the engine)
    with dropout 0.2, against the torch path fed each micro-batch's masks (the engine draws one
    seed a micro-batch, in order, from torch's generator). Tolerance: the twenty-step test's."""
    model, twin, engine, ours, theirs = twins(8)
    with_dropout(model, 0.2).train()
    modules = lora_modules(twin)
    for step in range(5):
        micro = micro_batches(model, seed=100 + step)
        shape = (max(b["input_ids"].shape[0] for b in micro), max(b["input_ids"].shape[1] for b in micro))
        torch.manual_seed(step)
        done = engine.train_step(micro, ours, max_grad_norm=1.0)
        torch.manual_seed(step)
        seeds = [int(torch.randint(0, 2**32, (), dtype=torch.int64)) for _ in micro]
        tokens = sum(labelled_tokens(b["labels"]) for b in micro)
        loss = 0.0
        for b, seed in zip(micro, seeds):
            rows, length = b["input_ids"].shape
            masks = {name: m[:rows, :length] for name, m in engine_dropout_masks(engine, modules, seed, *shape).items()}
            with replayed_dropout(modules, masks):
                out = twin(**b)
            n = labelled_tokens(b["labels"])
            (out.loss * n / tokens).backward()
            loss += out.loss.item() * n / tokens
        assert abs(done["loss"] - loss) <= LOSS_RTOL * loss
        torch.nn.utils.clip_grad_norm_(lora_parameters(twin), 1.0)
        theirs.step()
        theirs.zero_grad()
    assert_twins_agree(engine, model, twin)
