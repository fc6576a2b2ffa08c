"""The engine's optimizer step: every micro-batch's forward, loss and backward, the global-norm
clip and AdamW over every adapter at once, in one command buffer (two submits with a gradient
exchange between processes).

The step keeps what it needs of its own on the GPU: the flat AdamW moments (laid out like the
adapters' ``params``; the optimizer adopts per-Parameter views of them, ``WgpuAdamW.adopt_moments``,
so its ``state_dict`` keeps working), the clip's stats and partial sums, and the AdamW values it
writes before each submit. While the GPU runs a step, the host encodes the next one's command
buffer (same plan, micro-batch count and ``max_grad_norm``; none of a step's values are in it), so
a run of steps hides the encoding behind the GPU.

>>> # stats = OptimizerStep(adapters, workspace).run(plan, micro_batches, optimizer, max_grad_norm)
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np
import torch

from ..ops.optimizer import CLIP_PARTIALS, adamw_launch, adamw_uniform, clip_launches
from ..optim import WgpuAdamW
from ..runtime import Buffer, Recorder, Recording, write
from .adapters import EngineAdapters
from .train_plan import TrainPlan
from .workspace import Workspace


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
            all_reduce: Callable[[torch.Tensor], Any] | None = None) -> dict[str, Any]:
        """One step over the ``slots`` micro-batches whose inputs ``plan`` holds (``labelled``: the
        step's labelled tokens, the loss's divisor, over every process when ``all_reduce`` is given).
        Returns {"loss", "tokens", "grad_norm", "skipped"}; a non-finite loss or norm leaves the
        adapters and moments untouched (``skipped``). ``optimizer`` passed ``check_optimizer``."""
        plan.set_scale(1.0 / labelled)
        self._adopted(optimizer)
        self._adamw.write((self.adapters.size, *optimizer.step_scalars()))
        if all_reduce is not None:
            self.discard_ahead()
            # submit 1: the gradients go round the processes
            self._all_reduce_grads(self._record_passes(plan, slots), plan, all_reduce)
            recording, stats = self._record_update(Recorder(self.device), plan, max_grad_norm)
            recording.submit_async().wait()
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
        """A recorder holding every micro-batch's forward, loss and backward of a step."""
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

    def _all_reduce_grads(self, rec: Recorder, plan: TrainPlan, all_reduce: Callable[[torch.Tensor], Any]) -> None:
        """Submit ``rec`` (the step's forward and backward), read the gradients and the loss sum
        back, sum them over the processes with ``all_reduce``, and write the sums back: the
        gradient buffer takes the summed gradients, the losses buffer the summed loss in its
        first row and zeros elsewhere (the clip kernel's loss sum and non-finite check then see
        the global loss, identically on every process)."""
        flat = np.empty(self.adapters.size + 1, np.float32)
        losses = np.empty(plan.losses.numel, np.float32)
        rec.read(plan.grads, flat[:-1])
        rec.read(plan.losses, losses)
        rec.submit()
        flat[-1] = losses.astype(np.float64).sum()  # rows between slots hold zeros
        all_reduce(torch.from_numpy(flat))
        write(plan.grads, flat[:-1])
        summed = np.zeros(plan.losses.numel, np.float32)
        summed[0] = flat[-1]
        write(plan.losses, summed)
