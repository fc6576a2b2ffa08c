"""The WebGPU device of this process: adapter choice, limits, features, and the state it owns.

Usage::

    from torch_wgpu_lora.runtime import get_device, device_info
    dev = get_device()          # created on first use, then shared by every thread
    print(device_info()["adapter"])

Adapter choice: ``TORCH_WGPU_LORA_ADAPTER`` (a case-insensitive substring of the
adapter's name) wins; otherwise a discrete GPU, then an integrated or virtual GPU,
then a CPU adapter (Mesa's lavapipe). Native backends (Vulkan, Metal, D3D12) come
before OpenGL, whose compute support is the thinnest.

Several processes per machine (``torchrun``, ``accelerate launch``: data-parallel training):
when ``LOCAL_RANK`` is set and ``TORCH_WGPU_LORA_ADAPTER`` is not, process ``LOCAL_RANK``
takes the ``LOCAL_RANK``-th adapter (in wgpu's enumeration order) of the preferred kind,
the best (backend, type) class present, e.g. the fourth Vulkan discrete GPU. With fewer
such adapters than local ranks it is an error naming them, except on a CPU adapter
(lavapipe): there every process shares it (each with its own device), because the
processes share the same CPU cores whichever adapter object they use, and nothing is
gained by refusing. ``device_info()`` reports the local rank, the adapter's index among
those of its kind and why it was chosen. ``TORCH_WGPU_LORA_ADAPTER`` set per process
picks adapters by hand (every process with the same value shares the adapter it names).

State belongs to the device: the buffer pool, the staging buffers, compiled kernels,
interned uniforms, launch plans and resident weights all live in ``Device.state``
(created on first use by the module that owns each), guarded by ``Device.lock``, so
several threads can share one device.

Fork: a child process cannot use its parent's WebGPU device: the driver's worker
threads do not survive ``fork``, so the first submit would wait forever (lavapipe's
compute threads are global to the driver, so even a fresh device in the child hangs).
As CUDA does, a child forked after the parent created its device gets a clear
RuntimeError from ``get_device`` (use the ``spawn`` start method, or create the
device only in the children); the parent's objects are never touched in the child.
A child forked before any device existed starts its own as usual.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

ADAPTER_ENV = "TORCH_WGPU_LORA_ADAPTER"
LOCAL_RANK_ENV = "LOCAL_RANK"  # set by torchrun and accelerate launch for each process of a machine

INSTALL_HINT = (
    "No WebGPU adapter was found. torch_wgpu_lora needs a GPU driver with Vulkan, Metal "
    "or D3D12, or Mesa's CPU Vulkan driver (lavapipe): on Debian/Ubuntu run "
    "`apt-get install mesa-vulkan-drivers`."
)

_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
_BACKEND_RANK = {"Vulkan": 0, "Metal": 0, "D3D12": 0, "OpenGL": 1}
# Optional features used when the adapter has them (kernels check ``Device.features``).
_WANTED_FEATURES = ("subgroup", "timestamp-query", "timestamp-query-inside-passes", "shader-f16")
_LIMIT_NAMES = (
    "max-storage-buffer-binding-size",
    "max-buffer-size",
    "max-compute-workgroup-storage-size",
    "max-storage-buffers-per-shader-stage",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
    "max-compute-workgroups-per-dimension",
)

T = TypeVar("T")


def _adapter_name(info: Any) -> str:
    return f"{info.get('device', '')} ({info.get('description', '')})".strip()


def _kind(a: Any) -> tuple[int, int]:
    """The adapter's class, lower is better: (backend, type)."""
    info = a.info
    return (_BACKEND_RANK.get(info.get("backend_type", ""), 2), _TYPE_RANK.get(info.get("adapter_type", ""), 4))


def _kind_name(a: Any) -> str:
    return f"{a.info.get('backend_type', '?')} {a.info.get('adapter_type', '?')}"


@dataclass(frozen=True)
class AdapterChoice:
    """The adapter a process uses and why (``choose_adapter``'s answer)."""

    adapter: Any
    index: int  # its position among the adapters of its kind (wgpu's enumeration order)
    of_kind: int  # how many adapters of that kind there are
    local_rank: int | None  # the process's local rank, when one was given
    reason: str


def choose_adapter(adapters: list[Any], override: str | None, local_rank: int | None = None) -> AdapterChoice:
    """Pick the adapter to use from ``adapters`` (wgpu GPUAdapter objects), and say why.

    ``override`` is a substring of the adapter name (device, description or vendor),
    matched case-insensitively; it wins over ``local_rank``. Otherwise the preferred kind is
    the best (backend, type) class present, and ``local_rank`` (a process's rank on its
    machine) picks the ``local_rank``-th adapter of that kind; None picks the first. Fewer
    adapters of the kind than ``local_rank + 1``: RuntimeError, except on a CPU adapter,
    which the processes share. Raises RuntimeError naming the choices when nothing fits.
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
        best = min(matches, key=_kind)
        same = [a for a in matches if _kind(a) == _kind(best)]
        why = f"{ADAPTER_ENV}={override!r} names it"
        if local_rank is not None:
            why += f" ({ADAPTER_ENV} wins over {LOCAL_RANK_ENV}={local_rank})"
        return AdapterChoice(best, same.index(best), len(same), local_rank, why)
    if isinstance(local_rank, bool) or (local_rank is not None and (not isinstance(local_rank, int) or local_rank < 0)):
        raise RuntimeError(f"{LOCAL_RANK_ENV} must be an integer >= 0, got {local_rank!r}")
    kind = min(_kind(a) for a in adapters)
    candidates = [a for a in adapters if _kind(a) == kind]
    n, what = len(candidates), _kind_name(candidates[0])
    if local_rank is None:
        return AdapterChoice(candidates[0], 0, n, None, f"the first of {n} {what} adapter(s), the best kind found")
    if local_rank < n:
        return AdapterChoice(candidates[local_rank], local_rank, n, local_rank,
                             f"{LOCAL_RANK_ENV}={local_rank}: adapter {local_rank} of the {n} {what} adapter(s), "
                             "the best kind found")
    if candidates[0].info.get("adapter_type") == "CPU":
        index = local_rank % n
        return AdapterChoice(candidates[index], index, n, local_rank,
                             f"{LOCAL_RANK_ENV}={local_rank}, but only {n} {what} adapter(s): the processes share "
                             f"adapter {index}, each with its own device (a CPU adapter runs on the cores all "
                             "processes share anyway, so sharing loses nothing)")
    names = "; ".join(f"{i}: {_adapter_name(a.info)}" for i, a in enumerate(candidates))
    raise RuntimeError(f"{LOCAL_RANK_ENV}={local_rank} needs {local_rank + 1} WebGPU adapters of the preferred kind "
                       f"({what}), but this machine has {n} ({names}). Start at most {n} processes per machine "
                       f"(torchrun --nproc-per-node {n}), or set {ADAPTER_ENV} in each process to choose by hand")


def local_rank_from_env() -> int | None:
    """``LOCAL_RANK`` as an int (None when unset); RuntimeError when it is not an integer >= 0."""
    text = os.environ.get(LOCAL_RANK_ENV)
    if text is None or not text.strip():
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise RuntimeError(f"{LOCAL_RANK_ENV} must be an integer >= 0, got {text!r}")
    return value


def native() -> tuple[Any, Any, Any]:
    """wgpu-native through cffi: (``ffi``, ``lib``, ``libf``), ``lib`` its entry points and
    constants as they are, ``libf`` the entry points wrapped to raise WebGPU errors as
    exceptions (wgpu-py's own). For what wgpu-py does not expose (a submission's index, a wait
    for it, maps no poll thread waits on) and the recorder's launch fast path."""
    from wgpu.backends.wgpu_native._api import libf
    from wgpu.backends.wgpu_native._ffi import ffi, lib

    return ffi, lib, libf


class Device:
    """A wgpu device, the facts about it that kernels need, and the state it owns.

    Attributes: ``wgpu`` (the GPUDevice), ``queue``, ``info`` (adapter info dict),
    ``limits`` (dict), ``features`` (set of names), ``has_subgroups``,
    ``has_timestamps``, ``max_binding`` (bytes one storage binding may span),
    ``max_workgroups`` (per grid dimension), ``offset_alignment`` (bytes a binding's
    offset must be a multiple of), ``submits`` (command buffers submitted so far).
    """

    def __init__(self, adapter: Any, choice: AdapterChoice | None = None) -> None:
        want = [f for f in _WANTED_FEATURES if f in adapter.features]
        limits = {name: adapter.limits[name] for name in _LIMIT_NAMES if name in adapter.limits}
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
        self.offset_alignment = max(16, int(self.limits["min-storage-buffer-offset-alignment"]))
        self.lock = threading.RLock()
        self.state: dict[str, Any] = {}
        self.submits = 0
        self.allocated = 0  # bytes of storage and staging buffers the runtime holds (pooled ones included)
        self.peak_allocated = 0
        self.forked = False  # set in a forked child: this device belongs to the parent
        self.choice = choice or AdapterChoice(adapter, 0, 1, None, "given")

    def owned(self, name: str, make: Callable[[], T]) -> T:
        """The device's ``name`` state, made by ``make()`` on first use (thread-safe)."""
        value = self.state.get(name)
        if value is None:
            with self.lock:
                value = self.state.get(name)
                if value is None:
                    value = self.state[name] = make()
        return value

    def check_usable(self) -> None:
        """Raise the fork error in a child forked after this device was made: its driver's
        threads stayed in the parent, so work would hang. Called before allocating, writing
        and recording, so objects made before the fork (an engine, a plan) fail clearly too."""
        if self.forked:
            raise RuntimeError(FORKED_ERROR)

    def track(self, nbytes: int) -> None:
        """Count ``nbytes`` of GPU memory made (positive) or freed (negative) by the runtime."""
        with self.lock:
            self.allocated += nbytes
            self.peak_allocated = max(self.peak_allocated, self.allocated)

    def reset_peak(self) -> None:
        """Start ``peak_allocated`` again from what is allocated now (as torch.cuda.reset_peak_memory_stats)."""
        with self.lock:
            self.peak_allocated = self.allocated

    def submit(self, command_buffers: list[Any]) -> int:
        """``queue.submit``, counted (tests check how many submits a step makes); returns the
        submission's index, for ``wait_for``."""
        ffi, _, libf = native()
        handles = ffi.new("WGPUCommandBuffer[]", [cb._internal for cb in command_buffers])
        index = int(libf.wgpuQueueSubmitForIndex(self.queue._internal, len(command_buffers), handles))
        with self.lock:
            self.submits += 1
        return index

    def wait_for(self, index: int) -> None:
        """Block until submission ``index`` has finished on the GPU (later ones may still run).

        wgpu-py's ``map_async`` waits differently: its poll thread waits for *every* submitted
        command buffer (``wgpuDevicePoll`` with wait), and a ``queue.submit`` made meanwhile does
        not return before that poll does (on the H200, a decode batch's submit took 5.6-7.5 ms
        while the batch before's readback was pending, 0.1 ms once the runtime mapped this way).
        A generation that submits batch N + 1 and then waits for batch N's readback would leave
        the GPU idle until each submit returned. So the runtime waits for the one submission,
        then maps."""
        ffi, _, libf = native()
        libf.wgpuDevicePoll(self.wgpu._internal, True, ffi.new("uint64_t *", index))

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
            "local_rank": self.choice.local_rank,  # LOCAL_RANK of this process, None when unset
            "adapter_index": self.choice.index,  # among the adapters of its kind
            "adapters_of_kind": self.choice.of_kind,
            "choice": self.choice.reason,
        }

    def __repr__(self) -> str:
        return f"Device({self.name!r}, {self.info.get('backend_type', '')})"


@contextlib.contextmanager
def _quiet_mesa() -> Iterator[None]:
    """Mesa's Vulkan loader probes window-system sockets under XDG_RUNTIME_DIR and prints an
    error line for each probe when the variable is unset (containers, CI). Compute needs no
    window system: while the device is created, a private empty folder keeps stderr clean;
    the process's environment is restored afterwards."""
    if os.environ.get("XDG_RUNTIME_DIR"):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="torch-wgpu-lora-xdg-") as folder:
        os.environ["XDG_RUNTIME_DIR"] = folder
        try:
            yield
        finally:
            os.environ.pop("XDG_RUNTIME_DIR", None)


FORKED_ERROR = (
    "WebGPU cannot be used in a process forked after its parent created the WebGPU device "
    "(the driver's threads do not survive fork). Start worker processes with the 'spawn' "
    "method (multiprocessing.set_start_method('spawn') or "
    "multiprocessing.get_context('spawn')), or use WebGPU only in the children."
)

_device: Device | None = None
_lock = threading.Lock()
_parents_device: Device | None = None  # in a forked child: the parent's, kept unreleased and unused


def _forget_device_after_fork() -> None:
    global _device, _lock, _parents_device
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    if _device is not None:
        _device.forked = True
        _parents_device, _device = _device, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_device_after_fork)


def get_device() -> Device:
    """The process-wide device, created on first call (see the module docstring for fork)."""
    global _device
    device = _device
    if device is None:
        if _parents_device is not None:
            raise RuntimeError(FORKED_ERROR)
        with _lock:
            if _device is None:
                try:
                    import wgpu
                except ImportError as e:  # pragma: no cover - wgpu is a hard dependency
                    raise RuntimeError(f"wgpu-py is not installed ({e}); pip install wgpu") from e
                with _quiet_mesa():
                    try:
                        adapters = wgpu.gpu.enumerate_adapters_sync()
                    except Exception as e:  # the native loader itself can fail without drivers
                        raise RuntimeError(f"{INSTALL_HINT} (wgpu said: {e})") from e
                    choice = choose_adapter(adapters, os.environ.get(ADAPTER_ENV), local_rank_from_env())
                    _device = Device(choice.adapter, choice)
            device = _device
    return device


def device_info() -> dict[str, Any]:
    """Adapter name, backend, limits and features of the device in use, and how it was chosen:
    ``local_rank`` (None outside a multi-process launch), ``adapter_index`` among the
    ``adapters_of_kind`` adapters of its kind, ``choice`` (why, in words).

    >>> info = device_info()
    >>> info["backend"] in ("Vulkan", "Metal", "D3D12", "OpenGL")
    True
    """
    return get_device().describe()
