"""torch CPU tensors to and from GPU ``Buffer``s, and weights that stay resident on the GPU.

Layouts a 2-D float tensor can have on the GPU:

* ``"rows4"``: its rows, each padded with zeros to a multiple of 4 floats (kernels load vec4s);
* ``"cols4"``: its transpose in the same way (a [out, r] LoRA B kept as Bᵀ [r, out4]);
* ``"flat"``: any tensor's elements in order.

``to_gpu`` uploads (no host copy when the tensor is already float32, contiguous and a
multiple of 4 wide); ``write_into`` overwrites a buffer that has the layout (rows padded to
its width); ``into`` makes the readback sink that undoes the padding.

Resident weights (``resident``): a weight's GPU copy is made once and reused while the
tensor's values stay the same, checked against a shadow copy (so changes made through
``.data``, an optimizer, or ``load_state_dict`` are all seen). An optimizer that updates
the GPU copy in place and writes the result back into the tensor calls ``refresh`` so the
next forward does not upload it again.
"""

from __future__ import annotations

import weakref
from typing import Callable

import numpy as np
import torch

from .buffers import Buffer, upload, write
from .device import Device, get_device

LAYOUTS = ("rows4", "cols4", "flat")


def width4(n: int) -> int:
    """``n`` rounded up to a multiple of 4."""
    return -(-n // 4) * 4


def _as_float32_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().resolve_neg()  # numpy() refuses tensors with the negative bit set (torch._neg_view)
    return (t if t.dtype == torch.float32 else t.float()).numpy()


def to_gpu(t: torch.Tensor, layout: str = "rows4", device: Device | None = None) -> Buffer:
    """Upload ``t`` (a CPU float tensor) in ``layout`` as float32.

    >>> to_gpu(torch.ones(3, 5)).shape
    (3, 8)
    """
    device = device or get_device()
    t = t.detach().resolve_neg()
    if layout == "flat":
        if t.dtype == torch.float32 and t.is_contiguous():
            return upload(t.reshape(-1).numpy(), device)
        return upload(np.ascontiguousarray(_as_float32_numpy(t).reshape(-1)), device)
    if layout == "cols4":
        t = t.T
    elif layout != "rows4":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    rows, cols = t.shape
    if t.dtype == torch.float32 and t.is_contiguous() and cols % 4 == 0:
        return upload(t.numpy(), device)
    padded = np.zeros((rows, width4(cols)), np.float32)
    padded[:, :cols] = _as_float32_numpy(t)
    return upload(padded, device)


def write_into(buf: Buffer, t: torch.Tensor, layout: str = "rows4") -> None:
    """Overwrite ``buf`` with ``t`` (a CPU float tensor) in ``layout``: a 2-D ``buf`` takes the rows
    (of ``t``, or of ``t.T`` for ``"cols4"``) zero-padded to its width, a flat one the elements.

    >>> buf = Buffer((2, 64)); write_into(buf, torch.ones(2, 5))
    """
    values = _as_float32_numpy(t.T if layout == "cols4" else t)
    if layout == "flat" or len(buf.shape) == 1:
        if values.size != buf.numel:
            raise ValueError(f"write_into: {values.size} elements into a buffer of {buf.numel}")
        write(buf, np.ascontiguousarray(values.reshape(-1)))
        return
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    rows, cols = values.shape
    if rows != buf.shape[0] or cols > buf.shape[1]:
        raise ValueError(f"write_into: a [{rows}, {cols}] tensor into a buffer of {buf.shape} ({layout})")
    padded = np.zeros(buf.shape, np.float32)
    padded[:, :cols] = values
    write(buf, padded)


def into(dst: torch.Tensor, layout: str = "rows4") -> Callable[[np.ndarray], None]:
    """A readback sink that copies a mapped view in ``layout`` into the float32 tensor ``dst``,
    by torch's ``copy_`` (which spreads a large copy over torch's threads)."""
    target = dst.detach()
    if layout == "flat":
        target = target.view(-1)
    elif layout == "cols4":
        target = target.T
    width = target.shape[-1]

    def sink(view: np.ndarray) -> None:  # the padding past each row's width (or the flat size) is left
        target.copy_(torch.from_numpy(view[..., :width]))

    return sink


class _Resident:
    __slots__ = ("ref", "shadow", "buffer")

    def __init__(self, ref: weakref.ref, shadow: torch.Tensor, buffer: Buffer) -> None:
        self.ref, self.shadow, self.buffer = ref, shadow, buffer


def _entries(device: Device) -> dict[tuple[int, str], _Resident]:
    return device.owned("resident", dict)


def _drop(device_ref: weakref.ref, key: tuple[int, str]) -> None:
    device = device_ref()
    if device is not None:
        with device.lock:
            _entries(device).pop(key, None)


def resident(t: torch.Tensor, layout: str = "rows4", device: Device | None = None) -> Buffer:
    """``t``'s GPU copy in ``layout``, uploaded again only when ``t``'s values change.

    Each upload makes a new buffer: work recorded with the old one (a forward waiting for
    its backward) keeps it.

    >>> A = torch.randn(8, 64)
    >>> resident(A) is resident(A)
    True
    """
    device = device or get_device()
    key = (id(t), layout)
    entries = _entries(device)
    values = t.detach()
    with device.lock:
        entry = entries.get(key)
        if entry is not None and entry.ref() is t and torch.equal(entry.shadow, values):
            return entry.buffer
        buffer = to_gpu(values, layout, device)
        if entry is None or entry.ref() is not t:
            weakref.finalize(t, _drop, weakref.ref(device), key)
        entries[key] = _Resident(weakref.ref(t), values.clone(), buffer)
        return buffer


def resident_layouts(t: torch.Tensor, device: Device | None = None) -> list[str]:
    """The layouts ``t`` is resident in on ``device`` now (maybe stale)."""
    device = device or get_device()
    with device.lock:
        return [layout for (ident, layout), e in _entries(device).items() if ident == id(t) and e.ref() is t]


def refresh(t: torch.Tensor, layout: str, device: Device | None = None) -> None:
    """Record that ``t``'s resident copy in ``layout`` and ``t`` hold the same values again
    (after updating both, e.g. an optimizer step on the GPU read back into ``t``)."""
    device = device or get_device()
    with device.lock:
        entry = _entries(device).get((id(t), layout))
        if entry is not None and entry.ref() is t:
            entry.shadow.copy_(t.detach())
