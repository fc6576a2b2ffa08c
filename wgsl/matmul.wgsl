// Float projections y = x·Wᵀ (the dense flavour's projections and the LM head), with the
// epilogues of bitlinear.wgsl: v += LoRA segments; MODE 0 store, 1 add into OUT (a residual
// stream), 2 gate/up pairs (rows 2i, 2i + 1) → relu(gate)² · up (SAVE: raw pair into AUX).
//
// X: f32 [tokens, K] as vec4, rows padded to a multiple of 64 with zeros. W: the weight rows,
// K padded likewise, as vec4<u32> words: float32 bits, or with BF16 the raw bfloat16 bits
// two to a u32 (element 2i in the low half), widened exactly in registers.
//
// gemv: one token per grid row, ROWS rows a workgroup, LANES threads a row striding over its
// vec4 words (coalesced), one barrier, then a thread a row sums its lanes. gemm: 64 tokens × 64
// rows a workgroup of 128 threads, 8 tokens × 4 rows a thread, K in steps of 16 through
// workgroup memory.

struct Params {
  tokens: u32,
  rows: u32,
  w_words: u32,      // vec4<u32> words per weight row
  x_words: u32,      // vec4 words per token of X
  out_stride: u32,
  out_offset: u32,
  lora_rank: u32,
  segments: u32,
  aux_stride: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(4) var<storage, read> H: array<f32>;
@group(0) @binding(5) var<storage, read> LORA: array<u32>;
@group(0) @binding(6) var<storage, read> LB: array<f32>;
@group(0) @binding(7) var<storage, read_write> AUX: array<f32>;

override MODE: u32 = 0u;
override BF16: bool = false;
override SAVE: bool = false;
override ROWS: u32 = 8u;
override LANES: u32 = 32u;
override GEMV_WG: u32 = ROWS * LANES;

fn lo(w: u32) -> f32 { return bitcast<f32>(w << 16u); }
fn hi(w: u32) -> f32 { return bitcast<f32>(w & 0xffff0000u); }

// @include _projection_epilogue.wgsl

fn value(n: u32, j: u32, acc: f32) -> f32 {
  if (p.segments > 0u) { return acc + lora(n, j); }
  return acc;
}

var<workgroup> partial: array<f32, GEMV_WG>;

fn lanes_sum(first: u32) -> f32 {
  var s = 0.0;
  for (var i = 0u; i < LANES; i++) { s += partial[first + i]; }
  return s;
}

@compute @workgroup_size(GEMV_WG)
fn gemv(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let lane = t % LANES;
  let r = t / LANES;
  let n = wg.y;
  let j = wg.x * ROWS + r;
  let row = min(j, p.rows - 1u) * p.w_words;  // rows past the edge repeat the last one; not stored
  let x = n * p.x_words;
  var acc = 0.0;
  for (var u = lane; u < p.w_words; u += LANES) {
    let w = W[row + u];
    if (BF16) {
      let a = X[x + 2u * u];
      let b = X[x + 2u * u + 1u];
      acc += dot(a, vec4<f32>(lo(w.x), hi(w.x), lo(w.y), hi(w.y))) + dot(b, vec4<f32>(lo(w.z), hi(w.z), lo(w.w), hi(w.w)));
    } else {
      acc += dot(X[x + u], bitcast<vec4<f32>>(w));
    }
  }
  partial[t] = acc;
  workgroupBarrier();  // then one thread a row sums its lanes: one barrier, not log2(LANES)
  if (lane != 0u || j >= p.rows) { return; }
  if (MODE == 2u) {
    if (r % 2u == 0u) { put_pair(n, j / 2u, value(n, j, lanes_sum(t)), value(n, j + 1u, lanes_sum(t + LANES))); }
  } else {
    put(n, j, value(n, j, lanes_sum(t)));
  }
}

var<workgroup> xs: array<vec4<f32>, 256>;  // [token][k4] of the current K step (16 floats)
var<workgroup> ws: array<vec4<f32>, 256>;  // [row][k4]

@compute @workgroup_size(128)
fn gemm(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let tr = t % 16u;  // rows 4tr..
  let tt = t / 16u;  // tokens 8tt..
  let n0 = wg.y * 64u;
  let j0 = wg.x * 64u;
  var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
  var a4 = vec4<f32>(0.0); var a5 = vec4<f32>(0.0); var a6 = vec4<f32>(0.0); var a7 = vec4<f32>(0.0);
  for (var k = 0u; k < p.x_words; k += 4u) {
    for (var h = 0u; h < 2u; h++) {  // 64 tokens × 4 words and 64 rows × 4 words: two of each a thread
      let idx = t + 128u * h;
      xs[idx] = X[min(n0 + idx / 4u, p.tokens - 1u) * p.x_words + k + idx % 4u];
      if (!BF16) {
        ws[idx] = bitcast<vec4<f32>>(W[min(j0 + idx / 4u, p.rows - 1u) * p.w_words + k + idx % 4u]);
      }
    }
    if (BF16) {  // 16 values of a row are two words: one a thread, widened into two vec4s
      let w = W[min(j0 + t / 2u, p.rows - 1u) * p.w_words + k / 2u + t % 2u];
      let base = (t / 2u) * 4u + 2u * (t % 2u);
      ws[base] = vec4<f32>(lo(w.x), hi(w.x), lo(w.y), hi(w.y));
      ws[base + 1u] = vec4<f32>(lo(w.z), hi(w.z), lo(w.w), hi(w.w));
    }
    workgroupBarrier();
    for (var c = 0u; c < 4u; c++) {
      let w0 = ws[(4u * tr) * 4u + c];
      let w1 = ws[(4u * tr + 1u) * 4u + c];
      let w2 = ws[(4u * tr + 2u) * 4u + c];
      let w3 = ws[(4u * tr + 3u) * 4u + c];
      let x0 = xs[(8u * tt) * 4u + c];
      let x1 = xs[(8u * tt + 1u) * 4u + c];
      let x2 = xs[(8u * tt + 2u) * 4u + c];
      let x3 = xs[(8u * tt + 3u) * 4u + c];
      let x4 = xs[(8u * tt + 4u) * 4u + c];
      let x5 = xs[(8u * tt + 5u) * 4u + c];
      let x6 = xs[(8u * tt + 6u) * 4u + c];
      let x7 = xs[(8u * tt + 7u) * 4u + c];
      a0 += vec4<f32>(dot(x0, w0), dot(x0, w1), dot(x0, w2), dot(x0, w3));
      a1 += vec4<f32>(dot(x1, w0), dot(x1, w1), dot(x1, w2), dot(x1, w3));
      a2 += vec4<f32>(dot(x2, w0), dot(x2, w1), dot(x2, w2), dot(x2, w3));
      a3 += vec4<f32>(dot(x3, w0), dot(x3, w1), dot(x3, w2), dot(x3, w3));
      a4 += vec4<f32>(dot(x4, w0), dot(x4, w1), dot(x4, w2), dot(x4, w3));
      a5 += vec4<f32>(dot(x5, w0), dot(x5, w1), dot(x5, w2), dot(x5, w3));
      a6 += vec4<f32>(dot(x6, w0), dot(x6, w1), dot(x6, w2), dot(x6, w3));
      a7 += vec4<f32>(dot(x7, w0), dot(x7, w1), dot(x7, w2), dot(x7, w3));
    }
    workgroupBarrier();
  }
  let j = j0 + 4u * tr;
  let n = n0 + 8u * tt;
  store4(n, j, a0); store4(n + 1u, j, a1); store4(n + 2u, j, a2); store4(n + 3u, j, a3);
  store4(n + 4u, j, a4); store4(n + 5u, j, a5); store4(n + 6u, j, a6); store4(n + 7u, j, a7);
}

fn store4(n: u32, j: u32, acc: vec4<f32>) {
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
