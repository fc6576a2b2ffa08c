"""Whole-model gradient parity: the WebGPU kernels, or the whole-model engine, against PyTorch autograd.

>>> # model = apply_lora(load_bitnet(folder)); randomize_lora_B(model, seed=0)
>>> # report = compare_gradients(model, {"input_ids": ids})
>>> # print(report)                 # a markdown table, one row per adapter tensor
>>> # report.max_rel_error, report.loss_difference, report.to_dataframe()
>>> # compare_gradients(model, ids, same_forward=True)  # the gradient error alone (see below)
>>> # compare_gradients(model, ids, engine=BitNetEngine(model), same_forward=True)

``compare_gradients`` runs one forward and backward with every adapter on
``backend="wgpu"`` (or on ``engine``: the whole model on WebGPU, gradients from the engine's
own backward) and one with ``backend="torch"`` (transformers' modules and plain torch ops,
differentiated by autograd, with the straight-through backward of the quantised layers), on
the same batch and weights, and reports how far apart the adapter gradients are.

A fresh adapter has lora_B = 0, which makes every lora_A gradient exactly zero on both sides:
such a row proves nothing and is flagged (``GradientRow.reference_zero``); ``randomize_lora_B``
gives every adapter a seeded nonzero B first, so that every row is a real comparison.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from .bitnet import is_linear_like, layer_index, lora_modules, swapped_dropout
from .quantisation import FLIP_SHARE, FeedStats, feeding_codes

_PARAMS = ("A", "B")


@dataclass(frozen=True)
class GradientRow:
    """One adapter tensor's gradient comparison.

    ``max_rel_error`` is ``max|g_wgpu - g_torch| / max|g_torch|``: the worst error
    relative to the tensor's own scale (an entry-wise ratio would blow up on entries
    near zero). It is 0 when both gradients are exactly zero (``lora_A`` of a fresh
    adapter, whose B is zero) and inf when only the reference is.
    """

    module: str
    layer: int | None
    target: str
    param: str
    max_abs_error: float
    max_rel_error: float
    reference_max: float

    @property
    def reference_zero(self) -> bool:
        """The reference gradient is identically zero: the row compares nothing."""
        return self.reference_max == 0


@dataclass(frozen=True)
class GradientReport:
    """Per-adapter gradient errors plus both losses. ``str(report)`` is a markdown table."""

    rows: list[GradientRow]
    loss_wgpu: float
    loss_torch: float
    flips: int | None = None  # engine comparisons of quantised models: int8 codes fed that differ (near-ties)
    codes: int | None = None

    @property
    def loss_difference(self) -> float:
        """``|loss_wgpu - loss_torch|``."""
        return abs(self.loss_wgpu - self.loss_torch)

    @property
    def max_abs_error(self) -> float:
        return max(row.max_abs_error for row in self.rows)

    @property
    def max_rel_error(self) -> float:
        return max(row.max_rel_error for row in self.rows)

    @property
    def rms_rel_error(self) -> float:
        """The rows' ``max_rel_error`` combined as a root mean square: the typical tensor's error."""
        return (sum(row.max_rel_error ** 2 for row in self.rows) / len(self.rows)) ** 0.5

    def __str__(self) -> str:
        lines = ["| layer | module | param | max abs error | max rel error |",
                 "| ---: | :--- | :---: | ---: | ---: |"]
        for row in self.rows:
            layer = "" if row.layer is None else str(row.layer)
            flag = " (reference is 0: compares nothing)" if row.reference_zero else ""
            lines.append(f"| {layer} | {row.target} | {row.param} "
                         f"| {row.max_abs_error:.3e} | {row.max_rel_error:.3e}{flag} |")
        lines.append("")
        lines.append(f"loss: wgpu {self.loss_wgpu:.8f}, torch {self.loss_torch:.8f}, "
                     f"difference {self.loss_difference:.3e}")
        zero = sum(row.reference_zero for row in self.rows)
        if zero:
            lines.append(f"{zero} of {len(self.rows)} rows have an all-zero reference gradient (lora_B = 0?): "
                         "randomize_lora_B(model, seed) makes them real comparisons")
        if self.codes is not None:
            lines.append(f"torch was fed the engine's int8 activation codes: {self.flips} of {self.codes} differ "
                         "from torch's own rounding, each at a rounding tie")
        return "\n".join(lines)

    def to_dataframe(self) -> Any:
        """The rows as a pandas DataFrame (needs pandas: ``pip install pandas``)."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("GradientReport.to_dataframe needs pandas (pip install pandas)") from e
        return pd.DataFrame([row.__dict__ for row in self.rows])


def _as_batch(batch: Mapping[str, torch.Tensor] | torch.Tensor) -> dict[str, torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        batch = {"input_ids": batch}
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise ValueError("batch must be a tensor of input_ids or a mapping with 'input_ids' "
                         f"(and optionally 'attention_mask', 'labels'); got {type(batch).__name__}"
                         + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else ""))
    batch = dict(batch)
    batch.setdefault("labels", batch["input_ids"])
    if batch.get("position_ids") is not None:  # packed rows
        # transformers keeps packed examples apart only without an attention mask and without a cache
        if batch.get("attention_mask") is not None or batch.get("use_cache"):
            raise ValueError("a batch of packed rows (position_ids) goes in without an attention_mask and with "
                             "use_cache=False: transformers keeps packed examples apart only then")
        batch["use_cache"] = False
    return batch


def _loss_and_grads(model: nn.Module, batch: dict[str, torch.Tensor],
                    params: list[nn.Parameter]) -> tuple[float, list[torch.Tensor]]:
    loss = model(**batch).loss
    if loss is None:
        raise ValueError("the model returned no loss; pass labels or a causal LM that computes one")
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.item(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def _projections(model: nn.Module) -> dict[str, nn.Module]:
    """Adapter-wrapped layers and bare linear-like layers (not those inside an adapter), by name."""
    adapters = lora_modules(model)
    inside = tuple(f"{name}." for name in adapters)
    return {name: m for name, m in model.named_modules()
            if name in adapters or (name and is_linear_like(m) and not name.startswith(inside))}


@contextmanager
def _recording(model: nn.Module, outputs: dict[str, list[torch.Tensor]]) -> Iterator[None]:
    """Record every projection's output values, in call order."""
    def hook(name: str) -> Callable[..., None]:
        return lambda module, args, output: outputs.setdefault(name, []).append(output.detach())

    handles = [m.register_forward_hook(hook(name)) for name, m in _projections(model).items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _replaying(model: nn.Module, outputs: dict[str, list[torch.Tensor]]) -> Iterator[None]:
    """Make every projection output the recorded values, keeping this pass's autograd graph:
    ``recorded + (y - y.detach())`` equals ``recorded`` exactly and has y's gradient."""
    remaining = {name: list(values) for name, values in outputs.items()}

    def hook(name: str) -> Callable[..., torch.Tensor]:
        def replace(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            queue = remaining.get(name)
            if not queue or queue[0].shape != output.shape:
                raise RuntimeError(f"same_forward: {name} produced no matching output in the first pass; "
                                   "the reference must have the same architecture and see the same batch")
            return queue.pop(0) + (output - output.detach())
        return replace

    handles = [m.register_forward_hook(hook(name)) for name, m in _projections(model).items()]
    try:
        yield
        unused = sorted(name for name, queue in remaining.items() if queue)
        if unused:
            raise RuntimeError(f"same_forward: the second pass never produced the outputs of {unused}; "
                               "the reference must have the same architecture")
    finally:
        for h in handles:
            h.remove()


def _check_reference(adapters: dict[str, nn.Module], reference_adapters: dict[str, nn.Module]) -> None:
    if list(adapters) != list(reference_adapters):
        raise ValueError(f"reference has adapters {list(reference_adapters)}, the model {list(adapters)}; "
                         "they must be the same (apply_lora with the same targets)")
    for name, m in adapters.items():
        ref = reference_adapters[name]
        same = all(torch.equal(getattr(m, p), getattr(ref, p).to(getattr(m, p).dtype)) for p in ("lora_A", "lora_B"))
        if not same or m.scaling != ref.scaling:
            raise ValueError(f"adapter {name} differs between the model and the reference; copy it over "
                             "(reference.load_state_dict(lora_state_dict(model), strict=False))")


@torch.no_grad()
def randomize_lora_B(model: nn.Module, seed: int, std: float = 0.1) -> nn.Module:
    """Give every adapter's lora_B seeded N(0, std²) values (a fresh B = 0 makes dA exactly 0)."""
    generator = torch.Generator().manual_seed(seed)
    for m in lora_modules(model).values():
        m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=generator) * std)
    return model


def _engine_pass(engine: Any, batch: dict[str, torch.Tensor], params: list[nn.Parameter],
                 codes: dict | None, dropout_seed: int | None) -> tuple[float, list[torch.Tensor]]:
    ids, mask, positions = batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids")
    lengths = [ids.shape[1]] * ids.shape[0] if mask is None else mask.sum(1).tolist()
    loss, grads = engine.loss_and_grads(ids.cpu().long(), batch["labels"].cpu().long(), lengths, codes=codes,
                                        dropout_seed=dropout_seed,
                                        positions=None if positions is None else positions.cpu().long())
    return loss.item(), [grads[p] for p in params]


class _FixedMask(nn.Module):
    """A dropout that multiplies by a given mask (0 or the scale): the engine's, replayed in torch."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape != self.mask.shape:
            raise RuntimeError(f"dropout replay: an adapter input of shape {tuple(x.shape)}, the engine's mask "
                               f"{tuple(self.mask.shape)}")
        return x * self.mask.to(x.dtype)


def engine_dropout_masks(engine: Any, modules: dict[str, nn.Module], seed: int, batch: int,
                         tokens: int) -> dict[str, torch.Tensor]:
    """The LoRA dropout masks (0 or 1 / (1 − p), [batch, tokens, in_features]) the engine's kernels
    apply to each adapter's input in a pass of ``batch`` × ``tokens`` positions seeded with
    ``seed`` (``engine.adapters.dropout_masks``), by the adapters' names in ``modules``."""
    masks = engine.adapters.dropout_masks(seed, batch * tokens)
    by_name = {name: masks[m] for name, m in lora_modules(engine.model).items()}
    return {name: by_name[name].reshape(batch, tokens, -1) for name in modules}


def replayed_dropout(modules: dict[str, nn.Module],
                     masks: dict[str, torch.Tensor] | None) -> AbstractContextManager[None]:
    """Every adapter's dropout replaced by its mask from ``masks``, for the duration (nothing
    changes when None)."""
    if not masks:
        return nullcontext()
    return swapped_dropout(modules, {name: _FixedMask(mask) for name, mask in masks.items()})


def compare_gradients(model: nn.Module, batch: Mapping[str, torch.Tensor] | torch.Tensor, *,
                      reference: nn.Module | None = None, same_forward: bool = False,
                      engine: Any = None, backend: str = "wgpu", dropout_seed: int | None = None) -> GradientReport:
    """Adapter gradients from the WebGPU kernels vs. from autograd, on one batch.

    Pass 1 runs ``model`` with every adapter on ``backend="wgpu"``; pass 2 runs
    ``reference`` (default: ``model`` itself) with ``backend="torch"``. A reference is
    another copy of the model holding the same adapters, e.g. the ``AutoBitLinear``
    (unpacked) copy of a packed checkpoint, or a float64 copy (``check_parity``'s).

    ``batch`` is a tensor of input ids or a mapping of model inputs; labels default to
    the input ids (next-token loss). Packed rows come with ``position_ids`` and no attention
    mask (transformers then runs them without a cache, keeping their examples apart). The
    models run in eval mode (no dropout, so both passes see the same function). Gradients
    come from ``torch.autograd.grad``, so no parameter's ``.grad`` is touched; each adapter's
    backend and each module's train/eval mode are restored afterwards, even on error.

    Quantised models round activations to int8 (``round(x·127/absmax)``). The two
    passes' adapter outputs differ by float32 rounding (~1e-7), and now and then that
    moves one activation across a rounding boundary in a later layer; the passes then
    evaluate slightly different functions and gradients differ by 1e-4 to 3e-3
    (relative; measured on tiny models in about one batch in eight) rather than ~1e-6.
    With ``same_forward=True`` pass 2 sees exactly pass 1's forward: the output of
    every projection (adapter-wrapped or bare linear layer) is replaced by pass 1's
    value plus a zero carrying pass 2's own autograd graph, so the table shows the
    gradient error alone (at the cost of keeping every projection output of pass 1
    in memory).

    ``engine``, a ``BitNetEngine`` of ``model``, runs pass 1 instead: the whole model's forward
    and backward on WebGPU. With ``same_forward=True`` a quantised model's pass 2 is then fed
    the engine's int8 activation codes (``integrations.quantisation``): each code that differs
    from torch's own rounding must sit at a rounding tie, and the report counts them.

    ``backend="torch"`` makes pass 1 plain torch too (given ``engine``, after one engine pass
    for its int8 codes, fed to both passes): PyTorch float32's own error against a float64
    ``reference``, the scale ``check_parity`` measures WebGPU's against.

    ``dropout_seed`` (with ``engine``): the gradients with LoRA dropout. The engine's pass runs
    its adapters in training mode with masks seeded by it; the torch passes multiply each
    adapter's input by the same masks, computed in torch (``engine_dropout_masks``).

    >>> # print(compare_gradients(model, ids))
    """
    adapters = lora_modules(model)
    if not adapters:
        raise ValueError("the model has no LoRA adapters; call apply_lora(model) first")
    batch = _as_batch(batch)
    reference = model if reference is None else reference
    reference_adapters = lora_modules(reference)
    if reference is not model:
        _check_reference(adapters, reference_adapters)
    if backend not in ("wgpu", "torch"):
        raise ValueError(f"backend must be 'wgpu' or 'torch', got {backend!r}")
    if dropout_seed is not None and engine is None:
        raise ValueError("dropout_seed compares the engine's LoRA dropout: pass engine too")
    passes = ((model, adapters, backend), (reference, reference_adapters, "torch"))
    backends = {m: m.backend for _, modules, _ in passes for m in modules.values()}
    modes = {m: m.training for net, _, _ in passes for m in net.modules()}
    outputs: dict[str, list[torch.Tensor]] = {}
    results = []
    codes: dict | None = {} if engine is not None and same_forward else None
    stats = FeedStats()
    try:
        masks = None
        for index, (net, modules, backend) in enumerate(passes):
            net.eval()
            for m in modules.values():
                m.backend = backend
            params = [p for m in modules.values() for p in (m.lora_A, m.lora_B)]
            if index == 0 and engine is not None:
                if dropout_seed is not None:  # the engine drops in training mode; the torch passes replay it
                    for m in modules.values():
                        m.train()
                    masks = engine_dropout_masks(engine, modules, dropout_seed, *batch["input_ids"].shape)
                result = _engine_pass(engine, batch, params, codes, dropout_seed)
                net.eval()
                if backend == "wgpu":
                    results.append(result)
                    continue
            if not same_forward:
                hooks = nullcontext()
            elif engine is not None:
                hooks = feeding_codes(net, codes, stats) if codes else nullcontext()
            else:
                hooks = _recording(net, outputs) if index == 0 else _replaying(net, outputs)
            with hooks, replayed_dropout(modules, masks):
                results.append(_loss_and_grads(net, batch, params))
    finally:
        for m, backend in backends.items():
            m.backend = backend
        for m, training in modes.items():
            m.training = training
    (loss_wgpu, grads_wgpu), (loss_torch, grads_torch) = results
    rows = []
    names = [(name, param) for name in adapters for param in _PARAMS]
    for (name, param), g_wgpu, g_torch in zip(names, grads_wgpu, grads_torch):
        error = (g_wgpu.double() - g_torch.double()).abs().max().item()
        scale = g_torch.abs().max().item()
        rel = error / scale if scale > 0 else (0.0 if error == 0 else float("inf"))
        rows.append(GradientRow(module=name, layer=layer_index(name), target=name.rsplit(".", 1)[-1],
                                param=param, max_abs_error=error, max_rel_error=rel, reference_max=scale))
    fed = bool(codes)
    return GradientReport(rows=rows, loss_wgpu=loss_wgpu, loss_torch=loss_torch,
                          flips=stats.flips if fed else None, codes=stats.codes if fed else None)


# -- the tolerance policy ------------------------------------------------------------------------

def longest_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """The number of terms in the longest float32 sum behind an adapter gradient: the widest
    linear layer input (the adapters' sums over features, and the backward's through the
    layers after them) or the batch's token count (the adapter gradients' sums over tokens)."""
    widest = max(getattr(m, "in_features", 0) for m in model.modules())
    return max(widest, batch["input_ids"].numel())


@dataclass(frozen=True)
class ParityCheck:
    """Adapter gradients, WebGPU against PyTorch autograd in float64 with the forward pinned
    (``compare_gradients(..., reference=<float64 copy>, same_forward=True)``), the same error of
    PyTorch's own float32 autograd, and the largest error against float32 autograd with two
    independent forwards.

    The measure is the root mean square over the adapter tensors of each one's max relative
    error (``GradientReport.rms_rel_error``), and ``tolerance`` is twice the larger of PyTorch
    float32's own such error against float64 on the same batch and n·2^-24 (n = ``longest_sum``).
    Why: a float32 implementation that sums in other orders is as far from the exact gradient as
    torch's float32 is, give or take the luck of the rounding, and on small random models some
    gradients are ill-conditioned enough to turn 1e-7 differences in activations into 1e-5
    (measured: two engine builds differing only in one reduction's order differ by 1.6e-5 on one
    tensor). A root mean square over tensors evens that luck out where a maximum would not, and
    a factor of 2 for float32 against a float64 reference is what PyTorch's own compiler tests
    use (``torch._dynamo.utils.same`` with ``fp64_ref``). The floor n·2^-24 (one float32 sum of
    n terms) keeps a batch on which torch happens to be nearly exact from asking more than
    float32 can give. A wrong gradient in even one tensor (errors of order 1) lifts the root
    mean square far above it.
    """

    report: GradientReport
    longest_sum: int
    float32_rms_rel_error: float
    unpinned_max_rel_error: float
    whole_model: bool = False  # pass 1 was a BitNetEngine

    @property
    def tolerance(self) -> float:
        return 2 * max(self.float32_rms_rel_error, self.longest_sum * 2.0 ** -24)

    @property
    def passed(self) -> bool:
        flips_ok = self.report.codes is None or self.report.flips <= FLIP_SHARE * self.report.codes
        return self.report.rms_rel_error <= self.tolerance and flips_ok

    def __str__(self) -> str:
        verdict = "within" if self.passed else "ABOVE"
        if self.whole_model:
            pinned = "Pass 1 ran the whole model on WebGPU (BitNetEngine); " + (
                "torch was fed its int8 activation codes, and everything else each pass computed itself.\n"
                if self.report.codes is not None else "each pass computed its own forward.\n")
        else:
            pinned = "Pass 2 replayed pass 1's projection outputs (same_forward=True): the table is the backward's error.\n"
        return (f"{self.report}\n"
                f"rms of the max rel errors {self.report.rms_rel_error:.2e} (largest {self.report.max_rel_error:.2e}) "
                f"against autograd in float64: {verdict} the tolerance {self.tolerance:.2e}\n(2 × the larger of "
                f"PyTorch float32's own, {self.float32_rms_rel_error:.2e}, and n·2^-24 with n = {self.longest_sum}).\n"
                + pinned +
                f"Against autograd in float32 with two independent forwards the max rel error is "
                f"{self.unpinned_max_rel_error:.2e}: on a quantised model the\nadapter outputs' float32 rounding "
                "differences now and then round an int8 activation the other\nway in a later layer, and from there "
                "the passes compute slightly different functions.")


def check_parity(model: nn.Module, batch: dict[str, torch.Tensor], engine: Any = None,
                 dropout_seed: int | None = None) -> ParityCheck:
    """Compare ``model``'s adapter gradients on ``batch`` (see ``ParityCheck``), from the WebGPU
    LoRA kernels or, given ``engine``, from the whole-model engine (with ``dropout_seed``, with
    its LoRA dropout: ``compare_gradients``). It makes a float64 copy of the model for the
    duration (twice the float32 model's memory).

    >>> # print(check_parity(apply_lora(load_bitnet(path)), {"input_ids": ids}))
    """
    exact = copy.deepcopy(model).double()
    options = dict(engine=engine, dropout_seed=dropout_seed)
    report = compare_gradients(model, batch, reference=exact, same_forward=True, **options)
    float32 = compare_gradients(model, batch, reference=exact, same_forward=True, backend="torch", **options)
    del exact
    return ParityCheck(report=report, longest_sum=longest_sum(model, batch),
                       float32_rms_rel_error=float32.rms_rel_error,
                       unpinned_max_rel_error=compare_gradients(model, batch, **options).max_rel_error,
                       whole_model=engine is not None)
