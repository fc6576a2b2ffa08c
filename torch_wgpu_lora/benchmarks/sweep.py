"""The op's GPU time under variants: launch shapes (``lora_gpu.Tuning``) and shader checks.

One knob at a time around the default; each variant is undone afterwards
(``set_tuning(None)`` goes back to the default launch shapes, ``Device.configure`` back to the
device's settings as they were). Launch plans and compiled kernels are keyed on both, so a
variant never reuses another's.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, Iterator

from ..ops import lora_gpu
from ..runtime import get_device
from .lora_op import Case, Inputs, record
from .timing import gpu_times

SWEEP_VARIANTS = {
    "down_workgroups": [256, 512, 1024],
    "outer_workgroups": [256, 512, 1024],
    "down_quads": [1, 2, 4],
    "outer_quads": [1, 2, 4],
    "outer_cols": [32, 64, 128],
    "shader_checks": ["full", "bounds", "none"],  # the device's setting (launch plans key on it)
}

# The key cases ``--sweep`` runs SWEEP_VARIANTS on.
SWEEP_CASES = (Case(2048, 2560, 2560, 16, True, "q_proj"), Case(2048, 2560, 2560, 16, False, "q_proj"),
               Case(1, 2560, 2560, 16, False, "q_proj"))


@contextmanager
def variant(knob: str, value: Any, base: lora_gpu.Tuning) -> Iterator[None]:
    """Run the body with one knob changed: ``shader_checks`` (the device's setting) or a field of
    ``lora_gpu.Tuning`` (the others as in ``base``)."""
    device = get_device()
    previous = device.configure(shader_checks=value) if knob == "shader_checks" else device.settings
    if knob != "shader_checks":
        lora_gpu.set_tuning(lora_gpu.Tuning(**{**asdict(base), knob: value}))
    try:
        yield
    finally:
        lora_gpu.set_tuning(None)
        device.configure(previous)


def sweep(case: Case, variants: dict[str, list[Any]], repeats: int = 20) -> list[dict[str, Any]]:
    """GPU time of ``case`` under launch-shape variants, one knob at a time around the default.

    The knob ``shader_checks`` switches the runtime checks of newly compiled kernels.
    """
    base = lora_gpu.tuning(get_device())
    rows = []
    inp = Inputs(case)
    for knob, values in variants.items():
        for value in values:
            with variant(knob, value, base):
                times = gpu_times(lambda rec: record(rec, inp, case, 2.0), repeats)
            rows.append({"case": case.name, "n": case.n, "rank": case.rank, "mode": case.mode, "knob": knob,
                         "value": value, "gpu_us": statistics.median(times) * 1e6 if times else None})
    return rows
