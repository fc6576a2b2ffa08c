// Ternary BitLinear projections on the GPU's matrix units (subgroup matrices): the same exact
// integer dots as bitlinear.wgsl's gemm, dot[n][j] = Σ_k q[n][k] · t[j][k], as int8 × int8 → i32
// subgroup-matrix multiplies (_ternary_mma_tile.wgsl, the weights' rows its columns), then
// bitlinear.wgsl's epilogue (scales, LoRA segments, MODE 0 store, 1 add (SAVE: the sums into AUX),
// 2 gate/up pairs). One plane of A: the tokens' codes.
//
// Split-K (SPLITS > 1, for few tokens, whose tiles alone leave the GPU idle): workgroup z sums its
// range of K and stores the i32 sums into PART [SPLITS][tokens][rows]; split_epilogue adds the ranges
// (integers: the same sums in any order) and runs the epilogue; split_epilogue_rope runs decoding's
// q/k/v epilogue (MODE 3, _rope_epilogue.wgsl) instead, so a batch's q/k/v needs no rope launch.
// @subgroup-matrix i8 i32

struct Params {
  tokens: u32,
  rows: u32,
  k_words: u32,      // u32 words per weight row = vec4 words per token of XQ
  out_stride: u32,   // floats per output row
  out_offset: u32,   // first output column written
  lora_rank: u32,    // floats per row of H
  segments: u32,     // LoRA segments in LORA (0: none)
  aux_stride: u32,   // floats per row of AUX
  a_tokens: u32,     // = tokens (_ternary_mma_tile.wgsl's names)
  a_words: u32,      // = 4 · k_words: u32 words of codes a token
  t_rows: u32,       // = rows
  t_words: u32,      // = k_words
  cache_len: u32,    // MODE 3: positions per sequence in KC, VC
  tokens_per_seq: u32,  // MODE 3
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> AQ: array<vec4<u32>>;  // codes, 16 a vec4
@group(0) @binding(2) var<storage, read> XM: array<f32>;         // each token's scale (then code sums, unused)
@group(0) @binding(3) var<storage, read> T4: array<vec4<u32>>;   // weights, 64 a vec4
@group(0) @binding(4) var<storage, read> WS: array<f32>;
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(6) var<storage, read> H: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read> LORA: array<u32>;
@group(0) @binding(8) var<storage, read> LB: array<vec4<f32>>;
@group(0) @binding(9) var<storage, read_write> AUX: array<f32>;
@group(0) @binding(10) var<storage, read_write> PART: array<i32>;
@group(0) @binding(11) var<storage, read> COS: array<f32>;
@group(0) @binding(12) var<storage, read> SIN: array<f32>;
@group(0) @binding(13) var<storage, read> STARTS: array<u32>;
@group(0) @binding(14) var<storage, read_write> KC: array<f32>;
@group(0) @binding(15) var<storage, read_write> VC: array<f32>;

override MODE: u32 = 0u;
override DIVIDE: bool = true;
override SAVE: bool = false;
override SPLITS: u32 = 1u;
override HEADS: u32 = 1u;     // MODE 3: query heads, key/value heads, their width
override KV_HEADS: u32 = 1u;
override HEAD_DIM: u32 = 2u;

var<private> split: u32;  // the workgroup's range of K (split-K)

// @include _mma_tile.wgsl
// @include _ternary_mma_tile.wgsl
// @include _projection_epilogue.wgsl
// @include _rope_epilogue.wgsl

fn value(n: u32, j: u32, exact: i32) -> f32 {
  let s = XM[n];
  var v: f32;
  if (DIVIDE) { v = f32(exact) / (WS[j] * s); } else { v = f32(exact) / s * WS[j]; }
  if (p.segments > 0u) { v += lora(n, j); }
  return v;
}

// Row i of subgroup sg's result matrices (SM_M tokens, RESULT_ROW rows of the weights) from its
// slice of Staged: each subgroup writes its own, a row of RESULT_ROW outputs at a time.
fn finish(t: u32, lane: u32, sg: u32, n0: u32, j0: u32, i: u32) {
  let tn = n0 + (sg / SUB_N) * TM * SM_M + i * SM_M;
  let tj = j0 + (sg % SUB_N) * RESULT_ROW;
  if (SPLITS > 1u) {
    for (var e = lane; e < SM_M * RESULT_ROW; e += SM_SUBGROUP) {
      let n = tn + e / RESULT_ROW;
      let r = tj + e % RESULT_ROW;
      if (n < p.tokens && r < p.rows) { PART[(split * p.tokens + n) * p.rows + r] = staged_result(sg, e); }
    }
  } else if (MODE == 1u) {
    // An add: four neighbouring outputs of a token an iteration, every residual read before any sum
    // is stored, so that the four reads are in flight together (a read of OUT after a write to OUT
    // waits for it). At 4,096 tokens on the H100 this took o_proj's add with its sums saved from 374
    // to 293 µs and down_proj's from 644 to 566; for stores (MODE 0, 2) the same form was 1-13%
    // slower than one output an iteration (device run 46, results/h100/forward_epilogues_quads.json).
    for (var e = 4u * lane; e < SM_M * RESULT_ROW; e += 4u * SM_SUBGROUP) {  // RESULT_ROW: a multiple of 4
      let n = tn + e / RESULT_ROW;
      let r = tj + e % RESULT_ROW;
      if (n < p.tokens && r < p.rows) {
        let last = p.rows - 1u;  // outputs past the rows are read in bounds, and not stored
        let r1 = min(r + 1u, last);
        let r2 = min(r + 2u, last);
        let r3 = min(r + 3u, last);
        var v = vec4<f32>(value(n, r, staged_result(sg, e)), value(n, r1, staged_result(sg, e + 1u)),
                          value(n, r2, staged_result(sg, e + 2u)), value(n, r3, staged_result(sg, e + 3u)));
        v = vec4<f32>(with_residual(n, r, v.x), with_residual(n, r1, v.y), with_residual(n, r2, v.z),
                      with_residual(n, r3, v.w));
        put_final(n, r, v.x);
        if (r + 1u < p.rows) { put_final(n, r + 1u, v.y); }
        if (r + 2u < p.rows) { put_final(n, r + 2u, v.z); }
        if (r + 3u < p.rows) { put_final(n, r + 3u, v.w); }
      }
    }
  } else if (MODE == 2u) {  // gate/up: rows 2i, 2i + 1 together
    for (var e = 2u * lane; e < SM_M * RESULT_ROW; e += 2u * SM_SUBGROUP) {
      let n = tn + e / RESULT_ROW;
      let r = tj + e % RESULT_ROW;
      if (n < p.tokens && r + 1u < p.rows) {
        put_pair(n, r / 2u, value(n, r, staged_result(sg, e)), value(n, r + 1u, staged_result(sg, e + 1u)));
      }
    }
  } else {
    for (var e = lane; e < SM_M * RESULT_ROW; e += SM_SUBGROUP) {
      let n = tn + e / RESULT_ROW;
      let r = tj + e % RESULT_ROW;
      if (n < p.tokens && r < p.rows) { put(n, r, value(n, r, staged_result(sg, e))); }
    }
  }
}

@compute @workgroup_size(WG)
fn gemm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32,
        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {
  let n0 = wg.y * BM;
  let j0 = wg.x * BN;
  split = wg.z;  // for finish; the range below reads wg.z itself (uniform, as multiply's barriers need)
  let sum = sum_range(wg.z, SPLITS, 16u * p.k_words);
  var acc: Acc;
  multiply(&acc, t, sg / SUB_N, sg % SUB_N, n0, j0, sum.x, sum.y);
  put_results(&acc, t, lane, sg, n0, j0);
}

fn split_sum(n: u32, r: u32) -> i32 {
  var sum = 0;
  for (var s = 0u; s < SPLITS; s++) { sum += PART[(s * p.tokens + n) * p.rows + r]; }
  return sum;
}

// The epilogue of split-K: output row (gate/up: pair) x of token y.
@compute @workgroup_size(64)
fn split_epilogue(@builtin(global_invocation_id) id: vec3<u32>) {
  let n = id.y;
  if (MODE == 2u) {
    let r = 2u * id.x;
    if (r + 1u < p.rows) { put_pair(n, id.x, value(n, r, split_sum(n, r)), value(n, r + 1u, split_sum(n, r + 1u))); }
  } else if (id.x < p.rows) {
    put(n, id.x, value(n, id.x, split_sum(n, id.x)));
  }
}

// The epilogue of split-K in MODE 3: grid rows g = 2x, g + 1 (qkv_row's order: a rotation's two
// partners side by side) of token y, rotated into the queries and the caches.
@compute @workgroup_size(64)
fn split_epilogue_rope(@builtin(global_invocation_id) id: vec3<u32>) {
  let n = id.y;
  let g = 2u * id.x;
  if (g + 1u < p.rows) {
    let j = qkv_row(g);
    let j2 = qkv_row(g + 1u);
    put_rotated(n, g, value(n, j, split_sum(n, j)), value(n, j2, split_sum(n, j2)));
  }
}
