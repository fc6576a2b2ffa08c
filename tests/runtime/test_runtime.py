"""Runtime: adapter choice, device facts and state, buffers, arenas and staging, kernels, recorder,
threads and fork."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from torch_wgpu_lora.runtime import (Arena, Buffer, Launch, Recorder, Uniform, copy_launch, device_info, get_device,
                                     kernel, set_shader_checks, synchronize, upload, write)
from torch_wgpu_lora.runtime.buffers import pool_for, staging_for
from torch_wgpu_lora.runtime.device import (ADAPTER_ENV, INSTALL_HINT, LOCAL_RANK_ENV, choose_adapter,
                                            local_rank_from_env)
from torch_wgpu_lora.runtime.kernels import SHADER_CHECKS_ENV, params_layout, shader_checks
from torch_wgpu_lora.runtime.tensors import into, refresh, resident, to_gpu

from ..concurrency import in_forked_child, in_threads


class FakeAdapter:
    def __init__(self, device: str, adapter_type: str, backend: str = "Vulkan") -> None:
        self.info = {"device": device, "description": "", "vendor": "", "adapter_type": adapter_type,
                     "backend_type": backend}


def _reduce():
    return kernel("reduce.wgsl", "reduce_partials", WG=64)


def test_choose_adapter_prefers_gpus_and_native_backends():
    cpu = FakeAdapter("llvmpipe", "CPU")
    igpu = FakeAdapter("Intel Iris", "IntegratedGPU")
    dgpu_gl = FakeAdapter("NVIDIA H200", "DiscreteGPU", backend="OpenGL")
    dgpu = FakeAdapter("NVIDIA H200", "DiscreteGPU")
    assert choose_adapter([cpu, igpu, dgpu_gl, dgpu], None).adapter is dgpu
    assert choose_adapter([cpu, igpu], None).adapter is igpu
    assert choose_adapter([dgpu_gl, cpu], None).adapter is cpu  # OpenGL only as a last resort


def test_choose_adapter_override_is_a_case_insensitive_substring():
    cpu, dgpu = FakeAdapter("llvmpipe (LLVM 15)", "CPU"), FakeAdapter("NVIDIA H200", "DiscreteGPU")
    assert choose_adapter([dgpu, cpu], "LLVMPIPE").adapter is cpu
    with pytest.raises(RuntimeError, match=rf"{ADAPTER_ENV}='radeon' matches no adapter; adapters found: .*H200"):
        choose_adapter([dgpu, cpu], "radeon")


def test_each_local_rank_takes_its_own_adapter_of_the_preferred_kind():
    # wgpu lists each GPU once per backend; the preferred kind here is Vulkan discrete GPUs
    gpus = [FakeAdapter(f"NVIDIA H200 #{i}", "DiscreteGPU") for i in range(2)]
    others = [FakeAdapter("NVIDIA H200 #0", "DiscreteGPU", backend="OpenGL"), FakeAdapter("llvmpipe", "CPU"),
              FakeAdapter("Intel Iris", "IntegratedGPU")]
    adapters = [others[0], gpus[0], others[1], gpus[1], others[2]]
    assert choose_adapter(adapters, None).adapter is gpus[0]  # no local rank: the first, as before
    for rank in (0, 1):
        choice = choose_adapter(adapters, None, local_rank=rank)
        assert choice.adapter is gpus[rank] and (choice.index, choice.of_kind, choice.local_rank) == (rank, 2, rank)
        assert f"{LOCAL_RANK_ENV}={rank}: adapter {rank} of the 2 Vulkan DiscreteGPU" in choice.reason
    # a third process on a machine with two such GPUs: refused, naming them (never silently an iGPU or OpenGL)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2 needs 3 WebGPU adapters of the preferred kind \(Vulkan "
                                           r"DiscreteGPU\), but this machine has 2 \(0: NVIDIA H200 #0.*1: NVIDIA H200 "
                                           r"#1.*\)\. Start at most 2 processes per machine"):
        choose_adapter(adapters, None, local_rank=2)
    # the variable wins over the local rank: it names the adapter by hand
    choice = choose_adapter(adapters, "iris", local_rank=1)
    assert choice.adapter is others[2] and f"{ADAPTER_ENV}='iris' names it" in choice.reason


def test_local_ranks_share_a_cpu_adapter():
    cpu = FakeAdapter("llvmpipe (LLVM 15)", "CPU")
    gl = FakeAdapter("llvmpipe (LLVM 15)", "CPU", backend="OpenGL")
    for rank in range(4):
        choice = choose_adapter([gl, cpu], None, local_rank=rank)
        assert choice.adapter is cpu and choice.index == 0 and choice.of_kind == 1
    assert "the processes share adapter 0" in choose_adapter([cpu], None, local_rank=3).reason
    with pytest.raises(RuntimeError, match="LOCAL_RANK must be an integer >= 0, got -1"):
        choose_adapter([cpu], None, local_rank=-1)


def test_local_rank_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(LOCAL_RANK_ENV, raising=False)
    assert local_rank_from_env() is None
    monkeypatch.setenv(LOCAL_RANK_ENV, "3")
    assert local_rank_from_env() == 3
    monkeypatch.setenv(LOCAL_RANK_ENV, "first")
    with pytest.raises(RuntimeError, match="LOCAL_RANK must be an integer >= 0, got 'first'"):
        local_rank_from_env()


def test_no_adapter_error_says_what_to_install():
    with pytest.raises(RuntimeError) as err:
        choose_adapter([], None)
    assert str(err.value) == INSTALL_HINT
    assert "apt-get install mesa-vulkan-drivers" in INSTALL_HINT


def test_device_info_reports_adapter_backend_limits_features():
    info = device_info()
    assert info["adapter"] and info["backend"] in ("Vulkan", "Metal", "D3D12", "OpenGL")
    assert info["adapter_index"] < info["adapters_of_kind"] and info["choice"]
    assert info["local_rank"] == local_rank_from_env()
    assert info["limits"]["max-storage-buffer-binding-size"] == get_device().max_binding > 0
    assert isinstance(info["features"], list)
    assert get_device() is get_device()  # one device per process


def test_creating_the_device_leaves_the_environment_as_it_was():
    # Mesa's probes are quieted with a private XDG_RUNTIME_DIR only while the device is made.
    code = ("import os; had = os.environ.get('XDG_RUNTIME_DIR'); "
            "from torch_wgpu_lora.runtime import get_device; get_device(); "
            "assert os.environ.get('XDG_RUNTIME_DIR') == had, os.environ.get('XDG_RUNTIME_DIR')")
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "XDG_RUNTIME_DIR" not in done.stderr  # and Mesa printed nothing about it


def test_params_layout_is_read_from_the_wgsl_struct():
    src = "struct Params {\n  rows: u32,  // a comment: u32\n  shift: i32,\n  scale: f32,\n}\n"
    assert params_layout(src) == (("rows", "shift", "scale"), "<Iif")
    assert params_layout("fn main() {}") == ((), "<")
    with pytest.raises(TypeError, match="only u32, i32 and f32"):
        params_layout("struct Params { v: vec4<f32> }")


def test_params_by_position_or_name_and_bad_ones_named():
    k = _reduce()
    assert k.params == ("len4", "stride4", "splits", "accumulate", "scale")
    by_name = k.pack({"len4": 1, "stride4": 2, "splits": 3, "accumulate": 0, "scale": 0.5})
    assert by_name == k.pack((1, 2, 3, 0, 0.5)) and len(by_name) % 16 == 0
    with pytest.raises(ValueError, match=r"params \['bogus'\] unknown, \['scale'\] missing"):
        k.pack({"len4": 1, "stride4": 2, "splits": 3, "accumulate": 0, "bogus": 1})
    with pytest.raises(ValueError, match="2 params given"):
        k.pack((1, 2))


def test_override_constants_change_the_pipeline():
    # WG=64 and WG=256 are two pipelines of the same source; both compute the same sums.
    x = upload(np.arange(1024, dtype=np.float32))
    for wg in (64, 256):
        k = kernel("reduce.wgsl", "reduce_partials", WG=wg)
        assert k.constants == {"WG": wg}
        out = np.zeros(256, np.float32)
        acc = Buffer((256,))
        rec = Recorder()
        rec.dispatch(k, (-(-64 // wg), 1, 1), (x, acc), (64, 64, 4, 0, 1.0))
        rec.read(acc, out)
        rec.submit()
        expect = np.arange(1024, dtype=np.float32).reshape(4, 256).sum(0)
        np.testing.assert_array_equal(out, expect)
    assert kernel("reduce.wgsl", "reduce_partials", WG=64) is kernel("reduce.wgsl", "reduce_partials", WG=64)


def test_kernel_cache_is_keyed_on_the_shader_checks_and_every_mode_computes(monkeypatch):
    monkeypatch.delenv(SHADER_CHECKS_ENV, raising=False)
    assert shader_checks() == "bounds"  # the default: bounds checks, no loop counters
    default = kernel("reduce.wgsl", "reduce_partials", WG=128)
    x = upload(np.arange(1024, dtype=np.float32))
    expect = np.arange(1024, dtype=np.float32).reshape(4, 256).sum(0)
    try:
        for mode in ("full", "bounds", "none"):
            set_shader_checks(mode)
            k = kernel("reduce.wgsl", "reduce_partials", WG=128)
            assert (k is default) == (mode == "bounds")
            out, acc, rec = np.zeros(256, np.float32), Buffer((256,)), Recorder()
            rec.dispatch(k, (1, 1, 1), (x, acc), (64, 64, 4, 0, 1.0))
            rec.read(acc, out)
            rec.submit()
            np.testing.assert_array_equal(out, expect)
    finally:
        set_shader_checks(None)
    assert kernel("reduce.wgsl", "reduce_partials", WG=128) is default


def test_a_bad_shader_checks_variable_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(SHADER_CHECKS_ENV, "bogus")
    with pytest.raises(ValueError, match=rf"{SHADER_CHECKS_ENV} must be one of full, bounds, none, got 'bogus'"):
        shader_checks()


def test_upload_and_read_round_trip_every_dtype():
    arrays = [np.arange(24, dtype=np.float32).reshape(4, 6) / 7, np.arange(10, dtype=np.uint32) * 400_000_000,
              np.arange(-6, 6, dtype=np.int32), np.linspace(-2, 2, 8).astype(np.float16)]
    outs = [np.zeros_like(a) for a in arrays]
    rec = Recorder()
    for a, out in zip(arrays, outs):
        rec.read(upload(a), out)
    rec.submit()
    for a, out in zip(arrays, outs):
        np.testing.assert_array_equal(out, a)


def test_upload_hands_the_arrays_own_memory_to_wgpu(monkeypatch):
    queue = get_device().queue
    seen = []
    original = type(queue).write_buffer
    monkeypatch.setattr(type(queue), "write_buffer",
                        lambda self, buf, off, data, *a: (seen.append(data), original(self, buf, off, data, *a)))
    t = torch.randn(8, 4)
    upload(t.numpy())
    assert np.shares_memory(seen[0], t.numpy())  # no Python-side copy before wgpu's own


def test_read_fills_a_preallocated_tensor_in_place():
    t = torch.empty(3, 8)
    ptr = t.data_ptr()
    rec = Recorder()
    rec.read(upload(np.full((3, 8), 2.5, np.float32)), t.numpy())
    rec.submit()
    assert t.data_ptr() == ptr and torch.equal(t, torch.full((3, 8), 2.5))


def test_upload_refuses_what_it_cannot_pass_without_a_copy():
    with pytest.raises(TypeError, match="float32, float16, uint32 or int32 arrays, got float64"):
        upload(np.zeros(4))
    with pytest.raises(ValueError, match="C-contiguous"):
        upload(np.zeros((4, 4), np.float32).T)


def test_write_checks_size_and_lands_at_its_offset():
    buf = upload(np.zeros(8, np.float32))
    write(buf, np.array([1, 2], np.float32), offset=8)
    out = np.empty(8, np.float32)
    rec = Recorder()
    rec.read(buf, out)
    rec.submit()
    np.testing.assert_array_equal(out, [0, 0, 1, 2, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="do not fit"):
        write(buf, np.zeros(8, np.float32), offset=4)


def test_buffers_return_to_the_pool_and_are_reused():
    pool = pool_for(get_device())
    b = Buffer((1000,))
    serial = b.serial
    before = pool.free_bytes
    del b
    assert pool.free_bytes == before + 4000  # its wgpu buffer went back to the pool
    c = Buffer((999,))  # same size bucket
    assert c.serial == serial and pool.free_bytes == before


def test_arena_views_are_aligned_separate_and_kernels_see_only_their_range():
    device = get_device()
    arena = Arena(chunk_bytes=1 << 16)
    a = arena.alloc((5,))
    b = arena.alloc((64,))
    big = arena.alloc((40_000,))  # larger than a chunk: a chunk of its own
    assert a.gpu is b.gpu and big.gpu is not a.gpu
    assert b.offset % device.offset_alignment == 0 and b.offset >= a.binding_size
    x = upload(np.arange(256, dtype=np.float32))
    rec = Recorder()
    rec.clear(b)
    rec.dispatch(kernel("reduce.wgsl", "reduce_partials", WG=64), (1, 1, 1), (x, b), (16, 16, 4, 0, 1.0))
    rec.copy(x, a, nbytes=20)
    out_a, out_b = np.zeros(5, np.float32), np.zeros(64, np.float32)
    rec.read(a, out_a)
    rec.read(b, out_b)
    rec.submit()
    np.testing.assert_array_equal(out_a, np.arange(5))
    np.testing.assert_array_equal(out_b, np.arange(256, dtype=np.float32).reshape(4, 64).sum(0))


def test_rows_and_slice_are_views_of_their_range_and_refuse_what_does_not_fit():
    x = upload(np.arange(24, dtype=np.float32).reshape(6, 4))
    middle, tail = x.rows(2, 3), x.slice(17, (3,))
    assert middle.gpu is x.gpu and middle.shape == (3, 4) and middle.offset == x.offset + 2 * 16
    out_rows, out_tail = np.zeros((3, 4), np.float32), np.zeros(3, np.float32)
    rec = Recorder()
    rec.read(middle, out_rows)
    rec.read(tail, out_tail)
    rec.submit()
    np.testing.assert_array_equal(out_rows, np.arange(8, 20).reshape(3, 4))
    np.testing.assert_array_equal(out_tail, [17, 18, 19])
    with pytest.raises(ValueError, match="rows 4..7 of a buffer of 6 rows"):
        x.rows(4, 3)
    with pytest.raises(ValueError, match="slice of 4 elements at 21"):
        x.slice(21, (4,))
    with pytest.raises(ValueError, match="binding runs past the end"):
        x.slice(21, (3,))


def test_arena_chunks_grow_from_a_mebibyte_to_their_bound():
    arena = Arena(chunk_bytes=4 << 20)
    for _ in range(20):
        arena.alloc((100_000,))  # 400 kB each: 2 fit 1 MiB, 5 fit 2 MiB, 10 fit 4 MiB
    assert [c.size for c in arena.chunks] == [1 << 20, 2 << 20, 4 << 20, 4 << 20]
    big = Arena(chunk_bytes=4 << 20)
    big.alloc((600_000,))  # 2.4 MB: a first chunk of its size
    assert [c.size for c in big.chunks] == [2_400_000]
    assert arena.nbytes == sum(c.size for c in arena.chunks)


def test_copy_and_clear():
    src = upload(np.arange(8, dtype=np.float32))
    dst = Buffer((8,))
    out_copy, out_clear = np.zeros(8, np.float32), np.ones(8, np.float32)
    rec = Recorder()
    rec.copy(src, dst)
    rec.read(dst, out_copy)
    rec.submit()
    rec = Recorder()
    rec.clear(dst)
    rec.read(dst, out_clear)
    rec.submit()
    np.testing.assert_array_equal(out_copy, np.arange(8))
    np.testing.assert_array_equal(out_clear, 0)


def test_copy_launch_copies_inside_a_pass_and_refuses_what_it_cannot_copy():
    src, dst = Buffer((300_000,)), Buffer((300_004,))
    values = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    write(src, values)
    write(dst, np.full(300_004, 7.0, np.float32))
    out = np.zeros(300_004, np.float32)
    rec = Recorder()
    rec.launch(copy_launch(src, dst))
    rec.read(dst, out)
    rec.submit()
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


def test_a_readback_costs_one_queue_submit(monkeypatch):
    """wgpu-py's READ map mode submits an empty command buffer before mapping; the recorder maps
    its staging buffers itself, after the one submit that filled them."""
    from wgpu.backends.wgpu_native._api import libf

    src = upload(np.arange(8, dtype=np.float32))
    out = np.zeros(8, np.float32)
    submits = []
    for name in ("wgpuQueueSubmit", "wgpuQueueSubmitForIndex"):
        real = getattr(libf, name)
        monkeypatch.setattr(libf, name, lambda *args, real=real, name=name: (submits.append(name), real(*args))[1])
    for _ in range(2):  # the second maps a pooled staging buffer that was mapped before
        rec = Recorder()
        rec.read(src, out)
        rec.submit()
    assert submits == ["wgpuQueueSubmitForIndex"] * 2
    np.testing.assert_array_equal(out, np.arange(8))


def test_a_recording_encoded_ahead_runs_with_the_values_written_before_its_submit():
    """``Recorder.finish`` encodes now; the buffers and the ``Uniform`` written between that and
    the submit are what the GPU sees. Each recording submits once; a discarded one gives its
    staging back."""
    k = _reduce()
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
    k = _reduce()
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
    launch = Launch.build(_reduce(), (1, 1, 1), (x, acc), {"len4": 16, "stride4": 16, "splits": 1,
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
    launch = Launch.build(_reduce(), (1, 1, 1), (x, acc), (256, 256, 1, 0, 1.0))
    rec = Recorder()
    rec.clear(acc)
    rec.launch_indirect(launch, args)
    out = np.zeros(1024, np.float32)
    rec.read(acc, out)
    rec.submit()
    np.testing.assert_array_equal(out, np.r_[np.ones(768), np.zeros(256)])


def test_async_submits_overlap_and_fill_their_outputs_when_waited(monkeypatch):
    """Each readback waits for its own submission only, and maps without wgpu-py's map_async
    (whose poll thread would wait for all submitted work and hold up submits meanwhile)."""
    import wgpu

    def refuse(*args, **kwargs):
        raise AssertionError("the recorder called wgpu-py's map_async")

    monkeypatch.setattr(type(get_device().wgpu.create_buffer(size=16, usage=wgpu.BufferUsage.MAP_READ)),
                        "map_async", refuse)
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
    k = _reduce()
    too_many = get_device().max_workgroups + 1
    with pytest.raises(ValueError, match="exceeds max-compute-workgroups-per-dimension"):
        Recorder().dispatch(k, (too_many, 1, 1), (Buffer((4,)), Buffer((4,))), (1, 1, 1, 0, 1.0))


def test_shader_compile_errors_name_the_kernel(tmp_path, monkeypatch):
    from torch_wgpu_lora.runtime import kernels

    (tmp_path / "broken.wgsl").write_text("override WG: u32 = 1u;\n@compute @workgroup_size(WG) "
                                          "fn main() { let x: u32 = 1.5; }\n")
    monkeypatch.setattr(kernels, "WGSL_DIRS", (tmp_path,))
    with pytest.raises(RuntimeError, match=r"compiling broken.wgsl:main with \{'WG': 2\} failed"):
        kernel("broken.wgsl", "main", WG=2)


# -- torch tensors and resident weights --------------------------------------------------------

@pytest.mark.parametrize("layout", ["rows4", "cols4", "flat"])
def test_tensor_layouts_round_trip(layout):
    t = torch.randn(5, 7)
    buf = to_gpu(t, layout)
    assert buf.shape == {"rows4": (5, 8), "cols4": (7, 8), "flat": (35,)}[layout]
    back = torch.empty(5, 7)
    rec = Recorder()
    rec.read(buf, into(back, layout))
    rec.submit()
    assert torch.equal(back, t)


def test_resident_weights_upload_again_only_when_values_change():
    A = torch.randn(4, 8)
    first = resident(A)
    assert resident(A) is first
    A.data[0, 0] += 1  # through .data: no version bump, still seen
    second = resident(A)
    assert second is not first
    A.add_(1)
    assert resident(A) is not second


def test_refresh_marks_an_in_place_gpu_update_as_current():
    p = torch.zeros(2, 4)
    buf = resident(p)
    p.fill_(3.0)
    write(buf, np.full((2, 4), 3.0, np.float32))  # what an optimizer step does on the GPU
    refresh(p, "rows4")
    assert resident(p) is buf


# -- threads and fork ------------------------------------------------------------------------------

def test_many_threads_share_the_device_and_every_result_is_right():
    k = _reduce()

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


def _uses_webgpu() -> str:
    get_device()
    return "no error"


def test_a_forked_child_gets_a_clear_error_instead_of_hanging():
    parent = get_device()
    synchronize()  # the parent has used its device
    message = in_forked_child(_uses_webgpu)
    assert "forked after its parent created the WebGPU device" in message and "'spawn'" in message
    assert get_device() is parent and not parent.forked


def _uses_parents_buffer(buf: Buffer) -> list[str]:
    said = []
    uses = (lambda: write(buf, np.ones(4, np.float32)), lambda: Recorder(buf.device),
            lambda: Buffer((4,), device=buf.device))
    for use in uses:
        try:
            use()
            said.append("no error")
        except RuntimeError as e:
            said.append(str(e))
    return said


def test_objects_made_before_a_fork_give_the_child_the_fork_error():
    buf = upload(np.zeros(4, np.float32))
    synchronize()
    said = in_forked_child(_uses_parents_buffer, buf)  # writing, recording, allocating
    assert all("forked after its parent created the WebGPU device" in message for message in said), said


def test_a_child_forked_before_any_device_runs_kernels():
    import subprocess
    import sys

    code = """
import multiprocessing, numpy as np
from torch_wgpu_lora.runtime import Buffer, Recorder, kernel, upload
def child(q):
    x = np.arange(256, dtype=np.float32); out = np.empty(256, np.float32); acc = Buffer((256,))
    rec = Recorder()
    rec.dispatch(kernel("reduce.wgsl", "reduce_partials", WG=64), (1, 1, 1), (upload(x), acc), (64, 64, 1, 0, 2.0))
    rec.read(acc, out); rec.submit(); q.put(bool(np.array_equal(out, 2 * x)))
if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork"); q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,)); p.start(); p.join(120)
    assert p.exitcode == 0 and q.get(timeout=5) is True, p.exitcode
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_pooled_buffer_wgpu_released_is_never_handed_out():
    # A reference cycle holding a Buffer runs both finalizers: ours pools the wgpu buffer and
    # wgpu-py's releases it. The pool must not give such a buffer to the next Buffer.
    b = Buffer((1234,))
    gpu = b.gpu
    del b  # pooled
    gpu._release()  # what wgpu-py's own finalizer does in the same collection
    fresh = upload(np.ones(1234, np.float32))
    assert fresh.gpu is not gpu
    out = np.zeros(1234, np.float32)
    rec = Recorder()
    rec.read(fresh, out)
    rec.submit()
    assert out.sum() == 1234
