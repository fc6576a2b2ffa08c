"""runtime/device.py: adapter and backend choice, what the device reports, its settings, fork, and the
device made while torch.compile traces."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from torch_wgpu_lora.runtime import Buffer, Recorder, Settings, device_info, get_device, synchronize, upload, write
from torch_wgpu_lora.runtime.device import (ADAPTER_ENV, BACKEND_ENV, DAWN_NO_ADAPTER, INSTALL_HINT, LOCAL_RANK_ENV,
                                            choose_adapter, choose_backend, local_rank_from_env)
from torch_wgpu_lora.runtime.settings import SHADER_CHECKS_ENV

from ..concurrency import in_forked_child
from .helpers import (FakeAdapter, dawn_adapters_in_a_fresh_process, device_info_in_a_fresh_process, fake_backend,
                      missing_backend, run_python)

# -- adapter choice ------------------------------------------------------------------------------


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
    assert choose_adapter(adapters, None).adapter is gpus[0]  # no local rank: the first
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


# -- backend choice --------------------------------------------------------------------------------

def _pick(adapters):
    return choose_adapter(adapters, None)


def test_the_default_backend_is_wgpu_native_and_a_bad_name_is_refused():
    gpu = FakeAdapter("NVIDIA H200", "DiscreteGPU", features=("chromium-experimental-subgroup-matrix",))
    implementations = {"wgpu": fake_backend("wgpu-native", [gpu]), "dawn": fake_backend("dawn", [gpu])}
    for wanted, said in ((None, f"{BACKEND_ENV} unset"), ("", f"{BACKEND_ENV} unset"), ("WGPU", f"{BACKEND_ENV}=wgpu")):
        backend, choice, why = choose_backend(wanted, _pick, implementations)
        assert backend.name == "wgpu-native" and choice.adapter is gpu and why == f"{said}: wgpu-native, the default"
    with pytest.raises(ValueError, match=rf"{BACKEND_ENV} must be one of wgpu, dawn, auto, got 'vulkan'"):
        choose_backend("vulkan", _pick, implementations)


def test_auto_takes_dawn_only_where_its_adapter_offers_subgroup_matrices():
    plain = FakeAdapter("llvmpipe", "CPU")
    matrices = FakeAdapter("NVIDIA H200", "DiscreteGPU", features=("chromium-experimental-subgroup-matrix",))
    wgpu = fake_backend("wgpu-native", [plain])
    backend, choice, why = choose_backend("auto", _pick, {"wgpu": wgpu, "dawn": fake_backend("dawn", [plain, matrices])})
    assert backend.name == "dawn" and choice.adapter is matrices  # the GPU is the adapter Dawn would use
    assert why == f"{BACKEND_ENV}=auto: Dawn, whose adapter NVIDIA H200 () offers subgroup matrices"
    # the adapter Dawn would use has none (a CPU adapter listed alone): wgpu-native, saying why
    backend, _, why = choose_backend("auto", _pick, {"wgpu": wgpu, "dawn": fake_backend("dawn", [plain])})
    assert backend.name == "wgpu-native"
    assert why == f"{BACKEND_ENV}=auto: wgpu-native, as Dawn's adapter llvmpipe () offers no subgroup matrices"
    backend, _, why = choose_backend("auto", _pick, {"wgpu": wgpu, "dawn": fake_backend("dawn", [])})
    assert backend.name == "wgpu-native" and why.endswith("as Dawn found no adapter")
    backend, _, why = choose_backend("auto", _pick, {"wgpu": wgpu, "dawn": missing_backend})
    assert backend.name == "wgpu-native" and why.endswith("as wgpudawn is not installed")


def test_dawn_asked_for_is_dawn_or_a_clear_error_never_another_backend():
    wgpu = fake_backend("wgpu-native", [FakeAdapter("llvmpipe", "CPU")])
    with pytest.raises(RuntimeError, match=r"TORCH_WGPU_LORA_BACKEND=dawn needs wgpudawn, which is not installed .*"
                                           r"pip install 'torch_wgpu_lora\[dawn\]'"):
        choose_backend("dawn", _pick, {"wgpu": wgpu, "dawn": missing_backend})
    with pytest.raises(RuntimeError) as err:
        choose_backend("dawn", _pick, {"wgpu": wgpu, "dawn": fake_backend("dawn", [])})
    assert str(err.value) == DAWN_NO_ADAPTER and "bookworm-backports" in DAWN_NO_ADAPTER
    gpu = FakeAdapter("NVIDIA H200", "DiscreteGPU")
    backend, choice, why = choose_backend("dawn", _pick, {"wgpu": wgpu, "dawn": fake_backend("dawn", [gpu])})
    assert backend.name == "dawn" and choice.adapter is gpu and why == f"{BACKEND_ENV}=dawn"


def _dawn_would_use(dawn: list[dict]) -> dict | None:
    """The adapter choose_adapter takes among what wgpudawn listed (the best kind, the first of it)."""
    if not dawn:
        return None
    fakes = [FakeAdapter(a["device"], a["adapter_type"], a["backend_type"]) for a in dawn]
    return dawn[fakes.index(choose_adapter(fakes, None).adapter)]


def test_auto_and_dawn_in_a_fresh_process_follow_what_wgpudawn_lists():
    """The backend a fresh process takes with ``auto`` and with ``dawn``, against what wgpudawn itself
    lists on this machine (on Debian 12's lavapipe, nothing: Dawn refuses Mesa 22; on Mesa 25's, a CPU
    adapter without subgroup matrices; on an H200, a GPU with them)."""
    dawn = dawn_adapters_in_a_fresh_process()
    assert dawn is not None, "wgpudawn is in requirements-test.txt"
    used = _dawn_would_use(dawn)
    auto, stderr = device_info_in_a_fresh_process({BACKEND_ENV: "auto", ADAPTER_ENV: None, LOCAL_RANK_ENV: None})
    assert auto is not None, stderr
    if used is not None and used["matrices"]:
        assert auto["webgpu"] == "dawn" and auto["subgroup_matrices"] and auto["subgroup_matrix_configs"]
    else:
        assert auto["webgpu"] == "wgpu-native"
        why = "Dawn found no adapter" if used is None else f"Dawn's adapter {used['device']}"
        assert why in auto["webgpu_choice"], auto["webgpu_choice"]
    explicit, stderr = device_info_in_a_fresh_process({BACKEND_ENV: "dawn", ADAPTER_ENV: None, LOCAL_RANK_ENV: None})
    if used is None:
        assert explicit is None and DAWN_NO_ADAPTER in stderr
    else:
        assert explicit is not None, stderr
        assert explicit["webgpu"] == "dawn" and explicit["adapter"].startswith(used["device"])
        assert explicit["subgroup_matrices"] == used["matrices"]


def test_this_process_runs_on_the_backend_its_environment_names():
    """What CI's Dawn job sets (``TORCH_WGPU_LORA_BACKEND=dawn``) is what these tests ran on."""
    info = device_info()
    wanted = os.environ.get(BACKEND_ENV, "").strip().lower()
    if wanted == "dawn":
        assert info["webgpu"] == "dawn" and info["webgpu_choice"] == f"{BACKEND_ENV}=dawn"
    elif wanted in ("", "wgpu"):
        assert info["webgpu"] == "wgpu-native" and info["webgpu_choice"].endswith("wgpu-native, the default")
    assert get_device().backend.name == info["webgpu"]


# -- what the device reports -------------------------------------------------------------------------

def test_device_info_reports_adapter_backend_limits_features():
    info = device_info()
    device = get_device()
    assert info["adapter"] and info["backend"] in ("Vulkan", "Metal", "D3D12", "OpenGL")
    assert info["adapter_index"] < info["adapters_of_kind"] and info["choice"]
    assert info["local_rank"] == local_rank_from_env()
    assert info["limits"]["max-storage-buffer-binding-size"] == device.max_binding > 0
    assert info["features"] == sorted(device.wgpu.features)
    assert info["webgpu"] in ("wgpu-native", "dawn") and info["webgpu_version"] and info["webgpu_choice"]
    assert info["subgroup_matrices"] == (device.backend.feature("subgroup-matrix") in device.wgpu.features)
    assert bool(info["subgroup_matrix_configs"]) == info["subgroup_matrices"]
    assert info["settings"] == {"shader_checks": device.settings.shader_checks, "subgroups": device.settings.subgroups,
                                "pool_bytes": device.settings.pool_bytes, "gemms": device.settings.gemms,
                                "input_grad_digits": device.settings.input_grad_digits}
    assert info["memory"]["pool_bound_bytes"] == device.settings.pool_bytes
    assert get_device() is get_device()  # one device per process


def test_the_device_has_the_features_its_adapter_offers_under_their_runtime_names():
    device = get_device()
    offered = device.adapter.features
    for feature, flag in (("subgroups", device.has_subgroups), ("shader-f16", device.has_f16),
                          ("timestamp-query", device.has_timestamps),
                          ("timestamp-query-inside-passes", device.has_stamps_in_passes)):
        name = device.backend.feature(feature)
        assert flag == (name is not None and name in offered), feature


def test_creating_the_device_leaves_the_environment_as_it_was():
    # Mesa's probes are quieted with a private XDG_RUNTIME_DIR only while the device is made.
    code = ("import os; had = os.environ.get('XDG_RUNTIME_DIR'); "
            "from torch_wgpu_lora.runtime import get_device; get_device(); "
            "assert os.environ.get('XDG_RUNTIME_DIR') == had, os.environ.get('XDG_RUNTIME_DIR')")
    done = run_python(code, {"XDG_RUNTIME_DIR": None}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "XDG_RUNTIME_DIR" not in done.stderr  # and Mesa printed nothing about it


# -- settings ----------------------------------------------------------------------------------------

def test_configure_changes_settings_returns_the_previous_and_refuses_bad_values():
    device = get_device()
    before = device.settings
    previous = device.configure(subgroups=not before.subgroups, pool_bytes=12345)
    try:
        assert previous == before
        assert device.settings == Settings(before.shader_checks, not before.subgroups, 12345)
        with pytest.raises(ValueError, match="shader_checks must be one of full, bounds, none, got 'some'"):
            device.configure(shader_checks="some")
        with pytest.raises(ValueError, match="pool_bytes must be an integer >= 0, got -1"):
            device.configure(pool_bytes=-1)
        with pytest.raises(TypeError, match="subgroups must be True or False, got 1"):
            device.configure(subgroups=1)
        with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
            device.configure(bogus=1)
        assert device.settings == Settings(before.shader_checks, not before.subgroups, 12345)  # nothing changed
    finally:
        device.configure(previous)
    assert device.settings == before


def test_shader_checks_none_is_per_kernel_on_wgpu_native_and_per_device_on_dawn():
    device = get_device()
    if device.backend.CHECKS_PER_MODULE:
        previous = device.configure(shader_checks="none")
        device.configure(previous)
    else:  # Dawn: robustness is a toggle of the whole device, set when it is made
        assert device.created_checks != "none"  # the default, bounds
        with pytest.raises(ValueError, match=rf"dawn sets its bounds checks when the device is made .* "
                                             rf"{SHADER_CHECKS_ENV} before the first WebGPU use"):
            device.configure(shader_checks="none")
        device.configure(device.configure(shader_checks="full"))  # the same robustness: allowed


# -- fork ------------------------------------------------------------------------------------------

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
    done = run_python(code)
    assert done.returncode == 0, done.stderr[-2000:]


# -- torch.compile -----------------------------------------------------------------------------------

# After the runtime's import: transformers' BitLinear.activation_quant as transformers compiles it (int8
# codes and per-token scales) on a fixed input, computed with the inductor cache the process finds; where
# MODE is "check", again after dropping every compiled kernel and disabling the caches (code generated
# afresh for this process's vector width). Prints the capability, whether the scales are finite and
# whether the two computations agree.
ACTIVATION_QUANT = """
import torch
import torch_wgpu_lora.runtime

@torch.compile
def activation_quant(x):
    scale = 127 / x.abs().max(dim=-1, keepdim=True).values.clamp(min=1e-5)
    return (x * scale).round().clamp(-128, 127).to(torch.int8), scale

x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
cached = activation_quant(x)
torch.compiler.reset()
torch.compiler.config.force_disable_caches = True
fresh = activation_quant(x) if MODE == "check" else cached
print(torch.backends.cpu.get_cpu_capability(), bool(cached[1].isfinite().all()),
      all(torch.equal(a, b) for a, b in zip(cached, fresh)))
"""


def test_a_lower_cpu_capability_does_not_reuse_kernels_compiled_for_a_higher_one(tmp_path):
    """inductor's on-disk cache does not key a compiled graph by the vector width it generated C++
    for: a process at a lower ``ATEN_CPU_CAPABILITY`` rebuilt the cached code for its own width
    (AVX2 code under ``default``: a compile error; AVX-512 code under AVX2: half of every row left
    unprocessed, NaN gradients). Importing the runtime keys them apart: a process at the next lower
    capability, sharing the cache of one at the host's own, computes exactly what it computes from
    kernels generated afresh (the same kernels on the same data, so bit for bit)."""
    def run(capability: str | None, mode: str) -> list[str]:
        done = run_python(f"MODE = {mode!r}\n" + ACTIVATION_QUANT,
                          {"ATEN_CPU_CAPABILITY": capability, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.split()[-3:]

    host, finite, _ = run(None, "fill")
    assert finite == "True"
    assert host != "DEFAULT", "this host's torch has no vectorised CPU kernels: no lower capability to run"
    lower = "avx2" if host == "AVX512" else "default"
    assert run(lower, "check") == [lower.upper(), "True", "True"]


def test_a_compiled_fullgraph_call_can_be_the_first_webgpu_use():
    """The device is made while torch.compile traces (fullgraph: no graph break allowed); the compiled
    LoRALinear and the compiled op give what float64 torch gives, and only then is the device there."""
    code = """
import json, torch
import torch_wgpu_lora.runtime.device as device_module
from torch_wgpu_lora import LoRALinear, lora
torch.manual_seed(0)
layer = LoRALinear(torch.nn.Linear(24, 16), r=4, lora_alpha=8)
torch.nn.init.normal_(layer.lora_B)
x = torch.randn(5, 24)
assert device_module._device is None
y = torch.compile(layer, fullgraph=True)(x)
made = device_module._device is not None
W, b, A, B = (t.detach().double() for t in (layer.base_layer.weight, layer.base_layer.bias, layer.lora_A,
                                           layer.lora_B))
ref = x.double() @ W.T + b + 2.0 * (x.double() @ A.T) @ B.T
op = torch.compile(lambda x, A, B: lora(x, A, B, 0.5), fullgraph=True)(x, layer.lora_A.detach(), layer.lora_B.detach())
op_ref = 0.5 * (x.double() @ A.T) @ B.T
print(json.dumps({"made": made, "layer": float((y.double() - ref).abs().max() / ref.abs().max()),
                  "op": float((op.double() - op_ref).abs().max() / op_ref.abs().max())}))
"""
    done = run_python(code, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # float32 kernels and torch's float32 base layer against float64: tests/ops/test_lora.py's bound (1e-4 of the
    # largest output), which its docstring derives for sums far longer than these 24 terms
    assert result["made"] and result["layer"] <= 1e-4 and result["op"] <= 1e-4, result
