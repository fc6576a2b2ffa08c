"""Record many kernel launches, copies and readbacks; submit them once.

Usage::

    rec = Recorder()
    rec.dispatch(k, grid=(groups, 1, 1), buffers=(x, y), params=(n, d))
    rec.read(y, out)                  # out: a numpy array (e.g. a torch tensor's .numpy())
    rec.submit()                      # one command buffer, one submit, one map

Dispatches that follow each other share one compute pass; a copy or clear closes
the pass (WebGPU records those outside compute passes). wgpu inserts the memory
barriers that dependent dispatches need.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .buffers import DTYPES, Buffer, staging_for
from .device import Device, get_device
from .kernels import Kernel, params_buffer

_MAX_PASSES = 64  # timestamp pairs per recording


class Recorder:
    """One command buffer under construction. Also a context manager that submits on exit.

    With ``timestamps=True`` (and an adapter that has ``timestamp-query``),
    ``submit()`` returns the GPU time in seconds from the first pass's start to the
    last pass's end. ``per_dispatch=True`` gives every dispatch its own pass and fills
    ``kernel_times`` with (kernel name, seconds) pairs: a profile, not a fast path.
    """

    def __init__(self, device: Device | None = None, timestamps: bool = False, per_dispatch: bool = False) -> None:
        self.device = device or get_device()
        self.encoder = self.device.wgpu.create_command_encoder()
        self.pass_: Any = None
        self.keep: list[Any] = []  # handles alive until submit: nothing recorded is reused early
        self.reads: list[tuple[int, Buffer, Callable[[np.ndarray], None]]] = []
        self.read_bytes = 0
        self.dispatches = 0
        self.timestamps = timestamps and self.device.has_timestamps
        self.per_dispatch = per_dispatch
        self.pass_names: list[str] = []
        self.kernel_times: list[tuple[str, float]] = []
        self.passes = 0
        if self.timestamps:
            import wgpu

            self.query_set = self.device.wgpu.create_query_set(type=wgpu.QueryType.timestamp, count=2 * _MAX_PASSES)

    # -- recording ---------------------------------------------------------------
    def _compute_pass(self) -> Any:
        if self.pass_ is None:
            kwargs = {}
            if self.timestamps:
                if self.passes >= _MAX_PASSES:
                    raise RuntimeError(f"a timed recording holds at most {_MAX_PASSES} compute passes")
                kwargs["timestamp_writes"] = {
                    "query_set": self.query_set,
                    "beginning_of_pass_write_index": 2 * self.passes,
                    "end_of_pass_write_index": 2 * self.passes + 1,
                }
            self.pass_ = self.encoder.begin_compute_pass(**kwargs)
            self.passes += 1
        return self.pass_

    def _end_pass(self) -> None:
        if self.pass_ is not None:
            self.pass_.end()
            self.pass_ = None

    def dispatch(self, kernel: Kernel, grid: tuple[int, int, int], buffers: tuple[Buffer, ...], params: tuple = ()) -> None:
        """Record ``kernel`` over ``grid`` workgroups with ``buffers`` at bindings 1.. and ``params`` at 0."""
        limit = self.device.max_workgroups
        if max(grid) > limit:
            raise ValueError(f"{kernel.name}: grid {grid} exceeds max-compute-workgroups-per-dimension ({limit})")
        if min(grid) <= 0:
            return
        uniform = params_buffer(self.device, kernel.pack(params))
        group = kernel.bind_group(uniform, buffers)
        cpass = self._compute_pass()
        cpass.set_pipeline(kernel.pipeline)
        cpass.set_bind_group(0, group)
        cpass.dispatch_workgroups(*grid)
        self.keep.append(buffers)
        self.dispatches += 1
        if self.per_dispatch:
            self.pass_names.append(kernel.name)
            self._end_pass()

    def clear(self, buf: Buffer) -> None:
        """Record zero-filling ``buf``."""
        self._end_pass()
        self.encoder.clear_buffer(buf.gpu, 0, buf.gpu.size)
        self.keep.append(buf)

    def copy(self, src: Buffer, dst: Buffer) -> None:
        """Record copying all of ``src`` into ``dst`` (same byte size)."""
        if src.nbytes != dst.nbytes:
            raise ValueError(f"copy: {src.shape} and {dst.shape} differ in size")
        self._end_pass()
        if src.nbytes:
            self.encoder.copy_buffer_to_buffer(src.gpu, 0, dst.gpu, 0, -(-src.nbytes // 4) * 4)
        self.keep.append((src, dst))

    def read(self, buf: Buffer, out: np.ndarray | Callable[[np.ndarray], None]) -> None:
        """After submit, put ``buf`` into ``out``.

        ``out`` is an array of ``buf``'s shape (filled with ``np.copyto``: the one CPU
        copy), or a function that receives a read-only view of the mapped data shaped
        like ``buf`` and copies what it needs (e.g. a slice or a transpose) out of it.
        """
        if callable(out):
            sink = out
        else:
            if tuple(out.shape) != buf.shape:
                raise ValueError(f"read: out has shape {tuple(out.shape)}, buffer {buf.shape}")
            sink = lambda view, out=out: np.copyto(out, view)  # noqa: E731
        self._end_pass()
        offset = self.read_bytes
        nbytes = -(-buf.nbytes // 16) * 16
        self.reads.append((offset, buf, sink))
        self.read_bytes += nbytes
        self.keep.append(buf)

    # -- submitting --------------------------------------------------------------
    def submit(self) -> float | None:
        """Submit everything recorded, wait for the readbacks, fill their outputs.

        Returns GPU seconds when recording with timestamps, else None. Waits for the
        GPU only when something is read back or timed.
        """
        self._end_pass()
        time_offset = None
        if self.timestamps and self.passes:
            import wgpu

            nbytes = 16 * self.passes
            resolved = Buffer((nbytes // 4,), "u32", self.device)  # storage|copy buffers cannot take QUERY_RESOLVE
            resolve = self.device.wgpu.create_buffer(
                size=nbytes, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC
            )
            self.encoder.resolve_query_set(self.query_set, 0, 2 * self.passes, resolve, 0)
            self.encoder.copy_buffer_to_buffer(resolve, 0, resolved.gpu, 0, nbytes)
            time_offset = self.read_bytes
            self.reads.append((time_offset, resolved, lambda view: None))
            self.read_bytes += nbytes
            self.keep.append(resolve)
        staging = None
        if self.reads:
            staging = staging_for(self.device).ensure(self.read_bytes)
            for offset, buf, _ in self.reads:
                if buf.nbytes:
                    self.encoder.copy_buffer_to_buffer(buf.gpu, 0, staging, offset, -(-buf.nbytes // 4) * 4)
        self.device.queue.submit([self.encoder.finish()])
        seconds = None
        if staging is not None:
            import wgpu

            staging.map_sync(wgpu.MapMode.READ, 0, self.read_bytes)
            try:
                for offset, buf, sink in self.reads:
                    if buf.nbytes == 0:
                        sink(np.empty(buf.shape, DTYPES[buf.dtype]))
                        continue
                    raw = staging.read_mapped(offset, -(-buf.nbytes // 4) * 4, copy=False)
                    view = np.frombuffer(raw, dtype=DTYPES[buf.dtype], count=buf.numel).reshape(buf.shape)
                    if offset == time_offset:
                        ticks = view.view(np.uint64).astype(np.int64)  # (begin, end) per pass
                        seconds = float(ticks[-1] - ticks[0]) * 1e-9  # WebGPU timestamps are nanoseconds
                        durations = (ticks[1::2] - ticks[0::2]) * 1e-9
                        self.kernel_times = list(zip(self.pass_names, durations.tolist()))
                    else:
                        sink(view)
            finally:
                staging.unmap()
        self.keep.clear()
        self.reads.clear()
        return seconds

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.submit()


def synchronize(device: Device | None = None) -> None:
    """Wait until all submitted GPU work has finished (by mapping a tiny buffer).

    ``queue.on_submitted_work_done_sync`` raises in wgpu 0.32, so we copy four bytes
    in a fresh submit and wait for its mapping: a fence waits for all earlier work
    on the queue.
    """
    rec = Recorder(device)
    rec.read(_sync_source(rec.device), lambda view: None)
    rec.submit()


_sync_sources: dict[int, Buffer] = {}


def _sync_source(device: Device) -> Buffer:
    buf = _sync_sources.get(id(device))
    if buf is None:
        buf = _sync_sources[id(device)] = Buffer((4,), "u32", device)
    return buf
