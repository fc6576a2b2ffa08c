// Ternary BitLinear projections on the GPU's matrix units (subgroup matrices): the same exact
// integer dots as bitlinear.wgsl's gemm, dot[n][j] = Σ_k q[n][k] · t[j][k], as int8 × int8 → i32
// multiplies of 16 × 16 × 32 subgroup matrices, then bitlinear.wgsl's epilogue (scales, LoRA
// segments, MODE 0 store, 1 add (SAVE: the sums into AUX), 2 gate/up pairs).
//
// A workgroup of 8 subgroups of 32 invocations owns 128 tokens × 128 rows; subgroup (sr, sc) holds
// 2 × 4 result matrices (32 tokens × 64 rows) in named variables. Each step of 128 along K is staged
// in workgroup memory: the codes as they are, the 2-bit weights unpacked to int8 (t = code − 1 per
// byte), each row padded to 144 bytes (without the padding the matrix loads meet bank conflicts:
// 1.6× slower); the next step's global loads are issued before this step's multiplies. The shape was
// chosen by measurement (benchmarks/subgroup_matrix.py; benchmarks/results/h200/kernel_tuning.md).
// Tokens, rows and K past their ends are staged as zeros and not written.

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
@group(0) @binding(1) var<storage, read> XQ: array<vec4<i32>>;   // codes, 16 a vec4
@group(0) @binding(2) var<storage, read> XM: array<f32>;         // each token's scale (then code sums, unused)
@group(0) @binding(3) var<storage, read> W4: array<vec4<u32>>;   // weights, 64 a vec4
@group(0) @binding(4) var<storage, read> WS: array<f32>;
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(6) var<storage, read> H: array<f32>;
@group(0) @binding(7) var<storage, read> LORA: array<u32>;
@group(0) @binding(8) var<storage, read> LB: array<f32>;
@group(0) @binding(9) var<storage, read_write> AUX: array<f32>;

override MODE: u32 = 0u;
override DIVIDE: bool = true;
override SAVE: bool = false;

alias L = subgroup_matrix_left<i8, 32, 16>;
alias R = subgroup_matrix_right<i8, 16, 32>;
alias O = subgroup_matrix_result<i32, 16, 16>;

const STRIDE: u32 = 144u;  // bytes (= int8 elements) a staged row: 128 and 16 of padding
var<workgroup> As: array<i32, 4608>;  // 128 token rows × 36 words
var<workgroup> Ws: array<i32, 4608>;  // 128 weight rows × 36 words
var<workgroup> Cs: array<i32, 2048>;  // each subgroup's 16 × 16 slice for the epilogue

// @include _projection_epilogue.wgsl

// The four int8 weights of bit pair `shift / 2` of each byte lane: code c = t + 1 → t (no byte
// borrows: every byte is at least 0x80 when 1 is taken away).
fn unpacked(word: u32, shift: u32) -> i32 {
  return bitcast<i32>(((((word >> shift) & 0x03030303u) | 0x80808080u) - 0x01010101u) ^ 0x80808080u);
}

fn value(n: u32, j: u32, exact: i32) -> f32 {
  let s = XM[n];
  var v: f32;
  if (DIVIDE) { v = f32(exact) / (WS[j] * s); } else { v = f32(exact) / s * WS[j]; }
  if (p.segments > 0u) { v += lora(n, j); }
  return v;
}

// One result matrix (16 tokens from n0, 16 rows from j0) through the subgroup's slice of Cs.
fn finish(sg: u32, lane: u32, n0: u32, j0: u32) {
  workgroupBarrier();
  if (MODE == 2u) {  // gate/up: rows 2i, 2i + 1 together
    for (var e = 2u * lane; e < 256u; e += 64u) {
      let n = n0 + e / 16u;
      let j = j0 + e % 16u;
      if (n < p.tokens && j + 1u < p.rows) {
        put_pair(n, j / 2u, value(n, j, Cs[sg * 256u + e]), value(n, j + 1u, Cs[sg * 256u + e + 1u]));
      }
    }
  } else {
    for (var e = lane; e < 256u; e += 32u) {
      let n = n0 + e / 16u;
      let j = j0 + e % 16u;
      if (n < p.tokens && j < p.rows) { put(n, j, value(n, j, Cs[sg * 256u + e])); }
    }
  }
  workgroupBarrier();
}

@compute @workgroup_size(256)
fn gemm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32,
        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {
  let sr = sg / 2u;
  let sc = sg % 2u;
  let n0 = wg.y * 128u;
  let j0 = wg.x * 128u;
  let kv = p.k_words;  // vec4 words of codes a token row; vec4 words of weights a row: kv / 4
  // what this invocation stages: codes of token t / 8 + 32q at vec4 t % 8 (q = 0..3), weights of row t / 2 at vec4 t % 2
  let an = t / 8u;
  let ac = t % 8u;
  let wr = t / 2u;
  let wc = t % 2u;
  var ga0 = vec4<i32>(0); var ga1 = vec4<i32>(0); var ga2 = vec4<i32>(0); var ga3 = vec4<i32>(0);
  var gw = vec4<u32>(0x55555555u);  // code 1 everywhere: weight 0
  var c0_0: O; var c0_1: O; var c0_2: O; var c0_3: O;
  var c1_0: O; var c1_1: O; var c1_2: O; var c1_3: O;
  for (var kk = 0u; kk < 16u * kv; kk += 128u) {
    // global loads of this step (zeros past the tokens, the rows or K)
    let ka = kk / 16u + ac;
    if (ka < kv) {
      if (n0 + an < p.tokens) { ga0 = XQ[(n0 + an) * kv + ka]; } else { ga0 = vec4<i32>(0); }
      if (n0 + an + 32u < p.tokens) { ga1 = XQ[(n0 + an + 32u) * kv + ka]; } else { ga1 = vec4<i32>(0); }
      if (n0 + an + 64u < p.tokens) { ga2 = XQ[(n0 + an + 64u) * kv + ka]; } else { ga2 = vec4<i32>(0); }
      if (n0 + an + 96u < p.tokens) { ga3 = XQ[(n0 + an + 96u) * kv + ka]; } else { ga3 = vec4<i32>(0); }
    } else {
      ga0 = vec4<i32>(0); ga1 = vec4<i32>(0); ga2 = vec4<i32>(0); ga3 = vec4<i32>(0);
    }
    let kw = kk / 64u + wc;
    if (kw < kv / 4u && j0 + wr < p.rows) { gw = W4[(j0 + wr) * (kv / 4u) + kw]; } else { gw = vec4<u32>(0x55555555u); }
    // staged: a row's vec4 c at word 4c (codes) or 16c (weights) of the row's 36
    let a = an * 36u + ac * 4u;
    As[a] = ga0.x; As[a + 1u] = ga0.y; As[a + 2u] = ga0.z; As[a + 3u] = ga0.w;
    As[a + 1152u] = ga1.x; As[a + 1153u] = ga1.y; As[a + 1154u] = ga1.z; As[a + 1155u] = ga1.w;
    As[a + 2304u] = ga2.x; As[a + 2305u] = ga2.y; As[a + 2306u] = ga2.z; As[a + 2307u] = ga2.w;
    As[a + 3456u] = ga3.x; As[a + 3457u] = ga3.y; As[a + 3458u] = ga3.z; As[a + 3459u] = ga3.w;
    let w = wr * 36u + wc * 16u;
    Ws[w] = unpacked(gw.x, 0u); Ws[w + 1u] = unpacked(gw.x, 2u); Ws[w + 2u] = unpacked(gw.x, 4u);
    Ws[w + 3u] = unpacked(gw.x, 6u);
    Ws[w + 4u] = unpacked(gw.y, 0u); Ws[w + 5u] = unpacked(gw.y, 2u); Ws[w + 6u] = unpacked(gw.y, 4u);
    Ws[w + 7u] = unpacked(gw.y, 6u);
    Ws[w + 8u] = unpacked(gw.z, 0u); Ws[w + 9u] = unpacked(gw.z, 2u); Ws[w + 10u] = unpacked(gw.z, 4u);
    Ws[w + 11u] = unpacked(gw.z, 6u);
    Ws[w + 12u] = unpacked(gw.w, 0u); Ws[w + 13u] = unpacked(gw.w, 2u); Ws[w + 14u] = unpacked(gw.w, 4u);
    Ws[w + 15u] = unpacked(gw.w, 6u);
    workgroupBarrier();
    for (var kq = 0u; kq < 128u; kq += 32u) {
      let b0 = subgroupMatrixLoad<R>(&Ws, (sc * 64u) * STRIDE + kq, true, STRIDE);
      let b1 = subgroupMatrixLoad<R>(&Ws, (sc * 64u + 16u) * STRIDE + kq, true, STRIDE);
      let b2 = subgroupMatrixLoad<R>(&Ws, (sc * 64u + 32u) * STRIDE + kq, true, STRIDE);
      let b3 = subgroupMatrixLoad<R>(&Ws, (sc * 64u + 48u) * STRIDE + kq, true, STRIDE);
      let a0 = subgroupMatrixLoad<L>(&As, (sr * 32u) * STRIDE + kq, false, STRIDE);
      let a1 = subgroupMatrixLoad<L>(&As, (sr * 32u + 16u) * STRIDE + kq, false, STRIDE);
      c0_0 = subgroupMatrixMultiplyAccumulate(a0, b0, c0_0);
      c0_1 = subgroupMatrixMultiplyAccumulate(a0, b1, c0_1);
      c0_2 = subgroupMatrixMultiplyAccumulate(a0, b2, c0_2);
      c0_3 = subgroupMatrixMultiplyAccumulate(a0, b3, c0_3);
      c1_0 = subgroupMatrixMultiplyAccumulate(a1, b0, c1_0);
      c1_1 = subgroupMatrixMultiplyAccumulate(a1, b1, c1_1);
      c1_2 = subgroupMatrixMultiplyAccumulate(a1, b2, c1_2);
      c1_3 = subgroupMatrixMultiplyAccumulate(a1, b3, c1_3);
    }
    workgroupBarrier();
  }
  let tn = n0 + sr * 32u;
  let tj = j0 + sc * 64u;
  subgroupMatrixStore(&Cs, sg * 256u, c0_0, false, 16u); finish(sg, lane, tn, tj);
  subgroupMatrixStore(&Cs, sg * 256u, c0_1, false, 16u); finish(sg, lane, tn, tj + 16u);
  subgroupMatrixStore(&Cs, sg * 256u, c0_2, false, 16u); finish(sg, lane, tn, tj + 32u);
  subgroupMatrixStore(&Cs, sg * 256u, c0_3, false, 16u); finish(sg, lane, tn, tj + 48u);
  subgroupMatrixStore(&Cs, sg * 256u, c1_0, false, 16u); finish(sg, lane, tn + 16u, tj);
  subgroupMatrixStore(&Cs, sg * 256u, c1_1, false, 16u); finish(sg, lane, tn + 16u, tj + 16u);
  subgroupMatrixStore(&Cs, sg * 256u, c1_2, false, 16u); finish(sg, lane, tn + 16u, tj + 32u);
  subgroupMatrixStore(&Cs, sg * 256u, c1_3, false, 16u); finish(sg, lane, tn + 16u, tj + 48u);
}
