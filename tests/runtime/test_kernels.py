"""runtime/kernels.py: WGSL files to pipelines (every entry point of wgsl/ compiles on the device's
WebGPU implementation, from the same source but for its enable lines), Params layouts, override
constants, shader checks, and what a kernel may ask of the device."""

from __future__ import annotations

import re

import numpy as np
import pytest

from torch_wgpu_lora.runtime import Buffer, Kernel, Recorder, get_device, kernel, upload
from torch_wgpu_lora.runtime.backends import EXTENSION_FEATURES, Dawn, WgpuNative, wgsl_extensions
from torch_wgpu_lora.runtime.kernels import WGSL_DIRS, compiled_source, params_layout, wgsl_source

from .helpers import read_back, reduce_kernel

SOURCES = WGSL_DIRS[1]  # the checkout's wgsl/
FAMILIES = sorted(p.name for p in SOURCES.glob("*.wgsl") if not p.name.startswith("_"))
ENTRY = re.compile(r"@compute\s+@workgroup_size\([^)]*\)\s*fn\s+(\w+)")
# Override constants that differ from a file's defaults here: the attention tiles' defaults are sized
# for GPUs with 48 KiB of workgroup memory (the H200's); these fit WebGPU's 16 KiB default limit.
SMALL_TILES = {"attention.wgsl": {"RG": 2, "BK": 16}, "attention_backward.wgsl": {"BQ": 4, "BK": 4, "NT": 16}}


def test_every_family_has_entry_points_the_compile_test_finds():
    assert FAMILIES and all(ENTRY.search(wgsl_source(f)) for f in FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_entry_point_compiles_here_from_its_source_and_generated_enable_lines(family):
    """Each entry point of ``family`` becomes a pipeline on this device's WebGPU implementation (naga
    for wgpu-native, Tint for Dawn), with the barrier-only parts and, where the adapter has subgroups,
    the subgroup parts. What the compiler is given is the file's text with its parts included and
    nothing added but ``enable`` lines."""
    device = get_device()
    variants = (False, True) if device.has_subgroups else (False,)
    for subgroups in variants:
        source = wgsl_source(family, subgroups)
        lacking = sorted(e for e in wgsl_extensions(source) if not device.has(EXTENSION_FEATURES[e]))
        if lacking:  # a kernel for what this device has not (the matrix units): refused by name, not miscompiled
            with pytest.raises(ValueError, match=rf"{re.escape(family)} uses {re.escape(', '.join(lacking))}"):
                compiled_source(device, family, subgroups)
            continue
        given = compiled_source(device, family, subgroups)
        enables = [line for line in given.splitlines() if re.fullmatch(r"enable \w+;", line)]
        sizes = [line for line in given.splitlines() if re.fullmatch(r"const SM_\w+: u32 = \d+u;", line)]
        assert [line for line in given.splitlines() if line not in enables + sizes] == source.splitlines()
        assert bool(sizes) == ("// @subgroup-matrix" in source)  # the configuration's sizes, for those kernels alone
        assert enables == device.backend.enable_lines(wgsl_extensions(source)).splitlines()
        for entry in ENTRY.findall(source):
            Kernel(device, family, entry, SMALL_TILES.get(family, {}), device.settings.shader_checks, subgroups)


def test_enable_lines_are_what_each_compiler_needs():
    # Tint needs `enable subgroups;` for subgroup operations; naga refuses it and needs none
    assert WgpuNative.enable_lines({"f16", "subgroups"}) == "enable f16;\n"
    assert Dawn.enable_lines({"f16", "subgroups"}) == "enable f16;\nenable subgroups;\n"
    assert Dawn.enable_lines({"subgroup-matrix", "subgroups"}) == ("enable chromium_experimental_subgroup_matrix;\n"
                                                                  "enable subgroups;\n")
    assert WgpuNative.enable_lines(set()) == Dawn.enable_lines(set()) == ""


def test_the_extensions_a_source_uses_are_found_in_its_code_not_its_comments():
    assert wgsl_extensions("fn f() { let x = 1.0; }  // subgroupAdd, f16") == set()
    assert wgsl_extensions("var<private> h: f16;") == {"f16"}
    assert wgsl_extensions("let v = vec4h(1.5h);") == {"f16"}
    assert wgsl_extensions("fn m(@builtin(subgroup_invocation_id) lane: u32) {}") == {"subgroups"}
    assert wgsl_extensions("let s = subgroupAdd(x);") == {"subgroups"}
    assert wgsl_extensions("struct S { subgroup: u32 }") == set()  # a name, not a builtin
    assert wgsl_extensions("alias L = subgroup_matrix_left<f16, 8, 8>;\nlet a = subgroupMatrixLoad<L>(&A, 0u, false, 8u);") \
        == {"subgroup-matrix", "f16"}
    assert wgsl_extensions(wgsl_source("norm.wgsl", subgroups=True)) == {"subgroups"}
    assert wgsl_extensions(wgsl_source("norm.wgsl", subgroups=False)) == set()


MATRIX_KERNEL = """
alias L = subgroup_matrix_left<f32, 8, 8>;
@group(0) @binding(1) var<storage, read_write> A: array<f32>;
@compute @workgroup_size(32)
fn main() {
  let a = subgroupMatrixLoad<L>(&A, 0u, false, 8u);
  subgroupMatrixStore(&A, 0u, a, false, 8u);
}
"""


def test_a_kernel_asking_for_subgroup_matrices_gets_them_only_where_the_device_has_them(tmp_path, monkeypatch):
    """A kernel asks for what it uses by using it: subgroup matrices compile with Dawn's enable line on a
    device that offers them (configurations in ``Device.subgroup_matrix_configs``), and are refused,
    naming the file and what is missing, elsewhere (wgpu-native, lavapipe)."""
    from torch_wgpu_lora.runtime import kernels

    (tmp_path / "matrices.wgsl").write_text(MATRIX_KERNEL)
    monkeypatch.setattr(kernels, "WGSL_DIRS", (tmp_path,))
    device = get_device()
    if device.has("subgroup-matrix"):
        assert device.subgroup_matrix_configs and all({"m", "n", "k", "component_type"} <= set(c)
                                                      for c in device.subgroup_matrix_configs)
        assert compiled_source(device, "matrices.wgsl", False).startswith(
            "enable chromium_experimental_subgroup_matrix;\n")
    else:
        assert device.subgroup_matrix_configs == []
        with pytest.raises(ValueError, match=r"matrices.wgsl uses subgroup-matrix, which this device lacks "
                                             rf"\({device.backend.name} on "):
            kernel("matrices.wgsl", "main")


def test_a_kernel_generic_over_the_matrix_shape_gets_the_configuration_it_names(tmp_path, monkeypatch):
    """``// @subgroup-matrix i8 i32``: the runtime writes that configuration's sizes before the source
    (the largest of one subgroup size: ``subgroup_matrix_config``); a file naming two is refused."""
    from types import SimpleNamespace

    from torch_wgpu_lora.runtime import kernels

    generic = "// @subgroup-matrix i8 i32\n" + MATRIX_KERNEL.replace("f32, 8, 8", "i8, SM_K, SM_M").replace(
        "array<f32>", "array<i32>")
    (tmp_path / "generic.wgsl").write_text(generic)
    (tmp_path / "two.wgsl").write_text("// @subgroup-matrix f16 f32\n" + generic)
    monkeypatch.setattr(kernels, "WGSL_DIRS", (tmp_path,))
    config = dict(component_type="i8", result_component_type="i32", m=16, n=8, k=32, min_subgroup_size=32,
                  max_subgroup_size=32)
    device = SimpleNamespace(has=lambda feature: True, subgroup_matrix_configs=[config, {**config, "n": 16}],
                             limits={"max-compute-workgroup-storage-size": 49152}, name="test",
                             backend=Dawn)
    given = compiled_source(device, "generic.wgsl", False)
    assert given.split("// @subgroup-matrix")[0].endswith(
        "const SM_M: u32 = 16u;\nconst SM_N: u32 = 16u;\nconst SM_K: u32 = 32u;\nconst SM_SUBGROUP: u32 = 32u;\n"
        "const SM_STORAGE: u32 = 49152u;\n")
    with pytest.raises(ValueError, match="two.wgsl names 2 subgroup-matrix configurations"):
        compiled_source(device, "two.wgsl", False)
    device.subgroup_matrix_configs = [{**config, "component_type": "u8", "result_component_type": "u32"}]
    with pytest.raises(ValueError, match="generic.wgsl multiplies i8 subgroup matrices into i32, which this device"):
        compiled_source(device, "generic.wgsl", False)


# -- Params and override constants -----------------------------------------------------------------

def test_params_layout_is_read_from_the_wgsl_struct():
    src = "struct Params {\n  rows: u32,  // a comment: u32\n  shift: i32,\n  scale: f32,\n}\n"
    assert params_layout(src) == (("rows", "shift", "scale"), "<Iif")
    assert params_layout("fn main() {}") == ((), "<")
    with pytest.raises(TypeError, match="only u32, i32 and f32"):
        params_layout("struct Params { v: vec4<f32> }")


def test_params_by_position_or_name_and_bad_ones_named():
    k = reduce_kernel()
    assert k.params == ("len4", "stride4", "splits", "accumulate", "scale")
    by_name = k.pack({"len4": 1, "stride4": 2, "splits": 3, "accumulate": 0, "scale": 0.5})
    assert by_name == k.pack((1, 2, 3, 0, 0.5)) and len(by_name) % 16 == 0
    with pytest.raises(ValueError, match=r"params \['bogus'\] unknown, \['scale'\] missing"):
        k.pack({"len4": 1, "stride4": 2, "splits": 3, "accumulate": 0, "bogus": 1})
    with pytest.raises(ValueError, match="2 params given"):
        k.pack((1, 2))


def test_override_constants_change_the_pipeline():
    # WG=64 and WG=256 are two pipelines of the same source; both compute the same sums.
    x = upload(np.arange(1024, dtype=np.float32))
    for wg in (64, 256):
        k = kernel("reduce.wgsl", "reduce_partials", WG=wg)
        assert k.constants == {"WG": wg}
        acc = Buffer((256,))
        rec = Recorder()
        rec.dispatch(k, (-(-64 // wg), 1, 1), (x, acc), (64, 64, 4, 0, 1.0))
        rec.submit()
        expect = np.arange(1024, dtype=np.float32).reshape(4, 256).sum(0)
        np.testing.assert_array_equal(read_back(acc), expect)
    assert kernel("reduce.wgsl", "reduce_partials", WG=64) is kernel("reduce.wgsl", "reduce_partials", WG=64)


def test_kernel_cache_is_keyed_on_the_settings_and_every_mode_computes():
    device = get_device()
    assert device.settings.shader_checks == "bounds"  # the default: bounds checks, no loop counters
    default = kernel("reduce.wgsl", "reduce_partials", WG=128)
    x = upload(np.arange(1024, dtype=np.float32))
    expect = np.arange(1024, dtype=np.float32).reshape(4, 256).sum(0)
    modes = ("full", "bounds", "none") if device.backend.CHECKS_PER_MODULE else ("full", "bounds")
    before = device.settings
    try:
        for mode in modes:
            device.configure(shader_checks=mode)
            k = kernel("reduce.wgsl", "reduce_partials", WG=128)
            assert (k is default) == (mode == "bounds")
            acc = Buffer((256,))
            rec = Recorder()
            rec.dispatch(k, (1, 1, 1), (x, acc), (64, 64, 4, 0, 1.0))
            rec.submit()
            np.testing.assert_array_equal(read_back(acc), expect)
        device.configure(before, subgroups=False)
        assert kernel("reduce.wgsl", "reduce_partials", WG=128) is not default or not device.has_subgroups
    finally:
        device.configure(before)
    assert kernel("reduce.wgsl", "reduce_partials", WG=128) is default


def test_shader_compile_errors_name_the_kernel(tmp_path, monkeypatch):
    from torch_wgpu_lora.runtime import kernels

    (tmp_path / "broken.wgsl").write_text("override WG: u32 = 1u;\n@compute @workgroup_size(WG) "
                                          "fn main() { let x: u32 = 1.5; }\n")
    monkeypatch.setattr(kernels, "WGSL_DIRS", (tmp_path,))
    with pytest.raises(RuntimeError, match=r"compiling broken.wgsl:main with \{'WG': 2\} failed"):
        kernel("broken.wgsl", "main", WG=2)
