"""The runtime: a handful of nouns between WGSL files and torch ops.

``Device`` (the process's WebGPU device), ``Buffer`` (an array on the GPU),
``Kernel`` (a compiled WGSL entry point) and ``Recorder`` (many launches, one submit).
"""

from .buffers import Buffer, upload, write
from .device import Device, device_info, get_device
from .kernels import Kernel, kernel
from .recorder import Recorder, synchronize

__all__ = ["Buffer", "Device", "Kernel", "Recorder", "device_info", "get_device", "kernel", "synchronize", "upload", "write"]
