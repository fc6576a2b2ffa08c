"""Does Dawn reach the GPU's tensor cores? An int8 GEMM on subgroup matrices, timed and checked.

wgpu-native (wgpu-py 0.32) refuses the adapter's experimental ``cooperative-matrix`` feature;
Dawn exposes it as ``chromium-experimental-subgroup-matrix`` once its unsafe APIs are allowed.
This probe runs on ``wgpudawn`` (the wgpu-py API on Dawn; not a dependency of this package:
``pip install wgpudawn==0.32.0.4``): it prints the adapter's subgroup-matrix configurations,
then times C[M, N] = A[M, K] · W[N, K]ᵀ in int8 (A random codes, W ternary, as the engine's
forward projections) on 16 × 16 × 32 i8 → i32 subgroup matrices, checks it exactly against
numpy, and prints one JSON line. Findings on the H200: benchmarks/RESULTS.md.

    python -m benchmarks.dawn_subgroup_matrix M N K [--rows R] [--cols C] [--tile-m TM] [--tile-n TN]

A workgroup of R × C subgroups stages 64 K-columns of its A and W blocks in workgroup memory
(16-byte global loads), then each subgroup multiplies its 16·TM × 16·TN block of C, held as TM × TN
result matrices in named variables: every loop over them is unrolled here, because accumulators
in an array indexed by a loop variable cost the first form of this probe 1.6 to 1.9× its time.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def gemm_source(m: int, n: int, k: int, rows: int, cols: int, tile_m: int, tile_n: int) -> str:
    """WGSL of the probe's GEMM (see the module docstring)."""
    block_m, block_n, threads = 16 * tile_m * rows, 16 * tile_n * cols, 32 * rows * cols
    results = [(i, j) for i in range(tile_m) for j in range(tile_n)]

    def staged(name: str, src: str, block: int, first_row: str) -> str:  # 4 vec4 words a row of the K step
        return "".join(
            f"    {{ let i = t + {threads * q}u; let v = {src}[({first_row} + i / 4u) * (K / 16u) + kk / 16u + i % 4u];\n"
            f"      {name}[4u * i] = v.x; {name}[4u * i + 1u] = v.y; {name}[4u * i + 2u] = v.z; {name}[4u * i + 3u] = v.w; }}\n"
            for q in range(block * 4 // threads))

    def multiply(koff: int) -> str:
        lines = [f"      let b{j} = subgroupMatrixLoad<R>(&Ws, (sc * {16 * tile_n}u + {16 * j}u) * 64u + {koff}u, true, 64u);"
                 for j in range(tile_n)]
        lines += [f"      let a{i} = subgroupMatrixLoad<L>(&As, (sr * {16 * tile_m}u + {16 * i}u) * 64u + {koff}u, false, 64u);"
                  for i in range(tile_m)]
        lines += [f"      c{i}_{j} = subgroupMatrixMultiplyAccumulate(a{i}, b{j}, c{i}_{j});" for i, j in results]
        return "    {\n" + "\n".join(lines) + "\n    }\n"

    declare = "".join(f"  var c{i}_{j}: O;\n" for i, j in results)
    store = "".join(f"  subgroupMatrixStore(&C, (r0 + {16 * i}u) * N + c0 + {16 * j}u, c{i}_{j}, false, N);\n"
                    for i, j in results)
    return f"""enable chromium_experimental_subgroup_matrix;
enable subgroups;
diagnostic(off, subgroup_uniformity);
const M = {m}u; const N = {n}u; const K = {k}u;
@group(0) @binding(0) var<storage, read> A: array<vec4<i32>>;
@group(0) @binding(1) var<storage, read> W: array<vec4<i32>>;
@group(0) @binding(2) var<storage, read_write> C: array<i32>;
alias L = subgroup_matrix_left<i8, 32, 16>;
alias R = subgroup_matrix_right<i8, 16, 32>;
alias O = subgroup_matrix_result<i32, 16, 16>;
var<workgroup> As: array<i32, {block_m * 16}>;
var<workgroup> Ws: array<i32, {block_n * 16}>;

@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wg: vec3u, @builtin(local_invocation_index) t: u32, @builtin(subgroup_id) sg: u32) {{
  let sr = sg / {cols}u;
  let sc = sg % {cols}u;
  let r0 = wg.y * {block_m}u + sr * {16 * tile_m}u;
  let c0 = wg.x * {block_n}u + sc * {16 * tile_n}u;
{declare}  for (var kk = 0u; kk < K; kk += 64u) {{
{staged("As", "A", block_m, f"wg.y * {block_m}u")}{staged("Ws", "W", block_n, f"wg.x * {block_n}u")}    workgroupBarrier();
{multiply(0)}{multiply(32)}    workgroupBarrier();
  }}
{store}}}
"""


def main() -> None:
    import wgpudawn as wgpu
    from wgpudawn.backends.dawn import extras

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("m", type=int)
    parser.add_argument("n", type=int)
    parser.add_argument("k", type=int)
    parser.add_argument("--rows", type=int, default=2, help="subgroups a workgroup along M")
    parser.add_argument("--cols", type=int, default=2, help="subgroups a workgroup along N")
    parser.add_argument("--tile-m", type=int, default=4, help="16-row result matrices a subgroup along M")
    parser.add_argument("--tile-n", type=int, default=4, help="16-column result matrices a subgroup along N")
    args = parser.parse_args()
    m, n, k = args.m, args.n, args.k
    block_m, block_n = 16 * args.tile_m * args.rows, 16 * args.tile_n * args.cols
    if m % block_m or n % block_n or k % 64 or (block_m * 4) % (32 * args.rows * args.cols) \
            or (block_n * 4) % (32 * args.rows * args.cols):
        parser.error(f"M must be a multiple of {block_m}, N of {block_n}, K of 64, and each block's rows a "
                     f"multiple of the workgroup's threads / 4")

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
    module = device.create_shader_module(code=gemm_source(m, n, k, args.rows, args.cols, args.tile_m, args.tile_n))
    pipeline = device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
    group = device.create_bind_group(layout=pipeline.get_bind_group_layout(0),
                                     entries=[{"binding": i, "resource": {"buffer": b}} for i, b in enumerate(buffers)])
    queries = device.create_query_set(type="timestamp", count=2)
    stamps = device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
    grid = (n // block_n, m // block_m, 1)

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
    print(json.dumps({"m": m, "n": n, "k": k, "rows": args.rows, "cols": args.cols, "tile_m": args.tile_m,
                      "tile_n": args.tile_n,
                      "us": round(best * 1e6, 1), "tera_ops_per_s": round(2 * m * n * k / best / 1e12, 1),
                      "exact": exact}))


if __name__ == "__main__":
    main()
