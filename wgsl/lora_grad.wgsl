// LoRA gradients inside the engine's backward, for one adapter (a segment of a fused projection:
// output rows begin, begin + step, … < end; its B [rows, rank] at LB[b_offset]; its h at column
// h_col of H) or for a site's stacked A:
//   dh:  DH[n][h_col + r]          = scale · Σ_i dY[n][begin + step·i] · B[i][r]   (four tokens a workgroup)
//   db:  G[b_offset + i·rank + r] (+)= scale · Σ_n dY[n][begin + step·i] · H[n][h_col + r]
//   da:  G[a_offset + r·x_stride + k] (+)= Σ_n DH[n][r] · X[n][k]                 (DH already scaled)
//        (with DROPOUT X[n][k] · m[n][k], row r's adapter's dropout mask: _dropout.wgsl)
// The adapters' input gradient, Σ_r DH[n][r]·A[r][k], is added by the transposed projection.

struct Params {
  tokens: u32,
  begin: u32,
  end: u32,
  step: u32,
  rank: u32,       // this adapter's rank (dh, db) or the site's total rank (da)
  h_col: u32,
  b_offset: u32,   // db: where the gradient of B starts in G; dh: where B starts in LB
  a_offset: u32,   // da: where the gradient of the stacked A starts in G
  dy_stride: u32,
  h_stride: u32,   // floats per row of H and DH
  x_stride: u32,   // floats per row of X and of A's gradient (K padded to 64)
  k: u32,          // da: input features
  accumulate: u32,
  scale: f32,
  drop_key: u32,
  drop_split1: u32,
  drop_split2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> DY: array<f32>;
@group(0) @binding(2) var<storage, read> LB: array<f32>;
@group(0) @binding(3) var<storage, read_write> DH: array<f32>;
@group(0) @binding(4) var<storage, read> H: array<f32>;
@group(0) @binding(5) var<storage, read_write> G: array<f32>;
@group(0) @binding(6) var<storage, read> X: array<vec4<f32>>;  // da: rows of x_stride floats
@group(0) @binding(7) var<storage, read> DHR: array<f32>;
@group(0) @binding(8) var<storage, read> DROP: array<u32>;

override WG: u32 = 256u;
override DROPOUT: bool = false;

// @include _dropout.wgsl
// @include _reductions.wgsl

var<workgroup> slice_sums: array<vec4<f32>, WG>;

fn rows() -> u32 { return (p.end - p.begin + p.step - 1u) / p.step; }

fn quad(base: u32, r0: u32) -> vec4<u32> {  // the four rank columns r0.. (the last repeated past the rank)
  let last = p.rank - 1u;
  return vec4<u32>(base + min(r0, last), base + min(r0 + 1u, last), base + min(r0 + 2u, last),
                   base + min(r0 + 3u, last));
}

// dh: four tokens a workgroup, so that each load of B serves four tokens; the rank quads in turn.
fn put_dh(n: u32, r0: u32, v: vec4<f32>) {
  if (n >= p.tokens) { return; }
  for (var c = 0u; c < 4u; c++) {
    if (r0 + c < p.rank) { DH[n * p.h_stride + p.h_col + r0 + c] = p.scale * v[c]; }
  }
}

@compute @workgroup_size(WG)
fn dh(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  let t = inv.t;
  let n0 = 4u * wg.x;
  let count = rows();
  let last = p.tokens - 1u;  // tokens past it repeat it (not stored)
  let dy = vec4<u32>(min(n0, last), min(n0 + 1u, last), min(n0 + 2u, last), min(n0 + 3u, last)) * p.dy_stride +
           vec4<u32>(p.begin);
  for (var r0 = 0u; r0 < p.rank; r0 += 4u) {
    var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
    for (var i = t; i < count; i += WG) {
      let c = quad(p.b_offset + i * p.rank, r0);
      let b = vec4<f32>(LB[c.x], LB[c.y], LB[c.z], LB[c.w]);
      let j = p.step * i;
      a0 += DY[dy.x + j] * b; a1 += DY[dy.y + j] * b; a2 += DY[dy.z + j] * b; a3 += DY[dy.w + j] * b;
    }
    let s0 = sum_all4(t, a0);
    let s1 = sum_all4(t, a1);
    let s2 = sum_all4(t, a2);
    let s3 = sum_all4(t, a3);
    if (t == 0u) { put_dh(n0, r0, s0); put_dh(n0 + 1u, r0, s1); put_dh(n0 + 2u, r0, s2); put_dh(n0 + 3u, r0, s3); }
  }
}

// db: 32 outputs × one rank quad a workgroup. The tokens are split over SLICES slices of 32
// invocations (every SLICES-th token each), so each sums a few dozen tokens rather than all of
// them one after another, and the slices' sums are added in workgroup memory.
const SLICES: u32 = 8u;

fn slices_sum(t: u32, acc: vec4<f32>) -> vec4<f32> {  // the total, for invocations t < 32
  slice_sums[t] = acc;
  workgroupBarrier();
  var total = vec4<f32>(0.0);
  if (t < 32u) {
    for (var s = 0u; s < SLICES; s++) { total += slice_sums[32u * s + t]; }
  }
  return total;
}

@compute @workgroup_size(256)
fn db(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let i = wg.x * 32u + t % 32u;
  let r0 = wg.y * 4u;
  let count = rows();
  let j = p.begin + p.step * min(i, count - 1u);
  var acc = vec4<f32>(0.0);
  for (var n = t / 32u; n < p.tokens; n += SLICES) {
    let c = quad(n * p.h_stride + p.h_col, r0);
    acc += DY[n * p.dy_stride + j] * vec4<f32>(H[c.x], H[c.y], H[c.z], H[c.w]);
  }
  let total = slices_sum(t, acc);
  if (t >= 32u || i >= count) { return; }
  for (var c = 0u; c < 4u; c++) {
    if (r0 + c < p.rank) {
      let o = p.b_offset + i * p.rank + r0 + c;
      let v = p.scale * total[c];
      if (p.accumulate != 0u) { G[o] += v; } else { G[o] = v; }
    }
  }
}

// da: 32 features (8 words of 4) × one rank quad a workgroup, the tokens split over 32 slices of
// 8 invocations; an invocation sums one word's 4 features for the 4 ranks (with DROPOUT one mask
// hash serves the word's 4 features), and the slices' 16 sums each are added in workgroup memory.
const DA_SLICES: u32 = 32u;

var<workgroup> da_sums: array<vec4<f32>, 1024>;  // [rank of the quad][invocation]: a word's 4 features

@compute @workgroup_size(256)
fn da(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let w = wg.x * 8u + t % 8u;  // feature word: features 4w .. 4w + 3 (X's rows are padded to 64)
  let r0 = wg.y * 4u;
  let words = p.x_stride / 4u;
  var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
  for (var n = t / 8u; n < p.tokens; n += DA_SLICES) {
    let c = quad(n * p.h_stride, r0);
    let x = X[n * words + min(w, words - 1u)];
    if (DROPOUT) {
      let m = drop_quad4(r0, n, w);
      a0 += (x * m[0]) * DHR[c.x]; a1 += (x * m[1]) * DHR[c.y]; a2 += (x * m[2]) * DHR[c.z]; a3 += (x * m[3]) * DHR[c.w];
    } else {
      a0 += x * DHR[c.x]; a1 += x * DHR[c.y]; a2 += x * DHR[c.z]; a3 += x * DHR[c.w];
    }
  }
  da_sums[t] = a0; da_sums[256u + t] = a1; da_sums[512u + t] = a2; da_sums[768u + t] = a3;
  workgroupBarrier();
  for (var half = DA_SLICES / 2u; half > 0u; half >>= 1u) {  // slice s adds slice s + half
    if (t < 8u * half) {
      for (var c = 0u; c < 4u; c++) { da_sums[256u * c + t] += da_sums[256u * c + t + 8u * half]; }
    }
    workgroupBarrier();
  }
  if (t >= 8u) { return; }
  for (var c = 0u; c < 4u; c++) {
    if (r0 + c < p.rank) {
      let total = da_sums[256u * c + t];
      for (var e = 0u; e < 4u; e++) {
        let k = 4u * w + e;
        if (k < p.k) {
          let o = p.a_offset + (r0 + c) * p.x_stride + k;
          if (p.accumulate != 0u) { G[o] += total[e]; } else { G[o] = total[e]; }
        }
      }
    }
  }
}

// dh with one token per invocation and no barriers: for CPU adapters (see norm.wgsl).
@compute @workgroup_size(64)
fn dh_rows(@builtin(global_invocation_id) gid: vec3<u32>) {
  let n = gid.x;
  if (n >= p.tokens) { return; }
  let count = rows();
  for (var r = 0u; r < p.rank; r++) {
    var acc = 0.0;
    for (var i = 0u; i < count; i++) {
      acc += DY[n * p.dy_stride + p.begin + p.step * i] * LB[p.b_offset + i * p.rank + r];
    }
    DH[n * p.h_stride + p.h_col + r] = p.scale * acc;
  }
}
