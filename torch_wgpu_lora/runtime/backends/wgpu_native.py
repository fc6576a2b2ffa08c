"""wgpu-native through wgpu-py: the default backend.

Beyond wgpu-py's API it calls wgpu-native's C functions (through wgpu-py's cffi bindings) for
what wgpu-py does not expose: trusted shader modules (per-module runtime checks), a
submission's index and the wait for that one submission (``wgpuQueueSubmitForIndex``,
``wgpuDevicePoll``), and maps no poll thread waits on.

Why not wgpu-py's ``map_async``: its poll thread waits for *every* submitted command buffer
(``wgpuDevicePoll`` with wait), and a ``queue.submit`` made meanwhile does not return before that
poll does. A generation that submits batch N + 1 and then waits for batch N's readback would leave
the GPU idle until each submit returned. So the runtime waits for the one submission, then maps
(``benchmarks/RESULTS.md``, "Readbacks", gives what each way cost).
"""

from __future__ import annotations

import itertools
from typing import Any

from .base import Backend


class WgpuNative(Backend):
    name = "wgpu-native"
    FEATURES = {"subgroups": "subgroup", "shader-f16": "shader-f16", "timestamp-query": "timestamp-query",
                "timestamp-query-inside-passes": "timestamp-query-inside-passes"}
    # naga takes subgroup operations without an enable directive (and refuses `enable subgroups;`);
    # it has no subgroup matrices
    ENABLES = {"f16": "f16", "subgroups": None}

    def __init__(self) -> None:
        import wgpu
        from wgpu.backends.wgpu_native import _api, extras
        from wgpu.backends.wgpu_native._ffi import ffi, lib

        super().__init__(wgpu, lib, ffi)
        self._api, self._extras, self._ffi, self._libf = _api, extras, ffi, _api.libf
        self._map_status: dict[int, int] = {}
        self._tickets = itertools.count(1)

        def mapped(status: int, _message: Any, ticket: Any, _unused: Any) -> None:
            self._map_status[int(ffi.cast("intptr_t", ticket))] = int(status)

        # one callback for all maps; each map's ticket, passed as its user data, keys its status
        self._map_callback = ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)", mapped)

    def version(self) -> str:
        from wgpu.backends.wgpu_native import __version__ as native

        return f"wgpu-py {self.api.__version__}, wgpu-native {native}"

    def enumerate_adapters(self) -> list[Any]:
        return self.api.gpu.enumerate_adapters_sync()

    def request_device(self, adapter: Any, features: list[str], limits: dict[str, int], checks: str) -> Any:
        return adapter.request_device_sync(required_features=features, required_limits=limits)

    def shader_module(self, device: Any, source: str, label: str, checks: str) -> Any:
        """``full``: wgpu's own module (bounds checks and loop counters); ``bounds`` and ``none``:
        a trusted module (``wgpuDeviceCreateShaderModuleTrusted``, which wgpu-py does not wrap:
        the descriptor built as wgpu-py builds it) with bounds checks or without."""
        if checks == "full":
            return device.create_shader_module(code=source, label=label)
        api, ffi, lib = self._api, self._ffi, self.lib
        source_struct = api.new_struct_p("WGPUShaderSourceWGSL *", code=api.to_c_string_view(source))
        source_struct[0].chain.next = ffi.NULL
        source_struct[0].chain.sType = lib.WGPUSType_ShaderSourceWGSL
        descriptor = api.new_struct_p("WGPUShaderModuleDescriptor *",
                                      nextInChain=ffi.cast("WGPUChainedStruct *", source_struct),
                                      label=api.to_c_string_view(label))
        flags = lib.WGPUShaderRuntimeChecks_BoundsChecks if checks == "bounds" else lib.WGPUShaderRuntimeChecks_None
        handle = lib.wgpuDeviceCreateShaderModuleTrusted(device._internal, descriptor, flags)
        if handle == ffi.NULL:
            raise RuntimeError("shader module creation failed")
        return api.GPUShaderModule(label, handle, device)

    def submit(self, device: Any, command_buffers: list[Any]) -> int:
        handles = self._ffi.new("WGPUCommandBuffer[]", [cb._internal for cb in command_buffers])
        return int(self._libf.wgpuQueueSubmitForIndex(device.queue._internal, len(command_buffers), handles))

    def wait_for(self, device: Any, ticket: int) -> None:
        self._libf.wgpuDevicePoll(device._internal, True, self._ffi.new("uint64_t *", ticket))

    def map_read(self, device: Any, buffers: list[Any]) -> None:
        ffi, lib, libf = self._ffi, self.lib, self._libf
        tickets: list[int] = []
        try:
            for gpu in buffers:
                ticket = next(self._tickets)
                info = ffi.new("WGPUBufferMapCallbackInfo *")
                info.mode = lib.WGPUCallbackMode_AllowProcessEvents
                info.callback = self._map_callback
                info.userdata1 = ffi.cast("void *", ticket)
                tickets.append(ticket)
                libf.wgpuBufferMapAsync(gpu._internal, lib.WGPUMapMode_Read, 0, gpu.size, info[0])
            # the work is done, so one poll completes the maps (a blocking one if a second is needed)
            block = False
            while any(t not in self._map_status for t in tickets):
                libf.wgpuDevicePoll(device._internal, block, ffi.NULL)
                block = True
            statuses = [self._map_status.pop(t) for t in tickets]
            if any(status != lib.WGPUMapAsyncStatus_Success for status in statuses):
                raise RuntimeError(f"mapping a readback's staging buffers failed (WGPUMapAsyncStatus {statuses})")
        except BaseException:
            for gpu in buffers[:len(tickets)]:
                lib.wgpuBufferUnmap(gpu._internal)  # unchecked: a pending map is cancelled, a failed one left
            for t in tickets:
                self._map_status.pop(t, None)
            raise

    def mapped(self, gpu: Any, offset: int, nbytes: int) -> memoryview:
        pointer = self._libf.wgpuBufferGetConstMappedRange(gpu._internal, offset, nbytes)
        return memoryview(self._ffi.buffer(pointer, nbytes))

    def unmap(self, gpu: Any) -> None:
        self._libf.wgpuBufferUnmap(gpu._internal)

    def write_timestamp(self, compute_pass: Any, query_set: Any, index: int) -> None:
        self._extras.write_timestamp(compute_pass, query_set, index)
