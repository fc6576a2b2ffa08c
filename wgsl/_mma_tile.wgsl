// Shared by the GEMMs on the matrix units (// @include, beside the staging part of their operand
// types: _ternary_mma_tile.wgsl for int8 codes × ternary weights, matmul_mma.wgsl's own for f16):
// the main loop over the sum, the accumulators and the results staged for the epilogue, generic
// over the adapter's subgroup-matrix shape (SM_M, SM_N, SM_K, SM_SUBGROUP, which the runtime writes
// before the source).
//
//   C[r][c] = Σ_κ A[r][κ] · B[κ][c]
//
// A workgroup of SUB_M × SUB_N subgroups owns BM staged rows of A × BN columns of C; subgroup
// (sr, sc) holds TM × TN result matrices. The staged rows are the DIGITS planes' rows of the
// workgroup's BM / DIGITS tokens, plane by plane, so with DIGITS = SUB_M subgroup row sr holds plane
// sr. Each step of KSTEP along the sum is staged in workgroup memory, the next step's global loads
// issued right after the barrier, before this step's multiplies. What a thread holds (accumulators,
// the right matrices, the next step's loads) is in named variables, fields of structs read by
// constant names under override conditions, never arrays: an array of subgroup matrices indexed in a
// loop ran at a quarter of the speed on the H100 (benchmarks/results/h100/matrix_units.md).
//
// The staging part declares the matrix types L, R and O, and
//   override A_LOADS, B_LOADS: vec4 loads a thread makes a step, of A and of the weights (≤ 8 each);
//   fn load_a(v: u32, tok0: u32, kk: u32, k_end: u32) -> vec4<u32>, fn load_b(v: u32, c0: u32, kk: u32,
//     k_end: u32) -> vec4<u32>: the workgroup's load v of A (at token tok0) and of the weights (at
//     column c0) for step kk (zeros past the sum's end k_end and the matrices' edges);
//   fn put_a(v: u32, a: vec4<u32>), fn put_b(v: u32, b: vec4<u32>): load v into workgroup memory;
//   fn left(sr: u32, i: u32, q: u32) -> L, fn right(sc: u32, j: u32, q: u32) -> R: the subgroup's left
//     matrix i and right matrix j at sub-step q (SM_K terms) of the staged step;
//   fn stage_result(m: O, sg: u32, j: u32): result matrix j of subgroup sg's row being put, staged
//     beside the row's others (SM_M rows of RESULT_ROW, RESULT_STRIDE apart);
//   fn after_step(acc: ptr<function, Acc>, sr: u32, sc: u32, kk: u32, k_begin: u32, k_end: u32): what
//     follows each staged step kk of [k_begin, k_end) (in uniform control flow: it may hold barriers).
// The including kernel declares
//   fn finish(t: u32, lane: u32, sg: u32, n0: u32, c0: u32, i: u32): the epilogue of row i of every
//     subgroup's result matrices, as stage_result staged them (put_results calls it: a row of
//     matrices a round).

override SUB_M: u32 = 4u;     // subgroups along the rows of A
override SUB_N: u32 = 2u;     // subgroups along the columns of C
override TM: u32 = 2u;        // result matrices a subgroup along the rows (≤ 4)
override TN: u32 = 4u;        // and along the columns (≤ 4)
override KSTEP: u32 = 128u;   // the sum's step staged at once: a multiple of SM_K (and of the staging's loads)
override PAD: u32 = 16u;      // bytes after each staged row (against bank conflicts)
override DIGITS: u32 = 1u;    // planes of A rows (1, or SUB_M)
override WG: u32 = SUB_M * SUB_N * SM_SUBGROUP;
override BM: u32 = SUB_M * TM * SM_M;              // staged rows of A
override BN: u32 = SUB_N * TN * SM_N;              // columns of C
override RESULT_ROW: u32 = TN * SM_N;          // columns of a subgroup's row of result matrices
override RESULT_PAD: u32 = 8u;                 // words after each staged row of results (against bank conflicts)
override RESULT_STRIDE: u32 = RESULT_ROW + RESULT_PAD;

struct Fetched {
  a0: vec4<u32>,
  a1: vec4<u32>,
  a2: vec4<u32>,
  a3: vec4<u32>,
  a4: vec4<u32>,
  a5: vec4<u32>,
  a6: vec4<u32>,
  a7: vec4<u32>,
  b0: vec4<u32>,
  b1: vec4<u32>,
  b2: vec4<u32>,
  b3: vec4<u32>,
  b4: vec4<u32>,
  b5: vec4<u32>,
  b6: vec4<u32>,
  b7: vec4<u32>,
}

// Step kk's global loads (A_LOADS of A and B_LOADS of the weights, vec4s) into f.
fn fetch(f: ptr<function, Fetched>, t: u32, tok0: u32, c0: u32, kk: u32, k_end: u32) {
  { (*f).a0 = load_a(t + 0u * WG, tok0, kk, k_end); }
  if (A_LOADS > 1u) { (*f).a1 = load_a(t + 1u * WG, tok0, kk, k_end); }
  if (A_LOADS > 2u) { (*f).a2 = load_a(t + 2u * WG, tok0, kk, k_end); }
  if (A_LOADS > 3u) { (*f).a3 = load_a(t + 3u * WG, tok0, kk, k_end); }
  if (A_LOADS > 4u) { (*f).a4 = load_a(t + 4u * WG, tok0, kk, k_end); }
  if (A_LOADS > 5u) { (*f).a5 = load_a(t + 5u * WG, tok0, kk, k_end); }
  if (A_LOADS > 6u) { (*f).a6 = load_a(t + 6u * WG, tok0, kk, k_end); }
  if (A_LOADS > 7u) { (*f).a7 = load_a(t + 7u * WG, tok0, kk, k_end); }
  { (*f).b0 = load_b(t + 0u * WG, c0, kk, k_end); }
  if (B_LOADS > 1u) { (*f).b1 = load_b(t + 1u * WG, c0, kk, k_end); }
  if (B_LOADS > 2u) { (*f).b2 = load_b(t + 2u * WG, c0, kk, k_end); }
  if (B_LOADS > 3u) { (*f).b3 = load_b(t + 3u * WG, c0, kk, k_end); }
  if (B_LOADS > 4u) { (*f).b4 = load_b(t + 4u * WG, c0, kk, k_end); }
  if (B_LOADS > 5u) { (*f).b5 = load_b(t + 5u * WG, c0, kk, k_end); }
  if (B_LOADS > 6u) { (*f).b6 = load_b(t + 6u * WG, c0, kk, k_end); }
  if (B_LOADS > 7u) { (*f).b7 = load_b(t + 7u * WG, c0, kk, k_end); }
}

// Writes f into workgroup memory (put_a, put_b).
fn stage(f: ptr<function, Fetched>, t: u32) {
  { put_a(t + 0u * WG, (*f).a0); }
  if (A_LOADS > 1u) { put_a(t + 1u * WG, (*f).a1); }
  if (A_LOADS > 2u) { put_a(t + 2u * WG, (*f).a2); }
  if (A_LOADS > 3u) { put_a(t + 3u * WG, (*f).a3); }
  if (A_LOADS > 4u) { put_a(t + 4u * WG, (*f).a4); }
  if (A_LOADS > 5u) { put_a(t + 5u * WG, (*f).a5); }
  if (A_LOADS > 6u) { put_a(t + 6u * WG, (*f).a6); }
  if (A_LOADS > 7u) { put_a(t + 7u * WG, (*f).a7); }
  { put_b(t + 0u * WG, (*f).b0); }
  if (B_LOADS > 1u) { put_b(t + 1u * WG, (*f).b1); }
  if (B_LOADS > 2u) { put_b(t + 2u * WG, (*f).b2); }
  if (B_LOADS > 3u) { put_b(t + 3u * WG, (*f).b3); }
  if (B_LOADS > 4u) { put_b(t + 4u * WG, (*f).b4); }
  if (B_LOADS > 5u) { put_b(t + 5u * WG, (*f).b5); }
  if (B_LOADS > 6u) { put_b(t + 6u * WG, (*f).b6); }
  if (B_LOADS > 7u) { put_b(t + 7u * WG, (*f).b7); }
}

struct Acc {
  c00: O,
  c01: O,
  c02: O,
  c03: O,
  c10: O,
  c11: O,
  c12: O,
  c13: O,
  c20: O,
  c21: O,
  c22: O,
  c23: O,
  c30: O,
  c31: O,
  c32: O,
  c33: O,
}

// Sub-step q of the staged step: the subgroup's TM × TN products.
fn multiply_step(acc: ptr<function, Acc>, sr: u32, sc: u32, q: u32) {
  let b0 = right(sc, 0u, q);
  var b1 = b0;
  if (TN > 1u) { b1 = right(sc, 1u, q); }
  var b2 = b0;
  if (TN > 2u) { b2 = right(sc, 2u, q); }
  var b3 = b0;
  if (TN > 3u) { b3 = right(sc, 3u, q); }
  let a0 = left(sr, 0u, q);
  (*acc).c00 = subgroupMatrixMultiplyAccumulate(a0, b0, (*acc).c00);
  if (TN > 1u) { (*acc).c01 = subgroupMatrixMultiplyAccumulate(a0, b1, (*acc).c01); }
  if (TN > 2u) { (*acc).c02 = subgroupMatrixMultiplyAccumulate(a0, b2, (*acc).c02); }
  if (TN > 3u) { (*acc).c03 = subgroupMatrixMultiplyAccumulate(a0, b3, (*acc).c03); }
  if (TM > 1u) {
    let a1 = left(sr, 1u, q);
    (*acc).c10 = subgroupMatrixMultiplyAccumulate(a1, b0, (*acc).c10);
    if (TN > 1u) { (*acc).c11 = subgroupMatrixMultiplyAccumulate(a1, b1, (*acc).c11); }
    if (TN > 2u) { (*acc).c12 = subgroupMatrixMultiplyAccumulate(a1, b2, (*acc).c12); }
    if (TN > 3u) { (*acc).c13 = subgroupMatrixMultiplyAccumulate(a1, b3, (*acc).c13); }
  }
  if (TM > 2u) {
    let a2 = left(sr, 2u, q);
    (*acc).c20 = subgroupMatrixMultiplyAccumulate(a2, b0, (*acc).c20);
    if (TN > 1u) { (*acc).c21 = subgroupMatrixMultiplyAccumulate(a2, b1, (*acc).c21); }
    if (TN > 2u) { (*acc).c22 = subgroupMatrixMultiplyAccumulate(a2, b2, (*acc).c22); }
    if (TN > 3u) { (*acc).c23 = subgroupMatrixMultiplyAccumulate(a2, b3, (*acc).c23); }
  }
  if (TM > 3u) {
    let a3 = left(sr, 3u, q);
    (*acc).c30 = subgroupMatrixMultiplyAccumulate(a3, b0, (*acc).c30);
    if (TN > 1u) { (*acc).c31 = subgroupMatrixMultiplyAccumulate(a3, b1, (*acc).c31); }
    if (TN > 2u) { (*acc).c32 = subgroupMatrixMultiplyAccumulate(a3, b2, (*acc).c32); }
    if (TN > 3u) { (*acc).c33 = subgroupMatrixMultiplyAccumulate(a3, b3, (*acc).c33); }
  }
}

// The range [begin, end) of a sum of `length` terms that part z of `parts` covers (split-K over the
// grid's z): whole steps, the last ranges possibly empty.
fn sum_range(z: u32, parts: u32, length: u32) -> vec2<u32> {
  let span = (length + parts * KSTEP - 1u) / (parts * KSTEP) * KSTEP;
  return vec2<u32>(min(z * span, length), min(z * span + span, length));
}

// Adds to acc the subgroup (sr, sc)'s sums over [k_begin, k_end) of the workgroup at token tok0 and
// column c0 (every invocation of the workgroup calls it: it stages with barriers).
fn multiply(acc: ptr<function, Acc>, t: u32, sr: u32, sc: u32, tok0: u32, c0: u32, k_begin: u32, k_end: u32) {
  var f: Fetched;
  fetch(&f, t, tok0, c0, k_begin, k_end);
  for (var kk = k_begin; kk < k_end; kk += KSTEP) {
    stage(&f, t);
    workgroupBarrier();
    if (kk + KSTEP < k_end) { fetch(&f, t, tok0, c0, kk + KSTEP, k_end); }
    for (var q = 0u; q < KSTEP / SM_K; q++) { multiply_step(acc, sr, sc, q); }
    workgroupBarrier();
    after_step(acc, sr, sc, kk, k_begin, k_end);
  }
}

// For an epilogue that sums DIGITS planes (subgroup row d: plane d) of row i of the result matrices,
// staged side by side (stage_result): quad e of the planes' columns, four of them an invocation.
// n: its token; col: its first column of C; at: plane 0's first value among the staged results,
// plane d's PLANE_STRIDE · d further.
struct PlaneQuad {
  n: u32,
  col: u32,
  at: u32,
}

override PLANE_STRIDE: u32 = SUB_N * SM_M * RESULT_STRIDE;
override PLANE_QUADS: u32 = SUB_N * SM_M * RESULT_ROW / 4u;  // quads of a row of matrices across the planes' columns

fn plane_quad(e: u32, n0: u32, c0: u32, i: u32) -> PlaneQuad {
  let quads = SM_M * RESULT_ROW / 4u;      // a subgroup's
  let sc = e / quads;                       // the subgroup column whose row of matrices this is
  let r = (e % quads) / (RESULT_ROW / 4u);  // its row
  let c = 4u * (e % (RESULT_ROW / 4u));     // its first column
  return PlaneQuad(n0 + i * SM_M + r, c0 + sc * RESULT_ROW + c, sc * SM_M * RESULT_STRIDE + r * RESULT_STRIDE + c);
}

// Each row i of every subgroup's result matrices through Staged into the including file's finish.
fn put_results(acc: ptr<function, Acc>, t: u32, lane: u32, sg: u32, n0: u32, c0: u32) {
  stage_result((*acc).c00, sg, 0u);
  if (TN > 1u) { stage_result((*acc).c01, sg, 1u); }
  if (TN > 2u) { stage_result((*acc).c02, sg, 2u); }
  if (TN > 3u) { stage_result((*acc).c03, sg, 3u); }
  workgroupBarrier();
  finish(t, lane, sg, n0, c0, 0u);
  workgroupBarrier();
  if (TM > 1u) {
    stage_result((*acc).c10, sg, 0u);
    if (TN > 1u) { stage_result((*acc).c11, sg, 1u); }
    if (TN > 2u) { stage_result((*acc).c12, sg, 2u); }
    if (TN > 3u) { stage_result((*acc).c13, sg, 3u); }
    workgroupBarrier();
    finish(t, lane, sg, n0, c0, 1u);
    workgroupBarrier();
  }
  if (TM > 2u) {
    stage_result((*acc).c20, sg, 0u);
    if (TN > 1u) { stage_result((*acc).c21, sg, 1u); }
    if (TN > 2u) { stage_result((*acc).c22, sg, 2u); }
    if (TN > 3u) { stage_result((*acc).c23, sg, 3u); }
    workgroupBarrier();
    finish(t, lane, sg, n0, c0, 2u);
    workgroupBarrier();
  }
  if (TM > 3u) {
    stage_result((*acc).c30, sg, 0u);
    if (TN > 1u) { stage_result((*acc).c31, sg, 1u); }
    if (TN > 2u) { stage_result((*acc).c32, sg, 2u); }
    if (TN > 3u) { stage_result((*acc).c33, sg, 3u); }
    workgroupBarrier();
    finish(t, lane, sg, n0, c0, 3u);
    workgroupBarrier();
  }
}
