"""Shared by the runtime's tests: fake adapters and backends, a small kernel, reading a buffer back,
running code in a fresh Python process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

from torch_wgpu_lora.runtime import Buffer, Recorder, kernel


class FakeAdapter:
    """An adapter as ``choose_adapter`` and ``choose_backend`` see one: its info and features."""

    def __init__(self, device: str, adapter_type: str, backend: str = "Vulkan", features: tuple[str, ...] = ()) -> None:
        self.info = {"device": device, "description": "", "vendor": "", "adapter_type": adapter_type,
                     "backend_type": backend}
        self.features = set(features)


def fake_backend(name: str, adapters: list[FakeAdapter]) -> type:
    """A backend class whose instances list ``adapters`` (for ``choose_backend``)."""

    class Fake:
        def __init__(self) -> None:
            self.name = name

        def enumerate_adapters(self) -> list[FakeAdapter]:
            return adapters

    return Fake


def missing_backend() -> Any:
    """A backend constructor that fails as wgpudawn's does where it is not installed."""
    raise ImportError("No module named 'wgpudawn'")


def reduce_kernel() -> Any:
    """reduce.wgsl's reduce_partials with 64 threads: acc (+)= scale · Σ of ``splits`` rows of x."""
    return kernel("reduce.wgsl", "reduce_partials", WG=64)


def read_back(buf: Buffer) -> np.ndarray:
    """``buf``'s values, read back in a submit of their own."""
    out = np.zeros(buf.shape, {"f32": np.float32, "u32": np.uint32, "i32": np.int32, "f16": np.float16}[buf.dtype])
    rec = Recorder(buf.device)
    rec.read(buf, out)
    rec.submit()
    return out


def run_python(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``code`` run by this Python in a fresh process, with ``env`` added to this process's environment
    (a value of None removes that variable)."""
    full = {**os.environ}
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=timeout)


def device_info_in_a_fresh_process(env: dict[str, str] | None = None) -> tuple[dict[str, Any] | None, str]:
    """(``device_info()`` in a fresh process with ``env``, or None when it raised; that process's stderr)."""
    done = run_python("import json; from torch_wgpu_lora.runtime import device_info; "
                      "print(json.dumps(device_info()))", env)
    if done.returncode != 0:
        return None, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def dawn_adapters_in_a_fresh_process() -> list[dict[str, Any]] | None:
    """What wgpudawn itself lists, in a fresh process: each adapter's device name, type and whether it
    offers subgroup matrices (with the toggles the runtime gives Dawn); None where wgpudawn is not
    installed. The reference the runtime's backend choice is checked against."""
    code = """
import json
try:
    import wgpudawn
except ImportError:
    print("null"); raise SystemExit
from wgpudawn.backends.dawn import extras
extras.set_instance_extras(enable_toggles=["allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"])
print(json.dumps([{"device": a.info["device"], "adapter_type": a.info["adapter_type"],
                   "backend_type": a.info["backend_type"],
                   "matrices": "chromium-experimental-subgroup-matrix" in a.features}
                  for a in wgpudawn.gpu.enumerate_adapters_sync()]))
"""
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
