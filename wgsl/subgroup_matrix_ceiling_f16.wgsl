// The ceiling of the matrix units through WebGPU for f16 × f16 → f32: each subgroup loads its
// operands once and multiplies them ITERS times into 8 accumulators held in registers, with no
// memory traffic in the loop (benchmarks/matrix_units.py's "ceiling": no GEMM on this path runs faster).
// @subgroup-matrix f16 f32

struct Params {
  iters: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> OUT: array<f32>;

alias L = subgroup_matrix_left<f16, SM_K, SM_M>;
alias R = subgroup_matrix_right<f16, SM_N, SM_K>;
alias O = subgroup_matrix_result<f32, SM_N, SM_M>;

override SUBGROUPS: u32 = 4u;
var<workgroup> operands: array<f16, 2048>;

@compute @workgroup_size(SUBGROUPS * SM_SUBGROUP)
fn ceiling(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32,
           @builtin(subgroup_id) sg: u32) {
  for (var i = t; i < 2048u; i += SUBGROUPS * SM_SUBGROUP) { operands[i] = f16(i % 3u); }
  workgroupBarrier();
  let a = subgroupMatrixLoad<L>(&operands, 0u, false, SM_K);
  let b0 = subgroupMatrixLoad<R>(&operands, 256u, false, SM_N);
  let b1 = subgroupMatrixLoad<R>(&operands, 512u, false, SM_N);
  var c0: O; var c1: O; var c2: O; var c3: O; var c4: O; var c5: O; var c6: O; var c7: O;
  for (var i = 0u; i < p.iters; i++) {
    c0 = subgroupMatrixMultiplyAccumulate(a, b0, c0); c1 = subgroupMatrixMultiplyAccumulate(a, b1, c1);
    c2 = subgroupMatrixMultiplyAccumulate(a, b0, c2); c3 = subgroupMatrixMultiplyAccumulate(a, b1, c3);
    c4 = subgroupMatrixMultiplyAccumulate(a, b0, c4); c5 = subgroupMatrixMultiplyAccumulate(a, b1, c5);
    c6 = subgroupMatrixMultiplyAccumulate(a, b0, c6); c7 = subgroupMatrixMultiplyAccumulate(a, b1, c7);
  }
  let o = (wg.x * SUBGROUPS + sg) * 8u * SM_M * SM_N;  // each accumulator its own place: none is dead code
  let m = SM_M * SM_N;
  subgroupMatrixStore(&OUT, o, c0, false, SM_N); subgroupMatrixStore(&OUT, o + m, c1, false, SM_N);
  subgroupMatrixStore(&OUT, o + 2u * m, c2, false, SM_N); subgroupMatrixStore(&OUT, o + 3u * m, c3, false, SM_N);
  subgroupMatrixStore(&OUT, o + 4u * m, c4, false, SM_N); subgroupMatrixStore(&OUT, o + 5u * m, c5, false, SM_N);
  subgroupMatrixStore(&OUT, o + 6u * m, c6, false, SM_N); subgroupMatrixStore(&OUT, o + 7u * m, c7, false, SM_N);
}
