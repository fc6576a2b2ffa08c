"""WGSL kernels as data: load a file, set its override constants, cache the pipeline.

Each ``.wgsl`` file in ``wgsl/`` is a kernel family; parts shared by several families live in
``wgsl/_*.wgsl`` and are pulled in by a line ``// @include _part.wgsl``. Tuning knobs are WGSL
``override`` declarations (``override ROWS: u32 = 4u;``); ``kernel(file, entry, ROWS=8)``
sets them when the pipeline is created, so the source is never rewritten. Pipelines
are cached on the device by (file, entry, constants, shader checks).

Binding convention, shared by every kernel: ``@binding(0)`` is a uniform block
``struct Params`` of 32-bit scalars (u32, i32, f32), ``@binding(1..)`` are storage
buffers in the order the host passes them (or by number, as a dict, for a file whose entry
points each use some of its bindings). The layout of ``Params`` is declared once,
in the WGSL file: the host reads the field names and types from it and packs values
given by position or by name.

Runtime checks (``TORCH_WGPU_LORA_SHADER_CHECKS``): ``bounds``, the default, compiles the kernels
as wgpu-native trusted modules that keep wgpu's bounds check on every buffer access but not its
counter in every loop; ``full`` adds the counters (what wgpu does for untrusted shaders, so that
one that never ends cannot hang the GPU); ``none`` drops the bounds checks too. Every loop here
is bounded by override constants or by parameters the launch functions validate, so the counters
guard nothing, and they cost: on the H200 one decode-shaped RMSNorm launch takes 11.6 µs with
them and 5.4 µs without, and the engine's decode, prefill and training gain 1.1-1.5×.
"""

from __future__ import annotations

import os
import re
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, Sequence

from .buffers import SERIALS, Buffer
from .device import Device, get_device

_HERE = Path(__file__).resolve()
# Installed wheels carry the shaders as package data in torch_wgpu_lora/wgsl;
# a source checkout keeps them in the top-level wgsl/ folder.
WGSL_DIRS = (_HERE.parents[1] / "wgsl", _HERE.parents[2] / "wgsl")

SHADER_CHECKS = ("full", "bounds", "none")
DEFAULT_SHADER_CHECKS = "bounds"
SHADER_CHECKS_ENV = "TORCH_WGPU_LORA_SHADER_CHECKS"
_checks_override: str | None = None
_subgroups_override: bool | None = None


def wgsl_path(name: str) -> Path:
    for folder in WGSL_DIRS:
        path = folder / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"WGSL file {name!r} not found in {[str(d) for d in WGSL_DIRS]}")


_INCLUDE = re.compile(r"^// @include (\S+\.wgsl)[ \t]*$", re.MULTILINE)


def wgsl_source(name: str, subgroups: bool = False) -> str:
    """A WGSL file's text with its ``// @include _part.wgsl`` lines replaced by those files: code two
    kernel families share (an epilogue, a reduction) is written once. Parts are not nested. With
    ``subgroups`` a part's ``_part.subgroup.wgsl`` variant, where there is one, is used instead.

    >>> "fn lora(" in wgsl_source("bitlinear.wgsl")
    True
    """
    def part(match: re.Match) -> str:
        name = match.group(1)
        variant = name[: -len(".wgsl")] + ".subgroup.wgsl"
        if subgroups and any((folder / variant).is_file() for folder in WGSL_DIRS):
            name = variant
        return f"// ---- {name} ----\n" + wgsl_path(name).read_text()

    return _INCLUDE.sub(part, wgsl_path(name).read_text())


def use_subgroups(device: Device) -> bool:
    """Whether kernels compiled now use subgroup operations: where the adapter has them, unless
    ``set_subgroups(False)``."""
    return device.has_subgroups and _subgroups_override is not False


def set_subgroups(enabled: bool | None) -> None:
    """``False``: kernels compiled from now on use the barrier-only parts even where the adapter
    has subgroups (for tests and comparisons); ``None``: back to the adapter's capability."""
    global _subgroups_override
    _subgroups_override = enabled


def shader_checks() -> str:
    """The runtime-check mode kernels compile with now: ``set_shader_checks``'s value, else
    ``TORCH_WGPU_LORA_SHADER_CHECKS``, else ``bounds``."""
    if _checks_override is not None:
        return _checks_override
    mode = os.environ.get(SHADER_CHECKS_ENV, DEFAULT_SHADER_CHECKS)
    if mode not in SHADER_CHECKS:
        raise ValueError(f"{SHADER_CHECKS_ENV} must be one of {', '.join(SHADER_CHECKS)}, got {mode!r}")
    return mode


def set_shader_checks(mode: str | None) -> None:
    """Choose the runtime checks for kernels used from now on (see module docstring);
    ``None`` goes back to the environment variable."""
    global _checks_override
    if mode is not None and mode not in SHADER_CHECKS:
        raise ValueError(f"shader checks must be one of {SHADER_CHECKS}, got {mode!r}")
    _checks_override = mode


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


_COMMENT = re.compile(r"//[^\n]*")
_PARAMS = re.compile(r"struct\s+Params\s*\{([^}]*)\}")
_FIELD = re.compile(r"(\w+)\s*:\s*(\w+)")
_FORMATS = {"u32": "I", "i32": "i", "f32": "f"}


def params_layout(source: str) -> tuple[tuple[str, ...], str]:
    """(field names, ``struct`` format) of the WGSL ``struct Params`` in ``source``.

    >>> params_layout("struct Params { rows: u32, scale: f32 }")
    (('rows', 'scale'), '<If')
    """
    match = _PARAMS.search(_COMMENT.sub("", source))
    if match is None:
        return (), "<"
    names, letters = [], []
    for name, wgsl_type in _FIELD.findall(match.group(1)):
        if wgsl_type not in _FORMATS:
            raise TypeError(f"Params field {name}: {wgsl_type}; only u32, i32 and f32 fields are supported")
        names.append(name)
        letters.append(_FORMATS[wgsl_type])
    return tuple(names), "<" + "".join(letters)


class Kernel:
    """One compiled entry point of one WGSL file, with its override constants set.

    ``params`` are the names of the ``struct Params`` fields (binding 0), in order.
    """

    def __init__(self, device: Device, file: str, entry: str, constants: Mapping[str, Any],
                 checks: str = DEFAULT_SHADER_CHECKS, subgroups: bool = False) -> None:
        import wgpu

        self.device = device
        self.name = f"{file}:{entry}"
        self.constants = dict(constants)
        source = wgsl_source(file, subgroups)
        self.params, self._format = params_layout(source)
        try:
            module = _shader_module(device, source, self.name, checks)
            stage: dict[str, Any] = {"module": module, "entry_point": entry}
            if constants:
                stage["constants"] = {k: float(v) for k, v in constants.items()}
            self.pipeline = device.wgpu.create_compute_pipeline(layout=wgpu.AutoLayoutMode.auto, compute=stage,
                                                                label=self.name)
        except Exception as e:
            raise RuntimeError(f"compiling {self.name} with {dict(constants)} failed: {e}") from e
        self.layout = self.pipeline.get_bind_group_layout(0)
        self._bind_groups: OrderedDict[tuple, Any] = OrderedDict()

    def pack(self, values: Sequence[Any] | Mapping[str, Any]) -> bytes:
        """The uniform block's bytes, from values in field order or by field name."""
        if isinstance(values, Mapping):
            unknown, missing = set(values) - set(self.params), [n for n in self.params if n not in values]
            if unknown or missing:
                raise ValueError(f"{self.name}: params {sorted(unknown)} unknown, {missing} missing; "
                                 f"fields are {list(self.params)}")
            values = [values[n] for n in self.params]
        if len(values) != len(self.params):
            raise ValueError(f"{self.name}: {len(values)} params given, the kernel takes {list(self.params)}")
        data = struct.pack(self._format, *values)
        return data + bytes(-len(data) % 16)

    def _entries(self, uniform: Any, buffers: Sequence[Buffer] | Mapping[int, Buffer]) -> list[dict[str, Any]]:
        entries = []
        if self.params:
            entries.append({"binding": 0, "resource": {"buffer": uniform, "offset": 0, "size": uniform.size}})
        numbered = buffers.items() if isinstance(buffers, Mapping) else enumerate(buffers, start=1)
        for i, b in numbered:
            if b.binding_size > self.device.max_binding:
                raise ValueError(
                    f"{self.name}: a {b.shape} buffer ({b.nbytes} bytes) exceeds this adapter's "
                    f"max-storage-buffer-binding-size ({self.device.max_binding} bytes)"
                )
            entries.append({"binding": i, "resource": {"buffer": b.gpu, "offset": b.offset, "size": b.binding_size}})
        return entries

    def bind(self, buffers: Sequence[Buffer] | Mapping[int, Buffer],
             params: "Sequence[Any] | Mapping[str, Any] | Uniform" = ()) -> Any:
        """A new bind group for these buffers (at bindings 1.. in order, or by binding number when
        a file's entry points use different bindings) and params (values, interned; or a
        ``Uniform`` the caller rewrites): what a plan builds once and launches many times."""
        if isinstance(params, Uniform):
            if params.kernel is not self:
                raise ValueError(f"{self.name}: a Uniform made for {params.kernel.name}")
            uniform = params.gpu
        else:
            uniform = params_buffer(self.device, self.pack(params))[0] if self.params else None
        return self.device.wgpu.create_bind_group(layout=self.layout, entries=self._entries(uniform, buffers))

    def bind_group(self, params: Sequence[Any] | Mapping[str, Any], buffers: Sequence[Buffer]) -> Any:
        """The bind group for (params, buffers), cached while those buffers and values repeat."""
        uniform, serial = params_buffer(self.device, self.pack(params)) if self.params else (None, 0)
        key = (serial, *((b.serial, b.offset, b.nbytes) for b in buffers))  # pooled buffers come back resized
        with self.device.lock:
            group = self._bind_groups.get(key)
            if group is not None:
                self._bind_groups.move_to_end(key)
                return group
        group = self.device.wgpu.create_bind_group(layout=self.layout, entries=self._entries(uniform, buffers))
        with self.device.lock:
            self._bind_groups[key] = group
            if len(self._bind_groups) > 512:
                self._bind_groups.popitem(last=False)
        return group


class Uniform:
    """A kernel's params in a uniform buffer that its owner rewrites before each submit: for a
    launch recorded ahead of the values it will run with (the engine encodes a training step
    while the GPU runs the one before, and writes that step's learning rate when it submits).

    A write lands before the whole next command buffer runs, so every launch of one recording
    that binds it sees one value (interned params, the default, have no such limit).

    >>> k = kernel("reduce.wgsl", "reduce_partials", WG=64)
    >>> u = Uniform(k); u.write((4, 4, 1, 0, 1.0))
    >>> # launch = Launch.build(k, grid, buffers, u)   # recorded now, runs with what u holds then
    """

    def __init__(self, kernel: Kernel) -> None:
        import wgpu

        self.kernel = kernel
        size = len(kernel.pack([0] * len(kernel.params)))
        self.gpu = kernel.device.wgpu.create_buffer(size=size, usage=wgpu.BufferUsage.UNIFORM |
                                                    wgpu.BufferUsage.COPY_DST)

    def write(self, params: Sequence[Any] | Mapping[str, Any]) -> None:
        """Queue new values (by position or field name) for the next submit."""
        self.kernel.device.check_usable()
        self.kernel.device.queue.write_buffer(self.gpu, 0, self.kernel.pack(params))


def kernel(file: str, entry: str, device: Device | None = None, **constants: Any) -> Kernel:
    """The cached pipeline for ``entry`` in ``wgsl/<file>`` with override ``constants`` set.

    >>> k = kernel("reduce.wgsl", "reduce_partials", WG=64)
    >>> k.name, k.params[:2]
    ('reduce.wgsl:reduce_partials', ('len4', 'stride4'))
    """
    device = device or get_device()
    checks, subgroups = shader_checks(), use_subgroups(device)
    key = (file, entry, tuple(sorted(constants.items())), checks, subgroups)
    cache = device.owned("kernels", dict)
    k = cache.get(key)
    if k is None:
        k = Kernel(device, file, entry, constants, checks, subgroups)
        with device.lock:
            k = cache.setdefault(key, k)
    return k


def params_buffer(device: Device, data: bytes) -> tuple[Any, int]:
    """An immutable uniform buffer holding ``data`` (with its serial), interned by value.

    Interning keeps recording correct: ``queue.write_buffer`` lands before the whole
    command buffer runs, so one mutable buffer rewritten between two dispatches of a
    recording would show both the last value.
    """
    cache: OrderedDict[bytes, tuple[Any, int]] = device.owned("params", OrderedDict)
    with device.lock:
        buf = cache.get(data)
        if buf is not None:
            cache.move_to_end(data)
            return buf
    import wgpu

    buf = (device.wgpu.create_buffer_with_data(data=data, usage=wgpu.BufferUsage.UNIFORM), next(SERIALS))
    with device.lock:
        buf = cache.setdefault(data, buf)
        if len(cache) > 4096:
            cache.popitem(last=False)
    return buf
