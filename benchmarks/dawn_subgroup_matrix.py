"""Does Dawn reach the GPU's tensor cores? An int8 GEMM on subgroup matrices, timed and checked.

wgpu-native (wgpu-py 0.32) refuses the adapter's experimental ``cooperative-matrix`` feature;
Dawn exposes it as ``chromium-experimental-subgroup-matrix`` once its unsafe APIs are allowed.
This probe runs on ``wgpudawn`` (the wgpu-py API on Dawn; not a dependency of this package:
``pip install wgpudawn==0.32.0.4``): it prints the adapter's subgroup-matrix configurations,
then times C[M, N] = A[M, K] · W[N, K]ᵀ in int8 (A random codes, W ternary, as the engine's
forward projections) on 16 × 16 × 32 i8 → i32 subgroup matrices, checks it exactly against
numpy, and prints one JSON line. Findings on the H200: benchmarks/RESULTS.md.

    python -m benchmarks.dawn_subgroup_matrix M N K [--layout shared|direct] [--rows R] [--cols C]

``shared``: a workgroup of R × C subgroups stages 64 K-columns of A (R·64 rows) and W (C·32 rows)
in workgroup memory, each subgroup multiplying its 64 × 32 block; ``direct``: each subgroup loads
its matrices straight from the storage buffers.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def gemm_source(m: int, n: int, k: int, rows: int, cols: int, layout: str) -> str:
    """WGSL of the probe's GEMM: a workgroup of ``rows`` × ``cols`` subgroups, each owning a
    64 × 32 block of C as 4 × 2 16 × 16 result matrices."""
    block_m, block_n, threads = 64 * rows, 32 * cols, 32 * rows * cols
    head = f"""enable chromium_experimental_subgroup_matrix;
enable subgroups;
diagnostic(off, subgroup_uniformity);
const M = {m}u; const N = {n}u; const K = {k}u;
@group(0) @binding(0) var<storage, read> A: array<i32>;
@group(0) @binding(1) var<storage, read> W: array<i32>;
@group(0) @binding(2) var<storage, read_write> C: array<i32>;
alias L = subgroup_matrix_left<i8, 32, 16>;
alias R = subgroup_matrix_right<i8, 16, 32>;
alias O = subgroup_matrix_result<i32, 16, 16>;
"""
    store = """  for (var i = 0u; i < 4u; i++) {
    subgroupMatrixStore(&C, (r0 + 16u * i) * N + c0, acc[2u * i], false, N);
    subgroupMatrixStore(&C, (r0 + 16u * i) * N + c0 + 16u, acc[2u * i + 1u], false, N);
  }
}"""
    if layout == "direct":
        return head + f"""
@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wg: vec3u, @builtin(subgroup_id) sg: u32) {{
  let r0 = wg.y * {block_m}u + (sg / {cols}u) * 64u;
  let c0 = wg.x * {block_n}u + (sg % {cols}u) * 32u;
  var acc: array<O, 8>;
  for (var kk = 0u; kk < K; kk += 32u) {{
    let b0 = subgroupMatrixLoad<R>(&W, c0 * K + kk, true, K);
    let b1 = subgroupMatrixLoad<R>(&W, (c0 + 16u) * K + kk, true, K);
    for (var i = 0u; i < 4u; i++) {{
      let a = subgroupMatrixLoad<L>(&A, (r0 + 16u * i) * K + kk, false, K);
      acc[2u * i] = subgroupMatrixMultiplyAccumulate(a, b0, acc[2u * i]);
      acc[2u * i + 1u] = subgroupMatrixMultiplyAccumulate(a, b1, acc[2u * i + 1u]);
    }}
  }}
""" + store
    return head + f"""
var<workgroup> As: array<i32, {block_m * 16}>;
var<workgroup> Ws: array<i32, {block_n * 16}>;
@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wg: vec3u, @builtin(local_invocation_index) t: u32, @builtin(subgroup_id) sg: u32) {{
  let sr = sg / {cols}u;
  let sc = sg % {cols}u;
  let r0 = wg.y * {block_m}u + sr * 64u;
  let c0 = wg.x * {block_n}u + sc * 32u;
  var acc: array<O, 8>;
  for (var kk = 0u; kk < K; kk += 64u) {{
    for (var j = 0u; j < {block_m * 16 // threads}u; j++) {{
      let i = t + {threads}u * j;
      As[i] = A[(wg.y * {block_m}u + i / 16u) * (K / 4u) + kk / 4u + i % 16u];
    }}
    for (var j = 0u; j < {block_n * 16 // threads}u; j++) {{
      let i = t + {threads}u * j;
      Ws[i] = W[(wg.x * {block_n}u + i / 16u) * (K / 4u) + kk / 4u + i % 16u];
    }}
    workgroupBarrier();
    for (var k2 = 0u; k2 < 64u; k2 += 32u) {{
      let b0 = subgroupMatrixLoad<R>(&Ws, (sc * 32u) * 64u + k2, true, 64u);
      let b1 = subgroupMatrixLoad<R>(&Ws, (sc * 32u + 16u) * 64u + k2, true, 64u);
      for (var i = 0u; i < 4u; i++) {{
        let a = subgroupMatrixLoad<L>(&As, (sr * 64u + 16u * i) * 64u + k2, false, 64u);
        acc[2u * i] = subgroupMatrixMultiplyAccumulate(a, b0, acc[2u * i]);
        acc[2u * i + 1u] = subgroupMatrixMultiplyAccumulate(a, b1, acc[2u * i + 1u]);
      }}
    }}
    workgroupBarrier();
  }}
""" + store


def main() -> None:
    import wgpudawn as wgpu
    from wgpudawn.backends.dawn import extras

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("m", type=int)
    parser.add_argument("n", type=int)
    parser.add_argument("k", type=int)
    parser.add_argument("--layout", choices=("shared", "direct"), default="shared")
    parser.add_argument("--rows", type=int, default=2, help="subgroups a workgroup along M")
    parser.add_argument("--cols", type=int, default=4, help="subgroups a workgroup along N")
    args = parser.parse_args()
    m, n, k = args.m, args.n, args.k
    if m % (64 * args.rows) or n % (32 * args.cols) or k % 64:
        parser.error(f"M must be a multiple of {64 * args.rows}, N of {32 * args.cols}, K of 64")

    extras.set_instance_extras(enable_toggles=["allow_unsafe_apis"])
    feature = "chromium-experimental-subgroup-matrix"
    adapters = wgpu.gpu.enumerate_adapters_sync()
    for a in adapters:
        print(a.summary, extras.get_adapter_properties(a).get("subgroup_matrix_configs"))
    adapter = next((a for a in adapters if feature in a.features), None)
    if adapter is None:
        raise SystemExit(f"no adapter offers {feature}")
    limits = {name: adapter.limits[name] for name in ("max-storage-buffer-binding-size", "max-buffer-size")}
    device = adapter.request_device_sync(required_features=[feature, "subgroups", "timestamp-query"],
                                         required_limits=limits)
    rng = np.random.default_rng(0)
    a = rng.integers(-127, 128, (m, k)).astype(np.int8)
    w = rng.integers(-1, 2, (n, k)).astype(np.int8)
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    buffers = []
    for array in (a, w, np.zeros((m, n), np.int32)):
        buffers.append(device.create_buffer(size=array.nbytes, usage=usage))
        device.queue.write_buffer(buffers[-1], 0, array)
    module = device.create_shader_module(code=gemm_source(m, n, k, args.rows, args.cols, args.layout))
    pipeline = device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
    group = device.create_bind_group(layout=pipeline.get_bind_group_layout(0),
                                     entries=[{"binding": i, "resource": {"buffer": b}} for i, b in enumerate(buffers)])
    queries = device.create_query_set(type="timestamp", count=2)
    stamps = device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
    grid = (n // (32 * args.cols), m // (64 * args.rows), 1)

    def seconds_each(times: int) -> float:
        encoder = device.create_command_encoder()
        compute = encoder.begin_compute_pass(timestamp_writes={"query_set": queries, "beginning_of_pass_write_index": 0,
                                                               "end_of_pass_write_index": 1})
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, group)
        for _ in range(times):
            compute.dispatch_workgroups(*grid)
        compute.end()
        encoder.resolve_query_set(queries, 0, 2, stamps, 0)
        device.queue.submit([encoder.finish()])
        begin, end = np.frombuffer(device.queue.read_buffer(stamps), np.uint64)
        return (int(end) - int(begin)) * 1e-9 / times

    seconds_each(2)
    best = min(seconds_each(20) for _ in range(3))
    got = np.frombuffer(device.queue.read_buffer(buffers[2]), np.int32).reshape(m, n)
    exact = bool((got == a.astype(np.int64) @ w.astype(np.int64).T).all())
    print(json.dumps({"m": m, "n": n, "k": k, "layout": args.layout, "rows": args.rows, "cols": args.cols,
                      "us": round(best * 1e6, 1), "tera_ops_per_s": round(2 * m * n * k / best / 1e12, 1),
                      "exact": exact}))


if __name__ == "__main__":
    main()
