"""Shared by the engine's tests: tiny models and batches, launches run and read back, poisoned
buffers, the one closeness check, the engine-against-torch training twins, and generation's
tokenizer and references."""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import numpy as np
import torch

from torch_wgpu_lora import BitNetEngine, WgpuAdamW
from torch_wgpu_lora.engine import GenerationRequest, Generated
from torch_wgpu_lora.demo import demo_records
from torch_wgpu_lora.engine.kernels.norm import quantise_reference
from torch_wgpu_lora.engine.workspace import Workspace
from torch_wgpu_lora.integrations.bitnet import add_lora_layers, lora_parameters, load_bitnet
from torch_wgpu_lora.integrations.gradcheck import ParityCheck, randomize_lora_B
from torch_wgpu_lora.integrations.quantisation import FLIP_SHARE, FeedStats, feeding_codes
from torch_wgpu_lora.integrations.tiny import build_tiny_bitnet, build_tiny_tokenizer
from torch_wgpu_lora.logits import process_logits
from torch_wgpu_lora.loss import IGNORE_INDEX, labelled_tokens
from torch_wgpu_lora.runtime import Buffer, Recorder, get_device, write
from torch_wgpu_lora.training.data import Example, collate, pack

# Logits of the engine against transformers': within 1e-4 of the largest |logit| (float32 on both
# sides, sums in other orders: errors ~1e-6 of the scale, so 100× margin; an indexing bug gives O(1)).
LOGIT_RTOL = 1e-4
# A loss (a mean of float32 cross-entropies summed in another order) against torch's.
LOSS_RTOL = 1e-5

CONFIGS = {
    "gqa-tied": {},
    "untied-mha-3-layers": dict(tie_word_embeddings=False, num_key_value_heads=4, num_hidden_layers=3),
    "odd-sizes": dict(hidden_size=48, intermediate_size=40, num_attention_heads=4, num_key_value_heads=1,
                      vocab_size=67, num_hidden_layers=1),
}


def tiny_model(flavour: str, adapters: bool, seed: int = 0, **config) -> torch.nn.Module:
    """A tiny BitNet of ``flavour`` built offline, in eval mode; with ``adapters``, r=4 adapters on five
    projections whose B is random (so every adapter changes the logits)."""
    model = load_bitnet(build_tiny_bitnet(tempfile.mkdtemp(), flavour=flavour, seed=seed, **config))
    if adapters:
        add_lora_layers(model, r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def batch(vocab: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids [len(lengths), max(lengths)] and the right-padding mask of ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    tokens = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), tokens), generator=g)
    mask = (torch.arange(tokens)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def labelled_batch(model: torch.nn.Module, lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch with labels on every real position but the first two (a prompt without loss, as in
    instruction tuning)."""
    ids, mask = batch(model.config.vocab_size, lengths, seed)
    labels = ids.clone()
    labels[:, :2] = IGNORE_INDEX
    labels[mask == 0] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_positions(runs: list[list[int]]) -> torch.Tensor:
    """Position ids [rows, tokens] of packed rows, each a list of its examples' lengths (the last may
    be the padding, which continues as one more example), every row of the same total."""
    rows = [[i for n in row for i in range(n)] for row in runs]
    if len({len(r) for r in rows}) != 1:
        raise ValueError(f"packed rows of different lengths: {runs}")
    return torch.tensor(rows)


class Packing:
    """Examples, the rows of a right-padded batch (``lengths`` real tokens each), packed in order into
    rows of ``tokens``: ``rows[r]`` lists packed row r's examples; what is left of a row is padding,
    one more example."""

    def __init__(self, lengths: list[int], rows: list[list[int]], tokens: int) -> None:
        assert sorted(e for row in rows for e in row) == list(range(len(lengths)))
        assert all(sum(lengths[e] for e in row) <= tokens for row in rows)
        self.lengths, self.rows, self.tokens = lengths, rows, tokens
        # where each example's tokens go: (example, token) -> (packed row, column)
        src, dst = [], []
        for r, row in enumerate(rows):
            column = 0
            for e in row:
                src += [(e, j) for j in range(lengths[e])]
                dst += [(r, column + j) for j in range(lengths[e])]
                column += lengths[e]
        self.src, self.dst = torch.tensor(src).T, torch.tensor(dst).T

    @property
    def runs(self) -> list[list[int]]:
        """Each packed row's examples' lengths, the padding last where there is some."""
        out = []
        for row in self.rows:
            used = [self.lengths[e] for e in row]
            out.append(used + ([self.tokens - sum(used)] if sum(used) < self.tokens else []))
        return out

    def pack(self, x: torch.Tensor, fill: float | int) -> torch.Tensor:
        """``x`` [examples, longest, ...] laid out as the packed rows [rows, tokens, ...], ``fill`` elsewhere."""
        out = torch.full((len(self.rows), self.tokens, *x.shape[2:]), fill, dtype=x.dtype)
        out[self.dst[0], self.dst[1]] = x[self.src[0], self.src[1]]
        return out

    def batch(self, separate: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A batch of the examples' rows (``labelled_batch``'s) as packed rows: ids, labels (none on
        the padding) and position ids, no attention mask (as transformers takes packed rows)."""
        return {"input_ids": self.pack(separate["input_ids"], 0), "labels": self.pack(separate["labels"], IGNORE_INDEX),
                "position_ids": packed_positions(self.runs)}


class PackedEngine:
    """An engine running a batch of separate rows by running them as packed rows (``packing``): what
    ``integrations.gradcheck`` asks of it (``loss_and_grads``) on the rows, the engine computes
    packed. The int8 codes it hands back are the packed pass's at every real token; the rows'
    padding, which packing drops, takes the codes of a pass over the rows as they are."""

    def __init__(self, engine: BitNetEngine, packing: Packing) -> None:
        self.engine, self.packing = engine, packing

    def loss_and_grads(self, ids: torch.Tensor, labels: torch.Tensor, lengths: list[int], codes: dict | None = None,
                       dropout_seed: int | None = None, positions: torch.Tensor | None = None) -> tuple:
        assert positions is None and dropout_seed is None and lengths == self.packing.lengths
        packed = self.packing.batch({"input_ids": ids, "labels": labels})
        rows, tokens = packed["input_ids"].shape
        if codes is not None:
            self.engine.loss_and_grads(ids, labels, lengths, codes=codes)  # every token's, the padding's kept
        ours: dict | None = {} if codes is not None else None
        loss, grads = self.engine.loss_and_grads(packed["input_ids"], packed["labels"], [tokens] * rows, codes=ours,
                                                 positions=packed["position_ids"])
        p = self.packing
        for key, (values, scales) in (ours or {}).items():
            kept, kept_scales = codes[key]
            kept[p.src[0], p.src[1]] = values[p.dst[0], p.dst[1]]
            width = kept.shape[1]
            kept_scales[p.src[0] * width + p.src[1]] = scales[p.dst[0] * tokens + p.dst[1]]
        return loss, grads


# Packed rows for the kernels' tests: one, two and three examples a row, examples of one token,
# a last run of padding (one more example to the kernels), runs across 64-key tiles.
PACKED_ROWS = {
    "short": [[9], [4, 5], [1, 7, 1]],
    "long": [[70], [30, 1, 39], [64, 6], [1, 1, 68]],
}


def torch_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' own logits of the model, eagerly (packed rows: ``position_ids``, no mask and no
    cache, which is when transformers keeps packed examples apart)."""
    with torch.compiler.set_stance("force_eager"), torch.no_grad():
        if position_ids is not None:
            return model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        return model(input_ids=ids, attention_mask=mask).logits


def forward_with_codes(engine: BitNetEngine, ids: torch.Tensor, lengths: list[int],
                       positions: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The engine's logits [batch, tokens, vocab] and the int8 codes of every quantisation point
    (packed rows: their ``positions``, over whole rows)."""
    codes: dict = {}
    logits = engine.plan(*ids.shape, packed=positions is not None).run(ids, lengths, codes=codes, positions=positions)
    return logits, codes


def assert_parity(parity: ParityCheck, flavour: str) -> None:
    """An engine's ``check_parity`` passed on every count: each row compares something, the adapter
    gradients within the tolerance, the loss within LOSS_RTOL, and (quantised flavours) codes fed
    with few flips."""
    report = parity.report
    assert all(not row.reference_zero for row in report.rows), "a row compares nothing"
    assert report.rms_rel_error <= parity.tolerance, str(parity)
    assert report.loss_difference <= LOSS_RTOL * abs(report.loss_torch)
    if flavour != "dense":
        assert report.codes > 0 and report.flips <= FLIP_SHARE * report.codes
    assert parity.passed


def assert_close(got, ref, rtol: float, what: str, terms: float = 0.0) -> float:
    """The closeness check of the engine's tests: max |got - ref| <= rtol · max |ref| (tensors or
    arrays, compared in float64), every element of ``got`` finite. Returns the error relative to
    that scale (the absolute error when it is zero). ``terms``: the scale used instead when the
    reference is all zeros because its terms cancel exactly (float32 sums of them in another order
    reach zero only to their rounding): the size of those terms."""
    got, ref = (x.detach().double() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x)).double()
                for x in (got, ref))
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} against {tuple(ref.shape)}"
    bad = int((~torch.isfinite(got)).sum())
    assert not bad, f"{what}: {bad} elements not finite (unwritten?)"
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    scale = scale or terms
    err = float((got - ref).abs().max()) if ref.numel() else 0.0
    assert err <= rtol * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"
    return err / scale if scale else err


def assert_codes_round(codes: torch.Tensor, meta: torch.Tensor, xn: torch.Tensor, k: int) -> None:
    """A norm's int8 codes (u32 words [tokens, ≥ k / 4]) and meta (scales, then code sums) are
    BitLinear's quantisation of its own output ``xn`` [tokens, ≥ k]: the scales torch's of xn, each
    code torch's rounding of xn · scale but at a tie. The GPU's division 127/m may differ from
    torch's by an ulp, so the codes are compared with the kernel's own scale; the kernel may form
    y·s with other roundings than torch's product of the stored y and s (a fused multiply, y not
    rounded first): a few float32 ulps of |y·s| ≤ 128, under 1e-4 code units."""
    tokens = xn.shape[0]
    ours = torch.from_numpy(codes.numpy().view(np.int8).reshape(tokens, -1)[:, :k].astype(np.int64))
    scale = meta[:tokens]
    assert_close(scale, quantise_reference(xn[:, :k])[1], 2e-7, "scales")
    v = xn[:, :k] * scale[:, None]
    exact = v.round().clamp(-128, 127)
    flips = ours != exact
    away = flips & ((v - v.floor() - 0.5).abs() >= 1e-4)
    assert not away.any(), f"{int(away.sum())} codes differ from rounding the kernel's own y·s away from a tie"
    assert (ours - exact).abs().max() <= 1
    sums = meta[tokens:].numpy().view(np.int32)
    assert np.array_equal(sums, ours.sum(1).numpy())


def run(launches, *reads: Buffer) -> list[torch.Tensor]:
    """Record ``launches``, read ``reads`` back, submit once; the read buffers as tensors."""
    rec = Recorder()
    for launch in launches:
        rec.launch(launch)
    outs = []
    for buf in reads:
        out = np.empty(buf.shape, {"f32": np.float32, "u32": np.uint32, "i32": np.int32}[buf.dtype])
        rec.read(buf, out)
        outs.append(out)
    rec.submit()
    return [torch.from_numpy(o) for o in outs]


def poisoned(shape: tuple[int, ...], dtype: str = "f32") -> Buffer:
    """A buffer filled with NaN (float) or 0xDEADBEEF (integers), so an element a kernel leaves
    unwritten shows."""
    buf = Buffer(shape, dtype)
    nan_fill(buf)
    return buf


def nan_fill(buf: Buffer) -> None:
    """Overwrite ``buf`` with NaN (float) or 0xDEADBEEF (integers)."""
    write(buf, np.full(buf.shape, np.nan, np.float32) if buf.dtype == "f32" else np.full(buf.shape, 0xDEADBEEF, np.uint32))


def nan_past(cache: torch.Tensor, lengths) -> np.ndarray:
    """A KV cache [batch, kv_heads, positions, dim] as float32, NaN at every position at or past
    each sequence's length (so a key read past the length shows)."""
    x = cache.float().clone()
    for b, n in enumerate(lengths):
        x[b, :, n:] = float("nan")
    return np.ascontiguousarray(x.numpy())


def padded(x: torch.Tensor, width: int) -> np.ndarray:
    """[rows, k] as float32 rows zero-padded to ``width``."""
    out = np.zeros((x.shape[0], width), np.float32)
    out[:, : x.shape[1]] = x.numpy()
    return out


def kernel_workspace() -> Workspace:
    """A workspace for launches built outside a plan."""
    return Workspace(get_device())


# -- the engine's optimizer steps against the torch path ----------------------------------------------

def micro_batches(model: torch.nn.Module, seed: int) -> list[dict[str, torch.Tensor]]:
    """Two labelled micro-batches of different shapes."""
    return [labelled_batch(model, lengths, seed=seed + i) for i, lengths in enumerate(([9, 5], [7, 7, 3]))]


def packed_micro_batches(model: torch.nn.Module, seed: int) -> list[dict[str, torch.Tensor]]:
    """Two micro-batches of packed rows of different shapes, as the Trainer's collator makes them
    (``training.data``): [2, 9], the second row ending in padding, and [1, 11]."""
    g = torch.Generator().manual_seed(seed)

    def example(n: int) -> Example:
        ids = torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
        return Example(input_ids=ids, labels=[IGNORE_INDEX, *ids[1:]])

    return [collate(pack([example(n) for n in (5, 1, 3, 7, 1)], 9), pad_token_id=2),
            collate(pack([example(n) for n in (6, 4, 1)], 11), pad_token_id=2)]


def torch_grads(twin: torch.nn.Module, micro: list[dict]) -> tuple[dict[str, torch.Tensor], float]:
    """The torch path's backward of a step over ``micro`` (the loss per labelled token of the whole
    step) into the adapters' ``.grad``; returns those gradients by parameter name, and the step's
    summed loss."""
    tokens = sum(labelled_tokens(b["labels"]) for b in micro)
    loss_sum = 0.0
    for b in micro:
        if "position_ids" in b:  # packed rows, as transformers keeps their examples apart: no mask, no cache
            out = twin(input_ids=b["input_ids"], position_ids=b["position_ids"], labels=b["labels"], use_cache=False)
        else:
            out = twin(**b)
        n = labelled_tokens(b["labels"])
        (out.loss * n / tokens).backward()
        loss_sum += out.loss.item() * n
    return {name: p.grad.clone() for name, p in twin.named_parameters() if "lora_" in name}, loss_sum


def torch_step(twin: torch.nn.Module, micro: list[dict], optimizer: torch.optim.Optimizer,
               max_norm: float = 1.0) -> float:
    """The torch path's step over ``micro``: the loss weighted per labelled token, clipping, AdamW;
    returns the step's summed loss."""
    loss_sum = torch_grads(twin, micro)[1]
    torch.nn.utils.clip_grad_norm_(lora_parameters(twin), max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return loss_sum


def twins(seed: int, dropout: float = 0.0, **config) -> tuple:
    """A model with adapters (``config``: tiny_model's overrides), its deep copy, the engine on the
    first and the two optimizers (WgpuAdamW on the engine's, torch.optim.AdamW on the copy's) with
    the same settings. eps comparable to the gradients (not 1e-7): the update is then proportional
    to the gradient rather than its sign, so a comparison sees the gradient's size too."""
    model = tiny_model("dense", adapters=True, seed=seed, **config)
    randomize_lora_B(model, seed=seed + 1)
    twin = copy.deepcopy(model)
    ours = WgpuAdamW(lora_parameters(model), lr=5e-3, eps=1e-3)
    theirs = torch.optim.AdamW(lora_parameters(twin), lr=5e-3, eps=1e-3, weight_decay=0.01, foreach=False)
    return model, twin, BitNetEngine(model), ours, theirs


# Adapters after engine steps against torch steps from one start: 1e-4 of each tensor's scale. Each
# step's gradients agree to ~1e-6 (float32 orders), and Adam's normalised updates carry such
# differences forward without growing them much over 20 steps; a wrong gradient or update is off by O(1).
TWIN_RTOL = 1e-4


def assert_twins_agree(engine: BitNetEngine, model: torch.nn.Module, twin: torch.nn.Module) -> None:
    """Every adapter tensor of the engine's model (pulled from the GPU) within TWIN_RTOL of its
    scale of the torch twin's."""
    engine.adapters.pull()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        if "lora_" in name:
            assert_close(a.detach(), b.detach(), TWIN_RTOL, name)


# -- generation ----------------------------------------------------------------------------------------

def generate_batch(engine: BitNetEngine, prompts: list[list[int]], max_new_tokens: int | list[int], eos: set[int], *,
                   seeds: list[int] | None = None, tokens_per_submit: int = 8, on_token: Any = None,
                   batch_size: int | None = None, on_done: Any = None, **sampling: Any) -> list[Generated]:
    """``engine.generate_batch`` of the request these arguments make."""
    return engine.generate_batch(GenerationRequest(prompts, max_new_tokens, eos, seeds=seeds, sampling=sampling,
                                                   on_token=on_token, tokens_per_submit=tokens_per_submit,
                                                   batch_size=batch_size, on_done=on_done))


def mixed_prompts(vocab: int, lengths=(5, 9, 2, 13), seed: int = 0) -> list[list[int]]:
    """Prompts of ``lengths`` random tokens (none of the special ids 0, 1, 2)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def generate_alone(engine: BitNetEngine, prompt: list[int], max_new_tokens: int, eos: set[int], *, seed: int = 0,
                   **options: Any) -> Generated:
    """``engine.generate_batch`` of the one prompt ``prompt`` (with sampling seed ``seed``)."""
    return generate_batch(engine, [prompt], max_new_tokens, eos, seeds=[seed], **options)[0]


def tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained on the demo records (special tokens 0, 1, 2: bos, eos, pad)."""
    from transformers import AutoTokenizer

    texts = [r["instruction"] + " " + r["output"] for r in demo_records()]
    return AutoTokenizer.from_pretrained(build_tiny_tokenizer(tempfile.mkdtemp(), texts))


def engine_choice_is_explained_by_a_flip(model, engine, ids: list[int], penalty: float) -> tuple[int, int]:
    """At the position after ``ids``: (the engine's greedy choice, torch's greedy choice when fed the
    engine's int8 codes), after checking that feeding codes involved at least one near-tie flip."""
    x = torch.tensor([ids])
    logits, codes = forward_with_codes(engine, x, [len(ids)])
    logits = logits[0]
    stats = FeedStats()
    with feeding_codes(model, codes, stats), torch.no_grad(), torch.compiler.set_stance("force_eager"):
        fed = model(input_ids=x).logits[0, -1]
    assert stats.flips > 0, "the paths diverged without any rounding flip: a real difference"
    seen = x[0]
    return (int(torch.argmax(process_logits(logits[-1], seen, repetition_penalty=penalty))),
            int(torch.argmax(process_logits(fed, seen, repetition_penalty=penalty))))


def torch_greedy(model, ids: list[int], new_tokens: int, penalty: float) -> list[int]:
    """Greedy tokens after ``ids`` from transformers' model over the whole sequence at every step
    (no cache), with the repetition penalty of ``process_logits``."""
    ids = list(ids)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        for _ in range(new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(process_logits(logits, torch.tensor(ids), repetition_penalty=penalty))))
    return ids[-new_tokens:]
