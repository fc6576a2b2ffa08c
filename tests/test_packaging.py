"""An installed wheel works outside the checkout: it carries every WGSL shader and asset; setup.py's
version floors are high enough for the APIs the package uses."""

from __future__ import annotations

import re
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


# APIs the package may use whose first release sets a floor in setup.py: (package, what, a regex
# that finds its use in the package's sources, the first release that has it). From the release notes.
API_FLOORS = [
    ("torch", "torch.compiler.set_stance", r"\bset_stance\(", (2, 6)),
    ("torch", "torch.nn.utils.get_total_norm", r"\bget_total_norm\(", (2, 6)),
    ("torch", "torch.nn.utils.clip_grads_with_norm_", r"\bclip_grads_with_norm_\(", (2, 6)),
    ("torch", "torch.library.custom_op", r"\bcustom_op\(", (2, 4)),
    ("torch", "CustomOpDef.register_fake", r"\.register_fake\b", (2, 4)),
    ("torch", "CustomOpDef.register_autograd", r"\.register_autograd\(", (2, 4)),
    ("transformers", "from_pretrained(dtype=...)", r"from_pretrained\([^)]*\bdtype=", (4, 56)),
    # not an API but a behaviour: checked by running tests/integrations/test_bitnet.py on each release
    ("transformers", "packed AutoBitLinear checkpoints loading as ternary weights its forward runs",
     r"\bAutoBitLinear\b", (5, 13)),
    ("accelerate", "transformers loading quantised BitNet checkpoints (its ACCELERATE_MIN_VERSION)",
     r"\bAutoBitLinear\b", (1, 1)),
    ("transformers", "PreTrainedTokenizerFast(gguf_file=...) for GGUF files of any architecture", r"\bgguf_file=",
     (5, 18)),
    ("gguf", "TQ1_0 and TQ2_0 in gguf.quants", r"\bquants\.dequantize\(", (0, 11)),
]


def install_floors() -> dict[str, tuple[int, ...]]:
    """setup.py's ``package>=X.Y`` floors, read from its source."""
    text = (ROOT / "setup.py").read_text(encoding="utf-8")
    return {name: tuple(int(part) for part in version.split("."))
            for name, version in re.findall(r'"([A-Za-z0-9_-]+)>=([0-9.]+)', text)}


def test_setup_py_floors_cover_the_apis_the_package_uses():
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "torch_wgpu_lora").rglob("*.py"))
    floors = install_floors()
    used = [(package, what, version) for package, what, pattern, version in API_FLOORS if re.search(pattern, sources)]
    assert any(package == "torch" for package, _, _ in used), "the table no longer matches the sources"
    too_low = [f"{what} needs {package}>={'.'.join(map(str, version))}, setup.py asks for "
               f"{'.'.join(map(str, floors[package]))}" for package, what, version in used if floors[package] < version]
    assert not too_low, too_low
