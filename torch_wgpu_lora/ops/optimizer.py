"""The optimizer on WebGPU: its kernels, each with its torch reference beside it, the global-norm
clip (``clip.wgsl``) and AdamW (``adamw.wgsl``); ``WgpuAdamW``, the ``torch.optim.Optimizer`` built
on them; and ``clip_grad_norm``, the clip of gradients held in torch (the torch path's).

**The clip** (``clip_launches``, ``clip_reference``) reads a flat gradient and a step's per-token
losses and writes a 4-float stats buffer: [‖G‖, clip coefficient, non-finite flag, Σ losses], the
rule of ``torch.nn.utils.clip_grad_norm_`` (coef = min(1, max_norm / (‖G‖ + 1e-6)); max_norm 0:
off), the flag set when the norm or the loss is not finite. AdamW then reads the coefficient and
the flag from it: a whole optimizer step stays on the GPU and only the stats come back.

**AdamW**:

The math is torch.optim.AdamW's (decoupled weight decay), step t counted from 1::

    param    *= 1 - lr·weight_decay
    exp_avg   = lerp(exp_avg, grad, 1 - β1)
    exp_avg_sq = β2·exp_avg_sq + (1 - β2)·grad²
    param    -= lr / (1 - β1ᵗ) · exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - β2ᵗ) + eps)

``adamw_launch`` builds that update for one flat float32 tensor whose parameter,
gradient and moments are ``Buffer``s; parameter and moments are updated in place on
the GPU. Its step's values are kept in the launch, or read from an ``adamw_uniform`` that is
written before each submit (for a launch recorded ahead of its step). It reads the gradient's
factor and a skip flag from the clip's stats buffer; without one the gradient is used as is.
``adamw_step`` records it into a ``Recorder``. ``adamw_reference`` is the same step in torch ops,
in place on CPU tensors.

>>> import numpy as np
>>> from torch_wgpu_lora.runtime import Buffer, Recorder, upload
>>> p, g = upload(np.ones(8, np.float32)), upload(np.ones(8, np.float32))
>>> m, v = upload(np.zeros(8, np.float32)), upload(np.zeros(8, np.float32))
>>> rec = Recorder(); adamw_step(rec, p, g, m, v, step=1, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
>>> out = np.empty(8, np.float32); rec.read(p, out); rec.submit(); round(float(out[0]), 4)
0.9

**WgpuAdamW**: torch.optim.AdamW's update run by the AdamW kernel, moments kept on the GPU.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(4))
>>> opt = WgpuAdamW([w], lr=0.1, weight_decay=0.0)
>>> w.grad = torch.ones(4); opt.step(); opt.zero_grad()
>>> round(w[0].item(), 4)
0.9

Each ``step()`` records one ``adamw.wgsl`` launch per parameter that has a gradient into a
single submit and reads the updated values straight back into the parameters' memory.
Parameters are updated in their resident GPU copies (``runtime.tensors.resident``, the
copies the LoRA op reads), so a step uploads only the gradients, and the next forward
uploads nothing. The first and second moments never leave the GPU except through
``state_dict()``. The torch Parameters stay the truth: change them between steps
(``load_state_dict`` of the model, an adapter load) and the next step starts from the new
values. Like torch's optimizers, a step bumps each updated parameter's version counter,
so autograd refuses a backward through a graph built before the step.

Hyperparameters live in ``param_groups`` as in any torch optimizer, so torch's LR
schedulers drive ``lr``; ``state_dict()`` is laid out like torch.optim.AdamW's
(``step``, ``exp_avg``, ``exp_avg_sq`` per parameter) and either optimizer loads the other's.

A fused step run elsewhere (``BitNetEngine.train_step``: every adapter in one flat buffer,
clip and AdamW in one launch each) works on this optimizer's state through three public
calls: ``adopt_moments`` hands the moments over to the caller's GPU buffers (values kept),
``step_scalars`` gives the next step's AdamW values, and ``count_step`` counts a step applied
there. ``state_dict`` and ``load_state_dict`` keep working on the adopted buffers.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from ..runtime import Buffer, Device, Kernel, Launch, Recorder, Uniform, get_device, kernel, upload
from ..runtime.tensors import into, refresh, resident, resident_layouts, to_gpu, write_into

__all__ = ["CLIP_PARTIALS", "WgpuAdamW", "adamw_launch", "adamw_reference", "adamw_scalars", "adamw_step",
           "adamw_uniform", "clip_grad_norm", "clip_launches", "clip_reference"]

_WG = 256  # threads per workgroup of adamw.wgsl
_UNIT_STATS = np.array([0.0, 1.0, 0.0, 0.0], np.float32)  # [norm, gradient factor, skip flag, loss]
CLIP_PARTIALS = 256  # workgroups of the clip's sum of squares: floats of its ``partials`` buffer


def clip_launches(grads: Buffer, losses: Buffer, stats: Buffer, partials: Buffer, *, n: int, rows: int,
                  max_norm: float, device: Device | None = None) -> list[Launch]:
    """stats ← [‖grads[:n]‖, clip coefficient, non-finite flag, Σ losses[:rows]]; ``partials``
    (f32, at least ``CLIP_PARTIALS``) holds the workgroups' sums of squares in between.

    >>> # launches = clip_launches(grads, losses, stats, partials, n=size, rows=r, max_norm=1.0)
    """
    device = device or get_device()
    if partials.numel < CLIP_PARTIALS or stats.numel < 4:
        raise ValueError(f"clip: partials need {CLIP_PARTIALS} floats and stats 4, got {partials.shape} and "
                         f"{stats.shape}")
    params = (n, rows, float(max_norm))
    return [Launch.build(kernel("clip.wgsl", "sumsq", device, PARTIALS=CLIP_PARTIALS), (CLIP_PARTIALS, 1, 1),
                         {1: grads, 2: partials}, params),
            Launch.build(kernel("clip.wgsl", "stats", device, PARTIALS=CLIP_PARTIALS), (1, 1, 1),
                         {3: partials, 4: losses, 5: stats}, params)]


def clip_reference(grads: torch.Tensor, losses: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What ``clip_launches`` writes, in float64: [‖grads‖, coefficient, non-finite flag, Σ losses].

    >>> clip_reference(torch.tensor([3.0, 4.0]), torch.tensor([1.0, 2.0]), 1.0).tolist()
    [5.0, 0.199999960000008, 0.0, 3.0]
    """
    norm = torch.linalg.vector_norm(grads.double())
    loss = losses.double().sum()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0 else torch.ones((), dtype=torch.float64)
    finite = bool(torch.isfinite(norm)) and bool(torch.isfinite(loss))
    return torch.stack((norm, coef, torch.tensor(0.0 if finite else 1.0, dtype=torch.float64), loss))


def adamw_scalars(step: int, lr: float, betas: tuple[float, float], eps: float,
                  weight_decay: float) -> tuple[float, ...]:
    """The kernel's uniform values for step ``step`` (from 1), worked out in float64 as torch does.

    Returns (decay, w1, beta2, w2, neg_step_size, bc2_sqrt, eps).
    """
    if step < 1:
        raise ValueError(f"adamw: step counts from 1, got {step}")
    beta1, beta2 = betas
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, -(lr / bias_correction1),
            bias_correction2**0.5, eps)


def _kernel(device: Device) -> Kernel:
    return kernel("adamw.wgsl", "adamw_step", device, WG=_WG)


def adamw_uniform(device: Device | None = None) -> Uniform:
    """A uniform for ``adamw_launch`` that takes each step's values when written:
    ``u.write((n, *adamw_scalars(step, lr, betas, eps, weight_decay)))`` before each submit."""
    return Uniform(_kernel(device or get_device()))


def adamw_launch(param: Buffer, grad: Buffer, exp_avg: Buffer, exp_avg_sq: Buffer,
                 scalars: Sequence[float] | Uniform, *, stats: Buffer | None = None, n: int | None = None,
                 device: Device | None = None) -> Launch:
    """One AdamW update of the first ``n`` (default: all) elements of ``param``, ``exp_avg`` and
    ``exp_avg_sq`` (in place) from ``stats[1]`` · ``grad``, skipped when ``stats[2]`` is not 0.

    All four buffers hold float32. ``scalars``: ``adamw_scalars(step, ...)`` (the values kept in
    the launch), or an ``adamw_uniform`` written before each submit (a launch recorded ahead of
    its step). Without ``stats`` the gradient is used as is.
    """
    device = device or param.device
    n = param.numel if n is None else n
    for name, buf in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if buf.numel < n or buf.dtype != "f32":
            raise ValueError(f"adamw: {name} is {buf.shape} {buf.dtype}; expected at least {n} f32 elements")
    if stats is None:
        stats = device.owned("adamw_unit_stats", lambda: upload(_UNIT_STATS, device))
    groups = max(1, math.ceil(n / _WG))
    grid_x = min(groups, device.max_workgroups)
    return Launch.build(_kernel(device), (grid_x, math.ceil(groups / grid_x), 1),
                        (param, grad, exp_avg, exp_avg_sq, stats),
                        scalars if isinstance(scalars, Uniform) else (n, *scalars))


def adamw_step(rec: Recorder, param: Buffer, grad: Buffer, exp_avg: Buffer, exp_avg_sq: Buffer, *, step: int,
               lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Record one AdamW update of ``param``, ``exp_avg`` and ``exp_avg_sq`` (in place) from ``grad``,
    four buffers of the same number of float32 elements."""
    for name, buf in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if buf.numel != param.numel:
            raise ValueError(f"adamw_step: {name} is {buf.shape}; expected {param.numel} elements like param "
                             f"{param.shape}")
    if param.numel:
        rec.launch(adamw_launch(param, grad, exp_avg, exp_avg_sq,
                                adamw_scalars(step, lr, betas, eps, weight_decay), device=rec.device))


@torch.no_grad()
def adamw_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                    step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """The same step in torch ops, in place (torch.optim.AdamW's single-tensor path, op for op).

    >>> p, g = torch.ones(3), torch.ones(3)
    >>> adamw_reference(p, g, torch.zeros(3), torch.zeros(3), step=1, lr=0.1, betas=(0.9, 0.999),
    ...                 eps=1e-8, weight_decay=0.0)
    >>> round(p[0].item(), 4)
    0.9
    """
    decay, w1, beta2, w2, neg_step_size, bc2_sqrt, eps = adamw_scalars(step, lr, betas, eps, weight_decay)
    param.mul_(decay)
    exp_avg.lerp_(grad, w1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=w2)
    param.addcdiv_(exp_avg, (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps), value=neg_step_size)


# -- the optimizer -----------------------------------------------------------------------------------

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _check_tensor(t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.is_sparse:
        raise TypeError(f"WgpuAdamW: {what} must be a dense float32 CPU tensor, got {t.dtype} on {t.device}"
                        f"{' (sparse)' if t.is_sparse else ''}")


class WgpuAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose update runs on WebGPU.

    Same defaults as the seed design: ``lr=2e-4, betas=(0.9, 0.999), eps=1e-7,
    weight_decay=0.01``. Parameters must be float32 CPU tensors (LoRA adapters are);
    those whose ``grad`` is None are skipped, as torch does.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 2e-4,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-7, weight_decay: float = 0.01) -> None:
        if not (isinstance(lr, (int, float)) and 0.0 <= lr and math.isfinite(lr)):
            raise ValueError(f"WgpuAdamW: lr must be a finite number >= 0, got {lr!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"WgpuAdamW: betas must be two numbers in [0, 1), got {betas!r}")
        if not eps >= 0.0:
            raise ValueError(f"WgpuAdamW: eps must be >= 0, got {eps!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"WgpuAdamW: weight_decay must be >= 0, got {weight_decay!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        # Per parameter: the GPU layout it is updated in (fixed at its first step) and its moments.
        self._moments: dict[torch.Tensor, tuple[str, Buffer, Buffer]] = {}
        self._adopted: set[torch.Tensor] = set()  # whose moments live in a caller's buffers (adopt_moments)

    def _ordered_params(self) -> list[torch.Tensor]:
        """Parameters in the order ``state_dict`` numbers them."""
        return [p for group in self.param_groups for p in group["params"]]

    @staticmethod
    def _layout(p: torch.Tensor) -> str:
        """The layout p's GPU copy already has (the LoRA op's, so both share one copy), else flat."""
        layouts = resident_layouts(p) if p.dim() == 2 else []
        return layouts[0] if layouts else "flat"

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update every parameter that has a gradient; returns ``closure()`` when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Check every tensor before touching any state, so a bad one leaves the optimiser as it was.
        work = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p, _ in work:
            _check_tensor(p, "a parameter")
            _check_tensor(p.grad, "a gradient")
            if p.grad.shape != p.shape:
                raise ValueError(f"WgpuAdamW: a gradient of shape {tuple(p.grad.shape)} for a parameter of shape "
                                 f"{tuple(p.shape)}")
        device = get_device()
        rec = Recorder(device)
        updated = []
        for p, group in work:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
            state["step"] += 1
            if p.numel() == 0:
                continue
            if p not in self._moments:
                layout = self._layout(p)
                shape = resident(p, layout, device).shape
                self._moments[p] = (layout, Buffer(shape, device=device), Buffer(shape, device=device))
                for buf in self._moments[p][1:]:
                    rec.clear(buf)
            layout, exp_avg, exp_avg_sq = self._moments[p]
            param_buf = resident(p, layout, device)
            adamw_step(rec, param_buf, to_gpu(p.grad, layout, device), exp_avg, exp_avg_sq,
                       step=int(state["step"].item()), lr=group["lr"], betas=group["betas"], eps=group["eps"],
                       weight_decay=group["weight_decay"])
            rec.read(param_buf, into(p, layout))
            updated.append((p, layout))
        rec.submit()
        for p, layout in updated:
            refresh(p, layout, device)  # the GPU copy and p agree again: the next forward uploads nothing
            torch.autograd.graph.increment_version(p)
        return loss

    def moments(self, p: torch.Tensor) -> tuple[str, Buffer, Buffer] | None:
        """``p``'s (layout, exp_avg, exp_avg_sq) on the GPU; None before its first step."""
        return self._moments.get(p)

    @torch.no_grad()
    def adopt_moments(self, views: dict[torch.Tensor, tuple[str, Buffer, Buffer]]) -> None:
        """Keep each parameter's moments in the given GPU buffers from now on: (layout, exp_avg,
        exp_avg_sq), e.g. views of one flat buffer that a fused step updates. The moments held
        now are copied into them first (zeros for a parameter without any), so no state is
        lost; buffers adopted already are left as they are. ``step()``, ``state_dict()`` and
        ``load_state_dict()`` then work on them.

        >>> # optimizer.adopt_moments(adapters.views((exp_avg, exp_avg_sq)))
        """
        ours = set(self._ordered_params())
        strangers = [tuple(p.shape) for p in views if p not in ours]
        if strangers:
            raise ValueError(f"WgpuAdamW.adopt_moments: parameters of shapes {strangers} are not this optimizer's")
        changed = [p for p, (_, m, v) in views.items() if self._moments.get(p, (None, None, None))[1:] != (m, v)]
        if not changed:
            return
        held = {}
        rec = Recorder()
        for p in changed:
            if p in self._moments:
                layout, *buffers = self._moments[p]
                held[p] = [torch.empty_like(p, memory_format=torch.contiguous_format) for _ in buffers]
                for t, buf in zip(held[p], buffers):
                    rec.read(buf, into(t, layout))
        if held:
            rec.submit()
        for p in changed:
            layout, *targets = views[p]
            for t, target in zip(held.get(p, (torch.zeros_like(p),) * 2), targets):
                write_into(target, t, layout)
            self._moments[p] = views[p]
            self._adopted.add(p)
            self.state[p].setdefault("step", torch.tensor(0.0))  # a parameter with moments has a step count

    def step_scalars(self) -> tuple[float, ...]:
        """The AdamW values (``adamw_scalars``) of the next step of this optimizer's
        one parameter group, for a fused step run elsewhere."""
        if len(self.param_groups) != 1:
            raise ValueError("WgpuAdamW.step_scalars: a fused step takes one parameter group")
        group = self.param_groups[0]
        first = group["params"][0]
        step = int(self.state[first]["step"].item()) + 1 if "step" in self.state[first] else 1
        return adamw_scalars(step, group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def count_step(self) -> None:
        """Count one step applied elsewhere to every parameter of the one group (a fused step on
        adopted moments): each parameter's ``step`` advances, and LR schedulers see a step taken,
        as after ``step()``."""
        for p in self.param_groups[0]["params"]:
            self.state[p].setdefault("step", torch.tensor(0.0))
            self.state[p]["step"] += 1
        self._opt_called = True  # torch.optim.Optimizer's own mark of a step, which LR schedulers check

    def state_dict(self) -> dict[str, Any]:
        """torch's layout, with each parameter's moments read back into new CPU tensors."""
        packed = super().state_dict()
        index = {p: i for i, p in enumerate(self._ordered_params())}
        rec = Recorder()
        for p, (layout, *buffers) in self._moments.items():
            i = index[p]
            entry = dict(packed["state"][i])  # a copy: the packed entry is the live state dict
            entry["step"] = entry["step"].clone()
            for name, buf in zip(_MOMENTS, buffers):
                entry[name] = torch.empty_like(p, memory_format=torch.contiguous_format)
                rec.read(buf, into(entry[name], layout))
            packed["state"][i] = entry
        rec.submit()
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of this optimizer or of torch.optim.AdamW; moments go to the GPU."""
        for group in state_dict["param_groups"]:
            unsupported = [k for k in ("amsgrad", "maximize") if group.get(k)]
            if unsupported:
                raise ValueError(f"WgpuAdamW.load_state_dict: the saved optimiser used {unsupported}, which "
                                 "WgpuAdamW does not implement")
        moments: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        rest: dict[int, dict[str, Any]] = {}
        for i, entry in state_dict["state"].items():
            missing = [name for name in ("step", *_MOMENTS) if name not in entry]
            if missing:
                raise ValueError(f"WgpuAdamW.load_state_dict: state of parameter {i} lacks {missing}")
            moments[int(i)] = (entry["exp_avg"], entry["exp_avg_sq"])
            rest[int(i)] = {k: v for k, v in entry.items() if k not in _MOMENTS}
        saved_sizes = [len(group["params"]) for group in state_dict["param_groups"]]
        sizes = [len(group["params"]) for group in self.param_groups]
        if saved_sizes != sizes:
            raise ValueError(f"WgpuAdamW.load_state_dict: the saved param groups hold {saved_sizes} "
                             f"parameters, this optimizer's {sizes}")
        # Saved indices map to parameters group by group, as torch's load_state_dict maps them.
        saved = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = dict(zip(saved, self._ordered_params()))
        for i, pair in moments.items():
            if i not in params:
                raise ValueError(f"WgpuAdamW.load_state_dict: state for parameter {i}, which no saved "
                                 f"param group lists")
            for name, t in zip(_MOMENTS, pair):
                if tuple(t.shape) != tuple(params[i].shape):
                    raise ValueError(f"WgpuAdamW.load_state_dict: {name} of parameter {i} has shape "
                                     f"{tuple(t.shape)}, the parameter {tuple(params[i].shape)}")
        super().load_state_dict({**state_dict, "state": rest})
        adopted = {p: self._moments[p] for p in self._adopted}  # they stay in their buffers, which take the values
        self._moments = dict(adopted)
        loaded = {params[i]: pair for i, pair in moments.items()}
        for p in self._ordered_params():
            if p in loaded:
                self.state[p]["step"] = torch.as_tensor(self.state[p]["step"], dtype=torch.float32).clone()
            if p in adopted:
                layout, *buffers = adopted[p]
                for t, buf in zip(loaded.get(p, (torch.zeros_like(p),) * 2), buffers):
                    write_into(buf, t.detach(), layout)
            elif p in loaded and p.numel():
                layout = self._layout(p)
                self._moments[p] = (layout, *(to_gpu(t.detach(), layout) for t in loaded[p]))


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """The global L2 norm of the gradients; when ``max_norm > 0`` and the norm is finite, gradients
    are scaled in place so that it is at most ``max_norm`` (torch's ``clip_grad_norm_`` rule).

    ``max_norm == 0`` turns clipping off (the norm is still returned, for logging and the
    non-finite check). A non-finite norm leaves the gradients as they are.

    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grad_norm([w], 1.0), [round(g, 4) for g in w.grad.tolist()]
    (5.0, [0.6, 0.8])
    """
    if not (isinstance(max_norm, (int, float)) and max_norm >= 0 and math.isfinite(max_norm)):
        raise ValueError(f"max_grad_norm must be a finite number >= 0 (0 turns clipping off), got {max_norm!r}")
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if max_norm > 0 and torch.isfinite(total):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)
