"""Suite-wide setup. WebGPU tests never skip: without an adapter the suite fails with
the install hint (on CI and everywhere else), so a green run always means the
kernels ran."""

from __future__ import annotations

import os

import pytest

# torch's OpenMP threads spin while idle and starve lavapipe's threads on a small CPU
# (set before any test imports torch; notebooks' kernels inherit it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_report_header(config: pytest.Config) -> str:
    from torch_wgpu_lora.runtime import device_info

    info = device_info()  # raises RuntimeError naming what to install when no adapter exists
    return (f"WebGPU adapter: {info['adapter']} [{info['backend']}, {info['adapter_type']}] on {info['webgpu']} "
            f"({info['webgpu_choice']}) (CI={os.environ.get('CI', '')!r})")


@pytest.fixture(params=["subgroups", "barriers"])
def reductions(request: pytest.FixtureRequest):
    """Runs a test with the workgroup reductions of ``_reductions.subgroup.wgsl`` (where the adapter
    has subgroups) and of ``_reductions.wgsl`` (barriers only, as on adapters without them)."""
    from torch_wgpu_lora.runtime import get_device

    previous = get_device().configure(subgroups=request.param == "subgroups")
    yield request.param
    get_device().configure(previous)
