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

WebGPU implementation (``TORCH_WGPU_LORA_BACKEND``): ``wgpu`` (the default: wgpu-native through
wgpu-py), ``dawn`` (Dawn through wgpudawn, ``pip install torch_wgpu_lora[dawn]``), or ``auto``: Dawn
where wgpudawn is installed and the adapter Dawn would use offers subgroup matrices (the GPU's
matrix units), else wgpu-native. ``runtime/backends/`` holds what differs between the two;
``device_info()`` says which one runs and why.

Settings (shader checks, subgroups, the buffer pool's bound) belong to the device:
``Device.configure`` changes them, environment variables give their defaults
(``runtime/settings.py``).

Under ``torch.compile`` the device is made (or found) as the compiler traces the first call that
needs it, outside the traced graph: ``get_device`` is a constant to the compiler.

Compiled CPU kernels and the CPU's vector width. What runs beside the kernels on the CPU is often
compiled by inductor: transformers compiles BitNet's activation quantisation, and users compile
models holding ``LoRALinear``. Inductor's on-disk cache (torch 2.13) keys a compiled graph without
the vector width it generated C++ for, which ``ATEN_CPU_CAPABILITY`` and the CPU choose, so a
process at another width rebuilds the cached code for its own: AVX2 code under ``default`` does
not compile, and AVX-512 code under AVX2 processes half of every row and leaves the rest of its
outputs unwritten (NaN gradients). Importing the runtime (every torch path of this package does)
adds the capability to torch's cache-key tag (``torch.compiler.config.cache_key_tag``), so that
each capability compiles and caches its own kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import threading
from typing import Any, Callable, Iterator, Mapping, TypeVar

import torch

from .backends import FEATURES, IMPLEMENTATIONS, SUBGROUP_MATRIX, Backend
from .settings import SHADER_CHECKS_ENV, Settings, settings_from_env

ADAPTER_ENV = "TORCH_WGPU_LORA_ADAPTER"
LOCAL_RANK_ENV = "LOCAL_RANK"  # set by torchrun and accelerate launch for each process of a machine
BACKEND_ENV = "TORCH_WGPU_LORA_BACKEND"
BACKEND_CHOICES = ("wgpu", "dawn", "auto")

INSTALL_HINT = (
    "No WebGPU adapter was found. torch_wgpu_lora needs a GPU driver with Vulkan, Metal "
    "or D3D12, or Mesa's CPU Vulkan driver (lavapipe): on Debian/Ubuntu run "
    "`apt-get install mesa-vulkan-drivers`."
)

_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
_BACKEND_RANK = {"Vulkan": 0, "Metal": 0, "D3D12": 0, "OpenGL": 1}
DAWN_NO_ADAPTER = (
    "Dawn (wgpudawn) found no WebGPU adapter; its warnings above say why. Dawn needs more of Vulkan than "
    "wgpu-native does: it refuses Mesa's lavapipe before Mesa 23 (Debian 12's 22.3.6; Debian bookworm-backports "
    f"has Mesa 25). Unset {BACKEND_ENV} to use wgpu-native."
)
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


@dataclasses.dataclass(frozen=True)
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


def host_memory_bytes() -> int | None:
    """This machine's memory: what a CPU adapter's buffers live in."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on this platform
        return None


class Device:
    """A WebGPU device, the facts about it that kernels need, its settings and the state it owns.

    Attributes: ``backend`` (the WebGPU implementation: ``runtime/backends``), ``api`` (its wgpu-py
    API module: flags and enums), ``wgpu`` (the GPUDevice), ``queue``, ``info`` (adapter info
    dict), ``limits`` (dict), ``features`` (set of the implementation's names), ``has_subgroups``,
    ``has_f16``, ``has_timestamps``, ``has_stamps_in_passes`` (timestamps between launches of one
    pass), ``subgroup_matrix_configs`` (the adapter's subgroup-matrix shapes and types; empty
    without them), ``memory_bytes`` (the device's memory where known, else None), ``max_binding``
    (bytes one storage binding may span), ``max_workgroups`` (per grid dimension),
    ``offset_alignment`` (bytes a binding's offset must be a multiple of), ``submits`` (command
    buffers submitted so far), ``settings`` (``runtime/settings.py``; ``configure`` changes them).
    """

    def __init__(self, adapter: Any, choice: AdapterChoice | None = None, backend: Backend | None = None,
                 backend_reason: str = "given", settings: Settings | None = None) -> None:
        self.backend = backend or IMPLEMENTATIONS["wgpu"]()
        self.backend_reason = backend_reason
        self.api = self.backend.api
        self.adapter = adapter
        self.info = dict(adapter.info)
        self.is_cpu = self.info.get("adapter_type") == "CPU"
        self.memory_bytes = self.backend.memory_bytes(adapter) or (host_memory_bytes() if self.is_cpu else None)
        self.settings = settings or settings_from_env(self.memory_bytes)
        named = [self.backend.feature(f) for f in FEATURES]
        want = [f for f in named if f is not None and f in adapter.features]
        limits = {name: adapter.limits[name] for name in _LIMIT_NAMES if name in adapter.limits}
        self.created_checks = self.settings.shader_checks
        self.wgpu = self.backend.request_device(adapter, want, limits, self.created_checks)
        self.queue = self.wgpu.queue
        self.limits = dict(self.wgpu.limits)
        self.features = set(self.wgpu.features)
        self.has_subgroups = self.has("subgroups")
        self.has_f16 = self.has("shader-f16")
        self.has_timestamps = self.has("timestamp-query")
        self.has_stamps_in_passes = self.has("timestamp-query-inside-passes")
        matrices = self.has("subgroup-matrix")
        self.subgroup_matrix_configs = self.backend.subgroup_matrix_configs(adapter) if matrices else []
        self.max_binding = int(self.limits["max-storage-buffer-binding-size"])
        self.max_workgroups = int(self.limits["max-compute-workgroups-per-dimension"])
        self.offset_alignment = max(16, int(self.limits["min-storage-buffer-offset-alignment"]))
        self.lock = threading.RLock()
        self.state: dict[str, Any] = {}
        self.submits = 0
        self.allocated = 0  # bytes of storage and staging buffers the runtime holds (pooled ones included)
        self.peak_allocated = 0
        self.pooled = 0  # bytes of freed storage buffers kept for reuse (the pool's holdings)
        self.forked = False  # set in a forked child: this device belongs to the parent
        self.choice = choice or AdapterChoice(adapter, 0, 1, None, "given")

    def has(self, feature: str) -> bool:
        """Whether the device has ``feature`` (WebGPU's name, one of ``runtime.backends.FEATURES``) on."""
        name = self.backend.feature(feature)
        return name is not None and name in self.features

    def configure(self, settings: Settings | None = None, **changes: Any) -> Settings:
        """Change settings (``runtime/settings.py``), by name or as a whole ``Settings``; returns
        the settings as they were, so that ``configure(previous)`` restores them. Checked first:
        a bad value raises and changes nothing.

        >>> dev = get_device()
        >>> previous = dev.configure(subgroups=False)
        >>> dev.settings.subgroups, dev.configure(previous).subgroups
        (False, False)
        """
        new = dataclasses.replace(settings or self.settings, **changes)
        if not self.backend.CHECKS_PER_MODULE and (new.shader_checks == "none") != (self.created_checks == "none"):
            raise ValueError(f"{self.backend.name} sets its bounds checks when the device is made (this one: "
                             f"shader checks {self.created_checks!r}), not per kernel: choose 'none' or another "
                             f"mode with {SHADER_CHECKS_ENV} before the first WebGPU use")
        with self.lock:
            previous, self.settings = self.settings, new
        return previous

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

    def submit(self, command_buffers: list[Any]) -> Any:
        """``queue.submit``, counted (tests check how many submits a step makes); returns the
        submission's ticket, for ``wait_for``."""
        ticket = self.backend.submit(self.wgpu, command_buffers)
        with self.lock:
            self.submits += 1
        return ticket

    def wait_for(self, ticket: Any) -> None:
        """Block until the submission of ``ticket`` has finished on the GPU (later ones may still
        run): a readback waits for its own work, not for what was submitted after it
        (``runtime/backends/wgpu_native.py`` says why that matters)."""
        self.backend.wait_for(self.wgpu, ticket)

    @property
    def name(self) -> str:
        return _adapter_name(self.info)

    def describe(self) -> dict[str, Any]:
        """Adapter name, backend, type, limits and features, the WebGPU implementation and why,
        subgroup matrices, settings and memory, as plain data."""
        with self.lock:
            memory = {"allocated_bytes": self.allocated, "peak_allocated_bytes": self.peak_allocated,
                      "pooled_bytes": self.pooled, "pool_bound_bytes": self.settings.pool_bytes,
                      "device_memory_bytes": self.memory_bytes}
        return {
            "adapter": self.name,
            "vendor": self.info.get("vendor", ""),
            "backend": self.info.get("backend_type", ""),
            "adapter_type": self.info.get("adapter_type", ""),
            "webgpu": self.backend.name,  # the WebGPU implementation: wgpu-native or dawn
            "webgpu_version": self.backend.version(),
            "webgpu_choice": self.backend_reason,
            "subgroup_matrices": self.has("subgroup-matrix"),
            "subgroup_matrix_configs": self.subgroup_matrix_configs,
            "limits": {k: int(v) for k, v in sorted(self.limits.items())},
            "features": sorted(self.features),
            "settings": dataclasses.asdict(self.settings),
            "memory": memory,
            "local_rank": self.choice.local_rank,  # LOCAL_RANK of this process, None when unset
            "adapter_index": self.choice.index,  # among the adapters of its kind
            "adapters_of_kind": self.choice.of_kind,
            "choice": self.choice.reason,
        }

    def __repr__(self) -> str:
        return f"Device({self.name!r}, {self.info.get('backend_type', '')}, {self.backend.name})"


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


def _adapters(backend: Backend) -> list[Any]:
    with _quiet_mesa():
        try:
            return backend.enumerate_adapters()
        except Exception as e:  # the native loader itself can fail without drivers
            raise RuntimeError(f"{INSTALL_HINT} ({backend.name} said: {e})") from e


def choose_backend(wanted: str | None, pick: Callable[[list[Any]], AdapterChoice],
                   implementations: Mapping[str, Callable[[], Backend]] = IMPLEMENTATIONS
                   ) -> tuple[Backend, AdapterChoice, str]:
    """The WebGPU implementation to use, its adapter (``pick`` chooses among its adapters) and why.

    ``wanted`` is ``TORCH_WGPU_LORA_BACKEND``'s value: ``wgpu`` (also when None or empty), ``dawn``
    (an error, never another backend, when Dawn cannot be had), or ``auto`` (Dawn where wgpudawn is
    installed and the adapter ``pick`` takes among Dawn's offers subgroup matrices, else wgpu-native).
    ``implementations`` maps ``wgpu`` and ``dawn`` to their backends' constructors.
    """
    text = (wanted or "").strip().lower()
    if text and text not in BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV} must be one of {', '.join(BACKEND_CHOICES)}, got {wanted!r}")
    if text in ("", "wgpu"):
        backend = implementations["wgpu"]()
        said = f"{BACKEND_ENV}=wgpu" if text else f"{BACKEND_ENV} unset"
        return backend, pick(_adapters(backend)), f"{said}: wgpu-native, the default"
    try:
        dawn = implementations["dawn"]()
    except ImportError as e:
        if text == "dawn":
            raise RuntimeError(f"{BACKEND_ENV}=dawn needs wgpudawn, which is not installed ({e}): "
                               "pip install 'torch_wgpu_lora[dawn]'") from e
        why = "wgpudawn is not installed"
    else:
        adapters = _adapters(dawn)
        if text == "dawn":
            if not adapters:
                raise RuntimeError(DAWN_NO_ADAPTER)
            return dawn, pick(adapters), f"{BACKEND_ENV}=dawn"
        try:
            choice = pick(adapters) if adapters else None
        except RuntimeError as e:  # e.g. TORCH_WGPU_LORA_ADAPTER names no adapter of Dawn's
            choice, why = None, f"Dawn's adapters do not fit ({e})"
        else:
            why = "Dawn found no adapter"
        if choice is not None:
            name = _adapter_name(choice.adapter.info)
            if SUBGROUP_MATRIX in choice.adapter.features:
                return dawn, choice, f"{BACKEND_ENV}=auto: Dawn, whose adapter {name} offers subgroup matrices"
            why = f"Dawn's adapter {name} offers no subgroup matrices"
    backend = implementations["wgpu"]()
    return backend, pick(_adapters(backend)), f"{BACKEND_ENV}=auto: wgpu-native, as {why}"


def _pick(adapters: list[Any]) -> AdapterChoice:
    return choose_adapter(adapters, os.environ.get(ADAPTER_ENV), local_rank_from_env())


def _cache_key_tag_with_cpu_capability(tag: str) -> str:
    """``tag`` (torch's compile cache-key tag) with this process's CPU capability added once."""
    capability = f"cpu-capability:{torch.backends.cpu.get_cpu_capability()}"
    return tag if capability in tag.split(",") else ",".join(filter(None, (tag, capability)))


# See the module's docstring: without it, kernels compiled at another CPU capability are rebuilt here.
torch.compiler.config.cache_key_tag = _cache_key_tag_with_cpu_capability(torch.compiler.config.cache_key_tag)


@torch.compiler.assume_constant_result
def get_device() -> Device:
    """The process-wide device, created on first call (see the module docstring for fork).

    The compiler calls it as it traces and keeps the device as a constant (a device is made once per
    process), so ``torch.compile(fullgraph=True)`` works when its first call is the first WebGPU use."""
    global _device
    device = _device
    if device is None:
        if _parents_device is not None:
            raise RuntimeError(FORKED_ERROR)
        with _lock:
            if _device is None:
                backend, choice, why = choose_backend(os.environ.get(BACKEND_ENV), _pick)
                with _quiet_mesa():
                    _device = Device(choice.adapter, choice, backend, why)
            device = _device
    return device


def device_info() -> dict[str, Any]:
    """Adapter name, backend, limits and features of the device in use, and how it was chosen:
    ``local_rank`` (None outside a multi-process launch), ``adapter_index`` among the
    ``adapters_of_kind`` adapters of its kind, ``choice`` (why, in words); the WebGPU implementation
    (``webgpu``: ``wgpu-native`` or ``dawn``; ``webgpu_choice``: why), whether the adapter offers
    subgroup matrices and their configurations, the settings, and the memory the runtime holds
    (``memory``: allocated, peak, what the buffer pool keeps and its bound).

    >>> info = device_info()
    >>> info["backend"] in ("Vulkan", "Metal", "D3D12", "OpenGL"), info["webgpu"] in ("wgpu-native", "dawn")
    (True, True)
    """
    return get_device().describe()
