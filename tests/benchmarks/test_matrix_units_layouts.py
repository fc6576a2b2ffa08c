"""benchmarks/matrix_units.py's layouts section: each layout of the int8 GEMM's operands
(``wgsl/int8_gemm_layouts.wgsl``) gives the exact integer product, against int64 torch, so that its
timings compare kernels that compute the same thing. Marked ``matrix_units`` (int8 subgroup
matrices: a GPU through Dawn, or Mesa 26's lavapipe, ``scripts/matrix-units-lavapipe.sh``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_wgpu_lora.benchmarks import matrix_units
from torch_wgpu_lora.benchmarks.matrix_units import LAYOUT_KSTEPS, LAYOUTS, layout_launch, layouts
from torch_wgpu_lora.runtime import Buffer, get_device, upload
from torch_wgpu_lora.runtime.kernels import subgroup_matrix_config

from ..engine.helpers import run

pytestmark = pytest.mark.matrix_units


@pytest.mark.parametrize("kstep", LAYOUT_KSTEPS)
@pytest.mark.parametrize("tile", [(1, 2, 2, 1), (2, 2, 2, 2), (2, 1, 4, 4)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_gives_the_exact_integer_product(layout, tile, kstep):
    device = get_device()
    config = subgroup_matrix_config(device, "i8", "i32")
    tokens, n, k = 2 * tile[0] * tile[2] * config["m"], 3 * tile[1] * tile[3] * config["n"], 2 * max(LAYOUT_KSTEPS)
    g = np.random.default_rng(sum(tile) + kstep)
    a8 = g.integers(-127, 128, (tokens, k), dtype=np.int8)
    w8 = g.integers(-127, 128, (n, k), dtype=np.int8)  # any int8, not only ternary: every byte lane checked
    c = Buffer((tokens, n), "i32")
    try:
        launch = layout_launch(device, layout, tile, kstep, upload(a8.view(np.uint32)), upload(w8.view(np.uint32)),
                               c, tokens, n, k)
    except ValueError as e:  # only a tile the device's limits refuse, said as such
        assert "vec4 loads a thread" in str(e) or "stages" in str(e)
        return
    (got,) = run([launch], c)
    assert torch.equal(got.long(), torch.from_numpy(a8).long() @ torch.from_numpy(w8).long().T)


def test_a_shape_that_is_not_a_multiple_of_the_tile_is_refused():
    device = get_device()
    a = Buffer((8, 64), "u32")
    with pytest.raises(ValueError, match="not a multiple of the tile"):
        layout_launch(device, "both from storage", (1, 1, 1, 1), 64, a, a, Buffer((8, 8), "i32"), 8, 8, 100)


def test_the_section_times_every_layout_beside_the_engines_kernel(monkeypatch):
    config = subgroup_matrix_config(get_device(), "i8", "i32")
    monkeypatch.setattr(matrix_units, "PROJECTIONS", {"small": (8 * config["n"], 256)})
    lines = []
    rows = layouts([("small", 8 * config["m"])], {}, lines.append)
    assert rows and all(row["exact"] for row in rows), [r["variant"] for r in rows if not r["exact"]]
    assert sum(row["variant"].startswith("engine's kernel") for row in rows) == 2
    assert {row["variant"].split(",")[0] for row in rows} >= {"both from storage", "A staged", "A and W staged"}
