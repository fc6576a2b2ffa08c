// RMSNorm of one row per workgroup (and the row's LoRA ranks, four per workgroup), in
// transformers' order of operations,
//   r = 1 / sqrt(mean(x²) + eps),  y = g · (x · r),
// written to XN (rows padded with zeros to the stride), and with QUANT the per-token absmax
// int8 codes BitLinear's activation quantisation makes of y:
//   s = 127 / max(max|y|, 1e-5),  q = clamp(round(y · s), −128, 127)   (round half to even)
// packed four to a u32 in XQ, with s at XM[n] and Σ q (i32 bits) at XM[tokens + n]. With
// rank > 0 it also computes the LoRA down-projections of y for every adapter reading
// this input: H[n][r] = Σ_k A[r][k] · y_k (A: the adapters' A matrices stacked), with DROPOUT
// of y_k · m_k (each adapter its own mask, _dropout.wgsl). With PER_ROW each token runs one
// adapter of the several stacked (a batch of mixed adapters): H[n][r] is 0 where token n's adapter
// (ROWS[n]) is not rank r's (COLUMNS[r]), so the projection's epilogue adds only the token's own.
// With SAVE it keeps r in RS[n] for the backward pass.
//
// rmsnorm_split normalises a row that the previous projection's epilogue makes as it is read:
// the projection ran on the matrix units split along K (bitlinear_mma.wgsl's gemm with SPLITS
// ranges), and this launch runs its split_epilogue, without LoRA, for the whole row: the ranges'
// i32 sums added, scaled (bitlinear's value), then added into the residual stream (RES) or, with
// PAIRS, made into gate/up products relu(gate)² · up (written to RES, the FFN's activation). So a
// decoding step's add or gate/up epilogue and the next norm are one launch. The projection's
// token scales are the XM that this launch then overwrites with the new codes' (one workgroup a
// token reads its own before any writes it: a launch of one workgroup a row, no LoRA ranks).
// rmsnorm_partials normalises a decoding step's attention output read as its key spans' partials
// merged (_attention_partials.wgsl), so that decode_combine's launch and the norm are one.

struct Params {
  tokens: u32,
  k: u32,           // features
  x_stride: u32,    // floats per row of X
  stride: u32,      // floats per row of XN and A (k padded to a multiple of 64)
  code_words: u32,  // u32 words per row of XQ (stride / 4)
  rank: u32,        // rows of A (0: no LoRA)
  h_stride: u32,    // floats per row of H
  eps: f32,
  rank_chunk: u32,  // rmsnorm_rows: LoRA ranks an invocation computes
  drop_key: u32,
  drop_split1: u32,
  drop_split2: u32,
  part_rows: u32,   // rmsnorm_split: rows of the projection's sums in PART
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> G: array<f32>;
@group(0) @binding(3) var<storage, read_write> XN: array<vec4<f32>>;  // rows of stride floats
@group(0) @binding(4) var<storage, read_write> XQ: array<u32>;
@group(0) @binding(5) var<storage, read_write> XM: array<f32>;
@group(0) @binding(6) var<storage, read> A: array<f32>;
@group(0) @binding(7) var<storage, read_write> H: array<f32>;
@group(0) @binding(8) var<storage, read_write> RS: array<f32>;
@group(0) @binding(9) var<storage, read> A4: array<vec4<f32>>;  // A again, 16 bytes a read (rmsnorm)
@group(0) @binding(10) var<storage, read> DROP: array<u32>;
@group(0) @binding(11) var<storage, read> ROWS: array<u32>;     // PER_ROW: each token's adapter
@group(0) @binding(12) var<storage, read> COLUMNS: array<u32>;  // PER_ROW: each rank's adapter
@group(0) @binding(13) var<storage, read> PART: array<vec4<i32>>;   // rmsnorm_split: [SPLITS][tokens][part_rows]
@group(0) @binding(14) var<storage, read> PWS: array<vec4<f32>>;    // rmsnorm_split: the weights' row scales
@group(0) @binding(15) var<storage, read_write> RES: array<vec4<f32>>;  // rmsnorm_split: rows of x_stride floats
@group(0) @binding(16) var<storage, read> PO: array<vec4<f32>>;     // rmsnorm_partials
@group(0) @binding(17) var<storage, read> PML: array<vec2<f32>>;    // rmsnorm_partials

override WG: u32 = 256u;  // a multiple of 32
override QUANT: bool = true;
override SAVE: bool = false;
override K: u32 = 64u;       // rmsnorm: features
override STRIDE: u32 = 64u;  // rmsnorm: K padded to a multiple of 64
override DROPOUT: bool = false;
override PER_ROW: bool = false;
override SPLITS: u32 = 2u;     // rmsnorm_split: the projection's K ranges
override PAIRS: bool = false;  // rmsnorm_split: gate/up pairs (else an add into RES)
override DIVIDE: bool = true;  // rmsnorm_split: the projection's scaling (bitlinear.wgsl's scaled)
override SPANS: u32 = 1u;      // rmsnorm_partials: attention's key spans, its heads and their width
override HEADS: u32 = 1u;
override HEAD_DIM: u32 = 4u;
// The 4-feature words of a row an invocation holds (at most MAX_WORDS, below). An override, not a
// `let`: Tint (Dawn) puts a counter into every loop whose bound it cannot prove constant, and a
// loop with that counter is not unrolled, so the arrays it indexes leave the registers.
override WORDS: u32 = (STRIDE / 4u + WG - 1u) / WG;

// @include _reductions.wgsl
// @include _quantise.wgsl
// @include _dropout.wgsl
// @include _attention_partials.wgsl

// A row's 4-feature words are spread over the invocations (word t + WG·i for invocation t), held
// in registers from the one read of X to the codes; K and STRIDE are pipeline constants so the
// loops have fixed trip counts and the driver can unroll them, issuing every load of a phase
// at once (a decoded token normalises one row: this kernel's latency is the token's).
const MAX_WORDS: u32 = 8u;   // words an invocation holds: STRIDE ≤ 32 · WG (rmsnorm_launch picks WG)

fn a_row(row: u32, w: u32) -> vec4<f32> {  // A[row][4w..4w+3], the last row repeated past the rank
  return A4[min(row, p.rank - 1u) * (STRIDE / 4u) + w];
}

fn lora_a(row: u32, w: u32) -> mat4x4<f32> {  // columns: rows row.. of A at features 4w..
  return mat4x4<f32>(a_row(row, w), a_row(row + 1u, w), a_row(row + 2u, w), a_row(row + 3u, w));
}

// The grid's y splits the work: workgroup 0 of a row normalises it (XN, codes, meta, RS) and
// workgroup j ≥ 1 computes the LoRA ranks 4(j − 1).. of H, normalising the row too (the same
// operations: the same y). A row's loads (X, G and the workgroup's rows of A) are issued together,
// before the first reduction: one wait on memory, and the ranks' reads spread over workgroups.
@compute @workgroup_size(WG)
fn rmsnorm(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  var y: array<vec4<f32>, MAX_WORDS>;
  for (var i = 0u; i < WORDS; i++) { y[i] = row_features(wg.x * p.x_stride, 4u * (inv.t + WG * i)); }
  normalise(inv.t, wg.x, wg.y, &y);
}

// The projection's four sums of token n at rows 4v.., its K ranges added (integers: any order).
fn split_sums(n: u32, v: u32) -> vec4<i32> {
  var sum = vec4<i32>(0);
  for (var s = 0u; s < SPLITS; s++) { sum += PART[(s * p.tokens + n) * (p.part_rows / 4u) + v]; }
  return sum;
}

fn scaled4(exact: vec4<i32>, s: f32, ws: vec4<f32>) -> vec4<f32> {  // bitlinear.wgsl's scaled, four at once
  if (DIVIDE) { return vec4<f32>(exact) / (ws * s); }
  return vec4<f32>(exact) / s * ws;
}

// Word w (features 4w..) of token n's row, made by the projection's epilogue and written to RES;
// zeros past K.
fn split_word(n: u32, w: u32, s: f32) -> vec4<f32> {
  if (4u * w >= K) { return vec4<f32>(0.0); }
  let at = n * (p.x_stride / 4u) + w;
  var v: vec4<f32>;
  if (PAIRS) {  // rows 8w.. hold gate, up of features 4w, 4w + 1, ...
    let a = scaled4(split_sums(n, 2u * w), s, PWS[2u * w]);
    let b = scaled4(split_sums(n, 2u * w + 1u), s, PWS[2u * w + 1u]);
    let gate = max(vec4<f32>(a.x, a.z, b.x, b.z), vec4<f32>(0.0));
    v = gate * gate * vec4<f32>(a.y, a.w, b.y, b.w);
  } else {
    v = RES[at] + scaled4(split_sums(n, w), s, PWS[w]);
  }
  RES[at] = v;
  return v;
}

@compute @workgroup_size(WG)
fn rmsnorm_split(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  let s = XM[wg.x];
  var y: array<vec4<f32>, MAX_WORDS>;
  for (var i = 0u; i < WORDS; i++) { y[i] = split_word(wg.x, inv.t + WG * i, s); }
  normalise(inv.t, wg.x, 0u, &y);
}

@compute @workgroup_size(WG)
fn rmsnorm_partials(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  var y: array<vec4<f32>, MAX_WORDS>;
  for (var i = 0u; i < WORDS; i++) {
    let w = inv.t + WG * i;
    var v = vec4<f32>(0.0);
    if (4u * w < K) { v = attention_out(wg.x, w); }  // K = HEADS · HEAD_DIM: whole words
    y[i] = v;
  }
  normalise(inv.t, wg.x, wg.y, &y);
}

// Token n's row y (its words, as the entry point fetched them: word t + WG·i in y[i]) normalised by
// workgroup wy of the row (the grid's y, above).
fn normalise(t: u32, n: u32, wy: u32, y: ptr<function, array<vec4<f32>, MAX_WORDS>>) {
  let ranks = 4u * (wy - 1u);  // workgroups y ≥ 1: their first rank
  let out = n * STRIDE;
  let row_words = STRIDE / 4u;
  var g: array<vec4<f32>, MAX_WORDS>;
  var a: array<mat4x4<f32>, MAX_WORDS>;
  var ss = 0.0;
  for (var i = 0u; i < WORDS; i++) {
    g[i] = norm_weights(4u * (t + WG * i));
    if (wy > 0u) { a[i] = lora_a(ranks, min(t + WG * i, row_words - 1u)); }
    ss += dot((*y)[i], (*y)[i]);
  }
  let r = inverseSqrt(sum_all(t, ss) / f32(K) + p.eps);
  if (wy > 0u) {  // uniform: the whole workgroup computes its ranks of h and leaves
    var acc = vec4<f32>(0.0);
    for (var i = 0u; i < WORDS; i++) {
      let w = t + WG * i;
      if (w < row_words) {
        let v = g[i] * ((*y)[i] * r);
        if (DROPOUT) {
          let m = drop_quad4(ranks, n, w);
          acc += vec4<f32>(dot(v * m[0], a[i][0]), dot(v * m[1], a[i][1]), dot(v * m[2], a[i][2]),
                           dot(v * m[3], a[i][3]));
        } else {
          acc += v * a[i];
        }
      }
    }
    store_h(n, ranks, sum_all4(t, acc), t);
    return;
  }
  var m = 0.0;
  for (var i = 0u; i < WORDS; i++) {
    let w = t + WG * i;
    if (w < row_words) {
      let v = g[i] * ((*y)[i] * r);
      (*y)[i] = v;
      XN[out / 4u + w] = v;
      m = max(m, absmax4(v));
    }
  }
  if (SAVE && t == 0u) { RS[n] = r; }
  if (QUANT) {
    let s = quant_scale(max_all(t, m));
    var total = 0i;
    for (var i = 0u; i < WORDS; i++) {
      let w = t + WG * i;
      if (w < row_words) {
        let q = codes4((*y)[i], s);
        XQ[n * row_words + w] = pack4xI8(q);
        total += q.x + q.y + q.z + q.w;
      }
    }
    let sum = sum_all_i(t, total);
    if (t == 0u) {
      XM[n] = s;
      XM[p.tokens + n] = bitcast<f32>(sum);
    }
  }
}

// Rank j of token n's h: 0 where PER_ROW gives the token another adapter (a select, not a product:
// another adapter's non-finite values stay out).
fn h_value(n: u32, j: u32, v: f32) -> f32 {
  return select(v, 0.0, PER_ROW && ROWS[n] != COLUMNS[j]);
}

fn store_h(n: u32, j: u32, v: vec4<f32>, t: u32) {
  if (t != 0u) { return; }
  for (var l = 0u; l < 4u; l++) {
    if (j + l < p.rank) { H[n * p.h_stride + j + l] = h_value(n, j + l, v[l]); }
  }
}

// The same, one row per invocation with no barriers: for CPU adapters (lavapipe runs a
// workgroup's invocations as SIMD lanes, where many small barrier-separated steps cost more than
// a serial loop over a row), many rows and short ones. The arithmetic is the workgroup kernel's,
// element for element; only the order of the sums differs. The LoRA ranks are split over the
// grid's y (ranks rank_chunk·y ..; y = 0 also normalises and quantises): on lavapipe (Mesa
// 22.3.6) an invocation that walked every rank itself returned a wrong last rank once ranks ×
// features passed about 49,000-61,000 (the tail of A's last row read as zeros; e.g. 6,912
// features × 8 ranks, BitNet-2B's down_proj at r=8), and with rows of 40,000 features even one
// rank; cause not found. rmsnorm_launch keeps an invocation's share at ROWS_MAX_STEPS (16,384,
// checked on lavapipe) and gives longer rows to the workgroup kernel.
@compute @workgroup_size(64)
fn rmsnorm_rows(@builtin(global_invocation_id) gid: vec3<u32>) {
  let n = gid.x;
  if (n >= p.tokens) { return; }
  let row = n * p.x_stride;
  let out = n * p.stride;
  var ss = 0.0;
  for (var k = 0u; k < p.k; k++) { let v = X[row + k]; ss += v * v; }
  let r = inverseSqrt(ss / f32(p.k) + p.eps);
  let first = gid.y * p.rank_chunk;
  for (var j = first; j < min(first + p.rank_chunk, p.rank); j++) {
    let key = drop_key(j);
    var acc = 0.0;
    for (var k = 0u; k < p.k; k++) {
      var y = G[k] * (X[row + k] * r);
      if (DROPOUT) { y *= drop_mask(key, n, k); }
      acc += y * A[j * p.stride + k];
    }
    H[n * p.h_stride + j] = h_value(n, j, acc);
  }
  if (gid.y != 0u) { return; }
  var m = 0.0;
  for (var w = 0u; w < p.stride / 4u; w++) {
    var y = vec4<f32>(0.0);
    for (var l = 0u; l < 4u; l++) {
      let k = 4u * w + l;
      if (k < p.k) { y[l] = G[k] * (X[row + k] * r); }
    }
    XN[out / 4u + w] = y;
    m = max(m, absmax4(y));
  }
  if (SAVE) { RS[n] = r; }
  if (QUANT) {
    let s = quant_scale(m);
    var total = 0i;
    for (var w = 0u; w < p.code_words; w++) {
      var q = vec4<i32>(0);
      for (var l = 0u; l < 4u; l++) {
        let k = 4u * w + l;
        if (k < p.k) { q[l] = i32(clamp(round(G[k] * (X[row + k] * r) * s), -128.0, 127.0)); }
      }
      XQ[n * p.code_words + w] = pack4xI8(q);
      total += q.x + q.y + q.z + q.w;
    }
    XM[n] = s;
    XM[p.tokens + n] = bitcast<f32>(total);
  }
}
