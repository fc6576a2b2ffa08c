"""GEMMs on the GPU's matrix units through WebGPU subgroup matrices (Dawn), swept over their
tiling, beside torch's own GEMMs of the same shapes: which kernel shape reaches what rate.

Runs on ``wgpudawn`` (the wgpu-py API on Dawn; ``pip install wgpudawn==0.32.0.4``) with Dawn's
toggles ``allow_unsafe_apis`` (experimental features) and ``vulkan_enable_f16_on_nvidia`` (f16 on
NVIDIA, which Dawn blocks by default, and with it every f16 subgroup-matrix configuration).

The kinds of GEMM the engine runs, C[M, N] = Σ_k A[m, k] · B[k, n]:

* ``i8``: the forward ternary projections: A int8 activation codes [M, K], B the 2-bit packed
  ternary weights [N rows, K] (16 a u32, the engine's layout), unpacked to int8 while staged in
  workgroup memory; i8 × i8 → i32, exact.
* ``f16nt``: the LM head's forward: A float32 [M, K] split into two f16 parts (hi + lo, each row
  scaled by its own power of two), B bf16 [N rows, K] converted to f16; f32 accumulation.
* ``f16nn``: the input gradient through ternary weights: A float32 dY [M, K] split as above, B the
  packed ternary weights read as [K rows, N] (the contraction runs over the weights' rows).

A workgroup of ``rows × cols`` subgroups (32 invocations each) owns a block of C; each subgroup
holds ``tm × tn`` 16 × 16 result matrices in named variables (an array indexed in a loop cost
earlier probes 1.6-1.9×). Each step of ``ks`` along K is staged in workgroup memory, rows padded
by ``pad`` bytes; with ``prefetch`` the next step's global loads are issued before this step's
multiplies. Each variant is checked against numpy on its first shape and timed with timestamp
queries over repeated launches.

    python -m benchmarks.subgroup_matrix --out OUT [--seconds S] [--budget S]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

F16_TOGGLES = ["allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"]
FEATURE = "chromium-experimental-subgroup-matrix"


@dataclass(frozen=True)
class Variant:
    kind: str  # i8, f16nt, f16nn
    rows: int  # subgroups along M
    cols: int  # subgroups along N
    tm: int  # 16-row result matrices a subgroup along M
    tn: int  # 16-column result matrices a subgroup along N
    ks: int  # K a staged step
    pad: int  # bytes of padding after each staged row
    prefetch: bool
    split: bool = True  # f16: hi + lo parts of A (two multiplies per pair); False: hi only

    @property
    def block_m(self) -> int:
        return 16 * self.tm * self.rows

    @property
    def block_n(self) -> int:
        return 16 * self.tn * self.cols

    @property
    def threads(self) -> int:
        return 32 * self.rows * self.cols


def _names(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


def i8_source(v: Variant, m: int, n: int, k: int) -> str:
    """C[M, N] i32 = A[M, K] i8 · W[N, K]ᵀ, W 2-bit packed (16 a u32, engine layout)."""
    t = v.threads
    stride = v.ks + v.pad  # bytes (= int8 elements) a staged row
    a_vec4 = v.block_m * v.ks // 16  # vec4<u32> of A a step (16 codes each)
    w_vec4 = v.block_n * v.ks // 64  # vec4<u32> of packed W a step (64 weights each)
    assert a_vec4 % t == 0, v
    a_per, w_per = a_vec4 // t, -(-w_vec4 // t)  # the last round of W guarded where it is partial
    results = [(i, j) for i in range(v.tm) for j in range(v.tn)]

    def guarded(q: int, text: str) -> str:
        return text if (q + 1) * t <= w_vec4 else f"if (t + {q * t}u < {w_vec4}u) {{ {text.strip()} }}"

    def loads(step: str) -> str:  # global loads of step `step` (a K offset) into registers
        out = []
        for q in range(a_per):
            out.append(f"    ga{q} = A[(wg.y * {v.block_m}u + (t + {q * t}u) / {v.ks // 16}u) * {k // 16}u"
                       f" + {step} / 16u + (t + {q * t}u) % {v.ks // 16}u];")
        for q in range(w_per):
            out.append("    " + guarded(q, f"gw{q} = W[(wg.x * {v.block_n}u + (t + {q * t}u) / {v.ks // 64}u) * {k // 64}u"
                                       f" + {step} / 64u + (t + {q * t}u) % {v.ks // 64}u];"))
        return "\n".join(out) + "\n"

    def stores() -> str:
        out = []
        for q in range(a_per):
            i = f"(t + {q * t}u)"
            base = f"({i} / {v.ks // 16}u) * {stride // 4}u + ({i} % {v.ks // 16}u) * 4u"
            out.append(f"    {{ let b = {base}; As[b] = ga{q}.x; As[b + 1u] = ga{q}.y; As[b + 2u] = ga{q}.z;"
                       f" As[b + 3u] = ga{q}.w; }}")
        for q in range(w_per):
            i = f"(t + {q * t}u)"
            base = f"({i} / {v.ks // 64}u) * {stride // 4}u + ({i} % {v.ks // 64}u) * 16u"
            words = []
            for c, comp in enumerate("xyzw"):
                for j in range(4):
                    words.append(f"Ws[b + {4 * c + j}u] = codes(gw{q}.{comp}, {2 * j}u);")
            out.append("    " + guarded(q, f"{{ let b = {base}; " + " ".join(words) + " }"))
        return "\n".join(out) + "\n"

    def multiply() -> str:
        out = []
        for kq in range(0, v.ks, 32):
            out.append("    {")
            out += [f"      let b{j} = subgroupMatrixLoad<R>(&Ws, (sc * {16 * v.tn}u + {16 * j}u) * {stride}u + {kq}u,"
                    f" true, {stride}u);" for j in range(v.tn)]
            out += [f"      let a{i} = subgroupMatrixLoad<L>(&As, (sr * {16 * v.tm}u + {16 * i}u) * {stride}u + {kq}u,"
                    f" false, {stride}u);" for i in range(v.tm)]
            out += [f"      c{i}_{j} = subgroupMatrixMultiplyAccumulate(a{i}, b{j}, c{i}_{j});" for i, j in results]
            out.append("    }")
        return "\n".join(out) + "\n"

    regs = "".join(f"  var ga{q}: vec4<i32>;\n" for q in range(a_per)) + \
        "".join(f"  var gw{q}: vec4<u32>;\n" for q in range(w_per))
    accs = "".join(f"  var c{i}_{j}: O;\n" for i, j in results)
    store = "".join(_tile_epilogue(f"c{i}_{j}", f"r0 + {16 * i}u", f"c0 + {16 * j}u", n,
                                   f"f32(Cs[sg * 256u + e]) * S[row] * S[{m}u + col]") for i, j in results)
    if v.prefetch:
        body = (loads("0u") + f"  for (var kk = 0u; kk < {k}u; kk += {v.ks}u) {{\n" + stores()
                + "    workgroupBarrier();\n"
                + f"    if (kk + {v.ks}u < {k}u) {{\n" + loads(f"(kk + {v.ks}u)").replace("\n    ", "\n      ")
                + "    }\n" + multiply() + "    workgroupBarrier();\n  }\n")
    else:
        body = (f"  for (var kk = 0u; kk < {k}u; kk += {v.ks}u) {{\n" + loads("kk") + stores()
                + "    workgroupBarrier();\n" + multiply() + "    workgroupBarrier();\n  }\n")
    return f"""enable chromium_experimental_subgroup_matrix;
enable subgroups;
diagnostic(off, subgroup_uniformity);
@group(0) @binding(0) var<storage, read> A: array<vec4<i32>>;
@group(0) @binding(1) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> C: array<f32>;
@group(0) @binding(3) var<storage, read> S: array<f32>;  // each row's scale (of A), each column's (of W)
alias L = subgroup_matrix_left<i8, 32, 16>;
alias R = subgroup_matrix_right<i8, 16, 32>;
alias O = subgroup_matrix_result<i32, 16, 16>;
var<workgroup> As: array<i32, {v.block_m * stride // 4}>;
var<workgroup> Ws: array<i32, {v.block_n * stride // 4}>;
var<workgroup> Cs: array<i32, {256 * v.rows * v.cols}>;

// four int8 weights t in {{-1, 0, 1}} from their codes t + 1 at bit pair j of each byte lane
fn codes(word: u32, shift: u32) -> i32 {{
  return bitcast<i32>(((((word >> shift) & 0x03030303u) | 0x80808080u) - 0x01010101u) ^ 0x80808080u);
}}

@compute @workgroup_size({t})
fn main(@builtin(workgroup_id) wg: vec3u, @builtin(local_invocation_index) t: u32,
        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {{
  let sr = sg / {v.cols}u;
  let sc = sg % {v.cols}u;
  let r0 = wg.y * {v.block_m}u + sr * {16 * v.tm}u;
  let c0 = wg.x * {v.block_n}u + sc * {16 * v.tn}u;
{regs}{accs}{body}{store}}}
"""


def _tile_epilogue(acc: str, row0: str, col0: str, n: int, value: str) -> str:
    """One 16 × 16 result matrix through the subgroup's slice of Cs: each of its 32 invocations
    writes 8 elements of C[row0.., col0..] = ``value`` (of ``row``, ``col`` and Cs[sg * 256 + e])."""
    return (f"  subgroupMatrixStore(&Cs, sg * 256u, {acc}, false, 16u);\n"
            "  workgroupBarrier();\n"
            "  for (var e = lane; e < 256u; e += 32u) {\n"
            f"    let row = {row0} + e / 16u; let col = {col0} + e % 16u;\n"
            f"    C[row * {n}u + col] = {value};\n"
            "  }\n"
            "  workgroupBarrier();\n")


def f16_source(v: Variant, m: int, n: int, k: int, nn: bool) -> str:
    """C[M, N] f32 = A[M, K] (f32 split into f16 hi + lo, rows scaled by 2^-e[m]) · B, with B bf16
    [N, K] (``nn`` False) or the packed ternary weights read as [K rows, N] (``nn`` True)."""
    t = v.threads
    stride = v.ks + v.pad // 2  # f16 elements a staged A row
    a_vec4 = v.block_m * v.ks // 4  # vec4<f32> of A a step
    assert a_vec4 % t == 0, v
    a_per = a_vec4 // t
    results = [(i, j) for i in range(v.tm) for j in range(v.tn)]
    parts = ("h", "l") if v.split else ("h",)
    if nn:  # B tile [ks rows of K, block_n columns of N] from packed rows (N along the row: 16 a u32)
        b_stride = v.block_n + v.pad // 2
        b_vec4 = v.ks * v.block_n // 64
        b_src = "W: array<vec4<u32>>"
    else:  # B tile [block_n rows of N, ks of K] from bf16 rows (2 a u32)
        b_stride = stride
        b_vec4 = v.block_n * v.ks // 8
        b_src = "W: array<vec4<u32>>"
    b_per = -(-b_vec4 // t)  # the last round guarded when b_vec4 is not a multiple of the threads

    def guarded(q: int, text: str) -> str:
        return text if (q + 1) * t <= b_vec4 else f"if (t + {q * t}u < {b_vec4}u) {{ {text.strip()} }}"

    def loads(step: str) -> str:
        out = []
        for q in range(a_per):
            out.append(f"    ga{q} = A[(wg.y * {v.block_m}u + (t + {q * t}u) / {v.ks // 4}u) * {k // 4}u"
                       f" + {step} / 4u + (t + {q * t}u) % {v.ks // 4}u];")
        for q in range(b_per):
            if nn:  # row (k index) r of the step, word group c along N
                per_row = v.block_n // 64
                out.append("    " + guarded(q, f"gb{q} = W[({step} + (t + {q * t}u) / {per_row}u) * {n // 64}u"
                                            f" + wg.x * {v.block_n // 64}u + (t + {q * t}u) % {per_row}u];"))
            else:
                per_row = v.ks // 8
                out.append("    " + guarded(q, f"gb{q} = W[(wg.x * {v.block_n}u + (t + {q * t}u) / {per_row}u) * {k // 8}u"
                                            f" + {step} / 8u + (t + {q * t}u) % {per_row}u];"))
        return "\n".join(out) + "\n"

    def stores() -> str:
        out = []
        for q in range(a_per):
            i = f"(t + {q * t}u)"
            row = f"({i} / {v.ks // 4}u)"
            col = f"({i} % {v.ks // 4}u) * 4u"
            out.append(f"    {{ let r = {row}; let b = r * {stride}u + {col}; let s = Es[r];")
            for c, comp in enumerate("xyzw"):
                # hi: x's top 11 significant bits, cut by a mask (f16(x) and back is folded away by the
                # driver, which then loses lo: run 2 of results/h200/subgroup_matrix.json), lo: the rest
                out.append(f"      {{ let x = ga{q}.{comp} * s; let hb = bitcast<f32>(bitcast<u32>(x) & 0xffffe000u);"
                           f" Ah[b + {c}u] = f16(hb);" + (f" Al[b + {c}u] = f16(x - hb);" if v.split else "") + " }")
            out.append("    }")
        for q in range(b_per):
            i = f"(t + {q * t}u)"
            lines = []
            if nn:
                per_row = v.block_n // 64
                base = f"({i} / {per_row}u) * {b_stride}u + ({i} % {per_row}u) * 64u"
                for c, comp in enumerate("xyzw"):  # word c: weights 16c .. 16c + 15 along N
                    for j in range(4):
                        lines.append(f"{{ let w = codes(gb{q}.{comp}, {2 * j}u); "
                                     + " ".join(f"Bs[b + {16 * c + 4 * j + e}u] = f16(f32(bitcast<i32>((w >> {8 * e}u) << 24u) >> 24u));"
                                                for e in range(4)) + " }")
            else:
                per_row = v.ks // 8
                base = f"({i} / {per_row}u) * {b_stride}u + ({i} % {per_row}u) * 8u"
                for c, comp in enumerate("xyzw"):
                    lines.append(f"Bs[b + {2 * c}u] = f16(bitcast<f32>(gb{q}.{comp} << 16u));"
                                 f" Bs[b + {2 * c + 1}u] = f16(bitcast<f32>(gb{q}.{comp} & 0xffff0000u));")
            out.append("    " + guarded(q, f"{{ let b = {base}; " + " ".join(lines) + " }"))
        return "\n".join(out) + "\n"

    def multiply() -> str:
        out = []
        for kq in range(0, v.ks, 16):
            out.append("    {")
            if nn:
                out += [f"      let b{j} = subgroupMatrixLoad<R>(&Bs, {kq}u * {b_stride}u + sc * {16 * v.tn}u + {16 * j}u,"
                        f" false, {b_stride}u);" for j in range(v.tn)]
            else:
                out += [f"      let b{j} = subgroupMatrixLoad<R>(&Bs, (sc * {16 * v.tn}u + {16 * j}u) * {b_stride}u + {kq}u,"
                        f" true, {b_stride}u);" for j in range(v.tn)]
            for p in parts:
                out += [f"      let a{p}{i} = subgroupMatrixLoad<L>(&A{p}, (sr * {16 * v.tm}u + {16 * i}u) * {stride}u"
                        f" + {kq}u, false, {stride}u);" for i in range(v.tm)]
            for p in parts:
                out += [f"      c{i}_{j} = subgroupMatrixMultiplyAccumulate(a{p}{i}, b{j}, c{i}_{j});" for i, j in results]
            out.append("    }")
        return "\n".join(out) + "\n"

    regs = "".join(f"  var ga{q}: vec4<f32>;\n" for q in range(a_per)) + \
        "".join(f"  var gb{q}: vec4<u32>;\n" for q in range(b_per))
    accs = "".join(f"  var c{i}_{j}: O;\n" for i, j in results)
    # the epilogue undoes each row's power-of-two scale (exact)
    epilogue = "".join(_tile_epilogue(f"c{i}_{j}", f"r0 + {16 * i}u", f"c0 + {16 * j}u", n,
                                      f"Cs[sg * 256u + e] / Es[row - wg.y * {v.block_m}u]") for i, j in results)
    scale = (f"  for (var r = t; r < {v.block_m}u; r += {t}u) {{ Es[r] = S[wg.y * {v.block_m}u + r]; }}\n"
             "  workgroupBarrier();\n")
    if v.prefetch:
        body = (loads("0u") + f"  for (var kk = 0u; kk < {k}u; kk += {v.ks}u) {{\n" + stores()
                + "    workgroupBarrier();\n"
                + f"    if (kk + {v.ks}u < {k}u) {{\n" + loads(f"(kk + {v.ks}u)").replace("\n    ", "\n      ")
                + "    }\n" + multiply() + "    workgroupBarrier();\n  }\n")
    else:
        body = (f"  for (var kk = 0u; kk < {k}u; kk += {v.ks}u) {{\n" + loads("kk") + stores()
                + "    workgroupBarrier();\n" + multiply() + "    workgroupBarrier();\n  }\n")
    a_decl = "".join(f"var<workgroup> A{p}: array<f16, {v.block_m * stride}>;\n" for p in parts)
    b_rows = v.ks if nn else v.block_n
    return f"""enable chromium_experimental_subgroup_matrix;
enable subgroups;
enable f16;
diagnostic(off, subgroup_uniformity);
@group(0) @binding(0) var<storage, read> A: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> {b_src};
@group(0) @binding(2) var<storage, read_write> C: array<f32>;
@group(0) @binding(3) var<storage, read> S: array<f32>;  // 2^e of each row of A (its scale)
alias L = subgroup_matrix_left<f16, 16, 16>;
alias R = subgroup_matrix_right<f16, 16, 16>;
alias O = subgroup_matrix_result<f32, 16, 16>;
{a_decl}var<workgroup> Bs: array<f16, {b_rows * b_stride}>;
var<workgroup> Cs: array<f32, {256 * v.rows * v.cols}>;
var<workgroup> Es: array<f32, {v.block_m}>;

fn codes(word: u32, shift: u32) -> u32 {{
  return ((((word >> shift) & 0x03030303u) | 0x80808080u) - 0x01010101u) ^ 0x80808080u;
}}

@compute @workgroup_size({t})
fn main(@builtin(workgroup_id) wg: vec3u, @builtin(local_invocation_index) t: u32,
        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {{
  let sr = sg / {v.cols}u;
  let sc = sg % {v.cols}u;
  let r0 = wg.y * {v.block_m}u + sr * {16 * v.tm}u;
  let c0 = wg.x * {v.block_n}u + sc * {16 * v.tn}u;
{regs}{accs}{scale}{body}{epilogue}}}
"""


# -- host side ----------------------------------------------------------------------------------------

def pack_ternary(values: np.ndarray) -> np.ndarray:
    """int8 {-1, 0, 1} [rows, K] (K a multiple of 64) → u32 [rows, K / 16], the engine's layout."""
    rows, k = values.shape
    codes = (values.astype(np.int16) + 1).astype(np.uint8).reshape(rows, k // 16, 4, 4)  # [row, word, pair, lane]
    lanes = codes[:, :, 0] | (codes[:, :, 1] << 2) | (codes[:, :, 2] << 4) | (codes[:, :, 3] << 6)
    return np.ascontiguousarray(lanes).view(np.uint32).reshape(rows, -1)


def row_scales(a: np.ndarray) -> np.ndarray:
    """2^e per row so that the row's largest |value| lands in [2^14, 2^15): f16 keeps 11 bits of
    every value at least 2^-10 of it in hi, the next 11 in lo, far from f16's overflow."""
    top = np.abs(a).max(axis=1)
    e = np.where(top > 0, 14 - np.floor(np.log2(np.where(top > 0, top, 1))), 0)
    return np.exp2(e).astype(np.float32)


class Bench:
    def __init__(self) -> None:
        import wgpudawn as wgpu
        from wgpudawn.backends.dawn import extras

        self.wgpu = wgpu
        extras.set_instance_extras(enable_toggles=F16_TOGGLES)
        adapters = wgpu.gpu.enumerate_adapters_sync()
        self.adapters = [{"summary": a.summary, "features": sorted(a.features),
                          "configs": extras.get_adapter_properties(a).get("subgroup_matrix_configs")}
                         for a in adapters]
        adapter = next((a for a in adapters if FEATURE in a.features), None)
        if adapter is None:
            raise SystemExit(f"no adapter offers {FEATURE}: {self.adapters}")
        want = [FEATURE, "subgroups", "timestamp-query", "shader-f16"]
        names = ("max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size",
                 "max-compute-invocations-per-workgroup", "max-compute-workgroup-size-x")
        self.limits = {name: adapter.limits[name] for name in names}
        self.device = adapter.request_device_sync(required_features=[f for f in want if f in adapter.features],
                                                  required_limits=self.limits)
        self.queries = self.device.create_query_set(type="timestamp", count=2)
        self.stamps = self.device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)

    def buffer(self, array: np.ndarray):
        usage = self.wgpu.BufferUsage.STORAGE | self.wgpu.BufferUsage.COPY_SRC | self.wgpu.BufferUsage.COPY_DST
        buf = self.device.create_buffer(size=max(16, array.nbytes), usage=usage)
        self.device.queue.write_buffer(buf, 0, np.ascontiguousarray(array))
        return buf

    def pipeline(self, source: str, buffers: list):
        module = self.device.create_shader_module(code=source)
        pipeline = self.device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
        group = self.device.create_bind_group(layout=pipeline.get_bind_group_layout(0),
                                              entries=[{"binding": i, "resource": {"buffer": b}}
                                                       for i, b in enumerate(buffers)])
        return pipeline, group

    def seconds_each(self, pipeline, group, grid, times: int) -> float:
        encoder = self.device.create_command_encoder()
        compute = encoder.begin_compute_pass(timestamp_writes={"query_set": self.queries,
                                                               "beginning_of_pass_write_index": 0,
                                                               "end_of_pass_write_index": 1})
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, group)
        for _ in range(times):
            compute.dispatch_workgroups(*grid)
        compute.end()
        encoder.resolve_query_set(self.queries, 0, 2, self.stamps, 0)
        self.device.queue.submit([encoder.finish()])
        begin, end = np.frombuffer(self.device.queue.read_buffer(self.stamps), np.uint64)
        return (int(end) - int(begin)) * 1e-9 / times

    def read(self, buf, dtype, shape) -> np.ndarray:
        return np.frombuffer(self.device.queue.read_buffer(buf), dtype)[: int(np.prod(shape))].reshape(shape)


def workgroup_bytes(v: Variant) -> int:
    """Workgroup memory a variant declares."""
    tiles = 4 * 256 * v.rows * v.cols  # each subgroup's 16 × 16 slice for the epilogue
    if v.kind == "i8":
        return (v.block_m + v.block_n) * (v.ks + v.pad) + tiles
    a = v.block_m * (v.ks + v.pad // 2) * 2 * (2 if v.split else 1)
    b = v.ks * (v.block_n + v.pad // 2) * 2 if v.kind == "f16nn" else v.block_n * (v.ks + v.pad // 2) * 2
    return a + b + tiles + 4 * v.block_m


def run_variant(bench: Bench, v: Variant, m: int, n: int, k: int, rng: np.random.Generator, check: bool,
                seconds: float) -> dict:
    out = {**asdict(v), "m": m, "n": n, "k": k}
    if m % v.block_m or n % v.block_n or k % v.ks:
        return {**out, "error": "shape"}
    if v.kind == "i8":
        a = rng.integers(-127, 128, (m, k)).astype(np.int8)
        w = rng.integers(-1, 2, (n, k)).astype(np.int8)
        scales = np.exp2(rng.integers(-8, 8, m + n)).astype(np.float32)  # powers of two: the check stays exact
        bufs = [bench.buffer(a.view(np.int32)), bench.buffer(pack_ternary(w)), bench.buffer(np.zeros((m, n), np.float32)),
                bench.buffer(scales)]
        source = lambda: i8_source(v, m, n, k)  # noqa: E731 - built inside the try below
    else:
        nn = v.kind == "f16nn"
        a = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-30, 10, (m, 1)))).astype(np.float32)
        if nn:
            w = rng.integers(-1, 2, (k, n)).astype(np.int8)  # rows = the contraction
            wbuf = pack_ternary(w)
            wf = w.astype(np.float64)
        else:
            wf32 = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
            bits = (wf32.view(np.uint32) + 0x8000) & 0xFFFF0000  # bf16, rounded
            wf = bits.view(np.float32).astype(np.float64).T
            wbuf = np.ascontiguousarray((bits >> 16).astype(np.uint16)).view(np.uint32)
        scales = row_scales(a)
        bufs = [bench.buffer(a), bench.buffer(wbuf), bench.buffer(np.zeros((m, n), np.float32)), bench.buffer(scales)]
        source = lambda: f16_source(v, m, n, k, nn)  # noqa: E731 - built inside the try below
    need = workgroup_bytes(v)
    out["workgroup_bytes"] = need
    if need > bench.limits["max-compute-workgroup-storage-size"] or v.threads > bench.limits[
            "max-compute-invocations-per-workgroup"]:
        return {**out, "error": "limits"}
    try:
        t0 = time.perf_counter()
        pipeline, group = bench.pipeline(source(), bufs)
        out["compile_s"] = round(time.perf_counter() - t0, 2)
        grid = (n // v.block_n, m // v.block_m, 1)
        first = bench.seconds_each(pipeline, group, grid, 1)
        times = max(2, min(200, int(seconds / max(first, 1e-6))))
        bench.seconds_each(pipeline, group, grid, min(times, 5))
        best = min(bench.seconds_each(pipeline, group, grid, times) for _ in range(3))
    except Exception as e:  # a variant the compiler or the driver refuses: recorded, the sweep goes on
        return {**out, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    out["us"] = round(best * 1e6, 2)
    out["tera_ops_per_s"] = round(2 * m * n * k / best / 1e12, 2)
    if check:
        if v.kind == "i8":
            got = bench.read(bufs[2], np.float32, (m, n)).astype(np.float64)
            dots = a.astype(np.float64) @ w.astype(np.float64).T  # exact: |dot| < 2^53, and BLAS is quick
            out["exact"] = bool((got == dots * scales[:m, None] * scales[None, m:]).all())
        else:
            got = bench.read(bufs[2], np.float32, (m, n)).astype(np.float64)
            ref = a.astype(np.float64) @ wf
            scale = np.abs(ref).max(axis=1, keepdims=True) + 1e-300
            out["max_rel_error"] = float((np.abs(got - ref) / scale).max())  # per row: its own scale
    return out


def torch_rates(shapes: list[tuple[int, int, int]], seconds: float) -> list[dict]:
    """torch's int8 (``torch._int_mm``) and bf16/f16 GEMM rates on the same shapes, CUDA events."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for m, n, k in shapes:
        row = {"m": m, "n": n, "k": k}
        for name, make in (("int8", lambda: (torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda"),
                                              torch.randint(-1, 2, (k, n), dtype=torch.int8, device="cuda"))),
                           ("bf16", lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                                              torch.randn(k, n, device="cuda", dtype=torch.bfloat16))),
                           ("f16", lambda: (torch.randn(m, k, device="cuda", dtype=torch.float16),
                                             torch.randn(k, n, device="cuda", dtype=torch.float16)))):
            a, b = make()
            fn = (lambda: torch._int_mm(a, b)) if name == "int8" else (lambda: a @ b)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times = max(3, int(seconds / max(start.elapsed_time(end) / 1e3, 1e-6)))
            start.record()
            for _ in range(times):
                fn()
            end.record()
            torch.cuda.synchronize()
            each = start.elapsed_time(end) / 1e3 / times
            row[f"{name}_us"] = round(each * 1e6, 2)
            row[f"{name}_tera_ops_per_s"] = round(2 * m * n * k / each / 1e12, 1)
        out.append(row)
    return out


def variants() -> list[Variant]:
    """The shapes swept: each fits 48 KiB of workgroup memory (NVIDIA's limit)."""
    out = [Variant("i8", *shape, ks, 16, prefetch)
           for shape, ks, prefetch in itertools.product(((2, 2, 4, 4), (4, 2, 2, 4), (2, 4, 4, 2), (4, 2, 4, 4)),
                                                        (64, 128), (False, True))]
    out += [Variant("i8", 2, 2, 4, 4, ks, 0, True) for ks in (64, 128)]  # unpadded rows: bank conflicts?
    for kind in ("f16nn", "f16nt"):
        for (rows, cols, tm, tn, ks), prefetch in itertools.product(
                ((4, 2, 2, 4, 32), (4, 2, 2, 2, 32), (2, 2, 2, 4, 64), (2, 2, 2, 4, 32), (4, 2, 1, 4, 64)),
                (True, False)):
            out.append(Variant(kind, rows, cols, tm, tn, ks, 16, prefetch))
        out.append(Variant(kind, 4, 2, 2, 4, 32, 16, True, split=False))  # one part: what the split costs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=0.05, help="GPU time a timing aims at")
    parser.add_argument("--budget", type=float, default=420, help="seconds the sweep may take")
    parser.add_argument("--kinds", default="i8,f16nn,f16nt", help="the kinds of GEMM swept, comma-separated")
    parser.add_argument("--no-torch", action="store_true", help="leave torch's rates out")
    parser.add_argument("--prior", help="an earlier run's JSON: its variants join the ranking of the second phase")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    shapes = {"i8": [(512, 13824, 2560), (512, 2560, 6912), (4096, 13824, 2560)],
              "f16nn": [(512, 2560, 13824), (512, 6912, 2560), (4096, 2560, 13824)],
              "f16nt": [(512, 32768, 2560), (4096, 32768, 2560)]}
    kinds = args.kinds.split(",")
    prior = json.load(open(args.prior))["variants"] if args.prior else []
    result: dict = {"torch": [] if args.no_torch else torch_rates(sorted({s for kind in shapes.values() for s in kind}),
                                                                  args.seconds)}
    bench = Bench()
    result["adapters"] = bench.adapters
    result["limits"] = bench.limits
    result["variants"] = [{**r, "prior": True} for r in prior]

    def save() -> None:
        with open(os.path.join(args.out, "subgroup_matrix.json"), "w") as f:
            json.dump(result, f, indent=1)

    save()
    for v in (v for v in variants() if v.kind in kinds):
        if time.perf_counter() - start > args.budget:
            result["stopped"] = "budget"
            break
        row = run_variant(bench, v, *shapes[v.kind][0], rng, check=True, seconds=args.seconds)
        result["variants"].append(row)
        print(json.dumps(row), flush=True)
        save()
    # the fastest three correct variants of each kind on every shape of that kind
    for kind, kind_shapes in shapes.items():
        good = [r for r in result["variants"] if r["kind"] == kind and "us" in r and (r["m"], r["n"], r["k"]) == kind_shapes[0]
                and (r.get("exact") or r.get("max_rel_error", 1) < 1e-5)]
        for r in sorted(good, key=lambda r: r["us"])[:3]:
            v = Variant(**{f: r[f] for f in Variant.__dataclass_fields__})
            for shape in kind_shapes[1:]:
                if time.perf_counter() - start > args.budget:
                    break
                row = run_variant(bench, v, *shape, rng, check=False, seconds=args.seconds)
                result["variants"].append(row)
                print(json.dumps(row), flush=True)
                save()
    result["seconds"] = round(time.perf_counter() - start, 1)
    save()


if __name__ == "__main__":
    main()
