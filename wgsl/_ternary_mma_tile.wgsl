// Shared by bitlinear_mma.wgsl and bitlinear_t_mma.wgsl (// @include): the main loop of a GEMM on
// the matrix units, int8 rows × ternary weights → i32, generic over the adapter's subgroup-matrix
// shape. The runtime writes SM_M, SM_N, SM_K (the int8 × int8 → i32 configuration: 16 × 16 × 32 on
// NVIDIA, 8 × 8 × 8 on lavapipe), SM_SUBGROUP (its subgroup size) and SM_STORAGE (the device's bytes
// of workgroup memory) before the source.
//
//   C[r][c] = Σ_κ A[r][κ] · T[c][κ]
//
// A: int8 rows, four to a u32 (vec4 loads of 16), its rows in DIGITS planes of `a_tokens` rows each
// (a projection's codes: one plane; an input gradient's digits: one plane a digit). T: packed
// ternary weights (weights.py's layout: 16 a u32, codes t + 1), a row a column of C: a projection's
// own weights, an input gradient's transposed copy (bitlinear.py's transposed_weights), so that both
// stage their weights alike, as [BN][KSTEP] (on the H100 a row-major int8 right matrix loaded 2.2×
// slower than a column-major one, and an input gradient that transposed the weights' words as it
// staged them took 1.16-1.35× the time it takes from the transposed copy: device run 27).
//
// A workgroup of SUB_M × SUB_N subgroups owns BM staged rows of A × BN columns of C; subgroup
// (sr, sc) holds TM × TN result matrices. The staged rows are the DIGITS planes' rows of the
// workgroup's BM / DIGITS tokens, plane by plane, so with DIGITS = SUB_M subgroup row sr holds plane
// sr. Each step of KSTEP along the sum is staged in workgroup memory (A as it is; the weights
// unpacked to int8), rows padded by PAD bytes against bank conflicts; the next step's global loads are
// issued right after the barrier, before this step's multiplies. Rows, columns and sums past their
// ends are staged as zeros. What a thread holds (accumulators, the right matrices, the next step's
// loads) is in named variables, fields of structs read by constant names under override conditions,
// never arrays: an array of subgroup matrices indexed in a loop ran at a quarter of the speed on the
// H100 (benchmarks/results/h100/matrix_units.md).
//
// The including file declares Params with a_tokens (rows of a plane), a_words (u32 words a row of
// A), t_rows (T's rows), t_words (u32 words a row of T: a multiple of 4), the bindings AQ
// (array<vec4<u32>>) and T4 (array<vec4<u32>>), and
//   fn finish(t: u32, lane: u32, sg: u32, n0: u32, c0: u32, i: u32): the epilogue of row i of every
//     subgroup's result matrices, staged side by side at Staged[sg · SM_M · RESULT_STRIDE] as SM_M
//     rows of RESULT_ROW = TN · SM_N, RESULT_STRIDE apart (put_results calls it: a row of matrices a
//     round, stores along rows of RESULT_ROW columns).

alias L = subgroup_matrix_left<i8, SM_K, SM_M>;
alias R = subgroup_matrix_right<i8, SM_N, SM_K>;
alias O = subgroup_matrix_result<i32, SM_N, SM_M>;

override SUB_M: u32 = 4u;     // subgroups along the rows of A
override SUB_N: u32 = 2u;     // subgroups along the columns of C
override TM: u32 = 2u;        // result matrices a subgroup along the rows (≤ 4)
override TN: u32 = 4u;        // and along the columns (≤ 4)
override KSTEP: u32 = 128u;   // the sum's step staged at once: a multiple of 64 and of SM_K
override PAD: u32 = 16u;      // bytes after each staged row
override DIGITS: u32 = 1u;    // planes of A rows (1, or SUB_M)
override WG: u32 = SUB_M * SUB_N * SM_SUBGROUP;
override BM: u32 = SUB_M * TM * SM_M;              // staged rows of A
override BN: u32 = SUB_N * TN * SM_N;              // columns of C
override A_STRIDE: u32 = KSTEP + PAD;              // bytes a staged row of A
override T_STRIDE: u32 = KSTEP + PAD;              // bytes a staged row of weights: [BN][KSTEP]
override A_LOADS: u32 = (BM * KSTEP / 16u + WG - 1u) / WG;         // vec4 loads a thread a step (≤ 8)
override T_LOADS: u32 = (BN * KSTEP / 64u + WG - 1u) / WG;          // of 64 weights each

override A_WORDS: u32 = BM * A_STRIDE / 4u;  // the staged A [BM][A_STRIDE] bytes, then the weights
override RESULT_ROW: u32 = TN * SM_N;          // columns of a subgroup's row of result matrices
override RESULT_PAD: u32 = 8u;                 // words after each staged row of results (against bank conflicts)
override RESULT_STRIDE: u32 = RESULT_ROW + RESULT_PAD;

// Workgroup memory: the device's (SM_STORAGE, which the runtime writes too), a constant, as
// subgroupMatrixLoad takes arrays of a constant length (gemms.mma_shape checks that the staged step,
// and the results put_results stages after the loop, fit).
const STAGED_WORDS: u32 = SM_STORAGE / 4u;
const ZERO_CODES: u32 = 0x55555555u;  // sixteen weights of value 0 (code 1)

var<workgroup> Staged: array<i32, STAGED_WORDS>;  // A's rows, then the weights' [BN][T_STRIDE] bytes

// The four int8 weights of bit pair `shift / 2` of each byte lane: code c = t + 1 → t (no byte
// borrows: every byte is at least 0x80 when 1 is taken away).
fn unpacked(word: u32, shift: u32) -> i32 {
  return bitcast<i32>(((((word >> shift) & 0x03030303u) | 0x80808080u) - 0x01010101u) ^ 0x80808080u);
}

struct Fetched {
  a0: vec4<u32>,
  a1: vec4<u32>,
  a2: vec4<u32>,
  a3: vec4<u32>,
  a4: vec4<u32>,
  a5: vec4<u32>,
  a6: vec4<u32>,
  a7: vec4<u32>,
  t0: vec4<u32>,
  t1: vec4<u32>,
  t2: vec4<u32>,
  t3: vec4<u32>,
  t4: vec4<u32>,
  t5: vec4<u32>,
  t6: vec4<u32>,
  t7: vec4<u32>,
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

// The staged A's vec4 v (this thread's q-th: v = t + WG · q) of step kk: row v / (KSTEP / 16), 16 bytes
// (v % (KSTEP / 16)); zero past the tokens, the sum's end or the tile.
fn load_a(v: u32, tok0: u32, kk: u32, k_end: u32) -> vec4<u32> {
  let r = v / (KSTEP / 16u);
  let tok = tok0 + r % (BM / DIGITS);
  let kb = kk + 16u * (v % (KSTEP / 16u));
  if (v >= BM * KSTEP / 16u || tok >= p.a_tokens || kb >= k_end) { return vec4<u32>(0u); }
  return AQ[((r / (BM / DIGITS)) * p.a_tokens + tok) * (p.a_words / 4u) + kb / 16u];
}

// The staged weights' load v of step kk: the vec4 of row c0 + v / (KSTEP / 64) holding the sum's
// weights 64 (v % (KSTEP / 64)).. of the step; zero past the rows or a row's end (A is zero past the
// sum's end).
fn load_t(v: u32, c0: u32, kk: u32) -> vec4<u32> {
  let row = c0 + v / (KSTEP / 64u);
  let col = kk + 64u * (v % (KSTEP / 64u));
  if (v >= BN * KSTEP / 64u || row >= p.t_rows || col >= 16u * p.t_words) { return vec4<u32>(ZERO_CODES); }
  return T4[(row * p.t_words + col / 16u) / 4u];
}

fn a_offset(v: u32) -> u32 { return (v / (KSTEP / 16u)) * A_STRIDE + 16u * (v % (KSTEP / 16u)); }  // bytes

fn t_offset(v: u32) -> u32 { return (v / (KSTEP / 64u)) * T_STRIDE + 64u * (v % (KSTEP / 64u)); }  // bytes

fn put_a(v: u32, a: vec4<u32>) {
  if (v >= BM * KSTEP / 16u) { return; }
  let b = a_offset(v) / 4u;
  Staged[b] = bitcast<i32>(a.x); Staged[b + 1u] = bitcast<i32>(a.y); Staged[b + 2u] = bitcast<i32>(a.z);
  Staged[b + 3u] = bitcast<i32>(a.w);
}

// Staged weights [BN][KSTEP] (the columns of C as rows, the sum along them, so that the right
// matrices load column-major, the layout int8 matrix units read natively).
fn put_t(v: u32, w: vec4<u32>) {
  if (v >= BN * KSTEP / 64u) { return; }
  let b = A_WORDS + t_offset(v) / 4u;
  Staged[b] = unpacked(w.x, 0u); Staged[b + 1u] = unpacked(w.x, 2u); Staged[b + 2u] = unpacked(w.x, 4u);
  Staged[b + 3u] = unpacked(w.x, 6u);
  Staged[b + 4u] = unpacked(w.y, 0u); Staged[b + 5u] = unpacked(w.y, 2u); Staged[b + 6u] = unpacked(w.y, 4u);
  Staged[b + 7u] = unpacked(w.y, 6u);
  Staged[b + 8u] = unpacked(w.z, 0u); Staged[b + 9u] = unpacked(w.z, 2u); Staged[b + 10u] = unpacked(w.z, 4u);
  Staged[b + 11u] = unpacked(w.z, 6u);
  Staged[b + 12u] = unpacked(w.w, 0u); Staged[b + 13u] = unpacked(w.w, 2u); Staged[b + 14u] = unpacked(w.w, 4u);
  Staged[b + 15u] = unpacked(w.w, 6u);
}

// Step kk's global loads (A_LOADS and T_LOADS of them) into f.
fn fetch(f: ptr<function, Fetched>, t: u32, tok0: u32, c0: u32, kk: u32, k_end: u32) {
  { (*f).a0 = load_a(t + 0u * WG, tok0, kk, k_end); }
  if (A_LOADS > 1u) { (*f).a1 = load_a(t + 1u * WG, tok0, kk, k_end); }
  if (A_LOADS > 2u) { (*f).a2 = load_a(t + 2u * WG, tok0, kk, k_end); }
  if (A_LOADS > 3u) { (*f).a3 = load_a(t + 3u * WG, tok0, kk, k_end); }
  if (A_LOADS > 4u) { (*f).a4 = load_a(t + 4u * WG, tok0, kk, k_end); }
  if (A_LOADS > 5u) { (*f).a5 = load_a(t + 5u * WG, tok0, kk, k_end); }
  if (A_LOADS > 6u) { (*f).a6 = load_a(t + 6u * WG, tok0, kk, k_end); }
  if (A_LOADS > 7u) { (*f).a7 = load_a(t + 7u * WG, tok0, kk, k_end); }
  { (*f).t0 = load_t(t + 0u * WG, c0, kk); }
  if (T_LOADS > 1u) { (*f).t1 = load_t(t + 1u * WG, c0, kk); }
  if (T_LOADS > 2u) { (*f).t2 = load_t(t + 2u * WG, c0, kk); }
  if (T_LOADS > 3u) { (*f).t3 = load_t(t + 3u * WG, c0, kk); }
  if (T_LOADS > 4u) { (*f).t4 = load_t(t + 4u * WG, c0, kk); }
  if (T_LOADS > 5u) { (*f).t5 = load_t(t + 5u * WG, c0, kk); }
  if (T_LOADS > 6u) { (*f).t6 = load_t(t + 6u * WG, c0, kk); }
  if (T_LOADS > 7u) { (*f).t7 = load_t(t + 7u * WG, c0, kk); }
}

fn stage(f: ptr<function, Fetched>, t: u32) {
  { put_a(t + 0u * WG, (*f).a0); }
  if (A_LOADS > 1u) { put_a(t + 1u * WG, (*f).a1); }
  if (A_LOADS > 2u) { put_a(t + 2u * WG, (*f).a2); }
  if (A_LOADS > 3u) { put_a(t + 3u * WG, (*f).a3); }
  if (A_LOADS > 4u) { put_a(t + 4u * WG, (*f).a4); }
  if (A_LOADS > 5u) { put_a(t + 5u * WG, (*f).a5); }
  if (A_LOADS > 6u) { put_a(t + 6u * WG, (*f).a6); }
  if (A_LOADS > 7u) { put_a(t + 7u * WG, (*f).a7); }
  { put_t(t + 0u * WG, (*f).t0); }
  if (T_LOADS > 1u) { put_t(t + 1u * WG, (*f).t1); }
  if (T_LOADS > 2u) { put_t(t + 2u * WG, (*f).t2); }
  if (T_LOADS > 3u) { put_t(t + 3u * WG, (*f).t3); }
  if (T_LOADS > 4u) { put_t(t + 4u * WG, (*f).t4); }
  if (T_LOADS > 5u) { put_t(t + 5u * WG, (*f).t5); }
  if (T_LOADS > 6u) { put_t(t + 6u * WG, (*f).t6); }
  if (T_LOADS > 7u) { put_t(t + 7u * WG, (*f).t7); }
}

// Right matrix j of the subgroup's column sc at sub-step q of the staged step.
fn right(sc: u32, j: u32, q: u32) -> R {
  return subgroupMatrixLoad<R>(&Staged, 4u * A_WORDS + (sc * TN * SM_N + j * SM_N) * T_STRIDE + q * SM_K, true,
                               T_STRIDE);
}

fn left(sr: u32, i: u32, q: u32) -> L {
  return subgroupMatrixLoad<L>(&Staged, (sr * TM * SM_M + i * SM_M) * A_STRIDE + q * SM_K, false, A_STRIDE);
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
  }
}

// Result matrix j of the subgroup's row being put, beside the row's others (RESULT_STRIDE words a row).
fn stage_result(m: O, sg: u32, j: u32) {
  subgroupMatrixStore(&Staged, sg * SM_M * RESULT_STRIDE + j * SM_N, m, false, RESULT_STRIDE);
}

// Element e (row e / RESULT_ROW) of subgroup sg's staged row of result matrices.
fn staged_result(sg: u32, e: u32) -> i32 {
  return Staged[sg * SM_M * RESULT_STRIDE + e / RESULT_ROW * RESULT_STRIDE + e % RESULT_ROW];
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
