"""runtime/tensors.py: torch tensors to and from the GPU in each layout, resident weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_wgpu_lora.runtime import Recorder, write
from torch_wgpu_lora.runtime.tensors import into, refresh, resident, to_gpu


@pytest.mark.parametrize("layout", ["rows4", "cols4", "flat"])
def test_tensor_layouts_round_trip(layout):
    t = torch.randn(5, 7)
    buf = to_gpu(t, layout)
    assert buf.shape == {"rows4": (5, 8), "cols4": (7, 8), "flat": (35,)}[layout]
    back = torch.empty(5, 7)
    rec = Recorder()
    rec.read(buf, into(back, layout))
    rec.submit()
    assert torch.equal(back, t)


def test_resident_weights_upload_again_only_when_values_change():
    A = torch.randn(4, 8)
    first = resident(A)
    assert resident(A) is first
    A.data[0, 0] += 1  # through .data: no version bump, still seen
    second = resident(A)
    assert second is not first
    A.add_(1)
    assert resident(A) is not second


def test_refresh_marks_an_in_place_gpu_update_as_current():
    p = torch.zeros(2, 4)
    buf = resident(p)
    p.fill_(3.0)
    write(buf, np.full((2, 4), 3.0, np.float32))  # what an optimizer step does on the GPU
    refresh(p, "rows4")
    assert resident(p) is buf
