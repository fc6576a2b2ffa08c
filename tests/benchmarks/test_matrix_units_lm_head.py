"""benchmarks/matrix_units.py's lm_head section: every variant and tile of the LM head's forward
timed, each one's outputs on the checked rows within a float32 GEMM's error bound against float64
(``matmul.float32_gemm_bound``), so that its timings compare kernels that compute the same thing.
Marked ``matrix_units`` (f16 subgroup matrices: a GPU through Dawn, or Mesa 26's lavapipe,
``scripts/matrix-units-lavapipe.sh``)."""

from __future__ import annotations

import pytest

from torch_wgpu_lora.benchmarks import matrix_units
from torch_wgpu_lora.benchmarks.matrix_units import HEAD_TILES, lm_head

pytestmark = pytest.mark.matrix_units


def test_the_lm_head_section_times_every_variant_and_tile_within_a_float32_gemms_bound(monkeypatch):
    # A head of 700 rows × 320 (rows no multiple of a tile's columns): decoding's 16 rows (the general
    # cores, the GEMV, every decoding tile) and a training step's 70 (no multiple of a tile's rows)
    monkeypatch.setattr(matrix_units, "VOCAB", 700)
    monkeypatch.setattr(matrix_units, "HIDDEN", 320)
    monkeypatch.setattr(matrix_units, "HEAD_CHECKED", 300)
    lines, rows, saves = [], [], []
    lm_head([16, 70], {}, lines.append, rows, lambda: saves.append(len(rows)))
    assert len(saves) == 2
    for tokens, tiles in ((16, HEAD_TILES["decode"]), (70, HEAD_TILES["training"])):
        mine = [r for r in rows if r["tokens"] == tokens]
        variants = [r["variant"] for r in mine]
        assert variants.count("general") == 1 and variants.count("gemv") == (tokens <= 64)
        assert variants.count("matrix_units") == len(tiles), [line for line in lines if line.startswith("  ")]
    assert all(r["within_bound"] and r["seconds"] > 0 for r in rows), [(r["variant"], r["tile"], r["error"]) for r in rows]
