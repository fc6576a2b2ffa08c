"""An installed wheel works outside the checkout: it carries every WGSL shader and asset."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_the_shaders_and_assets(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("torch_wgpu_lora-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    shaders = sorted(p.name for p in (ROOT / "wgsl").glob("*.wgsl"))
    assert shaders and all(f"torch_wgpu_lora/wgsl/{name}" in names for name in shaders)
    assert "torch_wgpu_lora/assets/alpaca_demo.json" in names
    assert "torch_wgpu_lora/cli.py" in names and not any(n.startswith("tests/") for n in names)


def test_kernels_load_from_the_package_folder_first():
    from torch_wgpu_lora.runtime.kernels import WGSL_DIRS

    # torch_wgpu_lora/wgsl (installed wheel) is searched before the checkout's wgsl/.
    assert WGSL_DIRS[0].parent.name == "torch_wgpu_lora" and WGSL_DIRS[1] == ROOT / "wgsl"
