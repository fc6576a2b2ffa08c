"""LoRA on WebGPU as a torch op, with its torch reference beside it.

``lora(x, A, B, scaling)`` is ``scaling * (x @ A.T) @ B.T`` for CPU tensors, forward and
backward in the WGSL kernels of ``ops.lora_gpu``. It is registered the way PyTorch wants
custom kernels registered (``torch.library.custom_op`` with fake implementations and
``register_autograd``), so ``torch.compile`` (``fullgraph=True`` too) treats it as one
opaque op, and it behaves like any torch op from several threads and after a fork.
``torch.func.vmap`` has a batching rule: the vmapped batch folds into the rows (one call).

* Forward keeps x and h on the GPU for backward (when a gradient will be needed); backward
  uploads only dY and computes only the gradients autograd asks for. A and B stay on the
  GPU between calls (``runtime.tensors.resident``) and are uploaded again only when their
  values change.
* Double backward (``create_graph=True``, e.g. a gradient penalty) works: the backward is
  itself LoRA-shaped math, so with a graph being built it is computed by differentiable
  ops (dx through this op again, dA and dB as torch matmuls).
* ``base_plus_lora(base, x, A, B, scaling)`` (what ``LoRALinear`` calls) is ``base() + lora(...)``
  with the adapter's GPU work in flight while ``base()`` and its backward run on the CPU.
* dtypes: float32 inside. float16, bfloat16 and float64 inputs are computed in float32 and
  returned in the input's dtype. Integer inputs raise TypeError; tensors on any device other
  than the CPU raise ValueError (move them with ``.cpu()``).

>>> x = torch.randn(5, 16, requires_grad=True)
>>> A = torch.randn(4, 16, requires_grad=True); B = torch.randn(8, 4, requires_grad=True)
>>> y = lora(x, A, B, 2.0); y.sum().backward()
>>> x.grad.shape, A.grad.shape, B.grad.shape
(torch.Size([5, 16]), torch.Size([4, 16]), torch.Size([8, 4]))
"""

from __future__ import annotations

import itertools
import math
import numbers
import weakref
from typing import Any, Callable

import torch

from ..runtime import Buffer, Device, Recorder, get_device
from ..runtime.tensors import into, resident, to_gpu, width4
from .lora_gpu import LoRAWeights, backward, forward, max_rank, max_rows

__all__ = ["base_plus_lora", "lora", "lora_reference"]


def lora_reference(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """The same math in plain torch: ``scaling * (x @ A.T) @ B.T``.

    >>> lora_reference(torch.ones(2, 3), torch.ones(1, 3), torch.ones(4, 1), 0.5).shape
    torch.Size([2, 4])
    """
    return scaling * (x @ A.T) @ B.T


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check(x: Any, A: Any, B: Any, scaling: Any) -> float:
    """Validate the op's inputs; returns ``scaling`` as a Python float."""
    for name, t in (("x", x), ("A", A), ("B", B)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lora: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"lora: {name} has dtype {t.dtype}; expected a floating dtype "
                            "(float32, float16, bfloat16 or float64)")
        if t.device.type != "cpu":
            raise ValueError(f"lora: {name} is on {t.device}; the WebGPU op takes CPU tensors "
                             "(move them with .cpu(), or use backend='torch')")
    if A.dim() != 2 or B.dim() != 2:
        raise ValueError(f"lora: A and B must be 2-D, got A {tuple(A.shape)} and B {tuple(B.shape)}")
    if A.shape[1] == 0 or B.shape[0] == 0:
        raise ValueError(f"lora: in_features and out_features must be at least 1, got A {tuple(A.shape)} "
                         f"and B {tuple(B.shape)}")
    most = max_rank(get_device())
    if not 1 <= A.shape[0] <= most:
        raise ValueError(f"lora: rank must be between 1 and {most} (this adapter's limit), got A {tuple(A.shape)}")
    if x.dim() == 0 or x.shape[-1] != A.shape[1]:
        raise ValueError(f"lora: x {tuple(x.shape)} does not match A {tuple(A.shape)}: "
                         f"x's last dimension must equal A's in_features ({A.shape[1]})")
    if B.shape[1] != A.shape[0]:
        raise ValueError(f"lora: B {tuple(B.shape)} does not match A {tuple(A.shape)}: "
                         f"B must be [out_features, rank={A.shape[0]}]")
    if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real):
        raise TypeError(f"lora: scaling must be a real number, got {scaling!r}")
    value = float(scaling)
    if not math.isfinite(value) or abs(value) > torch.finfo(torch.float32).max:
        raise ValueError(f"lora: scaling must be finite in float32 (the kernels' precision), got {scaling!r}")
    return value


def _row_chunks(rows: int, in_f: int, out_f: int, rank: int, device: Device) -> list[slice]:
    """Row ranges each one forward/backward call takes (binding sizes and grid limits)."""
    per_call = max_rows(device, max(width4(in_f), width4(out_f)), rank)
    return [slice(i, min(i + per_call, rows)) for i in range(0, rows, per_call)]


# -- what forward leaves on the GPU for backward -----------------------------------------------

_tokens = itertools.count(1)


class _Saved:
    """x and h of each row chunk, on the GPU. The weights are not kept: backward reads A and B
    as they are then (their resident copies), as torch's own matmul backward would."""

    __slots__ = ("chunks", "scaling")

    def __init__(self, chunks: list[tuple[slice, Buffer, Buffer]], scaling: float) -> None:
        self.chunks, self.scaling = chunks, scaling


_NOTHING_SAVED = _Saved([], 0.0)


def _saved(device: Device) -> dict[int, _Saved]:
    return device.owned("lora_saved", dict)


def _forget(device_ref: weakref.ref, key: int) -> None:
    device = device_ref()
    if device is not None:
        with device.lock:
            _saved(device).pop(key, None)


# -- the registered ops --------------------------------------------------------------------------

def _record_forward(rec: Recorder, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float,
                    device: Device) -> tuple[torch.Tensor, list[tuple[slice, Buffer, Buffer]]]:
    """Record the forward of x [N, in]: (y [N, out] float32, filled when ``rec``'s work is
    collected; each row chunk's x and h on the GPU, for backward)."""
    rank, in_f, out_f = A.shape[0], A.shape[1], B.shape[0]
    y = torch.empty((x.shape[0], out_f), dtype=torch.float32)
    chunks = []
    if x.shape[0]:
        w = LoRAWeights(resident(A, "rows4", device), resident(B, "cols4", device), in_f, out_f)
        for chunk in _row_chunks(x.shape[0], in_f, out_f, rank, device):
            xb = to_gpu(x[chunk], "rows4", device)
            yb, hb = forward(rec, xb, w, scaling)
            rec.read(yb, into(y[chunk]))
            chunks.append((chunk, xb, hb))
    return y, chunks


def _record_backward(rec: Recorder, dy: torch.Tensor, saved: _Saved, A: torch.Tensor, B: torch.Tensor,
                     need_x: bool, need_A: bool, need_B: bool,
                     device: Device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Record the backward of dy [N, out] (contiguous float32): (dx [N, in], dA [r, in], dB [out, r])
    float32, each empty ([0]) unless asked for, filled when ``rec``'s work is collected."""
    rank, in_f, out_f = A.shape[0], A.shape[1], B.shape[0]
    rows = dy.shape[0]
    alloc = torch.empty if rows else torch.zeros  # readbacks overwrite all; no rows means zero gradients

    def grad(need: bool, shape: tuple[int, ...]) -> torch.Tensor:
        return alloc(shape if need else (0,), dtype=torch.float32)

    dx, dA, dB = grad(need_x, (rows, in_f)), grad(need_A, (rank, in_f)), grad(need_B, (out_f, rank))
    if rows and (need_x or need_A or need_B):
        w = LoRAWeights(resident(A, "rows4", device), resident(B, "cols4", device), in_f, out_f)
        dA_buf = Buffer(w.A.shape, device=device) if need_A else None
        dBt_buf = Buffer(w.Bt.shape, device=device) if need_B else None
        for i, (chunk, xb, hb) in enumerate(saved.chunks):
            dyb = to_gpu(dy[chunk], "rows4", device)
            dxb = Buffer(xb.shape, device=device) if need_x else None
            backward(rec, dyb, xb, hb, w, saved.scaling, dA=dA_buf, dBt=dBt_buf, dx=dxb, accumulate=i > 0)
            if need_x:
                rec.read(dxb, into(dx[chunk]))
        if need_A:
            rec.read(dA_buf, into(dA))
        if need_B:
            rec.read(dBt_buf, into(dB, "cols4"))
    return dx, dA, dB


_GONE = ("lora: the forward's GPU state is gone (was the graph built before a fork, or on another "
         "device?)")


@torch.library.custom_op("torch_wgpu_lora::lora_forward", mutates_args=())
def _lora_forward(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float,
                  save: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [N, out] float32, token): x is [N, in]; the token names the GPU state kept for backward."""
    device = get_device()
    rec = Recorder(device)
    y, chunks = _record_forward(rec, x, A, B, scaling, device)
    rec.submit()
    token = torch.zeros(1, dtype=torch.int64)
    if save and chunks:
        token[0] = key = next(_tokens)
        with device.lock:
            _saved(device)[key] = _Saved(chunks, scaling)
        weakref.finalize(token, _forget, weakref.ref(device), key)
    return y, token


@_lora_forward.register_fake
def _(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float, save: bool) -> tuple[torch.Tensor, ...]:
    return x.new_empty((x.shape[0], B.shape[0]), dtype=torch.float32), x.new_empty((1,), dtype=torch.int64)


@torch.library.custom_op("torch_wgpu_lora::lora_backward", mutates_args=())
def _lora_backward(dy: torch.Tensor, token: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   need_x: bool, need_A: bool, need_B: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [N, in], dA [r, in], dB [out, r]) float32, each empty ([0]) unless asked for."""
    device = get_device()
    with device.lock:
        saved = _saved(device).get(int(token[0]), _NOTHING_SAVED)  # a forward of no rows saves nothing
    if not saved.chunks and dy.shape[0] and (need_x or need_A or need_B):
        raise RuntimeError(_GONE)
    rec = Recorder(device)
    grads = _record_backward(rec, dy, saved, A, B, need_x, need_A, need_B, device)
    rec.submit()
    return grads


@_lora_backward.register_fake
def _(dy: torch.Tensor, token: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
      need_x: bool, need_A: bool, need_B: bool) -> tuple[torch.Tensor, ...]:
    def grad(need: bool, shape: tuple[int, ...]) -> torch.Tensor:
        return dy.new_empty(shape if need else (0,), dtype=torch.float32)

    return grad(need_x, (dy.shape[0], A.shape[1])), grad(need_A, tuple(A.shape)), grad(need_B, tuple(B.shape))


@_lora_forward.register_vmap
def _(info: Any, in_dims: tuple, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float,
      save: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[Any, Any]]:
    """``torch.func.vmap``'s rule. With one adapter for the whole batch (A and B not batched) the
    batch folds into the rows: one call over batch·N rows. Adapters batched too (an ensemble
    vmapped over its parameters) take one call per slice, each with its own A and B."""
    x_dim, A_dim, B_dim = in_dims[:3]
    if A_dim is None and B_dim is None:
        xs = x.movedim(x_dim, 0)
        y, token = _lora_forward(xs.reshape(-1, xs.shape[-1]), A, B, scaling, save)
        return (y.view(info.batch_size, xs.shape[1], -1), token), (0, None)

    def sliced(t: torch.Tensor, dim: int | None) -> list[torch.Tensor]:
        return list(t.unbind(dim)) if dim is not None else [t] * info.batch_size

    outputs = [_lora_forward(xi, Ai, Bi, scaling, save)
               for xi, Ai, Bi in zip(sliced(x, x_dim), sliced(A, A_dim), sliced(B, B_dim))]
    return (torch.stack([y for y, _ in outputs]), torch.stack([t for _, t in outputs])), (0, 0)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, A, B, scaling, _save = inputs
    ctx.scaling = scaling
    ctx.save_for_backward(x, A, B, output[1])  # autograd then refuses a backward after x, A or B changed in place


def _graph_grads(dy: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, s: float,
                 needs: tuple[bool, ...]) -> tuple[Any, Any, Any]:
    """The gradients by differentiable ops, for a backward that builds a graph (create_graph=True).
    It is LoRA-shaped: dx = s·dY·B·A is this op with (Bᵀ, Aᵀ); dA and dB are two small matmuls."""
    dy, xf, Af, Bf = dy.float(), x.float(), A.float(), B.float()
    return (lora(dy, Bf.T, Af.T, s).to(x.dtype) if needs[0] else None,
            (s * (dy @ Bf).T @ xf).to(A.dtype) if needs[1] else None,
            (s * dy.T @ (xf @ Af.T)).to(B.dtype) if needs[2] else None)


def _in_dtypes(grads: tuple[torch.Tensor, ...], x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               needs: tuple[bool, ...]) -> tuple[Any, Any, Any]:
    return tuple(g.to(t.dtype) if need else None for g, t, need in zip(grads, (x, A, B), needs))


def _backward(ctx: Any, dy: torch.Tensor, _dtoken: Any) -> tuple[Any, ...]:
    x, A, B, token = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    if torch.is_grad_enabled():
        return (*_graph_grads(dy, x, A, B, ctx.scaling, needs), None, None)
    grads = _lora_backward(dy.float().contiguous(), token, x, A, B, *needs)
    return (*_in_dtypes(grads, x, A, B, needs), None, None)


_lora_forward.register_autograd(_backward, setup_context=_setup_context)


def lora(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * (x @ A.T) @ B.T`` on WebGPU, differentiable, for x of shape [..., in].

    >>> x, A, B = torch.randn(2, 3, 16), torch.randn(4, 16), torch.randn(8, 4)
    >>> torch.allclose(lora(x, A, B, 0.5), lora_reference(x, A, B, 0.5), atol=1e-5)
    True
    """
    scaling = _check(x, A, B, scaling)
    save = torch.is_grad_enabled() and (x.requires_grad or A.requires_grad or B.requires_grad)
    y, _token = _lora_forward(x.reshape(-1, A.shape[1]), A, B, scaling, save)
    return y.to(x.dtype).reshape(*x.shape[:-1], B.shape[0])


# -- beside a base layer: the GPU's work in flight while the CPU computes the base ----------------

class _Beside:
    """One adapter call computed beside its base layer: its GPU work in flight, and what its
    backward needs. Shared by the two autograd nodes ``_Start`` and ``_Finish``."""

    __slots__ = ("device", "A", "B", "needs", "saved", "pending", "y", "grads", "dy")

    def __init__(self, device: Device, A: torch.Tensor, B: torch.Tensor) -> None:
        self.device, self.A, self.B = device, A, B
        self.needs: tuple[bool, ...] = (False, False, False)
        self.saved: _Saved | None = None
        self.pending = self.y = self.grads = self.dy = None

    def submit_backward(self, dy: torch.Tensor) -> None:
        if self.device is not get_device() or self.saved is None:
            raise RuntimeError(_GONE)
        rec = Recorder(self.device)
        self.grads = _record_backward(rec, dy, self.saved, self.A, self.B, *self.needs, self.device)
        self.pending = rec.submit_async()

    def collect(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pending, grads = self.pending, self.grads
        self.pending = self.grads = None
        pending.wait()
        return grads


class _Start(torch.autograd.Function):
    """Uploads x, records and submits the adapter's forward, returns at once (an empty tensor
    that links the two nodes in the graph). Its backward collects the gradients ``_Finish``'s
    backward set going, after autograd has run the base layer's backward meanwhile (nodes made
    later in the forward run earlier in the backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float,
                state: _Beside) -> torch.Tensor:
        state.needs = tuple(ctx.needs_input_grad[:3])
        rec = Recorder(state.device)
        state.y, chunks = _record_forward(rec, x, A, B, scaling, state.device)
        state.pending = rec.submit_async()
        if any(state.needs):
            state.saved = _Saved(chunks, scaling)
        ctx.state, ctx.scaling = state, scaling
        ctx.save_for_backward(x, A, B)  # autograd then refuses a backward after x, A or B changed in place
        return x.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _dlink: torch.Tensor) -> tuple[Any, ...]:
        x, A, B = ctx.saved_tensors
        state, needs = ctx.state, ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():
            dy, state.dy = state.dy, None  # the state does not keep the graph alive
            return (*_graph_grads(dy, x, A, B, ctx.scaling, needs), None, None)
        return (*_in_dtypes(state.collect(), x, A, B, needs), None, None)


class _Finish(torch.autograd.Function):
    """Waits for the adapter's forward and adds it to the base layer's output. Its backward
    uploads dY and submits the adapter's backward, then lets autograd go on to the base."""

    @staticmethod
    def forward(ctx: Any, base: torch.Tensor, _link: torch.Tensor, state: _Beside) -> torch.Tensor:
        state.pending.wait()
        y, state.pending, state.y = state.y, None, None
        ctx.state = state
        return base + y.view(base.shape).to(base.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        if not ctx.needs_input_grad[1]:  # the adapter is frozen and x needs no gradient: the base alone
            return dout, None, None
        state = ctx.state
        dy = dout.reshape(-1, dout.shape[-1]).float()
        if torch.is_grad_enabled():  # create_graph=True: _Start computes by differentiable ops
            state.dy = dy
        else:
            state.submit_backward(dy.contiguous())
        return dout, dout.new_zeros(0, dtype=torch.float32), None


def base_plus_lora(base: Callable[[], torch.Tensor], x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    """``base() + lora(x, A, B, scaling)`` with the adapter's WebGPU work in flight while ``base()``
    runs on the CPU, in the forward and in the backward: what ``LoRALinear`` does. ``base()``
    must return a tensor of shape ``[..., out]`` for x ``[..., in]``. Inside ``torch.compile``
    and ``torch.func`` transforms it is ``base() + lora(...)`` (the registered op, one opaque node).

    >>> x, A, B = torch.randn(2, 3, 16), torch.randn(4, 16), torch.randn(8, 4)
    >>> W = torch.randn(8, 16)
    >>> torch.allclose(base_plus_lora(lambda: x @ W.T, x, A, B, 0.5), x @ W.T + lora_reference(x, A, B, 0.5),
    ...                atol=1e-5)
    True
    """
    scaling = _check(x, A, B, scaling)
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        # compiled graphs and torch.func transforms (vmap) take the registered op instead
        out = base()
        return out + lora(x, A, B, scaling).to(out.dtype)
    state = _Beside(get_device(), A, B)
    link = _Start.apply(x.reshape(-1, A.shape[1]), A, B, scaling, state)
    try:
        out = base()
    except BaseException:
        state.pending.wait()  # nothing left in flight
        raise
    expected = (*x.shape[:-1], B.shape[0])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        state.pending.wait()
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"base_plus_lora: the base layer returned {got}; expected {expected} "
                         f"(x {tuple(x.shape)}, B {tuple(B.shape)})")
    return _Finish.apply(out, link, state)
