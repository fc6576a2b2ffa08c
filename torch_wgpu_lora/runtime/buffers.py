"""GPU-resident arrays (``Buffer``), where they come from (a pool, or an ``Arena`` planned
once), and the staging buffers readbacks pass through.

Copies per call, the whole story:

* upload (``upload``, ``write``): a C-contiguous numpy array (for a torch CPU tensor,
  its ``.numpy()`` view, which shares memory) goes straight to ``queue.write_buffer``.
  Python copies nothing; wgpu copies once into its own staging memory, which the API
  requires.
* download (``Recorder.read``): the GPU copies the buffer into a MAP_READ staging
  buffer inside the same command buffer as the kernels; after the submit the staging
  buffer is mapped and ``np.copyto`` writes into the caller's array (for torch, the
  ``.numpy()`` view of a preallocated tensor). That is the one CPU copy.
  ``queue.read_buffer`` is never used: it allocates a new buffer on every call.

A ``Buffer`` is a handle: shape, dtype and a byte range of a wgpu buffer. Pooled
buffers go back to the device's pool when their last handle goes away, so steady-state
work allocates nothing; arena views are carved out of a few large wgpu buffers that
live as long as their arena (a model's activations, planned once per shape). A
``Recorder`` keeps the handles it records alive until its work is done, so a buffer is
never reused while recorded work may still read it.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections import defaultdict
from typing import Any

import numpy as np

from .device import Device, get_device

# Element types a Buffer can hold. Packed layouts (four int8 codes or sixteen 2-bit
# weights in a u32, two f16 in a u32) are u32 arrays to the host; kernels unpack them.
DTYPES = {"f32": np.float32, "u32": np.uint32, "i32": np.int32, "f16": np.float16}
_NUMPY_TO_DTYPE = {np.dtype(v): k for k, v in DTYPES.items()}
_ALIGN = 16  # vec4 arrays are bound whole: keep every size a multiple of 16 bytes
SERIALS = itertools.count(1)  # identities for wgpu buffers (bind-group cache keys)
_FIRST_CHUNK = 1 << 20  # an arena's first chunk; each next one doubles (see Arena)


def _padded(nbytes: int) -> int:
    return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)


def _bucket(nbytes: int) -> int:
    """Round a size up so that near sizes share pooled buffers (at most 1/8 waste)."""
    nbytes = _padded(nbytes)
    if nbytes <= 4096:
        return nbytes
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


def _check_size(device: Device, nbytes: int) -> None:
    if nbytes > device.limits["max-buffer-size"]:
        raise ValueError(f"a {nbytes}-byte GPU buffer exceeds this adapter's max-buffer-size "
                         f"({device.limits['max-buffer-size']} bytes)")


def _storage_usage(device: Device) -> int:
    usage = device.api.BufferUsage
    # INDIRECT too: a kernel may write the grid of a later launch (sizes known only on the GPU)
    return usage.STORAGE | usage.COPY_SRC | usage.COPY_DST | usage.INDIRECT


class BufferPool:
    """Free wgpu storage buffers by size, reused before new ones are made. It keeps up to the
    device's ``pool_bytes`` setting of them (``runtime/settings.py``: by default 1/64 of the
    device's memory); a buffer freed past that bound is destroyed. ``Device.pooled`` counts what
    it keeps (``device_info()["memory"]`` reports both)."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.free: dict[int, list[tuple[Any, int]]] = defaultdict(list)
        self.free_bytes = 0

    def _count(self, nbytes: int) -> None:  # under the device's lock
        self.free_bytes += nbytes
        self.device.pooled = self.free_bytes

    def take(self, nbytes: int) -> tuple[Any, int]:
        size = _bucket(nbytes)
        _check_size(self.device, size)
        self.device.check_usable()
        with self.device.lock:
            bucket = self.free.get(size)
            while bucket:
                self._count(-size)
                gpu, serial = bucket.pop()
                if self.device.backend.alive(gpu):
                    return gpu, serial
                self.device.track(-size)
        self.device.track(size)
        return self.device.wgpu.create_buffer(size=size, usage=_storage_usage(self.device)), next(SERIALS)

    def give(self, gpu: Any, serial: int) -> None:
        with self.device.lock:
            if self.free_bytes + gpu.size <= self.device.settings.pool_bytes:
                self.free[gpu.size].append((gpu, serial))
                self._count(gpu.size)
                return
        self.device.track(-gpu.size)
        gpu.destroy()
        self.trim()

    def trim(self) -> int:
        """Destroy pooled buffers, largest first, until the pool holds no more than its bound;
        returns the bytes freed. A lowered bound takes effect this way when the next buffer that
        does not fit is freed."""
        dropped = []
        with self.device.lock:
            if self.free_bytes <= self.device.settings.pool_bytes:
                return 0
            for size in sorted(self.free, reverse=True):
                bucket = self.free[size]
                while bucket and self.free_bytes > self.device.settings.pool_bytes:
                    dropped.append(bucket.pop()[0])
                    self._count(-size)
        for gpu in dropped:
            self.device.track(-gpu.size)
            gpu.destroy()
        return sum(gpu.size for gpu in dropped)

    def release(self) -> int:
        """Free every pooled buffer no handle holds (as ``torch.cuda.empty_cache``); returns the bytes."""
        with self.device.lock:
            buffers = [gpu for bucket in self.free.values() for gpu, _ in bucket]
            self.free.clear()
            self._count(-self.free_bytes)
        for gpu in buffers:
            self.device.track(-gpu.size)
            gpu.destroy()
        return sum(gpu.size for gpu in buffers)


def pool_for(device: Device) -> BufferPool:
    return device.owned("buffer_pool", lambda: BufferPool(device))


class Buffer:
    """An array on the GPU: what kernels read and write, and ops pass along.

    ``shape`` and ``dtype`` (a key of ``DTYPES``) describe the logical array; it occupies
    ``nbytes`` bytes from ``offset`` in the wgpu buffer ``gpu`` (a pooled buffer may be
    a little larger; an arena view is one range of a larger buffer). ``serial``
    identifies the wgpu buffer for bind-group caching.

    >>> b = Buffer((4, 8))
    >>> b.nbytes, b.offset
    (128, 0)
    """

    __slots__ = ("gpu", "serial", "offset", "shape", "dtype", "nbytes", "device", "_pooled", "__weakref__")

    def __init__(self, shape: tuple[int, ...], dtype: str = "f32", device: Device | None = None) -> None:
        if dtype not in DTYPES:
            raise TypeError(f"Buffer dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.device = device or get_device()
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.nbytes = math.prod(self.shape) * np.dtype(DTYPES[dtype]).itemsize
        self.offset = 0
        self.gpu, self.serial = pool_for(self.device).take(self.nbytes)
        self._pooled = True

    @classmethod
    def view(cls, gpu: Any, serial: int, offset: int, shape: tuple[int, ...], dtype: str, device: Device) -> "Buffer":
        """A handle on ``gpu``'s bytes from ``offset`` (not pooled: the owner frees ``gpu``)."""
        buf = cls.__new__(cls)
        buf.device, buf.gpu, buf.serial, buf.offset = device, gpu, serial, offset
        buf.shape = tuple(int(s) for s in shape)
        buf.dtype = dtype
        buf.nbytes = math.prod(buf.shape) * np.dtype(DTYPES[dtype]).itemsize
        buf._pooled = False
        return buf

    def slice(self, offset: int, shape: tuple[int, ...]) -> "Buffer":
        """A view of this buffer's elements from element ``offset``, shaped ``shape`` (same
        dtype; the view shares the wgpu buffer and does not keep it alive).

        >>> b = Buffer((4, 8))
        >>> b.slice(8, (2, 8)).offset
        32
        """
        count = math.prod(int(s) for s in shape)
        if offset < 0 or offset + count > self.numel:
            raise ValueError(f"slice of {count} elements at {offset} does not fit a buffer of {self.numel}")
        start = self.offset + offset * np.dtype(DTYPES[self.dtype]).itemsize
        view = Buffer.view(self.gpu, self.serial, start, shape, self.dtype, self.device)
        if start + view.binding_size > self.gpu.size:  # bindings and readbacks span whole 16-byte words
            raise ValueError(f"slice of {count} elements at {offset}: its {view.binding_size}-byte binding runs past "
                             f"the end of the GPU buffer ({self.gpu.size} bytes)")
        return view

    def rows(self, first: int, count: int) -> "Buffer":
        """Rows ``first`` .. ``first + count`` of a [rows, ...] buffer, as a view.

        >>> Buffer((4, 8)).rows(1, 2).shape
        (2, 8)
        """
        width = math.prod(self.shape[1:])
        if first < 0 or count < 0 or first + count > self.shape[0]:
            raise ValueError(f"rows {first}..{first + count} of a buffer of {self.shape[0]} rows")
        return self.slice(first * width, (count, *self.shape[1:]))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def binding_size(self) -> int:
        """Bytes a bind group spans: ``nbytes`` rounded up to 16 (vec4 arrays)."""
        return _padded(self.nbytes)

    def __del__(self) -> None:
        gpu = getattr(self, "gpu", None)
        if gpu is None or not getattr(self, "_pooled", False):
            return
        self.gpu = None
        if self.device.forked:  # the parent's driver owns it: never release it here
            self.device.state.setdefault("orphans", []).append(gpu)
            return
        pool_for(self.device).give(gpu, self.serial)

    def __repr__(self) -> str:
        at = f", offset={self.offset}" if self.offset else ""
        return f"Buffer(shape={self.shape}, dtype={self.dtype}{at})"


class Arena:
    """Buffers planned together as views of a few large wgpu buffers. Each view starts at a
    multiple of the adapter's offset alignment; a chunk is at most ``max-buffer-size`` bytes
    and no view spans two chunks. Chunks grow: each new one is twice the last (from 1 MiB, at
    most ``chunk_bytes``, at least the view that asks for it), so a small model's arena holds a
    few MB, not a whole ``chunk_bytes``.

    For data kernels only read (a model's frozen weights): WebGPU checks a launch's buffer
    usages per wgpu buffer, not per range, so a launch that writes one view cannot bind any
    other view of the same chunk. Give written buffers their own ``Buffer``.

    >>> arena = Arena()
    >>> x, y = arena.alloc((4, 8)), arena.alloc((16,), "u32")
    >>> x.gpu is y.gpu, y.offset % arena.device.offset_alignment
    (True, 0)
    """

    def __init__(self, device: Device | None = None, chunk_bytes: int = 256 << 20) -> None:
        self.device = device or get_device()
        self.chunk_bytes = min(chunk_bytes, int(self.device.limits["max-buffer-size"]))
        self.chunks: list[Any] = []
        self._serial = 0
        self._used = 0
        self.nbytes = 0  # bytes of all chunks

    def alloc(self, shape: tuple[int, ...], dtype: str = "f32") -> Buffer:
        if dtype not in DTYPES:
            raise TypeError(f"Buffer dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        nbytes = _padded(math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize)
        align = self.device.offset_alignment
        start = -(-self._used // align) * align
        if not self.chunks or start + nbytes > self.chunks[-1].size:
            grown = min(self.chunk_bytes, 2 * self.chunks[-1].size if self.chunks else _FIRST_CHUNK)
            size = max(grown, _padded(nbytes))
            _check_size(self.device, size)
            self.chunks.append(self.device.wgpu.create_buffer(size=size, usage=_storage_usage(self.device)))
            self.device.track(size)
            weakref.finalize(self, self.device.track, -size)  # the chunk goes when the arena does
            self._serial = next(SERIALS)
            self.nbytes += size
            start = 0
        self._used = start + nbytes
        return Buffer.view(self.chunks[-1], self._serial, start, shape, dtype, self.device)


def dtype_of(array: np.ndarray) -> str:
    dtype = _NUMPY_TO_DTYPE.get(array.dtype)
    if dtype is None:
        raise TypeError(f"upload takes float32, float16, uint32 or int32 arrays, got {array.dtype}")
    return dtype


def upload(array: np.ndarray, device: Device | None = None) -> Buffer:
    """Copy a C-contiguous numpy array (float32, float16, uint32, int32) into a new ``Buffer``.

    No Python-side copy: the array's memory goes to ``queue.write_buffer`` as is.

    >>> buf = upload(np.ones((2, 4), np.float32))
    >>> buf.shape
    (2, 4)
    """
    dtype = dtype_of(array)
    if not array.flags.c_contiguous:
        raise ValueError("upload takes C-contiguous arrays (the caller decides when to copy)")
    buf = Buffer(array.shape, dtype, device)
    write(buf, array)
    return buf


def write(buf: Buffer, array: np.ndarray, offset: int = 0) -> None:
    """Overwrite ``buf`` (from byte ``offset``) with ``array``'s bytes (C-contiguous).

    ``queue.write_buffer`` lands before the next submit runs: write a step's inputs
    after submitting the previous step, not in the middle of one recording.
    """
    if not array.flags.c_contiguous:
        raise ValueError("write takes C-contiguous arrays (the caller decides when to copy)")
    if offset < 0 or offset + array.nbytes > buf.nbytes:
        raise ValueError(f"write: {array.nbytes} bytes at offset {offset} do not fit buffer {buf.shape} "
                         f"({buf.nbytes} bytes)")
    if array.nbytes % 4:
        raise ValueError(f"write: {array.nbytes} bytes is not a multiple of 4 (WebGPU writes whole words)")
    if array.nbytes:
        buf.device.check_usable()
        buf.device.queue.write_buffer(buf.gpu, buf.offset + offset, array)


class StagingPool:
    """MAP_READ buffers that readbacks pass through: one or more per submit in flight, so
    several threads (and a submit still being read while the next one runs) never share
    one. Each is at most ``max_bytes``; after use, buffers are kept up to ``keep_bytes``
    in all and the rest destroyed, so one large readback does not pin memory forever."""

    def __init__(self, device: Device, keep_bytes: int = 64 << 20, max_bytes: int = 256 << 20) -> None:
        self.device = device
        self.keep_bytes = keep_bytes
        self.max_bytes = min(max_bytes, int(device.limits["max-buffer-size"]))
        self.free: list[Any] = []

    def take(self, nbytes: int) -> Any:
        with self.device.lock:
            fits = [b for b in self.free if b.size >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.size)
                self.free.remove(best)
                return best
        size = min(1 << max(12, (nbytes - 1).bit_length()), max(nbytes, self.max_bytes))
        self.device.track(size)
        usage = self.device.api.BufferUsage
        return self.device.wgpu.create_buffer(size=size, usage=usage.MAP_READ | usage.COPY_DST)

    def give(self, gpu: Any) -> None:
        with self.device.lock:
            kept = sum(b.size for b in self.free)
            if kept + gpu.size <= self.keep_bytes:
                self.free.append(gpu)
                return
        self.device.track(-gpu.size)
        gpu.destroy()

    @property
    def kept_bytes(self) -> int:
        with self.device.lock:
            return sum(b.size for b in self.free)


def staging_for(device: Device) -> StagingPool:
    return device.owned("staging", lambda: StagingPool(device))
