"""Data-parallel training over several processes (one WebGPU adapter each) with torch.distributed.

>>> # torchrun --nproc-per-node 2 -m torch_wgpu_lora train --model DIR --data train.jsonl --output run
>>> # (the CLI calls init_from_env(); a Trainer made inside an initialised process group joins it)

What the processes ("ranks") share, and how (``Trainer`` calls these; see its docstring):

* the start: rank 0 alone looks at the output folder and reads a checkpoint; its answer (or
  its error) is broadcast (``on_rank0``), and so are the adapter values (``broadcast_``), so
  every rank starts from rank 0's adapters whatever each one was initialised with;
* each optimizer step: the step's labelled-token and token counts (one all-reduce, before the
  forward, so that every rank scales its loss by the global count), then the flattened LoRA
  gradients with the rank's loss sum appended (float32, a few MB: on the engine one
  all-reduce per bucket of layers, from a thread of the step's own while the backward goes
  on, ``engine.step``; on the torch path one all-reduce); every rank then clips and applies the
  same AdamW update to the same numbers;
* every ``check_every`` steps and before every checkpoint: a CRC-32 of the adapters' bytes
  from every rank (one all-gather); ranks that differ from rank 0 stop the run
  (``RanksDiverged``, naming them);
* checkpoints: the ranks' random states are gathered to rank 0, which writes; the others wait
  for its answer (a barrier that also carries rank 0's error, if any).

What the ranks send each other besides tensors (settings, rank 0's answers and errors, random
states, optimizer state) is plain data in a safetensors blob (``encode``/``decode``), parsed on
arrival and never unpickled, unlike torch.distributed's ``*_object`` collectives.

Collectives go through the process group the program already has, when its backend handles
CPU tensors (gloo, or MPI); otherwise (e.g. NCCL) through a gloo group made beside it. A
collective that fails (a rank died: its sockets close; or it did not answer within the
group's timeout) raises ``RankLost`` on the ranks still alive, naming the step and the
timeout, instead of hanging. ``init_from_env`` makes the group with a timeout of
``TORCH_WGPU_LORA_DIST_TIMEOUT`` seconds (default 300): long enough for a slow rank's first
step (kernels compile then), short enough that a hung run ends. A program that makes its own
group should ``import torch._dynamo`` before ``init_process_group`` (see ``init_from_env``):
otherwise the group outlives ``destroy_process_group`` and the process may abort as it exits.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

import numpy as np
import torch

__all__ = ["DEFAULT_TIMEOUT", "TIMEOUT_ENV", "DataParallel", "DistributedError", "RankLost", "RanksDiverged",
           "env_world_size", "init_from_env", "timeout_from_env"]

TIMEOUT_ENV = "TORCH_WGPU_LORA_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 300.0  # seconds
T = TypeVar("T")

_timeout_set: float | None = None  # the timeout init_from_env gave the default group


class DistributedError(RuntimeError):
    """Data-parallel training cannot go on."""


class RankLost(DistributedError):
    """A collective failed: another process died, or did not answer within the timeout."""


class RanksDiverged(DistributedError):
    """The ranks' adapters are no longer identical."""


def env_world_size() -> int:
    """``WORLD_SIZE`` as torchrun and accelerate set it (1 when unset)."""
    text = os.environ.get("WORLD_SIZE", "").strip()
    if not text:
        return 1
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"WORLD_SIZE must be an integer >= 1, got {text!r}")
    return value


def timeout_from_env(default: float = DEFAULT_TIMEOUT) -> float:
    """``TORCH_WGPU_LORA_DIST_TIMEOUT`` in seconds (``default`` when unset)."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return default
    return check_timeout(text, TIMEOUT_ENV)


def check_timeout(value: Any, name: str = "timeout") -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not (seconds > 0 and np.isfinite(seconds)):
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return seconds


def init_from_env(timeout: float | None = None) -> bool:
    """Make the default process group (gloo, ``env://``: MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE as torchrun and accelerate set them) when ``WORLD_SIZE`` > 1 and there is none
    yet; returns whether it did. ``timeout`` (seconds; default ``timeout_from_env()``) bounds
    every collective, so a dead or hung rank ends the run on the others."""
    global _timeout_set
    import torch.distributed as dist

    if env_world_size() <= 1 or not dist.is_available() or dist.is_initialized():
        return False
    seconds = timeout_from_env() if timeout is None else check_timeout(timeout)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK") if not os.environ.get(name)]
    if missing:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} asks for several processes, but "
                         f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: start them with "
                         "torchrun (or accelerate launch --multi_gpu), which sets every one")
    # torch._dynamo first: it imports torch.distributed.nn, whose functions take `group=group.WORLD`
    # as a default argument. Imported after the group exists (by the first custom op's call, e.g.
    # our LoRA op), they keep it alive past destroy_process_group, and its gloo threads then run
    # into interpreter shutdown, where freeing a finished collective's tensors aborts the process
    # ("terminate called without an active exception").
    importlib.import_module("torch._dynamo")

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))
    _timeout_set = seconds
    return True


def _cpu_backend(backend: str) -> bool:
    """Whether a backend string (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``) handles CPU tensors."""
    for entry in str(backend).lower().split(","):
        device, _, name = entry.strip().rpartition(":")
        if device == "cpu" or (not device and name in ("gloo", "mpi")):
            return True
    return False


class DataParallel:
    """The collectives of data-parallel LoRA training among the ranks of a process group.

    ``DataParallel.current()`` is None in a single process (no group, or a group of one);
    otherwise it uses the default group (or a gloo group beside it when that one cannot take
    CPU tensors: then every rank must call ``current()`` at the same point, as with any
    ``new_group``).
    """

    def __init__(self, timeout: float | None = None) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout = timeout if timeout is not None else _timeout_set
        self.group = None  # the default group
        self.backend = dist.get_backend()
        if not _cpu_backend(self.backend):
            seconds = timeout_from_env() if timeout is None else timeout
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
            self.timeout, self.backend = seconds, "gloo"

    @classmethod
    def current(cls, timeout: float | None = None) -> "DataParallel | None":
        """The data-parallel context of this process, or None when it runs alone."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return cls(timeout)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return f"DataParallel(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"

    # -- failures ----------------------------------------------------------------------------

    def _lost(self, what: str, err: BaseException) -> RankLost:
        within = f"within the timeout of {self.timeout:g} s" if self.timeout else "within the process group's timeout"
        said = " ".join(str(err).split())[:400]
        return RankLost(f"{what} failed on rank {self.rank} of {self.world_size}: another process of the run died "
                        f"or did not answer {within}, so this one stops too (torch.distributed said: {said})")

    def _run(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except RuntimeError as err:  # DistBackendError and gloo's errors are RuntimeErrors
            raise self._lost(what, err) from err

    # -- collectives -------------------------------------------------------------------------

    def all_reduce_(self, tensor: torch.Tensor, what: str = "an all-reduce") -> torch.Tensor:
        """Sum ``tensor`` (a contiguous CPU tensor) over the ranks, in place; returns it."""
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError("all_reduce_ takes a contiguous CPU tensor")
        self._run(what, lambda: self.dist.all_reduce(tensor, group=self.group))
        return tensor

    def sum_ints(self, values: Sequence[int], what: str = "an all-reduce of counts") -> list[int]:
        """Each value summed over the ranks (exact: int64)."""
        t = torch.tensor(list(values), dtype=torch.int64)
        return [int(v) for v in self.all_reduce_(t, what).tolist()]

    def sum_floats(self, values: Sequence[float], what: str = "an all-reduce of sums") -> list[float]:
        """Each value summed over the ranks, in float64."""
        t = torch.tensor(list(values), dtype=torch.float64)
        return [float(v) for v in self.all_reduce_(t, what).tolist()]

    def reduce_gradients(self, params: Sequence[torch.Tensor], extra: float, what: str) -> float:
        """Sum every parameter's ``.grad`` over the ranks (a missing one counts as zeros and is
        set), as one flat float32 all-reduce with ``extra`` appended; returns ``extra``'s sum."""
        sizes = [p.numel() for p in params]
        flat = torch.empty(sum(sizes) + 1, dtype=torch.float32)
        at = 0
        for p, n in zip(params, sizes):
            flat[at:at + n] = 0.0 if p.grad is None else p.grad.detach().reshape(-1)
            at += n
        flat[-1] = extra
        self.all_reduce_(flat, what)
        at = 0
        for p, n in zip(params, sizes):
            p.grad = flat[at:at + n].view_as(p).clone()
            at += n
        return float(flat[-1])

    def broadcast_(self, tensors: Sequence[torch.Tensor], what: str = "a broadcast from rank 0") -> None:
        """Give every rank rank 0's values of ``tensors`` (float32 CPU tensors, copied in place)."""
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).float() for t in tensors]) if tensors else torch.empty(0)
            self._run(what, lambda: self.dist.broadcast(flat, src=0, group=self.group))
            if not self.is_main:
                at = 0
                for t in tensors:
                    t.copy_(flat[at:at + t.numel()].view_as(t))
                    at += t.numel()

    def broadcast_object(self, value: Any, what: str = "a broadcast from rank 0") -> Any:
        """Rank 0's ``value`` on every rank (plain data, paths and tensors: see ``encode``)."""
        data = encode(value) if self.is_main else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._run(what, lambda: self.dist.broadcast(size, src=0, group=self.group))
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_main else \
            torch.empty(int(size[0]), dtype=torch.uint8)
        self._run(what, lambda: self.dist.broadcast(payload, src=0, group=self.group))
        return value if self.is_main else decode(payload.numpy().tobytes())

    def _all_gather_bytes(self, data: bytes, what: str) -> list[bytes]:
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        self._run(what, lambda: self.dist.all_gather(sizes, size, group=self.group))
        longest = max(int(s[0]) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._run(what, lambda: self.dist.all_gather(every, mine, group=self.group))
        return [t[:int(s[0])].numpy().tobytes() for t, s in zip(every, sizes)]

    def gather_objects(self, value: Any, what: str = "a gather to rank 0") -> list[Any] | None:
        """Every rank's ``value`` in rank order on rank 0; None on the others."""
        every = self._all_gather_bytes(encode(value), what)
        return [decode(data) for data in every] if self.is_main else None

    def check_same(self, values: dict[str, Any], what: str) -> None:
        """DistributedError on every rank unless every rank passes equal ``values`` (JSON-able):
        ranks that disagree would run different collectives and wait on each other forever."""
        every = [decode(data) for data in self._all_gather_bytes(encode(values), f"comparing {what}")]
        differ = {key: [v[key] for v in every] for key in values if any(v.get(key) != values[key] for v in every)}
        if differ:
            listed = "; ".join(f"{key}: " + ", ".join(f"rank {r} {v!r}" for r, v in enumerate(seen))
                               for key, seen in differ.items())
            raise DistributedError(f"the processes were given different {what} ({listed}); every process of a "
                                   "data-parallel run needs the same ones")

    def on_rank0(self, fn: Callable[[], T], what: str = "waiting for rank 0") -> T:
        """``fn()`` run on rank 0 alone, its result (or its exception, raised again with the same
        type and message) handed to every rank: rank 0's file work, with the others waiting at
        this barrier until it is done."""
        outcome: tuple
        if self.is_main:
            try:
                outcome = ("ok", fn())
            except Exception as err:  # every rank must hear of it, or they would wait forever
                self.broadcast_object(("error", _type_name(type(err)), str(err)), what)
                raise
        else:
            outcome = None  # type: ignore[assignment]
        outcome = self.broadcast_object(outcome, what)
        if outcome[0] == "ok":
            return outcome[1]
        _, name, message = outcome
        kind = _loaded_exception(name)
        try:
            error = kind(message) if kind is not None else None
        except Exception:  # an exception type that takes other arguments
            error = None
        raise error if error is not None else RuntimeError(f"rank 0 stopped: {name}: {message}")

    # -- keeping the ranks identical -----------------------------------------------------------

    @staticmethod
    def checksum(tensors: Iterable[torch.Tensor]) -> int:
        """CRC-32 of the tensors' bytes, in order."""
        crc = 0
        for t in tensors:
            crc = zlib.crc32(np.ascontiguousarray(t.detach().cpu().numpy()), crc)
        return crc

    def check_in_sync(self, tensors: Iterable[torch.Tensor], step: int) -> None:
        """All-gather a checksum of ``tensors`` (the adapters); RanksDiverged, on every rank, when a
        rank's differs from rank 0's, naming the ranks."""
        mine = torch.tensor([self.checksum(tensors)], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        self._run(f"the adapter check after step {step}", lambda: self.dist.all_gather(every, mine, group=self.group))
        sums = [int(t.item()) for t in every]
        differ = [r for r, s in enumerate(sums) if s != sums[0]]
        if differ:
            ranks = ", ".join(map(str, differ))
            listed = ", ".join(f"rank {r}: {s:08x}" for r, s in enumerate(sums))
            raise RanksDiverged(f"after step {step} the adapters of rank{'s' if len(differ) > 1 else ''} {ranks} differ "
                                f"from rank 0's (CRC-32 of the adapter values: {listed}). Every rank should apply the "
                                "same update to the same all-reduced gradients; something changed the adapters on "
                                "some ranks only (a callback, another program), or the ranks' GPUs round the update "
                                "differently. Resume from the last checkpoint")


# -- plain data between ranks, without pickle ---------------------------------------------------

def encode(value: Any) -> bytes:
    """``value`` as bytes another rank turns back with ``decode``: None, bools, numbers, strings,
    paths, tensors, and lists, tuples and dicts of them (optimizer and scheduler state dicts,
    random states, settings). A safetensors blob whose metadata holds the structure as JSON, so
    the receiving rank parses data and never unpickles (which could run code)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}

    def tree(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, torch.Tensor):
            key = str(len(tensors))
            tensors[key] = v.detach().cpu().contiguous()
            return {"t": key}
        if isinstance(v, os.PathLike):
            return {"p": os.fspath(v)}
        if isinstance(v, tuple):
            return {"l": [tree(x) for x in v]}
        if isinstance(v, list):
            return [tree(x) for x in v]
        if isinstance(v, dict):
            return {"d": [[tree(k), tree(x)] for k, x in v.items()]}
        raise TypeError(f"cannot send a {type(v).__name__} between ranks (plain data, paths and tensors only)")

    structure = json.dumps(tree(value))
    return save(tensors, metadata={"tree": structure})


def decode(data: bytes) -> Any:
    """The value ``encode`` made ``data`` of."""
    from safetensors.torch import load

    header_size = struct.unpack("<Q", data[:8])[0]
    structure = json.loads(json.loads(data[8:8 + header_size])["__metadata__"]["tree"])
    tensors = load(data)

    def value(v: Any) -> Any:
        if isinstance(v, list):
            return [value(x) for x in v]
        if not isinstance(v, dict):
            return v
        (tag, inner), = v.items()
        if tag == "t":
            return tensors[inner]
        if tag == "p":
            return Path(inner)
        if tag == "l":
            return tuple(value(x) for x in inner)
        return {value(k): value(x) for k, x in inner}

    return value(structure)


def _type_name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _loaded_exception(name: str) -> type | None:
    """The exception class of that name among those already defined in this process (none is
    imported: the ranks run the same code, so rank 0's error types exist here too)."""
    pending = [BaseException]
    while pending:
        kind = pending.pop()
        if _type_name(kind) == name:
            return kind
        pending.extend(kind.__subclasses__())
    return None

