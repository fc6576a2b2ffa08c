"""WGSL kernels as data: load a file, specialise its constants, cache the pipeline.

Each ``.wgsl`` file in ``wgsl/`` is valid WGSL on its own. Tuning knobs are plain
module constants (``const ROWS: u32 = 4u;``); ``kernel(file, entry, ROWS=8)``
rewrites those declarations before compiling. Rewriting ``const`` (rather than
using WGSL ``override``) lets a constant size a per-thread array, which override
constants cannot do. Pipelines are cached by (file, entry, constants).

Binding convention, shared by every kernel: ``@binding(0)`` is a uniform block of
32-bit parameters, ``@binding(1..)`` are storage buffers in the order the host
passes them.

Runtime checks: by default wgpu adds bounds checks to every buffer access and a
counter to every loop (so a bad shader cannot hang the GPU). ``TORCH_WGPU_LORA_SHADER_CHECKS``
= ``bounds`` keeps the bounds checks but drops the loop counters, ``none`` drops both
(wgpu-native's trusted shader modules). Our kernels clamp every index and bound every
loop by its parameters, so both are safe for them; ``full`` stays the default.
"""

from __future__ import annotations

import os
import re
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .buffers import Buffer, SERIALS
from .device import Device, get_device

_HERE = Path(__file__).resolve()
# Installed wheels carry the shaders as package data in torch_wgpu_lora/wgsl;
# a source checkout keeps them in the top-level wgsl/ folder.
WGSL_DIRS = (_HERE.parents[1] / "wgsl", _HERE.parents[2] / "wgsl")


def wgsl_path(name: str) -> Path:
    for folder in WGSL_DIRS:
        path = folder / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"WGSL file {name!r} not found in {[str(d) for d in WGSL_DIRS]}")


SHADER_CHECKS = ("full", "bounds", "none")
_checks = os.environ.get("TORCH_WGPU_LORA_SHADER_CHECKS", "full")
if _checks not in SHADER_CHECKS:
    raise ValueError(f"TORCH_WGPU_LORA_SHADER_CHECKS must be one of {SHADER_CHECKS}, got {_checks!r}")


def set_shader_checks(mode: str) -> None:
    """Choose the runtime checks for kernels compiled from now on (see module docstring)."""
    global _checks
    if mode not in SHADER_CHECKS:
        raise ValueError(f"shader checks must be one of {SHADER_CHECKS}, got {mode!r}")
    _checks = mode


def _shader_module(device: Device, source: str, label: str, checks: str) -> Any:
    if checks == "full":
        return device.wgpu.create_shader_module(code=source, label=label)
    # wgpu-py does not wrap wgpuDeviceCreateShaderModuleTrusted; build the same descriptor it builds.
    from wgpu.backends.wgpu_native import _api
    from wgpu.backends.wgpu_native._ffi import ffi, lib

    source_struct = _api.new_struct_p("WGPUShaderSourceWGSL *", code=_api.to_c_string_view(source))
    source_struct[0].chain.next = ffi.NULL
    source_struct[0].chain.sType = lib.WGPUSType_ShaderSourceWGSL
    descriptor = _api.new_struct_p(
        "WGPUShaderModuleDescriptor *",
        nextInChain=ffi.cast("WGPUChainedStruct *", source_struct),
        label=_api.to_c_string_view(label),
    )
    flags = lib.WGPUShaderRuntimeChecks_BoundsChecks if checks == "bounds" else lib.WGPUShaderRuntimeChecks_None
    handle = lib.wgpuDeviceCreateShaderModuleTrusted(device.wgpu._internal, descriptor, flags)
    if handle == ffi.NULL:
        raise RuntimeError("shader module creation failed")
    return _api.GPUShaderModule(label, handle, device.wgpu)


def specialise(source: str, constants: dict[str, int | float | bool]) -> str:
    """Replace ``const NAME: T = ...;`` declarations with the given values.

    >>> specialise("const ROWS: u32 = 4u;", {"ROWS": 8})
    'const ROWS: u32 = 8u;'
    """
    for name, value in constants.items():
        pattern = re.compile(rf"^(\s*const\s+{name}\s*:\s*(\w+)\s*=\s*)[^;]+;", re.MULTILINE)
        match = pattern.search(source)
        if match is None:
            raise KeyError(f"no `const {name}: ...;` declaration to specialise")
        wgsl_type = match.group(2)
        if wgsl_type == "u32":
            literal = f"{int(value)}u"
        elif wgsl_type == "i32":
            literal = f"{int(value)}i"
        elif wgsl_type == "f32":
            literal = f"{float(value)!r}f"
        elif wgsl_type == "bool":
            literal = "true" if value else "false"
        else:
            raise TypeError(f"const {name} has type {wgsl_type}; only u32, i32, f32, bool can be specialised")
        source = source[: match.start()] + match.group(1) + literal + ";" + source[match.end():]
    return source


class Kernel:
    """One compiled entry point of one WGSL file, with its constants baked in.

    ``params`` is the struct format (``struct`` module letters, e.g. ``"IIIf"``) of
    the uniform block at binding 0.
    """

    def __init__(self, device: Device, file: str, entry: str, params: str, constants: dict[str, Any],
                 checks: str = "full") -> None:
        import wgpu

        self.device = device
        self.name = f"{file}:{entry}"
        self.params_format = "<" + params
        self.constants = dict(constants)
        source = specialise(wgsl_path(file).read_text(), constants)
        try:
            module = _shader_module(device, source, self.name, checks)
            self.pipeline = device.wgpu.create_compute_pipeline(
                layout=wgpu.AutoLayoutMode.auto, compute={"module": module, "entry_point": entry}, label=self.name
            )
        except Exception as e:
            raise RuntimeError(f"compiling {self.name} with {constants} failed: {e}") from e
        self.layout = self.pipeline.get_bind_group_layout(0)
        self._bind_groups: OrderedDict[tuple, Any] = OrderedDict()

    def bind_group(self, params: tuple[Any, int], buffers: tuple[Buffer, ...]) -> Any:
        """The bind group for (params, buffers), reused while those buffers repeat."""
        params, params_serial = params
        key = (params_serial, *((b.serial, b.nbytes) for b in buffers))  # a pooled buffer may come back resized
        group = self._bind_groups.get(key)
        if group is None:
            for b in buffers:
                if b.nbytes > self.device.max_binding:
                    raise ValueError(
                        f"{self.name}: a {b.shape} buffer ({b.nbytes} bytes) exceeds this adapter's "
                        f"max-storage-buffer-binding-size ({self.device.max_binding} bytes)"
                    )
            entries = [{"binding": 0, "resource": {"buffer": params, "offset": 0, "size": params.size}}]
            entries += [
                {"binding": i, "resource": {"buffer": b.gpu, "offset": 0, "size": max(16, -(-b.nbytes // 16) * 16)}}
                for i, b in enumerate(buffers, start=1)
            ]
            group = self.device.wgpu.create_bind_group(layout=self.layout, entries=entries)
            self._bind_groups[key] = group
            if len(self._bind_groups) > 512:
                self._bind_groups.popitem(last=False)
        else:
            self._bind_groups.move_to_end(key)
        return group

    def pack(self, values: tuple) -> bytes:
        data = struct.pack(self.params_format, *values)
        return data + bytes(-len(data) % 16)


_kernels: dict[tuple, Kernel] = {}
_params: OrderedDict[tuple[int, bytes], tuple[Any, int]] = OrderedDict()


def kernel(file: str, entry: str, params: str, device: Device | None = None, **constants: Any) -> Kernel:
    """The cached pipeline for ``entry`` in ``wgsl/<file>`` with ``constants`` set.

    >>> k = kernel("reduce.wgsl", "reduce_partials", "IIIIf", WG=64)
    >>> k.name
    'reduce.wgsl:reduce_partials'
    """
    device = device or get_device()
    key = (id(device), file, entry, params, tuple(sorted(constants.items())), _checks)
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = Kernel(device, file, entry, params, constants, _checks)
    return k


def params_buffer(device: Device, data: bytes) -> tuple[Any, int]:
    """An immutable uniform buffer holding ``data`` (with its serial), interned by value.

    Interning keeps recording correct: ``queue.write_buffer`` lands before the whole
    command buffer runs, so one mutable buffer rewritten between two dispatches of a
    recording would show both the last value.
    """
    key = (id(device), data)
    buf = _params.get(key)
    if buf is None:
        import wgpu

        buf = (device.wgpu.create_buffer_with_data(data=data, usage=wgpu.BufferUsage.UNIFORM), next(SERIALS))
        _params[key] = buf
        if len(_params) > 4096:
            _params.popitem(last=False)
    else:
        _params.move_to_end(key)
    return buf
