"""The WebGPU implementations the runtime runs on, one module each: ``wgpu_native`` (wgpu-py,
the default) and ``dawn`` (wgpudawn, optional). ``base`` says what a backend provides.
``runtime/device.py`` chooses one per process (``TORCH_WGPU_LORA_BACKEND``)."""

from __future__ import annotations

from .base import EXTENSION_FEATURES, FEATURES, Backend, wgsl_extensions
from .dawn import SUBGROUP_MATRIX, Dawn
from .wgpu_native import WgpuNative

IMPLEMENTATIONS = {"wgpu": WgpuNative, "dawn": Dawn}

__all__ = ["EXTENSION_FEATURES", "FEATURES", "IMPLEMENTATIONS", "SUBGROUP_MATRIX", "Backend", "Dawn", "WgpuNative",
           "wgsl_extensions"]
