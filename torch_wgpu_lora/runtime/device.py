"""The one WebGPU device of this process: adapter choice, limits, features.

Usage::

    from torch_wgpu_lora.runtime import get_device, device_info
    dev = get_device()          # created on first use, then shared
    print(device_info()["adapter"])

Adapter choice: ``TORCH_WGPU_LORA_ADAPTER`` (a case-insensitive substring of the
adapter's name) wins; otherwise a discrete GPU, then an integrated or virtual GPU,
then a CPU adapter (Mesa's lavapipe). Native backends (Vulkan, Metal, D3D12) come
before OpenGL, whose compute support is the thinnest.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any

ADAPTER_ENV = "TORCH_WGPU_LORA_ADAPTER"

INSTALL_HINT = (
    "No WebGPU adapter was found. torch_wgpu_lora needs a GPU driver with Vulkan, Metal "
    "or D3D12, or Mesa's CPU Vulkan driver (lavapipe): on Debian/Ubuntu run "
    "`apt-get install mesa-vulkan-drivers`."
)

_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
_BACKEND_RANK = {"Vulkan": 0, "Metal": 0, "D3D12": 0, "OpenGL": 1}


def _adapter_name(info: Any) -> str:
    return f"{info.get('device', '')} ({info.get('description', '')})".strip()


def choose_adapter(adapters: list[Any], override: str | None) -> Any:
    """Pick the adapter to use from ``adapters`` (wgpu GPUAdapter objects).

    ``override`` is a substring of the adapter name (device, description or vendor),
    matched case-insensitively. Raises RuntimeError naming the choices when nothing fits.
    """
    if not adapters:
        raise RuntimeError(INSTALL_HINT)
    if override:
        needle = override.lower()
        matches = [
            a for a in adapters
            if any(needle in str(a.info.get(k, "")).lower() for k in ("device", "description", "vendor"))
        ]
        if not matches:
            names = ", ".join(sorted({_adapter_name(a.info) for a in adapters}))
            raise RuntimeError(f"{ADAPTER_ENV}={override!r} matches no adapter; adapters found: {names}")
        adapters = matches

    def rank(a: Any) -> tuple[int, int]:
        info = a.info
        return (_BACKEND_RANK.get(info.get("backend_type", ""), 2), _TYPE_RANK.get(info.get("adapter_type", ""), 4))

    return min(adapters, key=rank)


class Device:
    """A wgpu device plus the facts about it that kernels and ops need.

    Attributes: ``wgpu`` (the GPUDevice), ``queue``, ``info`` (adapter info dict),
    ``limits`` (dict), ``features`` (set of names), ``has_subgroups``,
    ``has_timestamps``, ``max_binding`` (bytes one storage binding may span).
    """

    def __init__(self, adapter: Any) -> None:
        want = [f for f in ("subgroup", "timestamp-query") if f in adapter.features]
        limit_names = (
            "max-storage-buffer-binding-size",
            "max-buffer-size",
            "max-compute-workgroup-storage-size",
            "max-storage-buffers-per-shader-stage",
            "max-compute-invocations-per-workgroup",
            "max-compute-workgroup-size-x",
        )
        limits = {name: adapter.limits[name] for name in limit_names if name in adapter.limits}
        self.adapter = adapter
        self.info = dict(adapter.info)
        self.wgpu = adapter.request_device_sync(required_features=want, required_limits=limits)
        self.queue = self.wgpu.queue
        self.limits = dict(self.wgpu.limits)
        self.features = set(self.wgpu.features)
        self.has_subgroups = "subgroup" in self.features
        self.has_timestamps = "timestamp-query" in self.features
        self.max_binding = int(self.limits["max-storage-buffer-binding-size"])
        self.max_workgroups = int(self.limits["max-compute-workgroups-per-dimension"])

    @property
    def name(self) -> str:
        return _adapter_name(self.info)

    @property
    def is_cpu(self) -> bool:
        return self.info.get("adapter_type") == "CPU"

    def describe(self) -> dict[str, Any]:
        """Adapter name, backend, type, limits and features, as plain data."""
        return {
            "adapter": self.name,
            "vendor": self.info.get("vendor", ""),
            "backend": self.info.get("backend_type", ""),
            "adapter_type": self.info.get("adapter_type", ""),
            "limits": {k: int(v) for k, v in sorted(self.limits.items())},
            "features": sorted(self.features),
        }


def _quiet_mesa() -> None:
    """Mesa's Vulkan loader probes window-system sockets under XDG_RUNTIME_DIR and prints an
    error line for each probe when the variable is unset (containers, CI). Compute needs no
    window system; a private empty folder keeps stderr clean."""
    if not os.environ.get("XDG_RUNTIME_DIR"):
        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="torch-wgpu-lora-xdg-")


_device: Device | None = None
_lock = threading.Lock()


def get_device() -> Device:
    """The process-wide device, created on first call."""
    global _device
    if _device is None:
        with _lock:
            if _device is None:
                _quiet_mesa()
                try:
                    import wgpu
                except ImportError as e:  # pragma: no cover - wgpu is a hard dependency
                    raise RuntimeError(f"wgpu-py is not installed ({e}); pip install wgpu") from e
                try:
                    adapters = wgpu.gpu.enumerate_adapters_sync()
                except Exception as e:  # the native loader itself can fail without drivers
                    raise RuntimeError(f"{INSTALL_HINT} (wgpu said: {e})") from e
                _device = Device(choose_adapter(adapters, os.environ.get(ADAPTER_ENV)))
    return _device


def device_info() -> dict[str, Any]:
    """Adapter name, backend, limits and features of the device in use.

    >>> info = device_info()
    >>> info["backend"] in ("Vulkan", "Metal", "D3D12", "OpenGL")
    True
    """
    return get_device().describe()
