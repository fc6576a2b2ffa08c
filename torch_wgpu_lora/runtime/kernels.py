"""WGSL kernels as data: load a file, set its override constants, cache the pipeline.

Each ``.wgsl`` file in ``wgsl/`` is a kernel family; parts shared by several families live in
``wgsl/_*.wgsl`` and are pulled in by a line ``// @include _part.wgsl``. Tuning knobs are WGSL
``override`` declarations (``override ROWS: u32 = 4u;``); ``kernel(file, entry, ROWS=8)``
sets them when the pipeline is created, so the source is never rewritten. Pipelines
are cached on the device by (file, entry, constants, and the shader-checks and subgroups settings).

Binding convention, shared by every kernel: ``@binding(0)`` is a uniform block
``struct Params`` of 32-bit scalars (u32, i32, f32), ``@binding(1..)`` are storage
buffers in the order the host passes them (or by number, as a dict, for a file whose entry
points each use some of its bindings). The layout of ``Params`` is declared once,
in the WGSL file: the host reads the field names and types from it and packs values
given by position or by name.

Runtime checks (the device's ``shader_checks`` setting; ``TORCH_WGPU_LORA_SHADER_CHECKS`` gives its
default): ``bounds``, the default, keeps a bounds check on every buffer access but no counter in
every loop (wgpu-native: a trusted module); ``full`` adds the counters (what wgpu-native does for
untrusted shaders, so that one that never ends cannot hang the GPU; on Dawn ``full`` is ``bounds``,
and Tint adds its own counter to each loop whose trip count it cannot prove constant, whatever the
mode: ``runtime/backends/dawn.py``); ``none`` drops the bounds checks too (on Dawn, for the whole
device, chosen when it is made). Every loop here is bounded by override constants or by parameters
the launch functions validate, so the counters guard nothing, and they cost (RESULTS.md, "Shader
checks"). A loop over a private array is bounded by a constant or override expression, never a
``let`` or a function's result, so that neither compiler's counter keeps it from being unrolled.

Sources are the same for every WebGPU implementation but for the ``enable`` lines, which the
runtime writes from what a kernel uses (f16, subgroup operations, subgroup matrices) as its
compiler needs them: Tint (Dawn) wants ``enable subgroups;``, naga (wgpu-native) refuses it. A kernel
that uses what the device lacks is refused with an error naming both.

Subgroup matrices come in shapes that differ between adapters (16 × 16 × 32 int8 on NVIDIA, 8 × 8 × 8 on
lavapipe), and WGSL wants a matrix type's sizes as constants, not overrides. A kernel that uses them
says which types it multiplies in a line ``// @subgroup-matrix i8 i32`` (component, result), and the
runtime writes that configuration's sizes before its source as ``const SM_M``, ``SM_N``, ``SM_K`` and
``SM_SUBGROUP`` (its subgroup size), and the device's workgroup memory as ``SM_STORAGE`` (matrix loads
take arrays of a constant length): the same WGSL runs on every adapter with matrix units
(``subgroup_matrix_config`` says which configuration is taken).
"""

from __future__ import annotations

import re
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, Sequence

from .backends import EXTENSION_FEATURES, wgsl_extensions
from .buffers import SERIALS, Buffer
from .device import Device, get_device
from .settings import DEFAULT_SHADER_CHECKS

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
    """Whether kernels compiled now use subgroup operations: where the adapter has them, unless the
    device's ``subgroups`` setting is off."""
    return device.has_subgroups and device.settings.subgroups


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


_MATRIX_TYPES = re.compile(r"^// @subgroup-matrix (\w+) (\w+)[ \t]*$", re.MULTILINE)


def subgroup_matrix_config(device: Device, component: str, result: str) -> dict[str, Any] | None:
    """The device's subgroup-matrix configuration for ``component`` × ``component`` → ``result``
    that kernels use: among those of one fixed subgroup size, the largest (M · N · K: fewer loads and
    multiplies a step); None where the device has none.

    >>> from types import SimpleNamespace
    >>> cfg = lambda m, n, k: dict(component_type="i8", result_component_type="i32", m=m, n=n, k=k,
    ...                            min_subgroup_size=32, max_subgroup_size=32)
    >>> subgroup_matrix_config(SimpleNamespace(subgroup_matrix_configs=[cfg(16, 8, 32), cfg(16, 16, 32)]),
    ...                        "i8", "i32")["n"]
    16
    """
    fits = [c for c in device.subgroup_matrix_configs
            if c["component_type"] == component and c["result_component_type"] == result
            and c["min_subgroup_size"] == c["max_subgroup_size"]]
    return max(fits, key=lambda c: c["m"] * c["n"] * c["k"], default=None)


def compiled_source(device: Device, file: str, subgroups: bool) -> str:
    """What the device's compiler is given for ``file``: its source (``wgsl_source``) after the
    ``enable`` lines the source needs there and, for a kernel on subgroup matrices, its
    configuration's sizes (the module docstring). ValueError naming the file where it uses what the
    device lacks."""
    source = wgsl_source(file, subgroups)
    extensions = wgsl_extensions(source)
    missing = sorted(e for e in extensions if not device.has(EXTENSION_FEATURES[e]))
    if missing:
        raise ValueError(f"{file} uses {', '.join(missing)}, which this device lacks ({device.backend.name} on "
                         f"{device.name}; its features: {', '.join(sorted(device.features)) or 'none'})")
    sizes = ""
    types = _MATRIX_TYPES.findall(source)
    if len(types) > 1:
        raise ValueError(f"{file} names {len(types)} subgroup-matrix configurations; a kernel file takes one")
    for component, result in types:
        config = subgroup_matrix_config(device, component, result)
        if config is None:
            raise ValueError(f"{file} multiplies {component} subgroup matrices into {result}, which this device "
                             f"does not offer ({device.name}: {device.subgroup_matrix_configs or 'none'})")
        sizes += (f"const SM_M: u32 = {config['m']}u;\nconst SM_N: u32 = {config['n']}u;\n"
                  f"const SM_K: u32 = {config['k']}u;\nconst SM_SUBGROUP: u32 = {config['max_subgroup_size']}u;\n"
                  f"const SM_STORAGE: u32 = {device.limits['max-compute-workgroup-storage-size']}u;\n")
    return device.backend.enable_lines(extensions) + sizes + source


class Kernel:
    """One compiled entry point of one WGSL file, with its override constants set.

    ``params`` are the names of the ``struct Params`` fields (binding 0), in order.
    """

    def __init__(self, device: Device, file: str, entry: str, constants: Mapping[str, Any],
                 checks: str = DEFAULT_SHADER_CHECKS, subgroups: bool = False) -> None:
        self.device = device
        self.name = f"{file}:{entry}"
        self.constants = dict(constants)
        source = compiled_source(device, file, subgroups)
        self.params, self._format = params_layout(source)
        try:
            module = device.backend.shader_module(device.wgpu, source, self.name, checks)
            stage: dict[str, Any] = {"module": module, "entry_point": entry}
            if constants:
                stage["constants"] = {k: float(v) for k, v in constants.items()}
            self.pipeline = device.wgpu.create_compute_pipeline(layout="auto", compute=stage, label=self.name)
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
        self.kernel = kernel
        size = len(kernel.pack([0] * len(kernel.params)))
        usage = kernel.device.api.BufferUsage
        self.gpu = kernel.device.wgpu.create_buffer(size=size, usage=usage.UNIFORM | usage.COPY_DST)

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
    checks, subgroups = device.settings.shader_checks, use_subgroups(device)
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
    buf = (device.wgpu.create_buffer_with_data(data=data, usage=device.api.BufferUsage.UNIFORM), next(SERIALS))
    with device.lock:
        buf = cache.setdefault(data, buf)
        if len(cache) > 4096:
            cache.popitem(last=False)
    return buf
