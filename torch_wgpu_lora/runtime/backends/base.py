"""What every WebGPU implementation gives the runtime, and what they share.

A ``Backend`` holds what differs between implementations: how adapters are listed and a device
requested, feature names, the ``enable`` lines WGSL needs, how shader checks are chosen, a
submission's ticket and the wait for it, mapping staging buffers, in-pass timestamps, and the
raw entry points of the launch fast path. Everything else the runtime does through the wgpu-py
API, which both implementations provide.
"""

from __future__ import annotations

import re
from typing import Any

# WebGPU's feature names for what the runtime may use, as the runtime asks for them; each
# backend maps them to its own names (``Backend.FEATURES``).
FEATURES = ("subgroups", "shader-f16", "timestamp-query", "timestamp-query-inside-passes", "subgroup-matrix")

# WGSL that needs an extension, found in a kernel's source (comments removed): f16 values,
# subgroup builtins and functions, subgroup matrices.
_COMMENT = re.compile(r"//[^\n]*")
_USES = {
    "f16": re.compile(r"\b(f16|vec[234]h|mat[234]x[234]h)\b|\b\d+(\.\d*)?h\b"),
    "subgroups": re.compile(r"\b(subgroup_size|subgroup_invocation_id|subgroup_id|num_subgroups)\b"
                            r"|\b(subgroup|quad)(?!Matrix)[A-Z]\w*"),
    "subgroup-matrix": re.compile(r"\bsubgroup_matrix_\w+|\bsubgroupMatrix\w+"),
}
# the feature each extension needs on the device
EXTENSION_FEATURES = {"f16": "shader-f16", "subgroups": "subgroups", "subgroup-matrix": "subgroup-matrix"}


def wgsl_extensions(source: str) -> set[str]:
    """The WGSL extensions ``source`` uses: a subset of ``f16``, ``subgroups``, ``subgroup-matrix``.

    >>> sorted(wgsl_extensions("let s = subgroupAdd(x); // f16 in a comment"))
    ['subgroups']
    """
    code = _COMMENT.sub("", source)
    return {name for name, pattern in _USES.items() if pattern.search(code)}


class Backend:
    """One WebGPU implementation (see the module docstring). Subclasses set the class attributes
    and implement the methods that raise NotImplementedError."""

    name = ""
    FEATURES: dict[str, str] = {}  # runtime feature name -> this implementation's (absent: it has none)
    ENABLES: dict[str, str | None] = {}  # WGSL extension -> its enable directive here; None: needs none
    CHECKS_PER_MODULE = True  # whether each shader module picks its runtime checks (else: the device's)

    def __init__(self, api: Any, lib: Any, ffi: Any) -> None:
        self.api = api  # the wgpu-py API module of this implementation (flags, enums)
        self.lib = lib  # raw C entry points (cffi), for the launch fast path
        self.null = ffi.NULL

    # -- adapters and devices -------------------------------------------------------------------
    def version(self) -> str:
        raise NotImplementedError

    def enumerate_adapters(self) -> list[Any]:
        raise NotImplementedError

    def request_device(self, adapter: Any, features: list[str], limits: dict[str, int], checks: str) -> Any:
        """A device with ``features`` (this implementation's names) and ``limits``; ``checks`` is
        the default shader-checks mode, for implementations that fix the checks per device."""
        raise NotImplementedError

    def subgroup_matrix_configs(self, adapter: Any) -> list[dict[str, Any]]:
        """The adapter's subgroup-matrix configurations (component and result types, M, N, K,
        subgroup sizes); empty where it has none."""
        return []

    def memory_bytes(self, adapter: Any) -> int | None:
        """The device-local memory the adapter reports; None where the implementation does not say."""
        return None

    def feature(self, name: str) -> str | None:
        """This implementation's name for runtime feature ``name`` (one of ``FEATURES``)."""
        return self.FEATURES.get(name)

    # -- shaders ----------------------------------------------------------------------------------
    @classmethod
    def enable_lines(cls, extensions: set[str]) -> str:
        """The ``enable`` directives that a source using ``extensions`` needs here."""
        lines = [f"enable {cls.ENABLES[e]};\n" for e in sorted(extensions) if cls.ENABLES.get(e)]
        return "".join(lines)

    def shader_module(self, device: Any, source: str, label: str, checks: str) -> Any:
        raise NotImplementedError

    # -- submitting, waiting and mapping ------------------------------------------------------------
    def submit(self, device: Any, command_buffers: list[Any]) -> Any:
        """Submit; returns a ticket ``wait_for`` takes."""
        raise NotImplementedError

    def wait_for(self, device: Any, ticket: Any) -> None:
        """Block until the submission of ``ticket`` (and those before it) has finished on the GPU."""
        raise NotImplementedError

    def map_read(self, device: Any, buffers: list[Any]) -> None:
        """Map every MAP_READ buffer of ``buffers``, whose work has finished; on an error none stays mapped."""
        raise NotImplementedError

    def mapped(self, gpu: Any, offset: int, nbytes: int) -> memoryview:
        """``nbytes`` of a mapped buffer from ``offset``: valid until it is unmapped."""
        raise NotImplementedError

    def unmap(self, gpu: Any) -> None:
        raise NotImplementedError

    def write_timestamp(self, compute_pass: Any, query_set: Any, index: int) -> None:
        raise NotImplementedError

    # -- the objects' native handles ----------------------------------------------------------------
    @staticmethod
    def handle(obj: Any) -> Any:
        """The native handle of a wgpu-py object (what the launch fast path passes to C)."""
        return obj._internal

    @staticmethod
    def alive(obj: Any) -> bool:
        """Whether the implementation still holds ``obj``. A Buffer handle and its wgpu buffer
        collected in one reference cycle run both finalizers: ours pools the buffer, wgpu-py's
        releases it."""
        return getattr(obj, "_internal", None) is not None
