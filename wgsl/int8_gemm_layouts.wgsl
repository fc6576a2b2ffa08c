// The matrix-unit int8 GEMM's main loop under each layout of its operands, for
// benchmarks/matrix_units.py's "layouts" section: where the engine's kernel
// (_ternary_mma_tile.wgsl, which unpacks the ternary weights as it stages them) spends its time.
//   C[r][c] = Σ_κ A[r][κ] · W[c][κ],  A int8 [tokens][k], W int8 [n][k] (weights already unpacked),
//   C i32 [tokens][n], four int8 a u32, rows of k bytes.
// * staged: each KSTEP of A staged through workgroup memory, and with STAGE_W of W too (else W's
//   right matrices loaded straight from storage); DOUBLE: two buffers, one barrier a step, else
//   one buffer and two. The next step's global loads go out before this step's multiplies.
// * direct: A's and W's matrices straight from storage, no workgroup memory, no barrier.
// Subgroup (sr, sc) of SUB_M × SUB_N holds TM × TN result matrices (named, never an array), stored
// straight to C. No edges: the launch checks that the shape is a multiple of the tile. The
// accumulators and products mirror _ternary_mma_tile.wgsl's rather than include it: that file's
// staging and right-matrix loads are the engine's one layout, the thing these variants replace.
// @subgroup-matrix i8 i32

struct Params {
  tokens: u32,
  n: u32,
  k: u32,  // bytes a row of A and of W
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> AV: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> AS: array<i32>;
@group(0) @binding(3) var<storage, read> WV: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> WS: array<i32>;
@group(0) @binding(5) var<storage, read_write> OUT: array<i32>;

alias L = subgroup_matrix_left<i8, SM_K, SM_M>;
alias R = subgroup_matrix_right<i8, SM_N, SM_K>;
alias O = subgroup_matrix_result<i32, SM_N, SM_M>;

override SUB_M: u32 = 2u;
override SUB_N: u32 = 2u;
override TM: u32 = 4u;
override TN: u32 = 4u;
override KSTEP: u32 = 64u;
override PAD: u32 = 16u;
override STAGE_W: bool = false;
override DOUBLE: bool = false;
override WG: u32 = SUB_M * SUB_N * SM_SUBGROUP;
override BM: u32 = SUB_M * TM * SM_M;
override BN: u32 = SUB_N * TN * SM_N;
override STRIDE: u32 = KSTEP + PAD;  // bytes a staged row
override A_BYTES: u32 = BM * STRIDE;
override HALF_BYTES: u32 = A_BYTES + select(0u, BN * STRIDE, STAGE_W);  // a buffer: A's step, then W's
override A_LOADS: u32 = (BM * KSTEP / 16u + WG - 1u) / WG;
override W_LOADS: u32 = select(0u, (BN * KSTEP / 16u + WG - 1u) / WG, STAGE_W);

const STAGED_WORDS: u32 = SM_STORAGE / 4u;  // a constant length, as subgroupMatrixLoad takes
var<workgroup> Staged: array<i32, STAGED_WORDS>;

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
struct Fetched {
  a0: vec4<u32>,
  a1: vec4<u32>,
  a2: vec4<u32>,
  a3: vec4<u32>,
  a4: vec4<u32>,
  a5: vec4<u32>,
  a6: vec4<u32>,
  a7: vec4<u32>,
  w0: vec4<u32>,
  w1: vec4<u32>,
  w2: vec4<u32>,
  w3: vec4<u32>,
  w4: vec4<u32>,
  w5: vec4<u32>,
  w6: vec4<u32>,
  w7: vec4<u32>,
}

// Row i of the subgroup's products: left matrix a times the right ones.
fn mma_row(acc: ptr<function, Acc>, i: u32, a: L, b0: R, b1: R, b2: R, b3: R) {
  if (i == 0u) {
    (*acc).c00 = subgroupMatrixMultiplyAccumulate(a, b0, (*acc).c00);
    if (TN > 1u) { (*acc).c01 = subgroupMatrixMultiplyAccumulate(a, b1, (*acc).c01); }
    if (TN > 2u) { (*acc).c02 = subgroupMatrixMultiplyAccumulate(a, b2, (*acc).c02); }
    if (TN > 3u) { (*acc).c03 = subgroupMatrixMultiplyAccumulate(a, b3, (*acc).c03); }
  } else if (i == 1u) {
    (*acc).c10 = subgroupMatrixMultiplyAccumulate(a, b0, (*acc).c10);
    if (TN > 1u) { (*acc).c11 = subgroupMatrixMultiplyAccumulate(a, b1, (*acc).c11); }
    if (TN > 2u) { (*acc).c12 = subgroupMatrixMultiplyAccumulate(a, b2, (*acc).c12); }
    if (TN > 3u) { (*acc).c13 = subgroupMatrixMultiplyAccumulate(a, b3, (*acc).c13); }
  } else if (i == 2u) {
    (*acc).c20 = subgroupMatrixMultiplyAccumulate(a, b0, (*acc).c20);
    if (TN > 1u) { (*acc).c21 = subgroupMatrixMultiplyAccumulate(a, b1, (*acc).c21); }
    if (TN > 2u) { (*acc).c22 = subgroupMatrixMultiplyAccumulate(a, b2, (*acc).c22); }
    if (TN > 3u) { (*acc).c23 = subgroupMatrixMultiplyAccumulate(a, b3, (*acc).c23); }
  } else {
    (*acc).c30 = subgroupMatrixMultiplyAccumulate(a, b0, (*acc).c30);
    if (TN > 1u) { (*acc).c31 = subgroupMatrixMultiplyAccumulate(a, b1, (*acc).c31); }
    if (TN > 2u) { (*acc).c32 = subgroupMatrixMultiplyAccumulate(a, b2, (*acc).c32); }
    if (TN > 3u) { (*acc).c33 = subgroupMatrixMultiplyAccumulate(a, b3, (*acc).c33); }
  }
}

fn store_all(acc: ptr<function, Acc>, r0: u32, c0: u32) {
  let s = p.n;
  subgroupMatrixStore(&OUT, r0 * s + c0, (*acc).c00, false, s);
  if (TN > 1u) { subgroupMatrixStore(&OUT, r0 * s + c0 + SM_N, (*acc).c01, false, s); }
  if (TN > 2u) { subgroupMatrixStore(&OUT, r0 * s + c0 + 2u * SM_N, (*acc).c02, false, s); }
  if (TN > 3u) { subgroupMatrixStore(&OUT, r0 * s + c0 + 3u * SM_N, (*acc).c03, false, s); }
  if (TM > 1u) {
    let r = (r0 + SM_M) * s + c0;
    subgroupMatrixStore(&OUT, r, (*acc).c10, false, s);
    if (TN > 1u) { subgroupMatrixStore(&OUT, r + SM_N, (*acc).c11, false, s); }
    if (TN > 2u) { subgroupMatrixStore(&OUT, r + 2u * SM_N, (*acc).c12, false, s); }
    if (TN > 3u) { subgroupMatrixStore(&OUT, r + 3u * SM_N, (*acc).c13, false, s); }
  }
  if (TM > 2u) {
    let r = (r0 + 2u * SM_M) * s + c0;
    subgroupMatrixStore(&OUT, r, (*acc).c20, false, s);
    if (TN > 1u) { subgroupMatrixStore(&OUT, r + SM_N, (*acc).c21, false, s); }
    if (TN > 2u) { subgroupMatrixStore(&OUT, r + 2u * SM_N, (*acc).c22, false, s); }
    if (TN > 3u) { subgroupMatrixStore(&OUT, r + 3u * SM_N, (*acc).c23, false, s); }
  }
  if (TM > 3u) {
    let r = (r0 + 3u * SM_M) * s + c0;
    subgroupMatrixStore(&OUT, r, (*acc).c30, false, s);
    if (TN > 1u) { subgroupMatrixStore(&OUT, r + SM_N, (*acc).c31, false, s); }
    if (TN > 2u) { subgroupMatrixStore(&OUT, r + 2u * SM_N, (*acc).c32, false, s); }
    if (TN > 3u) { subgroupMatrixStore(&OUT, r + 3u * SM_N, (*acc).c33, false, s); }
  }
}

@compute @workgroup_size(WG)
fn direct(@builtin(workgroup_id) wg: vec3<u32>, @builtin(subgroup_id) sg: u32) {
  let r0 = wg.y * BM + (sg / SUB_N) * TM * SM_M;
  let c0 = wg.x * BN + (sg % SUB_N) * TN * SM_N;
  var acc: Acc;
  for (var kk = 0u; kk < p.k; kk += SM_K) {
    let b0 = subgroupMatrixLoad<R>(&WS, c0 * p.k + kk, true, p.k);
    var b1 = b0; var b2 = b0; var b3 = b0;
    if (TN > 1u) { b1 = subgroupMatrixLoad<R>(&WS, (c0 + SM_N) * p.k + kk, true, p.k); }
    if (TN > 2u) { b2 = subgroupMatrixLoad<R>(&WS, (c0 + 2u * SM_N) * p.k + kk, true, p.k); }
    if (TN > 3u) { b3 = subgroupMatrixLoad<R>(&WS, (c0 + 3u * SM_N) * p.k + kk, true, p.k); }
    mma_row(&acc, 0u, subgroupMatrixLoad<L>(&AS, r0 * p.k + kk, false, p.k), b0, b1, b2, b3);
    if (TM > 1u) { mma_row(&acc, 1u, subgroupMatrixLoad<L>(&AS, (r0 + SM_M) * p.k + kk, false, p.k), b0, b1, b2, b3); }
    if (TM > 2u) { mma_row(&acc, 2u, subgroupMatrixLoad<L>(&AS, (r0 + 2u * SM_M) * p.k + kk, false, p.k), b0, b1, b2, b3); }
    if (TM > 3u) { mma_row(&acc, 3u, subgroupMatrixLoad<L>(&AS, (r0 + 3u * SM_M) * p.k + kk, false, p.k), b0, b1, b2, b3); }
  }
  store_all(&acc, r0, c0);
}

fn load_a(v: u32, r0: u32, kk: u32) -> vec4<u32> {
  if (v >= BM * KSTEP / 16u) { return vec4<u32>(0u); }
  return AV[((r0 + v / (KSTEP / 16u)) * p.k + kk + 16u * (v % (KSTEP / 16u))) / 16u];
}
fn load_w(v: u32, c0: u32, kk: u32) -> vec4<u32> {
  if (v >= BN * KSTEP / 16u) { return vec4<u32>(0u); }
  return WV[((c0 + v / (KSTEP / 16u)) * p.k + kk + 16u * (v % (KSTEP / 16u))) / 16u];
}
fn put(base: u32, v: u32, limit: u32, x: vec4<u32>) {
  if (v >= limit) { return; }
  let b = (base + (v / (KSTEP / 16u)) * STRIDE + 16u * (v % (KSTEP / 16u))) / 4u;
  Staged[b] = bitcast<i32>(x.x); Staged[b + 1u] = bitcast<i32>(x.y);
  Staged[b + 2u] = bitcast<i32>(x.z); Staged[b + 3u] = bitcast<i32>(x.w);
}
fn fetch(f: ptr<function, Fetched>, t: u32, r0: u32, c0: u32, kk: u32) {
  (*f).a0 = load_a(t, r0, kk);
  if (A_LOADS > 1u) { (*f).a1 = load_a(t + WG, r0, kk); }
  if (A_LOADS > 2u) { (*f).a2 = load_a(t + 2u * WG, r0, kk); }
  if (A_LOADS > 3u) { (*f).a3 = load_a(t + 3u * WG, r0, kk); }
  if (A_LOADS > 4u) { (*f).a4 = load_a(t + 4u * WG, r0, kk); }
  if (A_LOADS > 5u) { (*f).a5 = load_a(t + 5u * WG, r0, kk); }
  if (A_LOADS > 6u) { (*f).a6 = load_a(t + 6u * WG, r0, kk); }
  if (A_LOADS > 7u) { (*f).a7 = load_a(t + 7u * WG, r0, kk); }
  if (W_LOADS > 0u) { (*f).w0 = load_w(t, c0, kk); }
  if (W_LOADS > 1u) { (*f).w1 = load_w(t + WG, c0, kk); }
  if (W_LOADS > 2u) { (*f).w2 = load_w(t + 2u * WG, c0, kk); }
  if (W_LOADS > 3u) { (*f).w3 = load_w(t + 3u * WG, c0, kk); }
  if (W_LOADS > 4u) { (*f).w4 = load_w(t + 4u * WG, c0, kk); }
  if (W_LOADS > 5u) { (*f).w5 = load_w(t + 5u * WG, c0, kk); }
  if (W_LOADS > 6u) { (*f).w6 = load_w(t + 6u * WG, c0, kk); }
  if (W_LOADS > 7u) { (*f).w7 = load_w(t + 7u * WG, c0, kk); }
}
fn stage(f: ptr<function, Fetched>, t: u32, half: u32) {
  let base = half * HALF_BYTES;
  let la = BM * KSTEP / 16u;
  put(base, t, la, (*f).a0);
  if (A_LOADS > 1u) { put(base, t + WG, la, (*f).a1); }
  if (A_LOADS > 2u) { put(base, t + 2u * WG, la, (*f).a2); }
  if (A_LOADS > 3u) { put(base, t + 3u * WG, la, (*f).a3); }
  if (A_LOADS > 4u) { put(base, t + 4u * WG, la, (*f).a4); }
  if (A_LOADS > 5u) { put(base, t + 5u * WG, la, (*f).a5); }
  if (A_LOADS > 6u) { put(base, t + 6u * WG, la, (*f).a6); }
  if (A_LOADS > 7u) { put(base, t + 7u * WG, la, (*f).a7); }
  let lw = BN * KSTEP / 16u;
  let wb = base + A_BYTES;
  if (W_LOADS > 0u) { put(wb, t, lw, (*f).w0); }
  if (W_LOADS > 1u) { put(wb, t + WG, lw, (*f).w1); }
  if (W_LOADS > 2u) { put(wb, t + 2u * WG, lw, (*f).w2); }
  if (W_LOADS > 3u) { put(wb, t + 3u * WG, lw, (*f).w3); }
  if (W_LOADS > 4u) { put(wb, t + 4u * WG, lw, (*f).w4); }
  if (W_LOADS > 5u) { put(wb, t + 5u * WG, lw, (*f).w5); }
  if (W_LOADS > 6u) { put(wb, t + 6u * WG, lw, (*f).w6); }
  if (W_LOADS > 7u) { put(wb, t + 7u * WG, lw, (*f).w7); }
}
fn right(half: u32, sc: u32, j: u32, c0: u32, kk: u32, q: u32) -> R {
  if (STAGE_W) {
    return subgroupMatrixLoad<R>(&Staged, half * HALF_BYTES + A_BYTES + (sc * TN * SM_N + j * SM_N) * STRIDE + q * SM_K,
                                 true, STRIDE);
  }
  return subgroupMatrixLoad<R>(&WS, (c0 + sc * TN * SM_N + j * SM_N) * p.k + kk + q * SM_K, true, p.k);
}
fn left(half: u32, sr: u32, i: u32, q: u32) -> L {
  return subgroupMatrixLoad<L>(&Staged, half * HALF_BYTES + (sr * TM * SM_M + i * SM_M) * STRIDE + q * SM_K, false, STRIDE);
}
fn multiply_step(acc: ptr<function, Acc>, half: u32, sr: u32, sc: u32, c0: u32, kk: u32) {
  for (var q = 0u; q < KSTEP / SM_K; q++) {
    let b0 = right(half, sc, 0u, c0, kk, q);
    var b1 = b0; var b2 = b0; var b3 = b0;
    if (TN > 1u) { b1 = right(half, sc, 1u, c0, kk, q); }
    if (TN > 2u) { b2 = right(half, sc, 2u, c0, kk, q); }
    if (TN > 3u) { b3 = right(half, sc, 3u, c0, kk, q); }
    mma_row(acc, 0u, left(half, sr, 0u, q), b0, b1, b2, b3);
    if (TM > 1u) { mma_row(acc, 1u, left(half, sr, 1u, q), b0, b1, b2, b3); }
    if (TM > 2u) { mma_row(acc, 2u, left(half, sr, 2u, q), b0, b1, b2, b3); }
    if (TM > 3u) { mma_row(acc, 3u, left(half, sr, 3u, q), b0, b1, b2, b3); }
  }
}

@compute @workgroup_size(WG)
fn staged(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32,
          @builtin(subgroup_id) sg: u32) {
  let r0 = wg.y * BM;
  let c0 = wg.x * BN;
  let sr = sg / SUB_N;
  let sc = sg % SUB_N;
  var acc: Acc;
  var f: Fetched;
  fetch(&f, t, r0, c0, 0u);
  if (DOUBLE) {
    stage(&f, t, 0u);
    workgroupBarrier();
    var half = 0u;
    for (var kk = 0u; kk < p.k; kk += KSTEP) {
      let more = kk + KSTEP < p.k;
      if (more) { fetch(&f, t, r0, c0, kk + KSTEP); }
      multiply_step(&acc, half, sr, sc, c0, kk);
      if (more) { stage(&f, t, 1u - half); }
      workgroupBarrier();
      half = 1u - half;
    }
  } else {
    for (var kk = 0u; kk < p.k; kk += KSTEP) {
      stage(&f, t, 0u);
      workgroupBarrier();
      if (kk + KSTEP < p.k) { fetch(&f, t, r0, c0, kk + KSTEP); }
      multiply_step(&acc, 0u, sr, sc, c0, kk);
      workgroupBarrier();
    }
  }
  store_all(&acc, r0 + sr * TM * SM_M, c0 + sc * TN * SM_N);
}
