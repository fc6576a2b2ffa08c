"""The runtime: a handful of nouns between WGSL files and torch ops.

``Device`` (the process's WebGPU device, its ``Settings`` and the state it owns), ``Buffer`` (an
array on the GPU; ``Arena`` plans many at once), ``Kernel`` (a compiled WGSL entry point),
``Recorder`` (many launches, one submit; ``Launch`` is a launch built once and recorded
many times; ``Recording``, a command buffer encoded ahead of its submit; ``Uniform``, params
rewritten before each submit), and ``tensors`` (torch tensors to and from the GPU, resident
weights). ``backends/`` holds what differs between the WebGPU implementations the device can
run on (wgpu-native, Dawn).
"""

from .buffers import Arena, Buffer, upload, write
from .device import Device, device_info, get_device
from .kernels import Kernel, Uniform, kernel
from .recorder import Launch, Pending, Recorder, Recording, copy_launch, synchronize
from .settings import Settings

__all__ = ["Arena", "Buffer", "Device", "Kernel", "Launch", "Pending", "Recorder", "Recording", "Settings", "Uniform",
           "copy_launch", "device_info", "get_device", "kernel", "synchronize", "upload", "write"]
