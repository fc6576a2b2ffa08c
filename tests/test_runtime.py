"""Runtime: adapter choice, device facts, buffers and staging, kernels, recorder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_wgpu_lora.runtime import Buffer, Recorder, device_info, get_device, kernel, synchronize, upload
from torch_wgpu_lora.runtime.buffers import pool_for
from torch_wgpu_lora.runtime.device import ADAPTER_ENV, INSTALL_HINT, choose_adapter
from torch_wgpu_lora.runtime.kernels import specialise


class FakeAdapter:
    def __init__(self, device: str, adapter_type: str, backend: str = "Vulkan") -> None:
        self.info = {"device": device, "description": "", "vendor": "", "adapter_type": adapter_type,
                     "backend_type": backend}


def test_choose_adapter_prefers_gpus_and_native_backends():
    cpu = FakeAdapter("llvmpipe", "CPU")
    igpu = FakeAdapter("Intel Iris", "IntegratedGPU")
    dgpu_gl = FakeAdapter("NVIDIA H200", "DiscreteGPU", backend="OpenGL")
    dgpu = FakeAdapter("NVIDIA H200", "DiscreteGPU")
    assert choose_adapter([cpu, igpu, dgpu_gl, dgpu], None) is dgpu
    assert choose_adapter([cpu, igpu], None) is igpu
    assert choose_adapter([dgpu_gl, cpu], None) is cpu  # OpenGL only as a last resort


def test_choose_adapter_override_is_a_case_insensitive_substring():
    cpu, dgpu = FakeAdapter("llvmpipe (LLVM 15)", "CPU"), FakeAdapter("NVIDIA H200", "DiscreteGPU")
    assert choose_adapter([dgpu, cpu], "LLVMPIPE") is cpu
    with pytest.raises(RuntimeError, match=rf"{ADAPTER_ENV}='radeon' matches no adapter; adapters found: .*H200"):
        choose_adapter([dgpu, cpu], "radeon")


def test_no_adapter_error_says_what_to_install():
    with pytest.raises(RuntimeError) as err:
        choose_adapter([], None)
    assert str(err.value) == INSTALL_HINT
    assert "apt-get install mesa-vulkan-drivers" in INSTALL_HINT


def test_device_info_reports_adapter_backend_limits_features():
    info = device_info()
    assert info["adapter"] and info["backend"] in ("Vulkan", "Metal", "D3D12", "OpenGL")
    assert info["limits"]["max-storage-buffer-binding-size"] == get_device().max_binding > 0
    assert isinstance(info["features"], list)
    assert get_device() is get_device()  # one device per process


def test_specialise_rewrites_declared_constants_only():
    src = "const ROWS: u32 = 4u;\nconst SCALE: f32 = 1.0;\nconst ON: bool = false;\n"
    out = specialise(src, {"ROWS": 8, "SCALE": 0.5, "ON": True})
    assert out == "const ROWS: u32 = 8u;\nconst SCALE: f32 = 0.5f;\nconst ON: bool = true;\n"
    with pytest.raises(KeyError, match="no `const COLS"):
        specialise(src, {"COLS": 2})


def test_upload_and_read_round_trip_f32_and_u32():
    a = np.arange(24, dtype=np.float32).reshape(4, 6) / 7
    b = np.arange(10, dtype=np.uint32) * 3_000_000_000 // 10
    out_a, out_b = np.zeros_like(a), np.zeros_like(b)
    rec = Recorder()
    rec.read(upload(a), out_a)
    rec.read(upload(b), out_b)
    rec.submit()
    np.testing.assert_array_equal(out_a, a)
    np.testing.assert_array_equal(out_b, b)


def test_upload_hands_the_arrays_own_memory_to_wgpu(monkeypatch):
    queue = get_device().queue
    seen = []
    original = type(queue).write_buffer
    monkeypatch.setattr(type(queue), "write_buffer", lambda self, buf, off, data, *a: (seen.append(data), original(self, buf, off, data, *a)))
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
    with pytest.raises(TypeError, match="float32 or uint32 arrays, got float64"):
        upload(np.zeros(4))
    with pytest.raises(ValueError, match="C-contiguous"):
        upload(np.zeros((4, 4), np.float32).T)


def test_buffers_return_to_the_pool_and_are_reused():
    pool = pool_for(get_device())
    b = Buffer((1000,))
    serial = b.serial
    del b
    c = Buffer((999,))  # same size bucket
    assert c.serial == serial
    assert pool.free_bytes >= 0


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


def test_many_dispatches_one_submit_and_timestamps():
    x = upload(np.arange(16, dtype=np.float32))
    acc = Buffer((16,))
    k = kernel("reduce.wgsl", "reduce_partials", "IIIIf", WG=64)
    rec = Recorder(timestamps=True)
    rec.clear(acc)
    for _ in range(5):  # acc += 2 * x, five times, each reading the last one's result
        rec.dispatch(k, (1, 1, 1), (x, acc), (4, 4, 1, 1, 2.0))
    out = np.zeros(16, np.float32)
    rec.read(acc, out)
    seconds = rec.submit()
    np.testing.assert_array_equal(out, 10 * np.arange(16))
    assert rec.dispatches == 5
    if get_device().has_timestamps:
        assert 0 < seconds < 10
    synchronize()


def test_binding_larger_than_the_adapter_limit_is_refused(monkeypatch):
    device = get_device()
    big = Buffer((64,))
    k = kernel("reduce.wgsl", "reduce_partials", "IIIIf", WG=32)
    monkeypatch.setattr(device, "max_binding", 128)
    rec = Recorder()
    with pytest.raises(ValueError, match=r"\(64,\) buffer \(256 bytes\) exceeds this adapter's max-storage-buffer-binding-size \(128 bytes\)"):
        rec.dispatch(k, (1, 1, 1), (big, Buffer((64,))), (16, 16, 1, 0, 1.0))


def test_grid_over_the_dispatch_limit_is_refused():
    k = kernel("reduce.wgsl", "reduce_partials", "IIIIf", WG=256)
    too_many = get_device().max_workgroups + 1
    with pytest.raises(ValueError, match="exceeds max-compute-workgroups-per-dimension"):
        Recorder().dispatch(k, (too_many, 1, 1), (Buffer((4,)), Buffer((4,))), (1, 1, 1, 0, 1.0))


def test_shader_compile_errors_name_the_kernel(tmp_path, monkeypatch):
    from torch_wgpu_lora.runtime import kernels

    (tmp_path / "broken.wgsl").write_text("const WG: u32 = 1u;\n@compute @workgroup_size(WG) fn main() { let x: u32 = 1.5; }\n")
    monkeypatch.setattr(kernels, "WGSL_DIRS", (tmp_path,))
    with pytest.raises(RuntimeError, match=r"compiling broken.wgsl:main with \{'WG': 2\} failed"):
        kernel("broken.wgsl", "main", "I", WG=2)
