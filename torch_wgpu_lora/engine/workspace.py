"""Where the engine's GPU memory goes: every buffer a plan or the engine allocates is asked of a
``Workspace`` under a role, so memory can be read as a table (``BitNetEngine.memory_report``),
as llm.c plans its activations.

Three kinds of allocation:

* ``alloc(role, shape)``: a buffer of its own (an activation, a saved tensor, a cache). Each is
  its own wgpu buffer: WebGPU checks a launch's usages per wgpu buffer, not per range, so two
  views of one buffer cannot be bound in a launch that writes either.
* ``scratch(role, shape)``: one buffer per (role, shape, dtype), handed to every launch that asks
  for it: the temporaries of launches that run one after another (split-K partial sums, the
  attention scores of a layer). A plan's workspace takes its scratch from the workspace it was
  given as ``shared`` (the engine's), so plans that never run at once share it.
* ``derived(role, source, shape, dtype, fill)``: data computed once from a buffer that never
  changes (a frozen weight's transposed copy), made and filled on first use, then handed to every
  launch that asks for it, unchanged; in the ``shared`` workspace too.

Sizes are counted as the runtime allocates them (``Buffer.gpu.size``: pooled buffers are rounded
up to a size class), so a report's rows add up to what the device holds.

>>> # ws = Workspace(device, shared=engine.scratch)
>>> # x = ws.alloc("activations", (tokens, hidden)); part = ws.scratch("split-K partials", (n,))
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from ..runtime import Buffer, Device


class Workspace:
    """GPU buffers allocated under roles, and what each role holds."""

    def __init__(self, device: Device, shared: Workspace | None = None) -> None:
        self.device = device
        self.shared = shared
        self._bytes: defaultdict[str, int] = defaultdict(int)
        self._buffers: list[Buffer] = []  # keeps every allocation alive as long as the workspace
        self._scratch: dict[tuple, Buffer] = {}
        self._derived: dict[tuple, tuple[Buffer, Buffer]] = {}  # (role, id(source)) → (source, derived)

    def alloc(self, role: str, shape: tuple[int, ...], dtype: str = "f32") -> Buffer:
        """A new buffer of ``shape`` counted under ``role``."""
        buf = Buffer(shape, dtype, self.device)
        self._bytes[role] += buf.gpu.size
        self._buffers.append(buf)
        return buf

    def scratch(self, role: str, shape: tuple[int, ...], dtype: str = "f32") -> Buffer:
        """The buffer of ``shape`` kept for ``role`` (made on first use; in the ``shared`` workspace
        when there is one): what it holds is overwritten by the next launch that asks for it."""
        if self.shared is not None:
            return self.shared.scratch(role, shape, dtype)
        key = (role, tuple(int(s) for s in shape), dtype)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = self.alloc(role, shape, dtype)
        return buf

    def derived(self, role: str, source: Buffer, shape: tuple[int, ...], dtype: str,
                fill: Callable[[Buffer], None]) -> Buffer:
        """The buffer of ``shape`` kept for ``role`` of ``source`` (in the ``shared`` workspace when
        there is one): on first use allocated and handed to ``fill`` (which writes it from ``source``,
        a buffer nothing writes again), then the same buffer, as filled."""
        if self.shared is not None:
            return self.shared.derived(role, source, shape, dtype, fill)
        key = (role, id(source))
        if key not in self._derived:  # the entry holds the source too, so its id is not reused
            buf = self.alloc(role, shape, dtype)
            fill(buf)
            self._derived[key] = (source, buf)
        kept = self._derived[key][1]
        if kept.shape != tuple(shape) or kept.dtype != dtype:
            raise ValueError(f"{role}: asked for {dtype} {tuple(shape)}, and the buffer derived from this source "
                             f"is {kept.dtype} {kept.shape}")
        return kept

    def roles(self) -> dict[str, int]:
        """Bytes held under each role (this workspace's own, not the shared one's)."""
        return dict(self._bytes)

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())


@dataclass(frozen=True)
class MemoryRow:
    """One row of a memory report: who holds the bytes (``owner``: "weights", "engine", a plan's
    name, "runtime") and for what (``role``)."""

    owner: str
    role: str
    nbytes: int


@dataclass(frozen=True)
class MemoryReport:
    """The engine's GPU memory by owner and role, beside what the runtime counts as allocated
    (``allocated``) and its peak since the device was made or its peak was last reset
    (``peak``). ``str(report)`` is the table."""

    rows: tuple[MemoryRow, ...]
    allocated: int
    peak: int

    @property
    def total(self) -> int:
        return sum(r.nbytes for r in self.rows)

    def __str__(self) -> str:
        width = max([len(r.owner) + len(r.role) + 3 for r in self.rows] + [24])
        lines = [f"{'owner / role':<{width}} {'MB':>10}"]
        for r in self.rows:
            lines.append(f"{r.owner + ' / ' + r.role:<{width}} {r.nbytes / 1e6:>10.2f}")
        lines.append(f"{'total of the rows':<{width}} {self.total / 1e6:>10.2f}")
        lines.append(f"{'allocated (runtime)':<{width}} {self.allocated / 1e6:>10.2f}")
        lines.append(f"{'peak (runtime)':<{width}} {self.peak / 1e6:>10.2f}")
        return "\n".join(lines)
