"""Dawn through wgpudawn (the wgpu-py API on Dawn, an optional extra: ``pip install torch_wgpu_lora[dawn]``).

Dawn offers what wgpu-native keeps off: its experimental subgroup matrices
(``chromium-experimental-subgroup-matrix``, the GPU's matrix units through WebGPU). What differs
from wgpu-native, and how this backend handles it:

* Toggles, given before the first adapter is requested: ``allow_unsafe_apis`` (experimental
  features: subgroup matrices, timestamps inside passes) and ``vulkan_enable_f16_on_nvidia``
  (Dawn blocks ``shader-f16`` on NVIDIA's Vulkan driver by default, and with it every f16
  subgroup-matrix configuration).
* Threads: Dawn's objects are not thread-safe unless the device has
  ``implicit-device-synchronization``; the runtime's threads share one device, so it is required.
* Shader checks: Tint's bounds checks (robustness) are a setting of the whole device (the
  ``disable_robustness`` toggle), so ``full`` and ``bounds`` compile alike and ``none`` is chosen
  when the device is made (``TORCH_WGPU_LORA_SHADER_CHECKS``). Tint puts a 64-bit counter into every
  loop whose trip count it cannot prove constant (a bound that is a literal, a ``const`` or an
  ``override`` expression escapes it; a ``let`` or a function call does not), with no toggle to turn
  it off, and the driver then does not unroll that loop: a loop over a private array must have
  such a bound, or the array leaves the registers (``wgsl/norm.wgsl``'s ``WORDS``).
* WGSL: Tint needs ``enable subgroups;`` for subgroup operations and
  ``enable chromium_experimental_subgroup_matrix;`` for subgroup matrices; the runtime writes
  those lines.
* Timestamps: Dawn rounds them down to steps of 65.536 µs by default (a browser's guard against
  timing attacks); per-dispatch profiles of kernels that take a few µs need the full resolution,
  so the device is made without ``timestamp_quantization``.
* Waits and maps: the ticket of a submit is the queue's work-done future taken right after it
  (Dawn completes it once the work submitted so far has finished); maps go through wgpudawn's
  ``map_async``, whose synchronous wait blocks on that one map's future.
"""

from __future__ import annotations

from typing import Any

from .base import Backend

SUBGROUP_MATRIX = "chromium-experimental-subgroup-matrix"
INSTANCE_TOGGLES = ("allow_unsafe_apis", "vulkan_enable_f16_on_nvidia")
THREADS_FEATURE = "implicit-device-synchronization"


class Dawn(Backend):
    name = "dawn"
    FEATURES = {"subgroups": "subgroups", "shader-f16": "shader-f16", "timestamp-query": "timestamp-query",
                "timestamp-query-inside-passes": "chromium-experimental-timestamp-query-inside-passes",
                "subgroup-matrix": SUBGROUP_MATRIX}
    ENABLES = {"f16": "f16", "subgroups": "subgroups", "subgroup-matrix": "chromium_experimental_subgroup_matrix"}
    CHECKS_PER_MODULE = False

    def __init__(self) -> None:
        import wgpudawn  # ImportError where the optional extra is not installed
        from wgpudawn.backends.dawn import extras
        from wgpudawn.backends.dawn._ffi import ffi, lib

        super().__init__(wgpudawn, lib, ffi)
        self._extras, self._ffi = extras, ffi
        try:
            extras.set_instance_extras(enable_toggles=list(INSTANCE_TOGGLES))
            self.toggles: tuple[str, ...] = INSTANCE_TOGGLES
        except RuntimeError:  # this process made Dawn's instance before: its adapters lack the experimental features
            self.toggles = ()

    def version(self) -> str:
        from wgpudawn.backends.dawn import __version__ as dawn

        return f"wgpudawn {self.api.__version__}, Dawn {dawn}"

    def enumerate_adapters(self) -> list[Any]:
        return self.api.gpu.enumerate_adapters_sync()

    def request_device(self, adapter: Any, features: list[str], limits: dict[str, int], checks: str) -> Any:
        if THREADS_FEATURE not in adapter.features:
            raise RuntimeError(f"Dawn's adapter {adapter.info.get('device', '')!r} lacks {THREADS_FEATURE}, without "
                               "which threads cannot share its device")
        toggles = ["disable_robustness"] if checks == "none" else []
        return self._extras.request_device_sync(adapter, required_features=[*features, THREADS_FEATURE],
                                                required_limits=limits, enable_toggles=toggles,
                                                disable_toggles=["timestamp_quantization"])

    def subgroup_matrix_configs(self, adapter: Any) -> list[dict[str, Any]]:
        if SUBGROUP_MATRIX not in adapter.features:
            return []
        return list(self._extras.get_adapter_properties(adapter).get("subgroup_matrix_configs", []))

    def memory_bytes(self, adapter: Any) -> int | None:
        if "adapter-properties-memory-heaps" not in adapter.features:
            return None
        heaps = self._extras.get_adapter_properties(adapter).get("memory_heaps", [])
        local = [h["size"] for h in heaps if "device-local" in h["properties"]]
        return sum(local) or None

    def shader_module(self, device: Any, source: str, label: str, checks: str) -> Any:
        return device.create_shader_module(code=source, label=label)

    def submit(self, device: Any, command_buffers: list[Any]) -> Any:
        device.queue.submit(command_buffers)
        return device.queue.on_submitted_work_done_async()

    def wait_for(self, device: Any, ticket: Any) -> None:
        ticket.sync_wait()

    def map_read(self, device: Any, buffers: list[Any]) -> None:
        promises = []
        try:
            for gpu in buffers:
                promises.append(gpu.map_async("READ", 0, gpu.size))
            for promise in promises:
                promise.sync_wait()
        except BaseException:
            # the work is done, so the maps asked for settle at once: let them, then unmap what mapped
            for promise in promises:
                try:
                    promise.sync_wait()
                except Exception:  # a failed map leaves its buffer unmapped
                    pass
            for gpu in buffers[:len(promises)]:
                if gpu.map_state == "mapped":
                    gpu.unmap()
            raise

    def mapped(self, gpu: Any, offset: int, nbytes: int) -> memoryview:
        # the range itself, as the wgpu-native backend gives it (wgpudawn's read_mapped wraps it read-only)
        return memoryview(self._ffi.buffer(self.lib.wgpuBufferGetConstMappedRange(gpu._internal, offset, nbytes),
                                           nbytes))

    def unmap(self, gpu: Any) -> None:
        gpu.unmap()

    def write_timestamp(self, compute_pass: Any, query_set: Any, index: int) -> None:
        self._extras.write_timestamp(compute_pass, query_set, index)
