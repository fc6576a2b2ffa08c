// LoRA gradients inside the engine's backward, for one adapter (a segment of a fused projection:
// output rows begin, begin + step, … < end; its B [rows, rank] at LB[b_offset]; its h at column
// h_col of H) or for a site's stacked A:
//   dh:  DH[n][h_col + r]          = scale · Σ_i dY[n][begin + step·i] · B[i][r]   (one token a workgroup)
//   db:  G[b_offset + i·rank + r] (+)= scale · Σ_n dY[n][begin + step·i] · H[n][h_col + r]
//   da:  G[a_offset + r·x_stride + k] (+)= Σ_n DH[n][r] · X[n][k]                 (DH already scaled)
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
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> DY: array<f32>;
@group(0) @binding(2) var<storage, read> LB: array<f32>;
@group(0) @binding(3) var<storage, read_write> DH: array<f32>;
@group(0) @binding(4) var<storage, read> H: array<f32>;
@group(0) @binding(5) var<storage, read_write> G: array<f32>;
@group(0) @binding(6) var<storage, read> X: array<f32>;
@group(0) @binding(7) var<storage, read> DHR: array<f32>;

override WG: u32 = 256u;

var<workgroup> red: array<vec4<f32>, WG>;

fn rows() -> u32 { return (p.end - p.begin + p.step - 1u) / p.step; }

@compute @workgroup_size(WG)
fn dh(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let n = wg.x;
  let count = rows();
  for (var r0 = 0u; r0 < p.rank; r0 += 4u) {
    var acc = vec4<f32>(0.0);
    let last = p.rank - 1u;
    for (var i = t; i < count; i += WG) {
      let dy = DY[n * p.dy_stride + p.begin + p.step * i];
      let b = p.b_offset + i * p.rank;
      acc += dy * vec4<f32>(LB[b + r0], LB[b + min(r0 + 1u, last)], LB[b + min(r0 + 2u, last)],
                            LB[b + min(r0 + 3u, last)]);
    }
    red[t] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
      if (t < s) { red[t] += red[t + s]; }
      workgroupBarrier();
    }
    if (t == 0u) {
      for (var c = 0u; c < 4u; c++) {
        if (r0 + c < p.rank) { DH[n * p.h_stride + p.h_col + r0 + c] = p.scale * red[0][c]; }
      }
    }
    workgroupBarrier();
  }
}

// db: 64 rows of B × 4 rank quads a workgroup; every thread loops over the tokens.
@compute @workgroup_size(256)
fn db(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let i = wg.x * 64u + t % 64u;
  let r0 = (wg.y * 4u + t / 64u) * 4u;
  if (i >= rows() || r0 >= p.rank) { return; }
  let j = p.begin + p.step * i;
  let last = p.rank - 1u;
  var acc = vec4<f32>(0.0);
  for (var n = 0u; n < p.tokens; n++) {
    let h = n * p.h_stride + p.h_col;
    acc += DY[n * p.dy_stride + j] * vec4<f32>(H[h + r0], H[h + min(r0 + 1u, last)], H[h + min(r0 + 2u, last)],
                                                H[h + min(r0 + 3u, last)]);
  }
  for (var c = 0u; c < 4u; c++) {
    if (r0 + c < p.rank) {
      let o = p.b_offset + i * p.rank + r0 + c;
      let v = p.scale * acc[c];
      if (p.accumulate != 0u) { G[o] += v; } else { G[o] = v; }
    }
  }
}

// da: 64 input features × 4 rank quads a workgroup; every thread loops over the tokens.
@compute @workgroup_size(256)
fn da(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let k = wg.x * 64u + t % 64u;
  let r0 = (wg.y * 4u + t / 64u) * 4u;
  if (k >= p.k || r0 >= p.rank) { return; }
  let last = p.rank - 1u;
  var acc = vec4<f32>(0.0);
  for (var n = 0u; n < p.tokens; n++) {
    let h = n * p.h_stride;
    acc += X[n * p.x_stride + k] * vec4<f32>(DHR[h + r0], DHR[h + min(r0 + 1u, last)], DHR[h + min(r0 + 2u, last)],
                                             DHR[h + min(r0 + 3u, last)]);
  }
  for (var c = 0u; c < 4u; c++) {
    if (r0 + c < p.rank) {
      let o = p.a_offset + (r0 + c) * p.x_stride + k;
      if (p.accumulate != 0u) { G[o] += acc[c]; } else { G[o] = acc[c]; }
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
