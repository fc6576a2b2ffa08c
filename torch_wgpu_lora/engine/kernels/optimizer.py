"""The engine's optimizer step on the GPU (``optimizer.wgsl``): the gradient's global norm, the
clip coefficient and a non-finite flag (with the step's loss sum) in a 4-float stats buffer,
then torch.optim.AdamW's update of every adapter at once, skipped when the flag is set.

>>> # launches = clip_launches(grads, losses, stats, n=size, rows=r, max_norm=1.0)
>>> # rec.launch(adamw_launch(params, grads, m, v, stats, step=3, lr=2e-4, ...))
"""

from __future__ import annotations

from ...ops.adamw import adamw_scalars
from ...runtime import Buffer, Device, Launch, get_device, kernel

_FILE = "optimizer.wgsl"
PARTIALS = 256


def _params(n: int, rows: int, max_norm: float, scalars: tuple = (1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0)) -> tuple:
    return (n, rows, float(max_norm), *scalars)


def clip_launches(grads: Buffer, losses: Buffer, stats: Buffer, partials: Buffer, *, n: int, rows: int,
                  max_norm: float, device: Device | None = None) -> list[Launch]:
    """stats ← [‖grads‖, clip coefficient, non-finite flag, Σ losses[:rows]]."""
    device = device or get_device()
    params = _params(n, rows, max_norm)
    return [Launch.build(kernel(_FILE, "sumsq", device, PARTIALS=PARTIALS), (PARTIALS, 1, 1), {1: grads, 2: partials},
                         params),
            Launch.build(kernel(_FILE, "stats", device, PARTIALS=PARTIALS), (1, 1, 1),
                         {3: partials, 4: losses, 5: stats}, params)]


def adamw_launch(params: Buffer, grads: Buffer, exp_avg: Buffer, exp_avg_sq: Buffer, stats: Buffer, *, n: int,
                 step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 device: Device | None = None) -> Launch:
    """AdamW on ``params`` from ``stats[1]`` · ``grads`` (skipped when ``stats[2]`` flags a
    non-finite norm or loss); ``step`` counts from 1."""
    device = device or get_device()
    groups = -(-n // 256)
    grid_x = min(groups, device.max_workgroups)
    return Launch.build(kernel(_FILE, "adamw", device), (grid_x, -(-groups // grid_x), 1),
                        {1: grads, 6: params, 7: exp_avg, 8: exp_avg_sq, 9: stats},
                        _params(n, 0, 0.0, adamw_scalars(step, lr, betas, eps, weight_decay)))
