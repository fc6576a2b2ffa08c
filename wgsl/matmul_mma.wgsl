// The LM head's GEMMs on the GPU's matrix units (f16 × f16 → f32), to float32 accuracy, for
// bfloat16 weights W [rows][K] (matmul.wgsl's layout: two to a u32, element 2i in the low half):
//
//   forward (W_ALONG_SUM false):        OUTF[n][out_offset + c] = Σ_κ A[n][κ] · W[c][κ]   (logits)
//   input gradient (W_ALONG_SUM true):  OUT[n][c] (+)= Σ_κ A[n][a_col + κ] · W[κ][c]        (dX)
//
// * W is exact in f16 once scaled by 2^e, one power of two for the whole matrix (largest: its
//   largest magnitude) that puts that magnitude in [2¹³, 2¹⁴): a bfloat16 value keeps its 8 bits
//   in f16 down to 2⁻¹⁷ of f16's range, so every weight within 2³⁰ of the largest is exact, and one
//   below that is off by at most 2⁻²⁵, 2⁻³⁸ of the largest.
// * A, float32, is split in place, a row at a time (split), into f16 pairs: the row scaled by 2^s_n
//   so that its largest |x| lies in [2¹³, 2¹⁴), x·2^s_n = hi + lo·2⁻¹¹ + δ, hi = x·2^s_n rounded to
//   11 significant bits (bit arithmetic: never a float round trip a compiler could fold away), lo
//   the remainder times 2¹¹ converted to f16; |δ| ≤ 2⁻²¹·|x·2^s_n| + 2⁻³⁵ (lo's own conversion,
//   or its subnormal step). The u32 that held x holds the pair (hi in its low half): A keeps its
//   shape, and the logits' 2 GB at 8 × 512 tokens need no second buffer.
// * gemm_tiled: the two planes hi and lo times W on the matrix units (_mma_tile.wgsl, DIGITS =
//   SUB_M = 2: subgroup row 0 the hi plane, row 1 the lo plane, each into its own f32 accumulators,
//   products exact in f32); the epilogue adds lo's sums times 2⁻¹¹ to hi's and scales by
//   2^−(s_n + e). Against float64 the error is a float32 GEMM's kind: the sums' float32 roundings
//   (the units' within DRAIN steps, then each lane's round-to-nearest sums of those) plus δ's.
// A row holding an infinity or NaN gives NaN outputs (split marks it; its pairs are zeros).
// @subgroup-matrix f16 f32

struct Params {
  tokens: u32,      // rows of A
  rows: u32,        // the sum's length: K (forward), the vocabulary chunk's rows (input gradient)
  columns: u32,     // columns of C: W's rows (forward), K (input gradient)
  w_words: u32,     // u32 words a row of W
  a_stride: u32,    // u32 words a row of A
  a_col: u32,       // A's first column of the sum (the input gradient's vocabulary chunk)
  width: u32,       // split: columns of a row of A it converts; largest: W's words
  out_stride: u32,  // floats a row of OUTF (forward), of OUT (input gradient)
  out_offset: u32,  // forward: OUTF's first column
  // the input gradient's store (_input_grad_store.wgsl): k = columns; no adapters on the head
  k: u32,
  lora_rank: u32,
  dh_stride: u32,
  la_stride: u32,
  accumulate: u32,
  drop_key: u32,
  drop_split1: u32,
  drop_split2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> A: array<u32>;             // gemm_tiled: the split rows of A
@group(0) @binding(2) var<storage, read> W4: array<vec4<u32>>;      // gemm_tiled: W
@group(0) @binding(3) var<storage, read> DSR: array<i32>;           // gemm_tiled: each row's s_n
@group(0) @binding(4) var<storage, read_write> OUT: array<vec4<f32>>;  // input gradient
@group(0) @binding(5) var<storage, read> DH: array<f32>;
@group(0) @binding(6) var<storage, read> LA: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> PART: array<vec4<f32>>;  // SPLITS > 1: the ranges' sums
@group(0) @binding(8) var<storage, read> DROP: array<u32>;
@group(0) @binding(9) var<storage, read_write> OUTF: array<f32>;    // forward
@group(0) @binding(10) var<storage, read> LARGEST: array<u32>;     // gemm_tiled: W's largest magnitude (f32 bits)
@group(0) @binding(11) var<storage, read_write> AS: array<u32>;    // split: A, rewritten in place
@group(0) @binding(12) var<storage, read_write> DS: array<i32>;    // split: each row's s_n
@group(0) @binding(13) var<storage, read> WL: array<u32>;          // largest: W
@group(0) @binding(14) var<storage, read_write> ML: array<atomic<u32>>;  // largest: its result

override W_ALONG_SUM: bool = false;
const NOT_FINITE: i32 = 0x7fffffff;  // DS's mark of a row holding an infinity or NaN
const TOP: i32 = 14;                 // a row's (and W's) largest magnitude scaled into [2^(TOP-1), 2^TOP)

// @include _mma_tile.wgsl
// @include _reductions.wgsl
// @include _dropout.wgsl
// @include _input_grad_store.wgsl

alias L = subgroup_matrix_left<f16, SM_K, SM_M>;
alias R = subgroup_matrix_right<f16, SM_N, SM_K>;
alias O = subgroup_matrix_result<f32, SM_N, SM_M>;

override A_STRIDE: u32 = KSTEP + PAD / 2u;  // halves a staged row of A
// halves a staged row of W: [BN][KSTEP] (its rows the columns of C), or [KSTEP][BN] (along the sum)
override W_STRIDE: u32 = select(KSTEP, BN, W_ALONG_SUM) + PAD / 2u;
override W_BASE: u32 = BM * A_STRIDE;            // the staged W's first half
override A_LOADS: u32 = ((BM / DIGITS) * KSTEP / 4u + WG - 1u) / WG;  // four pairs a load (≤ 8)
override B_LOADS: u32 = (BN * KSTEP / 8u + WG - 1u) / WG;             // eight weights a load (≤ 8)

// Workgroup memory, half for a staged step and half for the results (subgroupMatrixLoad takes arrays
// of a constant length; gemms.mma_shape checks that each fits in its half).
const STAGED_HALVES: u32 = SM_STORAGE / 4u;
const RESULT_WORDS: u32 = SM_STORAGE / 8u;
var<workgroup> Staged: array<f16, STAGED_HALVES>;
var<workgroup> Results: array<f32, RESULT_WORDS>;
var<private> w_scale: f32;  // 2^e
var<private> range: u32;    // the grid's z: the range of the sum (_input_grad_store.wgsl's store)

// x · 2^s without overflowing on the way (s reaches 163 for a row whose largest value is subnormal).
fn times_pow2(x: f32, s: i32) -> f32 { return ldexp(ldexp(x, s / 2), s - s / 2); }

fn scale_exponent(largest: f32) -> i32 { return TOP - frexp(largest).exp; }

// ---- split: a row of A in place, one workgroup a row (the grid's y: an indirect grid covers the
// labelled rows only) ----

// x (already scaled) as its f16 pair: hi rounded to 11 significant bits by adding half of the bits
// dropped (a carry into the exponent rounds up a power of two), zero below f16's normal range (lo
// keeps such values); lo the rest, times 2¹¹.
fn pair(x: f32) -> u32 {
  var hi = bitcast<f32>((bitcast<u32>(x) + 0x1000u) & 0xffffe000u);
  if (abs(x) < 0x1p-14f) { hi = 0.0; }
  return pack2x16float(vec2<f32>(hi, (x - hi) * 2048.0));
}

@compute @workgroup_size(WG)
fn split(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  let t = inv.t;
  let n = wg.y;
  let row = n * p.a_stride;
  var m = 0.0;
  var bad = 0i;  // values that are infinite or NaN (a NaN would drop out of the max)
  for (var j = t; j < p.width; j += WG) {
    let bits = AS[row + j];
    m = max(m, abs(bitcast<f32>(bits)));
    bad += i32((bits & 0x7f800000u) == 0x7f800000u);
  }
  m = max_all(t, m);
  let finite = sum_all_i(t, bad) == 0;
  let s = scale_exponent(m);
  if (t == 0u) { DS[n] = select(NOT_FINITE, s, finite); }
  for (var j = t; j < p.width; j += WG) {  // each value read and rewritten by the invocation that read it above
    var word = 0u;
    if (finite) { word = pair(times_pow2(bitcast<f32>(AS[row + j]), s)); }
    AS[row + j] = word;
  }
}

// ---- largest: W's largest magnitude, as f32 bits (an infinity or NaN: 0x7f800000 or more; positive
// floats order as their bits, and a NaN's exceed an infinity's), made once per weight matrix ----

@compute @workgroup_size(256)
fn largest(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
  var m = 0u;
  for (var i = gid.x; i < p.width; i += groups.x * 256u) {  // width: W's words
    let w = WL[i];
    m = max(m, max((w << 16u) & 0x7fffffffu, w & 0x7fff0000u));
  }
  atomicMax(&ML[0], m);
}

// ---- gemm_tiled: the staging of _mma_tile.wgsl's loop for f16 ----

// Load v of step kk of A: pairs κ .. κ + 3 of the tile's token row v / (KSTEP / 4); zero past the
// tokens or the sum's end.
fn load_a(v: u32, tok0: u32, kk: u32, k_end: u32) -> vec4<u32> {
  let tok = tok0 + v / (KSTEP / 4u);
  let k = kk + 4u * (v % (KSTEP / 4u));
  var a = vec4<u32>(0u);
  if (v >= (BM / DIGITS) * KSTEP / 4u || tok >= p.tokens) { return a; }
  let at = tok * p.a_stride + p.a_col + k;
  if (k < k_end) { a.x = A[at]; }
  if (k + 1u < k_end) { a.y = A[at + 1u]; }
  if (k + 2u < k_end) { a.z = A[at + 2u]; }
  if (k + 3u < k_end) { a.w = A[at + 3u]; }
  return a;
}

// Load v of step kk of W: eight weights along a row; zero past W's rows (a row past the sum's end
// along the sum, or past the columns of C) and, along the sum, past the columns of C.
fn load_b(v: u32, c0: u32, kk: u32, k_end: u32) -> vec4<u32> {
  var row: u32;
  var col: u32;
  var inside: bool;
  if (W_ALONG_SUM) {
    row = kk + v / (BN / 8u);
    col = c0 + 8u * (v % (BN / 8u));
    inside = v < BN * KSTEP / 8u && row < k_end && col < p.columns;
  } else {
    row = c0 + v / (KSTEP / 8u);
    col = kk + 8u * (v % (KSTEP / 8u));
    inside = v < BN * KSTEP / 8u && row < p.columns && col < 2u * p.w_words;
  }
  if (!inside) { return vec4<u32>(0u); }
  return W4[(row * p.w_words + col / 2u) / 4u];
}

fn put_a(v: u32, a: vec4<u32>) {
  if (v >= (BM / DIGITS) * KSTEP / 4u) { return; }
  let hi = (v / (KSTEP / 4u)) * A_STRIDE + 4u * (v % (KSTEP / 4u));
  let lo = hi + (BM / DIGITS) * A_STRIDE;  // the lo plane's rows follow the hi plane's
  let x = unpack2x16float(a.x);
  let y = unpack2x16float(a.y);
  let z = unpack2x16float(a.z);
  let w = unpack2x16float(a.w);
  Staged[hi] = f16(x.x); Staged[hi + 1u] = f16(y.x); Staged[hi + 2u] = f16(z.x); Staged[hi + 3u] = f16(w.x);
  Staged[lo] = f16(x.y); Staged[lo + 1u] = f16(y.y); Staged[lo + 2u] = f16(z.y); Staged[lo + 3u] = f16(w.y);
}

fn bf16_lo(w: u32) -> f16 { return f16(bitcast<f32>(w << 16u) * w_scale); }
fn bf16_hi(w: u32) -> f16 { return f16(bitcast<f32>(w & 0xffff0000u) * w_scale); }

fn put_b(v: u32, w: vec4<u32>) {
  if (v >= BN * KSTEP / 8u) { return; }
  var b: u32;
  if (W_ALONG_SUM) {
    b = W_BASE + (v / (BN / 8u)) * W_STRIDE + 8u * (v % (BN / 8u));
  } else {
    b = W_BASE + (v / (KSTEP / 8u)) * W_STRIDE + 8u * (v % (KSTEP / 8u));
  }
  Staged[b] = bf16_lo(w.x); Staged[b + 1u] = bf16_hi(w.x); Staged[b + 2u] = bf16_lo(w.y);
  Staged[b + 3u] = bf16_hi(w.y); Staged[b + 4u] = bf16_lo(w.z); Staged[b + 5u] = bf16_hi(w.z);
  Staged[b + 6u] = bf16_lo(w.w); Staged[b + 7u] = bf16_hi(w.w);
}

fn left(sr: u32, i: u32, q: u32) -> L {
  return subgroupMatrixLoad<L>(&Staged, (sr * TM * SM_M + i * SM_M) * A_STRIDE + q * SM_K, false, A_STRIDE);
}

// Right matrix j of the subgroup's column sc at sub-step q: staged [BN][KSTEP] it loads column-major,
// [KSTEP][BN] row-major.
fn right(sc: u32, j: u32, q: u32) -> R {
  let c = sc * TN * SM_N + j * SM_N;
  if (W_ALONG_SUM) {
    return subgroupMatrixLoad<R>(&Staged, W_BASE + q * SM_K * W_STRIDE + c, false, W_STRIDE);
  }
  return subgroupMatrixLoad<R>(&Staged, W_BASE + c * W_STRIDE + q * SM_K, true, W_STRIDE);
}

// Draining: NVIDIA's matrix units lose the low bits of their f32 sums as they accumulate (on the
// H100, summing all of K: up to 8.5× torch's float32 error on the same data; matmul.HEAD_DRAIN_TERMS), so
// every DRAIN staged steps each lane adds its share of the units' sums, in round-to-nearest f32, into
// its own (drained) and the accumulators start again from zero. 0: never (the results straight from
// the accumulators).
override DRAIN: u32 = 4u;
const PER_LANE: u32 = SM_M * SM_N / SM_SUBGROUP;  // elements of a result matrix a lane drains
var<private> drained: array<f32, 16u * PER_LANE>;  // [result row i][TN · PER_LANE]
var<private> lane_id: u32;

// Row i of the subgroup's result matrices (m0 .. m3) added into drained, through its Results region.
fn drain_row(i: u32, sg: u32, m0: O, m1: O, m2: O, m3: O) {
  stage_result(m0, sg, 0u);
  if (TN > 1u) { stage_result(m1, sg, 1u); }
  if (TN > 2u) { stage_result(m2, sg, 2u); }
  if (TN > 3u) { stage_result(m3, sg, 3u); }
  workgroupBarrier();
  for (var q = 0u; q < TN * PER_LANE; q++) {
    let e = lane_id + SM_SUBGROUP * q;
    drained[i * TN * PER_LANE + q] += Results[sg * SM_M * RESULT_STRIDE + e / RESULT_ROW * RESULT_STRIDE + e % RESULT_ROW];
  }
  workgroupBarrier();
}

fn after_step(acc: ptr<function, Acc>, sr: u32, sc: u32, kk: u32, k_begin: u32, k_end: u32) {
  if (DRAIN == 0u || (((kk - k_begin) / KSTEP + 1u) % max(DRAIN, 1u) != 0u && kk + KSTEP < k_end)) { return; }
  let sg = sr * SUB_N + sc;
  drain_row(0u, sg, (*acc).c00, (*acc).c01, (*acc).c02, (*acc).c03);
  if (TM > 1u) { drain_row(1u, sg, (*acc).c10, (*acc).c11, (*acc).c12, (*acc).c13); }
  if (TM > 2u) { drain_row(2u, sg, (*acc).c20, (*acc).c21, (*acc).c22, (*acc).c23); }
  if (TM > 3u) { drain_row(3u, sg, (*acc).c30, (*acc).c31, (*acc).c32, (*acc).c33); }
  *acc = Acc();
}

fn stage_result(m: O, sg: u32, j: u32) {
  subgroupMatrixStore(&Results, sg * SM_M * RESULT_STRIDE + j * SM_N, m, false, RESULT_STRIDE);
}

// Row i of every subgroup's result matrices (SM_M tokens, RESULT_ROW columns; subgroup row d: plane
// d), four columns an invocation: lo's sums times 2⁻¹¹ added to hi's, scaled back.
fn finish(t: u32, lane: u32, sg: u32, n0: u32, c0: u32, i: u32) {
  for (var e = t; e < PLANE_QUADS; e += WG) {
    let q = plane_quad(e, n0, c0, i);
    let n = q.n;
    let k = q.col;
    if (n < p.tokens && k < p.columns) {
      let hi = q.at;
      let lo = hi + PLANE_STRIDE;
      var v = vec4<f32>(Results[lo], Results[lo + 1u], Results[lo + 2u], Results[lo + 3u]) * (1.0 / 2048.0)
              + vec4<f32>(Results[hi], Results[hi + 1u], Results[hi + 2u], Results[hi + 3u]);
      let s = DSR[n];
      if (s == NOT_FINITE) {
        v = vec4<f32>(bitcast<f32>(bitcast<u32>(s)));  // NOT_FINITE's bits are a NaN's
      } else {
        let back = -s - scale_exponent(bitcast<f32>(LARGEST[0]));
        v = vec4<f32>(times_pow2(v.x, back), times_pow2(v.y, back), times_pow2(v.z, back), times_pow2(v.w, back));
      }
      if (W_ALONG_SUM) {
        store(n, k, v);
      } else {
        let o = n * p.out_stride + p.out_offset + k;
        OUTF[o] = v.x;
        if (k + 1u < p.columns) { OUTF[o + 1u] = v.y; }
        if (k + 2u < p.columns) { OUTF[o + 2u] = v.z; }
        if (k + 3u < p.columns) { OUTF[o + 3u] = v.w; }
      }
    }
  }
}

@compute @workgroup_size(WG)
fn gemm_tiled(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32,
              @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32,
              @builtin(num_workgroups) groups: vec3<u32>) {
  let n0 = wg.y * (BM / DIGITS);
  let c0 = wg.x * BN;
  range = wg.z;
  lane_id = lane;
  w_scale = ldexp(1.0, scale_exponent(bitcast<f32>(LARGEST[0])));
  let sum = sum_range(wg.z, groups.z, p.rows);
  var acc: Acc;
  multiply(&acc, t, sg / SUB_N, sg % SUB_N, n0, c0, sum.x, sum.y);
  if (DRAIN == 0u) {
    put_results(&acc, t, lane, sg, n0, c0);
    return;
  }
  for (var i = 0u; i < TM; i++) {  // each row of the drained sums through Results into finish
    for (var q = 0u; q < TN * PER_LANE; q++) {
      let e = lane + SM_SUBGROUP * q;
      Results[sg * SM_M * RESULT_STRIDE + e / RESULT_ROW * RESULT_STRIDE + e % RESULT_ROW] = drained[i * TN * PER_LANE + q];
    }
    workgroupBarrier();
    finish(t, lane, sg, n0, c0, i);
    workgroupBarrier();
  }
}
