"""runtime/recorder.py: launches, copies and readbacks recorded and submitted once; recordings encoded
ahead; timestamps; waits for one submission; threads sharing the device."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from torch_wgpu_lora.runtime import (Arena, Buffer, Launch, Recorder, Uniform, copy_launch, get_device, kernel,
                                     synchronize, upload, write)
from torch_wgpu_lora.runtime.buffers import staging_for

from ..concurrency import in_threads
from .helpers import read_back, reduce_kernel


def test_copy_and_clear():
    src = upload(np.arange(8, dtype=np.float32))
    dst = Buffer((8,))
    rec = Recorder()
    rec.copy(src, dst)
    rec.submit()
    np.testing.assert_array_equal(read_back(dst), np.arange(8))
    rec = Recorder()
    rec.clear(dst)
    rec.submit()
    np.testing.assert_array_equal(read_back(dst), 0)


def test_copy_launch_copies_inside_a_pass_and_refuses_what_it_cannot_copy():
    src, dst = Buffer((300_000,)), Buffer((300_004,))
    values = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    write(src, values)
    write(dst, np.full(300_004, 7.0, np.float32))
    rec = Recorder()
    rec.launch(copy_launch(src, dst))
    rec.submit()
    out = read_back(dst)
    np.testing.assert_array_equal(out[:300_000], values)
    np.testing.assert_array_equal(out[300_000:], 7.0)  # past src's end: untouched
    with pytest.raises(ValueError, match="whole vec4s"):
        copy_launch(Buffer((6,)), Buffer((8,)))
    with pytest.raises(ValueError, match="at least as large"):
        copy_launch(Buffer((8,)), Buffer((4,)))
    arena = Arena()
    a, b = arena.alloc((8,)), arena.alloc((8,))
    with pytest.raises(ValueError, match="one GPU buffer"):  # WebGPU: no read and write binding of one buffer
        copy_launch(a, b)


def _native_entry_points():
    """The error-checked C entry points of the backend in use (wgpu-py's ``libf`` for wgpu-native,
    wgpudawn's for Dawn): what its submits go through."""
    return sys.modules[type(get_device().wgpu).__module__].libf


def test_a_readback_costs_one_queue_submit(monkeypatch):
    """wgpu-py's READ map mode (wgpu-native) submits an empty command buffer before mapping; the
    recorder maps its staging buffers itself, after the one submit that filled them. Counted in the C
    calls of whichever implementation runs."""
    libf = _native_entry_points()
    src = upload(np.arange(8, dtype=np.float32))
    out = np.zeros(8, np.float32)
    submits = []
    for name in [n for n in dir(libf) if n.startswith("wgpuQueueSubmit")]:
        real = getattr(libf, name)
        monkeypatch.setattr(libf, name, lambda *args, real=real, name=name: (submits.append(name), real(*args))[1])
    for _ in range(2):  # the second maps a pooled staging buffer that was mapped before
        rec = Recorder()
        rec.read(src, out)
        rec.submit()
    assert len(submits) == 2, submits
    np.testing.assert_array_equal(out, np.arange(8))


def test_a_recording_encoded_ahead_runs_with_the_values_written_before_its_submit():
    """``Recorder.finish`` encodes now; the buffers and the ``Uniform`` written between that and
    the submit are what the GPU sees. Each recording submits once; a discarded one gives its
    staging back."""
    k = reduce_kernel()
    x, acc = upload(np.arange(16, dtype=np.float32)), Buffer((16,))
    params = Uniform(k)
    launch = Launch.build(k, (1, 1, 1), (x, acc), params)  # acc = scale · x
    outs = [np.zeros(16, np.float32) for _ in range(2)]
    recordings = []
    for out in outs:
        rec = Recorder()
        rec.launch(launch)
        rec.read(acc, out)
        recordings.append(rec.finish())
    for scale, recording in zip((3.0, 5.0), recordings):
        write(x, np.full(16, scale, np.float32))
        params.write((4, 4, 1, 0, scale))
        recording.submit_async().wait()
    np.testing.assert_array_equal(outs[0], 9.0)
    np.testing.assert_array_equal(outs[1], 25.0)
    with pytest.raises(RuntimeError, match="already submitted or discarded"):
        recordings[0].submit_async()
    rec = Recorder()
    rec.read(acc, outs[0])
    unused = rec.finish()
    pool = staging_for(get_device())
    free = len(pool.free)
    unused.discard()
    assert len(pool.free) == free + 1
    with pytest.raises(ValueError, match="a Uniform made for copy.wgsl:copy"):
        Launch.build(k, (1, 1, 1), (x, acc), Uniform(kernel("copy.wgsl", "copy")))


def test_many_dispatches_one_submit_and_timestamps():
    device = get_device()
    x = upload(np.arange(16, dtype=np.float32))
    acc = Buffer((16,))
    k = reduce_kernel()
    submits = device.submits
    rec = Recorder(timestamps=True)
    rec.clear(acc)
    for _ in range(5):  # acc += 2 * x, five times, each reading the last one's result
        rec.dispatch(k, (1, 1, 1), (x, acc), (4, 4, 1, 1, 2.0))
    out = np.zeros(16, np.float32)
    rec.read(acc, out)
    seconds = rec.submit()
    np.testing.assert_array_equal(out, 10 * np.arange(16))
    assert rec.dispatches == 5 and device.submits == submits + 1
    if device.has_timestamps:
        assert 0 < seconds < 10
    synchronize()


def test_prebuilt_launches_and_a_per_dispatch_profile_past_64_launches():
    device = get_device()
    x = upload(np.ones(64, np.float32))
    acc = Buffer((64,))
    launch = Launch.build(reduce_kernel(), (1, 1, 1), (x, acc), {"len4": 16, "stride4": 16, "splits": 1,
                                                                 "accumulate": 1, "scale": 1.0})
    rec = Recorder(per_dispatch=True)
    rec.clear(acc)
    for _ in range(100):
        rec.launch(launch)
    out = np.zeros(64, np.float32)
    rec.read(acc, out)
    rec.submit()
    np.testing.assert_array_equal(out, 100)
    if device.has_timestamps:
        assert len(rec.kernel_times) == 100
        assert all(name == "reduce.wgsl:reduce_partials" and t >= 0 for name, t in rec.kernel_times)


def test_indirect_launch_reads_its_grid_from_the_gpu():
    x = upload(np.ones(1024, np.float32))
    acc = Buffer((1024,))
    args = upload(np.array([3, 1, 1, 0], np.uint32))  # 3 workgroups of 64 vec4s: the first 768 floats
    launch = Launch.build(reduce_kernel(), (1, 1, 1), (x, acc), (256, 256, 1, 0, 1.0))
    rec = Recorder()
    rec.clear(acc)
    rec.launch_indirect(launch, args)
    rec.submit()
    np.testing.assert_array_equal(read_back(acc), np.r_[np.ones(768), np.zeros(256)])


def test_async_submits_fill_their_outputs_when_waited_in_any_order(monkeypatch):
    """Each readback waits for its own submission. On wgpu-native the recorder maps without wgpu-py's
    map_async, whose poll thread would wait for all submitted work and hold up submits meanwhile
    (``runtime/backends/wgpu_native.py``); Dawn's map_async waits on the one map (no poll thread)."""
    device = get_device()
    if device.backend.name == "wgpu-native":
        def refuse(*args, **kwargs):
            raise AssertionError("the recorder called wgpu-py's map_async")

        staging_type = type(device.wgpu.create_buffer(size=16, usage=device.api.BufferUsage.MAP_READ))
        monkeypatch.setattr(staging_type, "map_async", refuse)
    outs = [np.zeros(4, np.float32) for _ in range(3)]
    pendings = []
    for i, out in enumerate(outs):
        rec = Recorder()
        rec.read(upload(np.full(4, i, np.float32)), out)
        pendings.append(rec.submit_async())
    assert not any(out.any() for out in outs[1:])  # nothing is filled before its wait
    for p in reversed(pendings):
        p.wait()
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out, i)


def test_a_readback_larger_than_a_staging_buffer_is_split_and_staging_shrinks(monkeypatch):
    device = get_device()
    pool = staging_for(device)
    monkeypatch.setattr(pool, "max_bytes", 4096)
    data = np.arange(3000, dtype=np.float32)  # 12000 bytes: three staging buffers
    out = np.zeros_like(data)
    rec = Recorder()
    rec.read(upload(data), out)
    rec.read(upload(data[:5].copy()), lambda view: np.testing.assert_array_equal(view, data[:5]))
    rec.submit()
    np.testing.assert_array_equal(out, data)
    monkeypatch.setattr(pool, "keep_bytes", 8192)
    rec = Recorder()
    rec.read(upload(np.zeros(1 << 16, np.float32)), lambda view: None)
    rec.submit()
    assert pool.kept_bytes <= 8192  # a large readback does not pin its staging memory


def test_binding_larger_than_the_adapter_limit_is_refused(monkeypatch):
    device = get_device()
    big = Buffer((64,))
    k = kernel("reduce.wgsl", "reduce_partials", WG=32)
    monkeypatch.setattr(device, "max_binding", 128)
    rec = Recorder()
    with pytest.raises(ValueError, match=r"\(64,\) buffer \(256 bytes\) exceeds this adapter's "
                                         r"max-storage-buffer-binding-size \(128 bytes\)"):
        rec.dispatch(k, (1, 1, 1), (big, Buffer((64,))), (16, 16, 1, 0, 1.0))


def test_grid_over_the_dispatch_limit_is_refused():
    k = reduce_kernel()
    too_many = get_device().max_workgroups + 1
    with pytest.raises(ValueError, match="exceeds max-compute-workgroups-per-dimension"):
        Recorder().dispatch(k, (too_many, 1, 1), (Buffer((4,)), Buffer((4,))), (1, 1, 1, 0, 1.0))


def test_many_threads_share_the_device_and_every_result_is_right():
    k = reduce_kernel()

    def check(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(40):
            x = rng.standard_normal(256).astype(np.float32)
            out = np.empty(256, np.float32)
            rec = Recorder()
            acc = Buffer((256,))
            rec.dispatch(k, (1, 1, 1), (upload(x), acc), (64, 64, 1, 0, 3.0))
            rec.read(acc, out)
            rec.submit()
            np.testing.assert_array_equal(out, 3 * x)

    in_threads(check, 4)
