// Ternary BitLinear projections: int8 activation codes × 2-bit weights, exact integer dots.
//   acc[n][j] = Σ_k q[n][k] · (t[j][k] + 1)      dot4I8Packed on packed codes (see engine/weights.py)
//   dot       = acc − Σ_k q[n][k]                 (the row's code sum, from the quantisation kernel)
//   v         = dot / (WS[j] · s[n])   (DIVIDE)   or   dot / s[n] · WS[j]
//   v        += scale_s · Σ_r B_s[j'][r] · h[n][c_s + r]   for a LoRA segment s holding row j (j' its row in B_s)
// then the epilogue (MODE): 0 store, 1 add into OUT (a residual stream), 2 gate/up pairs
// (rows 2i, 2i+1): OUT[n][i] = relu(gate)² · up, and with SAVE the raw pair into AUX.
//
// Two entry points. gemv (a decoded token: a stream of the weights at memory bandwidth): one
// token per workgroup row of the grid, ROWS weight rows a workgroup, LANES threads a row, each
// reading 16 bytes (64 weights) at a time through W4 (the same weights as W), the row's length
// a pipeline constant so that every load of a thread is issued at once; one barrier, then one
// thread a row sums its lanes. gemm: 64 tokens × 64 rows a workgroup, 4 × 4 a thread, K in
// steps of 64 through workgroup memory; weights decoded once per step with one shift and
// mask per four of them.
//
// XQ holds each token's codes as vec4<u32> (16 codes), K padded to a multiple of 64 with
// zero codes; XM holds the per-token scales s[n] at [0, N) and code sums (as i32 bits) at
// [N, 2N). LORA holds `segments` headers of 8 words (row_begin, row_end, row_step, h_col,
// b_offset, rank, scale bits, 0); each segment's B [rows, rank] starts at LB[b_offset] (LB is
// the engine's flat buffer of every adapter parameter).

struct Params {
  tokens: u32,
  rows: u32,
  k_words: u32,      // u32 words per weight row = vec4 words per token of XQ
  out_stride: u32,   // floats per output row
  out_offset: u32,   // first output column written
  lora_rank: u32,    // floats per row of H
  segments: u32,     // LoRA segments in LORA (0: none)
  aux_stride: u32,   // floats per row of AUX
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> XQ: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> XM: array<f32>;
@group(0) @binding(3) var<storage, read> W: array<u32>;
@group(0) @binding(4) var<storage, read> WS: array<f32>;
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(6) var<storage, read> H: array<f32>;
@group(0) @binding(7) var<storage, read> LORA: array<u32>;
@group(0) @binding(8) var<storage, read> LB: array<f32>;
@group(0) @binding(9) var<storage, read_write> AUX: array<f32>;
@group(0) @binding(10) var<storage, read> W4: array<vec4<u32>>;

override MODE: u32 = 0u;
override DIVIDE: bool = true;
override SAVE: bool = false;
override ROWS: u32 = 16u;   // gemv: weight rows per workgroup, 128 / LANES (even: gate/up pairs stay together)
override LANES: u32 = 8u;   // gemv: threads per row (gemv_lanes picks them per projection)
override ROW_VECS: u32 = 4u;  // gemv: vec4 words per weight row (k_words / 4)
override GEMV_WG: u32 = ROWS * LANES;

const M2: u32 = 0x03030303u;

fn spread(w: u32) -> vec4<u32> {
  return vec4<u32>(w, w >> 2u, w >> 4u, w >> 6u) & vec4<u32>(M2);
}

fn dot16(a: vec4<u32>, d: vec4<u32>) -> i32 {
  return dot4I8Packed(a.x, d.x) + dot4I8Packed(a.y, d.y) + dot4I8Packed(a.z, d.z) + dot4I8Packed(a.w, d.w);
}

// @include _projection_epilogue.wgsl

// The projection's value for token n, row j, from the raw integer accumulator.
fn value(n: u32, j: u32, acc: i32) -> f32 {
  let dot = f32(acc - bitcast<i32>(XM[p.tokens + n]));
  var v: f32;
  if (DIVIDE) { v = dot / (WS[j] * XM[n]); } else { v = dot / XM[n] * WS[j]; }
  if (p.segments > 0u) { v += lora(n, j); }
  return v;
}

var<workgroup> partial: array<i32, GEMV_WG>;

fn lanes_sum(first: u32) -> i32 {
  var s = 0i;
  for (var i = 0u; i < LANES; i++) { s += partial[first + i]; }
  return s;
}

@compute @workgroup_size(GEMV_WG)
fn gemv(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let lane = t % LANES;
  let r = t / LANES;
  let n = wg.y;
  let j = wg.x * ROWS + r;
  let row = min(j, p.rows - 1u) * ROW_VECS;  // rows past the edge repeat the last one; not stored
  let x = n * p.k_words;
  var acc = 0i;
  for (var i = 0u; i < (ROW_VECS + LANES - 1u) / LANES; i++) {
    let u = lane + LANES * i;
    if (u < ROW_VECS) {
      let w = W4[row + u];
      let c = x + 4u * u;
      acc += dot16(XQ[c], spread(w.x)) + dot16(XQ[c + 1u], spread(w.y)) + dot16(XQ[c + 2u], spread(w.z))
           + dot16(XQ[c + 3u], spread(w.w));
    }
  }
  partial[t] = acc;
  workgroupBarrier();
  if (lane != 0u || j >= p.rows) { return; }
  if (MODE == 2u) {
    if (r % 2u == 0u) {
      put_pair(n, j / 2u, value(n, j, lanes_sum(t)), value(n, j + 1u, lanes_sum(t + LANES)));
    }
  } else {
    put(n, j, value(n, j, lanes_sum(t)));
  }
}

// gemm: 64 tokens × 64 rows a workgroup; thread (tr, tt) owns rows 4tr.. and tokens 4tt..
var<workgroup> xs: array<vec4<u32>, 256>;  // [token][word] of the current K step
var<workgroup> ws: array<u32, 256>;        // [row][word]

@compute @workgroup_size(256)
fn gemm(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let tr = t % 16u;
  let tt = t / 16u;
  let n0 = wg.y * 64u;
  let j0 = wg.x * 64u;
  // what this thread loads each step: token/row t / 4, word t % 4
  let load_n = min(n0 + t / 4u, p.tokens - 1u) * p.k_words + t % 4u;
  let load_j = min(j0 + t / 4u, p.rows - 1u) * p.k_words + t % 4u;
  var a0 = vec4<i32>(0); var a1 = vec4<i32>(0); var a2 = vec4<i32>(0); var a3 = vec4<i32>(0);
  for (var u = 0u; u < p.k_words; u += 4u) {
    xs[t] = XQ[load_n + u];
    ws[t] = W[load_j + u];
    workgroupBarrier();
    for (var w = 0u; w < 4u; w++) {
      let d0 = spread(ws[(4u * tr) * 4u + w]);
      let d1 = spread(ws[(4u * tr + 1u) * 4u + w]);
      let d2 = spread(ws[(4u * tr + 2u) * 4u + w]);
      let d3 = spread(ws[(4u * tr + 3u) * 4u + w]);
      let x0 = xs[(4u * tt) * 4u + w];
      let x1 = xs[(4u * tt + 1u) * 4u + w];
      let x2 = xs[(4u * tt + 2u) * 4u + w];
      let x3 = xs[(4u * tt + 3u) * 4u + w];
      a0 += vec4<i32>(dot16(x0, d0), dot16(x0, d1), dot16(x0, d2), dot16(x0, d3));
      a1 += vec4<i32>(dot16(x1, d0), dot16(x1, d1), dot16(x1, d2), dot16(x1, d3));
      a2 += vec4<i32>(dot16(x2, d0), dot16(x2, d1), dot16(x2, d2), dot16(x2, d3));
      a3 += vec4<i32>(dot16(x3, d0), dot16(x3, d1), dot16(x3, d2), dot16(x3, d3));
    }
    workgroupBarrier();
  }
  let j = j0 + 4u * tr;
  store4(n0 + 4u * tt, j, a0);
  store4(n0 + 4u * tt + 1u, j, a1);
  store4(n0 + 4u * tt + 2u, j, a2);
  store4(n0 + 4u * tt + 3u, j, a3);
}

// Four consecutive rows j.. of token n (two gate/up pairs in MODE 2).
fn store4(n: u32, j: u32, acc: vec4<i32>) {
  if (n >= p.tokens) { return; }
  if (MODE == 2u) {
    if (j + 1u < p.rows) { put_pair(n, j / 2u, value(n, j, acc.x), value(n, j + 1u, acc.y)); }
    if (j + 3u < p.rows) { put_pair(n, j / 2u + 1u, value(n, j + 2u, acc.z), value(n, j + 3u, acc.w)); }
    return;
  }
  for (var r = 0u; r < 4u; r++) {
    if (j + r < p.rows) { put(n, j + r, value(n, j + r, acc[r])); }
  }
}
