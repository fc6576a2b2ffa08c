"""The first half of the engine's optimizer step on the GPU (``optimizer.wgsl``): the gradient's
global norm, the clip coefficient and a non-finite flag (with the step's loss sum) in a 4-float
stats buffer, which ``ops.adamw.adamw_launch`` then reads to update every adapter at once
(skipped when the flag is set).

>>> # launches = clip_launches(grads, losses, stats, partials, n=size, rows=r, max_norm=1.0)
>>> # rec.launch(adamw_launch(params, grads, m, v, stats=stats, n=size, step=3, lr=2e-4, ...))
"""

from __future__ import annotations

from ...runtime import Buffer, Device, Launch, get_device, kernel

_FILE = "optimizer.wgsl"
PARTIALS = 256


def clip_launches(grads: Buffer, losses: Buffer, stats: Buffer, partials: Buffer, *, n: int, rows: int,
                  max_norm: float, device: Device | None = None) -> list[Launch]:
    """stats ← [‖grads‖, clip coefficient, non-finite flag, Σ losses[:rows]]."""
    device = device or get_device()
    params = (n, rows, float(max_norm))
    return [Launch.build(kernel(_FILE, "sumsq", device, PARTIALS=PARTIALS), (PARTIALS, 1, 1), {1: grads, 2: partials},
                         params),
            Launch.build(kernel(_FILE, "stats", device, PARTIALS=PARTIALS), (1, 1, 1),
                         {3: partials, 4: losses, 5: stats}, params)]
