"""Where the engine's GPU memory goes: every buffer a plan or the engine allocates is asked of a
``Workspace`` under a role, so memory can be read as a table (``BitNetEngine.memory_report``),
as llm.c plans its activations.

Two kinds of allocation:

* ``alloc(role, shape)``: a buffer of its own (an activation, a saved tensor, a cache). Each is
  its own wgpu buffer: WebGPU checks a launch's usages per wgpu buffer, not per range, so two
  views of one buffer cannot be bound in a launch that writes either.
* ``scratch(role, shape)``: one buffer per (role, shape, dtype), handed to every launch that asks
  for it: the temporaries of launches that run one after another (split-K partial sums, the
  attention scores of a layer). A plan's workspace takes its scratch from the workspace it was
  given as ``shared`` (the engine's), so plans that never run at once share it.

Sizes are counted as the runtime allocates them (``Buffer.gpu.size``: pooled buffers are rounded
up to a size class), so a report's rows add up to what the device holds.

>>> # ws = Workspace(device, shared=engine.scratch)
>>> # x = ws.alloc("activations", (tokens, hidden)); part = ws.scratch("split-K partials", (n,))
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..runtime import Buffer, Device


class Workspace:
    """GPU buffers allocated under roles, and what each role holds."""

    def __init__(self, device: Device, shared: Workspace | None = None) -> None:
        self.device = device
        self.shared = shared
        self._bytes: defaultdict[str, int] = defaultdict(int)
        self._buffers: list[Buffer] = []  # keeps every allocation alive as long as the workspace
        self._scratch: dict[tuple, Buffer] = {}

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
