"""Record many kernel launches, copies and readbacks; submit them once.

Usage::

    rec = Recorder()
    rec.dispatch(k, grid=(groups, 1, 1), buffers=(x, y), params=(n, d))
    rec.read(y, out)                  # out: a numpy array (e.g. a torch tensor's .numpy())
    rec.submit()                      # one command buffer, one submit, wait, fill ``out``

    pending = rec.submit_async()      # or: submit now, encode the next step, then
    pending.wait()                    # wait for this one and fill its outputs

    recording = rec.finish()          # or: encode now (while the GPU runs something else),
    recording.submit_async().wait()   # submit later, after the queue writes that feed it

Dispatches that follow each other share one compute pass; a copy or clear closes
the pass (WebGPU records those outside compute passes). wgpu inserts the memory
barriers that dependent dispatches need.

Two ways to launch: ``dispatch`` (a kernel, buffers and params given each time; bind
groups and uniforms cached by value) and ``launch`` (a ``Launch`` whose bind group a
plan built once: the fast path for a model step that records hundreds of launches).

Every submit takes its own staging buffers from the device's pool, so threads and
submits in flight never share one. A Recorder itself belongs to one thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .buffers import DTYPES, Buffer, staging_for
from .device import Device, get_device
from .kernels import Kernel, Uniform, kernel

_QUERIES_PER_SET = 4096  # WebGPU's largest query set


@dataclass(frozen=True)
class Launch:
    """One kernel launch with its bind group built once (by a plan): record it any number of
    times with ``Recorder.launch``. ``keep`` holds the buffers the bind group refers to;
    ``handles`` are the native pipeline and bind group handles, what the fast path passes to C."""

    kernel: Kernel
    bind_group: Any
    grid: tuple[int, int, int]
    keep: tuple[Buffer, ...] = ()
    handles: tuple[Any, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        backend = self.kernel.device.backend
        object.__setattr__(self, "handles", (backend.handle(self.kernel.pipeline), backend.handle(self.bind_group)))

    @classmethod
    def build(cls, kernel: Kernel, grid: tuple[int, int, int], buffers: Sequence[Buffer] | Mapping[int, Buffer],
              params: Sequence[Any] | Mapping[str, Any] | Uniform = ()) -> "Launch":
        _check_grid(kernel, grid)
        keep = tuple(buffers.values()) if isinstance(buffers, Mapping) else tuple(buffers)
        return cls(kernel, kernel.bind(buffers, params), tuple(int(g) for g in grid), keep)


def copy_launch(src: Buffer, dst: Buffer) -> Launch:
    """A launch of ``copy.wgsl`` copying all of ``src`` into ``dst`` (byte sizes multiples of 16):
    a copy that stays inside a compute pass, where ``Recorder.copy`` ends the pass it is in.

    >>> # rec.launch(copy_launch(residual, saved))
    """
    if src.nbytes % 16 or dst.nbytes < src.nbytes:
        raise ValueError(f"copy_launch copies whole vec4s into a buffer at least as large: {src.nbytes} bytes "
                         f"into {dst.nbytes}")
    if src.gpu is dst.gpu:
        raise ValueError("copy_launch cannot copy between views of one GPU buffer (WebGPU forbids binding a buffer "
                         "both read-only and writable in one dispatch); use Recorder.copy")
    vec4s = src.nbytes // 16
    k = kernel("copy.wgsl", "copy", src.device)
    return Launch.build(k, (min(-(-vec4s // 256), k.device.max_workgroups), 1, 1), (src, dst), (vec4s,))


def _check_grid(kernel: Kernel, grid: tuple[int, int, int]) -> None:
    limit = kernel.device.max_workgroups
    if max(grid) > limit:
        raise ValueError(f"{kernel.name}: grid {tuple(grid)} exceeds max-compute-workgroups-per-dimension ({limit})")


@dataclass
class _Read:
    buf: Buffer
    sink: Callable[[np.ndarray], None]
    pieces: list[tuple[int, int, int]]  # (staging index, staging offset, bytes)


def _give_back(device: Device, staging: list[Any]) -> None:
    """Staging buffers back to the device's pool."""
    pool = staging_for(device)
    for gpu in staging:
        pool.give(gpu)


class Pending:
    """A submitted recording whose readbacks have not been collected yet."""

    def __init__(self, device: Device, staging: list[Any], reads: list[_Read], keep: list[Any],
                 times: "_Timestamps | None", ticket: Any) -> None:
        self.device, self._staging, self._reads, self._keep, self._times = device, staging, reads, keep, times
        self.ticket = ticket  # the submission's, for Device.wait_for
        self.done = False
        self.seconds: float | None = None
        self.kernel_times: list[tuple[str, float]] = []

    def wait(self) -> float | None:
        """Wait for the GPU, fill every readback's output; returns GPU seconds when timed."""
        if self.done:
            return self.seconds
        mapped: list[Any] = []
        backend = self.device.backend
        try:
            if self._staging:
                self.device.wait_for(self.ticket)
                backend.map_read(self.device.wgpu, self._staging)
                mapped = self._staging
            for read in self._reads:
                read.sink(self._view(read))
            if self._times is not None:
                self.seconds, self.kernel_times = self._times.collect(self._view(self._times.read))
        finally:
            for gpu in mapped:
                backend.unmap(gpu)
            _give_back(self.device, self._staging)
            self._staging, self._keep, self.done = [], [], True
        return self.seconds

    def _view(self, read: _Read) -> np.ndarray:
        np_dtype = DTYPES[read.buf.dtype]
        if read.buf.nbytes == 0:
            return np.empty(read.buf.shape, np_dtype)
        if len(read.pieces) == 1:
            index, offset, nbytes = read.pieces[0]
            raw = self.device.backend.mapped(self._staging[index], offset, nbytes)
            return np.frombuffer(raw, dtype=np_dtype, count=read.buf.numel).reshape(read.buf.shape)
        whole = np.empty(sum(n for _, _, n in read.pieces), np.uint8)  # a readback past one staging buffer
        at = 0
        for index, offset, nbytes in read.pieces:
            whole[at:at + nbytes] = np.frombuffer(self.device.backend.mapped(self._staging[index], offset, nbytes),
                                                  np.uint8)
            at += nbytes
        return whole.view(np_dtype)[: read.buf.numel].reshape(read.buf.shape)


class _Timestamps:
    """Timestamp queries of one recording, in sets of up to 4096."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.sets: list[Any] = []
        self.count = 0
        self.names: list[str] = []  # what ended at each query after the first, for per-dispatch profiles
        self.read: _Read | None = None

    def next(self) -> tuple[Any, int]:
        if self.count == len(self.sets) * _QUERIES_PER_SET:
            self.sets.append(self.device.wgpu.create_query_set(type="timestamp", count=_QUERIES_PER_SET))
        index = self.count
        self.count += 1
        return self.sets[index // _QUERIES_PER_SET], index % _QUERIES_PER_SET

    def resolve(self, encoder: Any, keep: list[Any]) -> Buffer:
        out = Buffer((2 * self.count,), "u32", self.device)
        usage = self.device.api.BufferUsage
        for i, query_set in enumerate(self.sets):
            n = min(_QUERIES_PER_SET, self.count - i * _QUERIES_PER_SET)
            resolve = self.device.wgpu.create_buffer(size=8 * n, usage=usage.QUERY_RESOLVE | usage.COPY_SRC)
            encoder.resolve_query_set(query_set, 0, n, resolve, 0)
            encoder.copy_buffer_to_buffer(resolve, 0, out.gpu, 8 * i * _QUERIES_PER_SET, 8 * n)
            keep.append(resolve)
        return out

    def collect(self, view: np.ndarray) -> tuple[float, list[tuple[str, float]]]:
        ticks = view.view(np.uint64).astype(np.int64)  # WebGPU timestamps are nanoseconds
        return float(ticks[-1] - ticks[0]) * 1e-9, self._named(ticks)

    def _named(self, ticks: np.ndarray) -> list[tuple[str, float]]:
        if not self.names:
            return []
        if len(self.names) == len(ticks) - 1:  # in-pass stamps: one before the first launch, one after each
            return list(zip(self.names, (np.diff(ticks) * 1e-9).tolist()))
        return list(zip(self.names, ((ticks[1::2] - ticks[0::2]) * 1e-9).tolist()))  # a pass per launch


class Recording:
    """A finished command buffer not yet submitted (``Recorder.finish``): submit it once, or
    ``discard`` it (its staging buffers go back to the device's pool)."""

    def __init__(self, device: Device, command_buffer: Any, staging: list[Any], reads: list[_Read],
                 keep: list[Any], times: "_Timestamps | None") -> None:
        self.device, self._command_buffer = device, command_buffer
        self._staging, self._reads, self._keep, self._times = staging, reads, keep, times

    def submit_async(self) -> Pending:
        """Submit it; the returned ``Pending`` waits and fills the readbacks' outputs."""
        if self._command_buffer is None:
            raise RuntimeError("this recording was already submitted or discarded")
        self.device.check_usable()
        command_buffer, self._command_buffer = self._command_buffer, None
        ticket = self.device.submit([command_buffer])
        return Pending(self.device, self._staging, self._reads, self._keep, self._times, ticket)

    def discard(self) -> None:
        """Drop it unsubmitted."""
        if self._command_buffer is None:
            return
        self._command_buffer = None
        _give_back(self.device, self._staging)
        self._staging, self._keep = [], []


class Recorder:
    """One command buffer under construction. Also a context manager that submits on exit.

    With ``timestamps=True`` (and an adapter that has ``timestamp-query``), ``submit()``
    returns the GPU time in seconds from the first pass's start to the last pass's end.
    ``per_dispatch=True`` also fills ``kernel_times`` with (kernel name, seconds) for every
    launch: stamps between launches inside one pass where the adapter allows it
    (``timestamp-query-inside-passes``), else a pass per launch. A profile, not a fast path.
    """

    def __init__(self, device: Device | None = None, timestamps: bool = False, per_dispatch: bool = False) -> None:
        self.device = device or get_device()
        self.device.check_usable()
        self.backend = self.device.backend
        self.encoder = self.device.wgpu.create_command_encoder()
        self.pass_: Any = None
        self._pass_handle: Any = None
        self._pipeline: Any = None  # the pipeline set last in the open pass (the fast path skips repeats)
        self.keep: list[Any] = []  # handles alive until the GPU is done: nothing recorded is reused early
        self.reads: list[_Read] = []
        self.dispatches = 0
        timed = (timestamps or per_dispatch) and self.device.has_timestamps
        self._times = _Timestamps(self.device) if timed else None
        self.per_dispatch = per_dispatch and timed
        self._in_pass_stamps = self.per_dispatch and self.device.has_stamps_in_passes
        self.kernel_times: list[tuple[str, float]] = []

    # -- recording ---------------------------------------------------------------
    def _compute_pass(self) -> Any:
        if self.pass_ is None:
            kwargs = {}
            if self._times is not None and not self._in_pass_stamps:
                # queries come in (begin, end) pairs from index 0 and sets hold an even number:
                # a pair never straddles two sets
                (query_set, begin), (_, end) = self._times.next(), self._times.next()
                kwargs["timestamp_writes"] = {"query_set": query_set, "beginning_of_pass_write_index": begin,
                                              "end_of_pass_write_index": end}
            self.pass_ = self.encoder.begin_compute_pass(**kwargs)
            self._pass_handle = self.backend.handle(self.pass_)
            self._pipeline = None
            if self._in_pass_stamps and self._times.count == 0:
                self.backend.write_timestamp(self.pass_, *self._times.next())
        return self.pass_

    def _end_pass(self) -> None:
        if self.pass_ is not None:
            self.pass_.end()
            self.pass_ = None
            self._pipeline = None

    def _native_pass(self) -> Any:
        if self.pass_ is None:
            self._compute_pass()
        return self._pass_handle

    def _launched(self, kernel: Kernel) -> None:
        self.dispatches += 1
        if self.per_dispatch:
            self._times.names.append(kernel.name)
            if self._in_pass_stamps:
                self.backend.write_timestamp(self.pass_, *self._times.next())
            else:
                self._end_pass()

    def dispatch(self, kernel: Kernel, grid: tuple[int, int, int], buffers: Sequence[Buffer],
                 params: Sequence[Any] | Mapping[str, Any] = ()) -> None:
        """Record ``kernel`` over ``grid`` workgroups with ``buffers`` at bindings 1.. and
        ``params`` (by position or name) at 0."""
        _check_grid(kernel, grid)
        if min(grid) <= 0:
            return
        group = kernel.bind_group(params, buffers)
        cpass = self._compute_pass()
        cpass.set_pipeline(kernel.pipeline)
        self._pipeline = self.backend.handle(kernel.pipeline)
        cpass.set_bind_group(0, group)
        cpass.dispatch_workgroups(*grid)
        self.keep.append(tuple(buffers))
        self._launched(kernel)

    def launch(self, launch: Launch) -> None:
        """Record a prebuilt ``Launch``. The hot path of a model step (hundreds of launches): three
        calls straight into the WebGPU implementation's C API, the pipeline set only when it
        changes. (Encoding errors are reported when the command buffer is finished, as with
        wgpu-py's own calls.)"""
        native, lib = self._native_pass(), self.backend.lib
        pipeline, group = launch.handles
        if pipeline != self._pipeline:
            lib.wgpuComputePassEncoderSetPipeline(native, pipeline)
            self._pipeline = pipeline
        lib.wgpuComputePassEncoderSetBindGroup(native, 0, group, 0, self.backend.null)
        x, y, z = launch.grid
        lib.wgpuComputePassEncoderDispatchWorkgroups(native, x, y, z)
        self.keep.append(launch)
        self._launched(launch.kernel)

    def launch_indirect(self, launch: Launch, args: Buffer, offset: int = 0) -> None:
        """Record ``launch`` with its grid read on the GPU from ``args`` (three u32 at byte
        ``offset``): for grids that depend on values the GPU computed (a KV length)."""
        cpass = self._compute_pass()
        cpass.set_pipeline(launch.kernel.pipeline)
        self._pipeline = self.backend.handle(launch.kernel.pipeline)
        cpass.set_bind_group(0, launch.bind_group)
        cpass.dispatch_workgroups_indirect(args.gpu, args.offset + offset)
        self.keep.append(args)
        self._launched(launch.kernel)

    def clear(self, buf: Buffer) -> None:
        """Record zero-filling ``buf``."""
        self._end_pass()
        if buf.nbytes:
            self.encoder.clear_buffer(buf.gpu, buf.offset, -(-buf.nbytes // 4) * 4)
        self.keep.append(buf)

    def copy(self, src: Buffer, dst: Buffer, nbytes: int | None = None, src_offset: int = 0,
             dst_offset: int = 0) -> None:
        """Record copying ``nbytes`` (all of ``src`` by default, which must then match ``dst``'s
        size) from ``src`` at byte ``src_offset`` to ``dst`` at ``dst_offset``."""
        if nbytes is None:
            if src.nbytes != dst.nbytes:
                raise ValueError(f"copy: {src.shape} and {dst.shape} differ in size")
            nbytes = src.nbytes
        if src_offset + nbytes > src.nbytes or dst_offset + nbytes > dst.nbytes or nbytes % 4:
            raise ValueError(f"copy: {nbytes} bytes from {src_offset} of {src} to {dst_offset} of {dst} do not fit "
                             "(or are not whole words)")
        self._end_pass()
        if nbytes:
            self.encoder.copy_buffer_to_buffer(src.gpu, src.offset + src_offset, dst.gpu, dst.offset + dst_offset,
                                               nbytes)
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
        self.reads.append(_Read(buf, sink, []))
        self.keep.append(buf)

    # -- submitting --------------------------------------------------------------
    def _stage(self) -> list[Any]:
        """Record the copies of every readback into staging buffers; returns them."""
        pool = staging_for(self.device)
        sizes: list[int] = []  # bytes used in each staging buffer
        for read in self.reads:
            left, at = (read.buf.binding_size if read.buf.nbytes else 0), 0  # 16-byte pieces keep offsets mappable
            while left:
                if not sizes or sizes[-1] == pool.max_bytes:
                    sizes.append(0)
                nbytes = min(left, pool.max_bytes - sizes[-1])
                read.pieces.append((len(sizes) - 1, sizes[-1], nbytes))
                sizes[-1] += nbytes
                left -= nbytes
                at += nbytes
        staging = [pool.take(size) for size in sizes]
        for read in self.reads:
            at = 0
            for index, offset, nbytes in read.pieces:
                self.encoder.copy_buffer_to_buffer(read.buf.gpu, read.buf.offset + at, staging[index], offset, nbytes)
                at += nbytes
        return staging

    def finish(self) -> "Recording":
        """End recording: the command buffer and its readbacks' staging, to submit later."""
        self._end_pass()
        if self._times is not None and self._times.count:
            self._times.read = _Read(self._times.resolve(self.encoder, self.keep), lambda view: None, [])
            self.reads.append(self._times.read)
        staging = self._stage()
        reads = [r for r in self.reads if r is not (self._times.read if self._times else None)]
        recording = Recording(self.device, self.encoder.finish(), staging, reads, self.keep, self._times)
        self.keep, self.reads = [], []
        return recording

    def submit_async(self) -> Pending:
        """Submit everything recorded now; the returned ``Pending`` waits and fills outputs."""
        return self.finish().submit_async()

    def submit(self) -> float | None:
        """Submit everything recorded, wait for the readbacks, fill their outputs.

        Returns GPU seconds when recording with timestamps, else None. Waits for the GPU
        only when something is read back or timed.
        """
        pending = self.submit_async()
        if not pending._staging:
            return None
        seconds = pending.wait()
        self.kernel_times = pending.kernel_times
        return seconds

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.submit()


def synchronize(device: Device | None = None) -> None:
    """Wait until all submitted GPU work has finished.

    ``queue.on_submitted_work_done_sync`` raises in wgpu 0.32, so this submits an empty
    command buffer (which also carries any queued ``write_buffer``) and waits for it: the
    queue runs submissions in order.
    """
    device = device or get_device()
    device.check_usable()
    device.wait_for(device.submit([device.wgpu.create_command_encoder().finish()]))
