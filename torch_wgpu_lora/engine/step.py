"""The engine's optimizer step: every micro-batch's forward, loss and backward, the global-norm
clip and AdamW over every adapter at once, in one command buffer; or, with a gradient exchange
between processes, the backward in parts whose gradients are summed while the next part runs.

The step keeps what it needs of its own on the GPU: the flat AdamW moments (laid out like the
adapters' ``params``; the optimizer adopts per-Parameter views of them, ``WgpuAdamW.adopt_moments``,
so its ``state_dict`` keeps working), the clip's stats and partial sums, and the AdamW values it
writes before each submit. While the GPU runs a step, the host encodes the next one's command
buffer (same plan, micro-batch count and ``max_grad_norm``; none of a step's values are in it), so
a run of steps hides the encoding behind the GPU.

The gradient exchange overlaps the backward, as DDP's bucketed hooks do. The flat gradients are
laid out like ``params``: layer by layer, each layer's adapters in one range (``gradient_buckets``
checks it). A bucket is the range of a run of layers, complete once the last micro-batch's
backward has passed them, so the last layers' bucket comes first. The step records every
micro-batch but the last whole, and the last one's program split where each bucket is complete
(``TrainPlan.backward_done``): one submit per bucket, each reading its bucket back. While the GPU
runs part k + 1, the host waits for part k and hands its bucket to a thread of its own that sums
it over the processes (``all_reduce``: one flat float32 CPU tensor per bucket, the step's loss
sum appended to the last). The clip and AdamW submit waits for the last bucket only; the summed
ranges are written back just before it.

>>> # stats = OptimizerStep(adapters, workspace).run(plan, micro_batches, optimizer, max_grad_norm)
"""

from __future__ import annotations

import queue
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..ops.optimizer import CLIP_PARTIALS, WgpuAdamW, adamw_launch, adamw_uniform, clip_launches
from ..runtime import Buffer, Pending, Recorder, Recording, write
from .adapters import EngineAdapters
from .config import pad
from .train_plan import TrainPlan
from .workspace import Workspace

# Bytes of gradients per bucket of the exchange. DDP's 25 MiB suits models of hundreds of MB of
# gradients; LoRA's are a few MB (BitNet-2B, r=8 on q/v: 8 MB over 30 layers), which would make
# one bucket and no overlap. 1 MiB makes about 8 there, each all-reduce starting a few layers'
# backward after the last, and leaves the optimizer waiting for the last eighth only.
DEFAULT_BUCKET_BYTES = 1 << 20


@dataclass(frozen=True)
class Bucket:
    """Decoder layers whose adapters' gradients travel together: ``layers``, whose gradients are
    floats ``start`` to ``stop`` of the flat buffer."""

    layers: range
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def check_bucket_bytes(value: Any) -> None:
    """ValueError unless ``value`` is a bucket size in bytes: an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"bucket_bytes must be a whole number of bytes >= 1, got {value!r}")


def gradient_buckets(adapters: EngineAdapters, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """The gradient exchange's buckets in the order the backward completes them, the last layers'
    first: runs of whole layers, each closed once it holds ``bucket_bytes`` or more (DDP's rule;
    a layer larger than that is a bucket of its own), the last one running down to layer 0.
    Together they cover the flat gradients (``adapters.size`` floats) once."""
    check_bucket_bytes(bucket_bytes)
    starts = [sites["attn"].a_offset for sites in adapters.sites] + [adapters.size]
    for layer, sites in enumerate(adapters.sites):  # the layout the buckets rely on
        begin, end = starts[layer], starts[layer + 1]
        ranges = [(s.a_offset, s.a_offset + s.rank * pad(s.k, 64)) for s in sites.values()]
        ranges += [(a.b_offset, a.b_offset + a.module.lora_B.numel()) for s in sites.values() for a in s.adapters]
        if not begin <= end or any(not begin <= lo <= hi <= end for lo, hi in ranges):
            raise RuntimeError(f"layer {layer}'s adapters do not lie in one range of the flat gradients "
                               f"[{begin}, {end}): the gradient buckets need them to")
    buckets, end = [], len(adapters.sites)
    for layer in reversed(range(end)):
        if layer == 0 or 4 * (starts[end] - starts[layer]) >= bucket_bytes:
            buckets.append(Bucket(range(layer, end), starts[layer], starts[end]))
            end = layer
    return buckets


def _reduce_buckets(ready: queue.SimpleQueue, count: int, all_reduce: Callable[[torch.Tensor], Any],
                    note: Callable[[str, int], None]) -> None:
    """The exchange thread: all-reduce ``count`` buckets as they arrive (None: the step stopped)."""
    for k in range(count):
        flat = ready.get()
        if flat is None:
            return
        note("reduce", k)
        all_reduce(torch.from_numpy(flat))
        note("reduced", k)


class OptimizerStep:
    """Runs optimizer steps of ``adapters`` with the plans it is given; its buffers live in ``workspace``."""

    def __init__(self, adapters: EngineAdapters, workspace: Workspace) -> None:
        self.adapters, self.device = adapters, workspace.device
        self.workspace = workspace
        self._moments: tuple[Buffer, Buffer] | None = None  # made at the first step
        self._views: dict | None = None  # each Parameter's views of them, which the optimizer adopts
        self._adopters: weakref.WeakSet = weakref.WeakSet()  # optimizers holding those views
        self._stats = workspace.alloc("optimizer", (4,))
        self._partials = workspace.alloc("optimizer", (CLIP_PARTIALS,))
        self._adamw = adamw_uniform(self.device)  # each step's AdamW values, written before its submit
        # (key, recording, its stats array): the next step's command buffer, encoded while the GPU ran
        # the last one; used when the next step has the same key, else discarded
        self._ahead: tuple[tuple, Recording, np.ndarray] | None = None
        self.encoded = 0  # command buffers of whole steps encoded so far
        self._exchanger: ThreadPoolExecutor | None = None  # the thread that all-reduces buckets (made when needed)
        # The last step with a gradient exchange, as (event, bucket, time.perf_counter()): "submitted"
        # and "read" (a part of the backward and its bucket's readback), "reduce" and "reduced" (the
        # bucket's all-reduce, on the exchange thread), "written" (the sums back on the GPU) and
        # "updated" (clip and AdamW done, bucket -1): how the exchange overlaps the backward.
        self.exchange_events: list[tuple[str, int, float]] = []

    def check_optimizer(self, optimizer: Any) -> None:
        """Raises unless ``optimizer`` is a ``WgpuAdamW`` with one group of exactly these adapters."""
        if not isinstance(optimizer, WgpuAdamW) or len(optimizer.param_groups) != 1:
            raise ValueError("BitNetEngine.train_step runs WgpuAdamW with one parameter group")
        ours = {id(p) for m in self.adapters.modules for p in (m.lora_A, m.lora_B)}
        theirs = {id(p) for p in optimizer.param_groups[0]["params"]}
        if ours != theirs:
            raise ValueError("the optimizer must hold exactly this model's adapter Parameters")

    def _adopted(self, optimizer: WgpuAdamW) -> tuple[Buffer, Buffer]:
        """The flat moments, which ``optimizer`` holds as per-Parameter views (values it had kept)."""
        if self._moments is None:
            self._moments = tuple(self.workspace.alloc("optimizer", (self.adapters.size,)) for _ in range(2))
            for buf in self._moments:  # the padding between the adapters' regions stays zero
                write(buf, np.zeros(buf.numel, np.float32))
            self._views = self.adapters.views(self._moments)
        optimizer.adopt_moments(self._views)
        self._adopters.add(optimizer)
        return self._moments

    def release_moments(self) -> None:
        """Give every optimizer that holds views of the flat moments buffers of its own, values
        kept (``WgpuAdamW.adopt_moments``), before this step and its buffers go: views do not keep
        the flat buffers alive, and the pool would hand them to the next owner."""
        if self._views is not None:
            for optimizer in list(self._adopters):
                optimizer.adopt_moments({p: (layout, *(Buffer(b.shape, device=self.device) for b in pair))
                                         for p, (layout, *pair) in self._views.items()})
        self._adopters.clear()

    def run(self, plan: TrainPlan, slots: int, labelled: int, optimizer: WgpuAdamW, max_grad_norm: float, *,
            all_reduce: Callable[[torch.Tensor], Any] | None = None,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, Any]:
        """One step over the ``slots`` micro-batches whose inputs ``plan`` holds (``labelled``: the
        step's labelled tokens, the loss's divisor, over every process when ``all_reduce`` is given:
        a function summing a flat float32 CPU tensor over the processes in place, which runs on
        the exchange thread once per bucket of ``gradient_buckets(adapters, bucket_bytes)``).
        Returns {"loss", "tokens", "grad_norm", "skipped"}; a non-finite loss or norm leaves the
        adapters and moments untouched (``skipped``). ``optimizer`` passed ``check_optimizer``."""
        plan.set_scale(1.0 / labelled)
        self._adopted(optimizer)
        self._adamw.write((self.adapters.size, *optimizer.step_scalars()))
        if all_reduce is not None:
            self.discard_ahead()
            stats = self._exchange(plan, slots, all_reduce, gradient_buckets(self.adapters, bucket_bytes),
                                   max_grad_norm)
        else:
            key = (plan, slots, float(max_grad_norm))
            ahead, self._ahead = self._ahead, None
            if ahead is not None and ahead[0] != key:
                ahead[1].discard()
                ahead = None
            recording, stats = ahead[1:] if ahead is not None else self._record_step(plan, slots, max_grad_norm)
            pending = recording.submit_async()
            try:  # the next step's command buffer, encoded while the GPU runs this one
                self._ahead = (key, *self._record_step(plan, slots, max_grad_norm))
            finally:
                pending.wait()
        norm, _, skipped, loss_sum = (float(v) for v in stats)
        if not skipped:
            optimizer.count_step()
            self.adapters.gpu_is_newer = True
        return {"loss": None if skipped else loss_sum / labelled, "tokens": labelled, "grad_norm": norm,
                "skipped": bool(skipped)}

    def _record_passes(self, plan: TrainPlan, slots: int) -> Recorder:
        """A recorder clearing the gradients, then holding the forward, loss and backward of the
        first ``slots`` micro-batches of a step."""
        rec = Recorder(self.device)
        rec.clear(plan.grads)
        for slot in range(slots):
            plan.record(rec, slot)
        return rec

    def _record_step(self, plan: TrainPlan, slots: int, max_grad_norm: float) -> tuple[Recording, np.ndarray]:
        """A whole step's command buffer and the array its stats readback fills. It depends on no
        value of the step: inputs, loss scale and AdamW's values are written before its submit."""
        self.encoded += 1
        return self._record_update(self._record_passes(plan, slots), plan, max_grad_norm)

    def _record_update(self, rec: Recorder, plan: TrainPlan, max_grad_norm: float) -> tuple[Recording, np.ndarray]:
        """Into ``rec``: the global-norm clip, AdamW and the stats readback; returns the finished
        recording and the stats' array."""
        exp_avg, exp_avg_sq = self._moments
        for launch in clip_launches(plan.grads, plan.losses, self._stats, self._partials, n=self.adapters.size,
                                    rows=plan.losses.numel, max_norm=max_grad_norm, device=self.device):
            rec.launch(launch)
        rec.launch(adamw_launch(self.adapters.params, plan.grads, exp_avg, exp_avg_sq, self._adamw, stats=self._stats,
                                n=self.adapters.size, device=self.device))
        stats = np.empty(4, np.float32)
        rec.read(self._stats, stats)
        return rec.finish(), stats

    def discard_ahead(self) -> None:
        """Drop the command buffer encoded ahead (a step of another shape comes next)."""
        if self._ahead is not None:
            self._ahead[1].discard()
            self._ahead = None

    def _exchange(self, plan: TrainPlan, slots: int, all_reduce: Callable[[torch.Tensor], Any],
                  buckets: list[Bucket], max_grad_norm: float) -> np.ndarray:
        """The step with its gradients exchanged bucket by bucket (the module's docstring); returns
        the stats array. The losses buffer takes the summed loss in its first row and zeros
        elsewhere, the gradient buffer the summed gradients: the clip kernel's loss sum and
        non-finite check then see the global loss, identically on every process."""
        events: list[tuple[str, int, float]] = []
        self.exchange_events = events

        def note(what: str, k: int) -> None:
            events.append((what, k, time.perf_counter()))

        last = len(buckets) - 1
        sums = [np.empty(b.size + (k == last), np.float32) for k, b in enumerate(buckets)]  # + the loss sum
        losses = np.empty(plan.losses.numel, np.float32)
        ready: queue.SimpleQueue = queue.SimpleQueue()
        if self._exchanger is None:
            self._exchanger = ThreadPoolExecutor(1, thread_name_prefix="torch-wgpu-lora-gradient-exchange")
        reducing = self._exchanger.submit(_reduce_buckets, ready, len(buckets), all_reduce, note)

        def collect(k: int, pending: Pending) -> None:
            pending.wait()
            note("read", k)
            if k == last:
                sums[k][-1] = losses.astype(np.float64).sum()  # rows between slots hold zeros
            ready.put(sums[k])

        try:
            in_flight: deque = deque()
            recorded = 0  # steps of the last slot's program recorded so far
            for k, bucket in enumerate(buckets):
                rec = self._record_passes(plan, slots - 1) if k == 0 else Recorder(self.device)
                stop = plan.backward_done(bucket.layers.start)
                plan.record(rec, slots - 1, start=recorded, stop=stop)
                recorded = stop
                if bucket.size:
                    rec.read(plan.grads.slice(bucket.start, (bucket.size,)), sums[k][:bucket.size])
                if k == last:
                    rec.read(plan.losses, losses)
                in_flight.append((k, rec.submit_async()))
                note("submitted", k)
                if len(in_flight) == 2:  # one part queued behind the one the GPU runs
                    collect(*in_flight.popleft())
            while in_flight:
                collect(*in_flight.popleft())
            # encoded while the exchange thread sums the last bucket
            update, stats = self._record_update(Recorder(self.device), plan, max_grad_norm)
        except BaseException:
            ready.put(None)  # the exchange thread stops waiting
            raise
        try:
            reducing.result()
        except BaseException:
            update.discard()
            raise
        for bucket, summed in zip(buckets, sums):
            write(plan.grads, summed[:bucket.size], offset=4 * bucket.start)
        total = np.zeros(plan.losses.numel, np.float32)
        total[0] = sums[last][-1]
        write(plan.losses, total)
        note("written", -1)
        update.submit_async().wait()
        note("updated", -1)
        return stats
