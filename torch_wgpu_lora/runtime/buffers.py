"""GPU-resident arrays (``Buffer``), their pool, and staging to and from numpy.

Copies per call, the whole story:

* upload (``upload``): a C-contiguous float32 numpy array (for a torch CPU tensor,
  its ``.numpy()`` view, which shares memory) goes straight to
  ``queue.write_buffer``. Python copies nothing; wgpu copies once into its own
  staging memory, which the API requires.
* download (``Recorder.read``): the GPU copies the buffer into one persistent
  MAP_READ staging buffer inside the same command buffer as the kernels; after the
  single submit the staging buffer is mapped and ``np.copyto`` writes into the
  caller's array (for torch, the ``.numpy()`` view of a preallocated tensor).
  That is the one CPU copy. ``queue.read_buffer`` is never used: it allocates a
  new buffer on every call.

A ``Buffer`` is a handle: shape, dtype and a pooled wgpu buffer. When the last
handle goes away the wgpu buffer returns to the pool, so steady-state training
allocates nothing. A ``Recorder`` keeps the handles it records alive until its
submit, so a buffer is never reused while recorded work may still read it.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Any

import numpy as np

from .device import Device, get_device

DTYPES = {"f32": np.float32, "u32": np.uint32}
_ALIGN = 16  # vec4 arrays are bound whole: keep every size a multiple of 16 bytes
SERIALS = itertools.count(1)  # identities for wgpu buffers (bind-group cache keys)


def _bucket(nbytes: int) -> int:
    """Round a size up so that near sizes share pooled buffers (at most 1/8 waste)."""
    nbytes = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
    if nbytes <= 4096:
        return nbytes
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class BufferPool:
    """Free wgpu storage buffers by size, reused before new ones are made."""

    def __init__(self, device: Device, keep_bytes: int = 1 << 30) -> None:
        self.device = device
        self.keep_bytes = keep_bytes
        self.free: dict[int, list[tuple[Any, int]]] = defaultdict(list)
        self.free_bytes = 0

    def take(self, nbytes: int) -> tuple[Any, int]:
        size = _bucket(nbytes)
        if size > self.device.limits["max-buffer-size"]:
            raise ValueError(
                f"a {nbytes}-byte GPU buffer exceeds this adapter's max-buffer-size "
                f"({self.device.limits['max-buffer-size']} bytes)"
            )
        bucket = self.free.get(size)
        if bucket:
            self.free_bytes -= size
            return bucket.pop()
        import wgpu

        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        return self.device.wgpu.create_buffer(size=size, usage=usage), next(SERIALS)

    def give(self, gpu: Any, serial: int) -> None:
        if self.free_bytes + gpu.size > self.keep_bytes:
            gpu.destroy()
            return
        self.free[gpu.size].append((gpu, serial))
        self.free_bytes += gpu.size


_pools: dict[int, BufferPool] = {}


def pool_for(device: Device) -> BufferPool:
    pool = _pools.get(id(device))
    if pool is None:
        pool = _pools[id(device)] = BufferPool(device)
    return pool


class Buffer:
    """An array on the GPU: what kernels read and write, and ops pass along.

    ``shape`` and ``dtype`` ("f32" or "u32") describe the logical array; the wgpu
    buffer underneath may be a little larger (pooling). ``serial`` identifies the
    wgpu buffer for bind-group caching.

    >>> b = Buffer((4, 8))
    >>> b.nbytes
    128
    """

    __slots__ = ("gpu", "serial", "shape", "dtype", "nbytes", "_pool")

    def __init__(self, shape: tuple[int, ...], dtype: str = "f32", device: Device | None = None) -> None:
        if dtype not in DTYPES:
            raise TypeError(f"Buffer dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self._pool = pool_for(device or get_device())
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.nbytes = math.prod(self.shape) * 4
        self.gpu, self.serial = self._pool.take(self.nbytes)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def device(self) -> Device:
        return self._pool.device

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None and getattr(self, "gpu", None) is not None:
            pool.give(self.gpu, self.serial)
            self.gpu = None

    def __repr__(self) -> str:
        return f"Buffer(shape={self.shape}, dtype={self.dtype})"


def upload(array: np.ndarray, device: Device | None = None) -> Buffer:
    """Copy a C-contiguous float32/uint32 numpy array into a new GPU ``Buffer``.

    No Python-side copy: the array's memory goes to ``queue.write_buffer`` as is.

    >>> buf = upload(np.ones((2, 4), np.float32))
    >>> buf.shape
    (2, 4)
    """
    dtype = {np.dtype(np.float32): "f32", np.dtype(np.uint32): "u32"}.get(array.dtype)
    if dtype is None:
        raise TypeError(f"upload takes float32 or uint32 arrays, got {array.dtype}")
    if not array.flags.c_contiguous:
        raise ValueError("upload takes C-contiguous arrays (the caller decides when to copy)")
    buf = Buffer(array.shape, dtype, device)
    write(buf, array)
    return buf


def write(buf: Buffer, array: np.ndarray) -> None:
    """Overwrite ``buf`` with ``array`` (same number of bytes, C-contiguous)."""
    if array.nbytes != buf.nbytes:
        raise ValueError(f"write: array has {array.nbytes} bytes, buffer {buf.shape} has {buf.nbytes}")
    if array.nbytes:
        buf.device.queue.write_buffer(buf.gpu, 0, array)


class Staging:
    """The persistent MAP_READ buffer that readbacks pass through; grows on demand."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.gpu: Any = None

    def ensure(self, nbytes: int) -> Any:
        if self.gpu is None or self.gpu.size < nbytes:
            import wgpu

            if self.gpu is not None:
                self.gpu.destroy()
            size = 1 << max(12, (nbytes - 1).bit_length())
            usage = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
            self.gpu = self.device.wgpu.create_buffer(size=size, usage=usage)
        return self.gpu


_stagings: dict[int, Staging] = {}


def staging_for(device: Device) -> Staging:
    staging = _stagings.get(id(device))
    if staging is None:
        staging = _stagings[id(device)] = Staging(device)
    return staging
