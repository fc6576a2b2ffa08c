// BitLinear's straight-through input gradient on the GPU's matrix units, to float32 accuracy:
//   OUT[n][k] (+)= Σ_j (A[n][j] ∘ c_j) · t[j][k]  (+ Σ_r DH[n][r] · LA[r][k])
// as bitlinear_t.wgsl defines it, computed from int8 digits of each row of A ∘ c (the Ozaki
// scheme's idea; benchmarks/RESULTS.md, "Input gradients on the matrix units"):
//
// * digits: x = A[n][j] ∘ c_j (float32, as bitlinear_t.wgsl rounds it), scaled by 2^s_n so that the
//   row's largest |x| lies in [32, 64), is cut into DIGITS signed int8 digits,
//     x · 2^s_n = d_0 + d_1 · 2⁻⁷ + d_2 · 2⁻¹⁴ + …,  d_0 = round(x · 2^s_n), each next digit the
//   rounded remainder times 2⁷ (every digit in [−64, 64]; every step exact in float32), written as
//   DIGITS planes of int8 rows DQ [DIGITS][tokens][a_words · 4] and s_n into DS.
// * gemm_tiled: each plane times the ternary weights is an exact i32 GEMM (|Σ| ≤ 64 · rows < 2²⁴, so
//   exact in float32 too), on the matrix units (_ternary_mma_tile.wgsl, DIGITS = SUB_M: subgroup row
//   d holds plane d of the workgroup's tokens), from the weights' transposed copy TT [K][rows]
//   (ternary_transpose.wgsl: its rows are the outputs k, as a projection's are); the epilogue sums
//   the planes' products with their powers of two, from the last, and scales by 2^−s_n. With D
//   digits each x is kept to 2^(1 − 7D) of its row's largest value (four: 2⁻²⁷, the default; the
//   input_grad_digits setting offers three and two, 2⁻²⁰ and 2⁻¹³, for 3/4 and 1/2 of the work), and
//   the sums over j are exact: the error is the digits' cut-off and the epilogue's D − 1 roundings,
//   not a float32 GEMM's rounding at every step of the sum.
//   The grid's z splits the rows j into ranges (split-K, _input_grad_store.wgsl's PART and split_sum).
// @subgroup-matrix i8 i32

struct Params {
  tokens: u32,
  rows: u32,        // J: weight rows (output features of the forward projection)
  a_stride: u32,    // floats per row of A
  out_stride: u32,  // floats per row of OUT
  k: u32,           // input features written (the rest of a row is left alone)
  lora_rank: u32,   // rows of LA / floats per row of DH used (0: none)
  dh_stride: u32,
  la_stride: u32,
  accumulate: u32,
  drop_key: u32,
  drop_split1: u32,
  drop_split2: u32,
  a_tokens: u32,    // = tokens: rows of a digit plane
  a_words: u32,     // u32 words a row of a digit plane (rows padded to 16)
  t_rows: u32,      // rows of TT: the weights' K, padded to 64
  t_words: u32,     // u32 words a row of TT: rows padded to 64, 16 a word
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> AQ: array<vec4<u32>>;  // gemm_tiled: the digit planes
@group(0) @binding(2) var<storage, read> T4: array<vec4<u32>>;   // gemm_tiled: TT, the weights transposed
@group(0) @binding(3) var<storage, read> DSR: array<i32>;        // gemm_tiled: each token's s_n (digits' DS)
@group(0) @binding(4) var<storage, read_write> OUT: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> DH: array<f32>;
@group(0) @binding(6) var<storage, read> LA: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> PART: array<vec4<f32>>;  // SPLITS > 1: the ranges' sums
@group(0) @binding(8) var<storage, read> DROP: array<u32>;  // DROPOUT: _dropout.wgsl's state
@group(0) @binding(9) var<storage, read> A: array<f32>;            // digits: dY
@group(0) @binding(10) var<storage, read> WS: array<f32>;          // digits: the rows' scales
@group(0) @binding(11) var<storage, read_write> DQ: array<u32>;    // digits: the planes it writes
@group(0) @binding(12) var<storage, read_write> DS: array<i32>;    // digits: each token's s_n

override DIVIDE: bool = true;
const NOT_FINITE: i32 = 0x7fffffff;  // DS's mark of a row holding an infinity or NaN

// @include _mma_tile.wgsl
// @include _ternary_mma_tile.wgsl
// @include _reductions.wgsl
// @include _dropout.wgsl
// @include _input_grad_store.wgsl

var<private> range: u32;  // the grid's z: the range of rows j summed (_input_grad_store.wgsl's store)

fn scaled_dy(n: u32, j: u32) -> f32 {  // A[n][j] ∘ c_j, zero past the rows
  if (j >= p.rows) { return 0.0; }
  let c = WS[j];
  return A[n * p.a_stride + j] * select(c, 1.0 / c, DIVIDE);
}

// x · 2^s without overflowing on the way: s reaches 154 for a row whose largest value is subnormal.
fn times_pow2(x: f32, s: i32) -> f32 { return ldexp(ldexp(x, s / 2), s - s / 2); }

// One workgroup a token row.
@compute @workgroup_size(WG)
fn digits(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  let t = inv.t;
  let n = wg.x;
  var m = 0.0;
  var bad = 0i;  // values that are infinite or NaN (a NaN would drop out of the max)
  for (var j = t; j < p.rows; j += WG) {
    let x = scaled_dy(n, j);
    m = max(m, abs(x));
    bad += i32((bitcast<u32>(x) & 0x7f800000u) == 0x7f800000u);
  }
  m = max_all(t, m);
  let finite = sum_all_i(t, bad) == 0;
  let s = 6 - frexp(m).exp;  // m · 2^s in [32, 64)
  if (t == 0u) { DS[n] = select(NOT_FINITE, s, finite); }
  for (var w = t; w < p.a_words; w += WG) {
    var r = vec4<f32>(0.0);
    if (finite) {
      r = vec4<f32>(times_pow2(scaled_dy(n, 4u * w), s), times_pow2(scaled_dy(n, 4u * w + 1u), s),
                    times_pow2(scaled_dy(n, 4u * w + 2u), s), times_pow2(scaled_dy(n, 4u * w + 3u), s));
    }
    for (var d = 0u; d < DIGITS; d++) {
      let q = round(r);
      DQ[(d * p.tokens + n) * p.a_words + w] = pack4xI8(vec4<i32>(q));
      r = (r - q) * 128.0;
    }
  }
}

// Row i of every subgroup's result matrices (SM_M tokens, RESULT_ROW features; subgroup row d: digit
// plane d), staged at Staged[sg · SM_M · RESULT_STRIDE]: the planes' products summed, four features an
// invocation.
fn finish(t: u32, lane: u32, sg: u32, n0: u32, k0: u32, i: u32) {
  for (var e = t; e < PLANE_QUADS; e += WG) {
    let q = plane_quad(e, n0, k0, i);
    let n = q.n;
    let k = q.col;
    if (n < p.tokens && k < p.k) {
      var v = vec4<f32>(0.0);
      for (var d = DIGITS; d > 0u; d--) {
        let at = q.at + (d - 1u) * PLANE_STRIDE;
        v = v * (1.0 / 128.0) + vec4<f32>(f32(Staged[at]), f32(Staged[at + 1u]), f32(Staged[at + 2u]),
                                          f32(Staged[at + 3u]));
      }
      let s = DSR[n];
      if (s == NOT_FINITE) {
        v = vec4<f32>(bitcast<f32>(bitcast<u32>(s)));  // NOT_FINITE's bits are a NaN's
      } else {
        v = vec4<f32>(times_pow2(v.x, -s), times_pow2(v.y, -s), times_pow2(v.z, -s), times_pow2(v.w, -s));
      }
      store(n, k, v);
    }
  }
}

@compute @workgroup_size(WG)
fn gemm_tiled(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32,
              @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32,
              @builtin(num_workgroups) groups: vec3<u32>) {
  let n0 = wg.y * (BM / DIGITS);
  let k0 = wg.x * BN;
  range = wg.z;
  let sum = sum_range(wg.z, groups.z, p.rows);
  var acc: Acc;
  multiply(&acc, t, sg / SUB_N, sg % SUB_N, n0, k0, sum.x, sum.y);
  put_results(&acc, t, lane, sg, n0, k0);
}
