// RMSNorm's input gradient, one row per workgroup, from the forward's saved r = 1/rms:
//   y = g · (x · r)   ⇒   dx = r · (g · dy) − x · r³ · (Σ_k g_k · dy_k · x_k) / K
// stored, or added into OUT (a residual stream's running gradient: never overwritten there).

struct Params {
  tokens: u32,
  k: u32,
  dy_stride: u32,
  x_stride: u32,
  out_stride: u32,
  accumulate: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> DY: array<f32>;
@group(0) @binding(2) var<storage, read> X: array<f32>;
@group(0) @binding(3) var<storage, read> RS: array<f32>;
@group(0) @binding(4) var<storage, read> G: array<f32>;
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;
// The same bindings 16 bytes a read (rmsnorm_backward4: k and every row stride multiples of 4)
@group(0) @binding(6) var<storage, read> DY4: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read> X4: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read> G4: array<vec4<f32>>;
@group(0) @binding(9) var<storage, read_write> OUT4: array<vec4<f32>>;

override WG: u32 = 256u;

// @include _reductions.wgsl

@compute @workgroup_size(WG)
fn rmsnorm_backward(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  let t = inv.t;
  let n = wg.x;
  let dy = n * p.dy_stride;
  let x = n * p.x_stride;
  var s = 0.0;
  for (var k = t; k < p.k; k += WG) { s += G[k] * DY[dy + k] * X[x + k]; }
  let total = sum_all(t, s);
  let r = RS[n];
  let c = r * r * r * total / f32(p.k);
  let o = n * p.out_stride;
  for (var k = t; k < p.k; k += WG) {
    let v = r * (G[k] * DY[dy + k]) - X[x + k] * c;
    if (p.accumulate != 0u) { OUT[o + k] += v; } else { OUT[o + k] = v; }
  }
}

// The same, four features an invocation at a time (a vec4 read or write where rmsnorm_backward
// makes four scalar ones, each warp-wide access a quarter as wide).
@compute @workgroup_size(WG)
fn rmsnorm_backward4(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  let t = inv.t;
  let n = wg.x;
  let words = p.k / 4u;
  let dy = n * p.dy_stride / 4u;
  let x = n * p.x_stride / 4u;
  var s = 0.0;
  for (var w = t; w < words; w += WG) { s += dot(G4[w] * DY4[dy + w], X4[x + w]); }
  let total = sum_all(t, s);
  let r = RS[n];
  let c = r * r * r * total / f32(p.k);
  let o = n * p.out_stride / 4u;
  for (var w = t; w < words; w += WG) {
    let v = r * (G4[w] * DY4[dy + w]) - X4[x + w] * c;
    if (p.accumulate != 0u) { OUT4[o + w] += v; } else { OUT4[o + w] = v; }
  }
}

// The same, one row per invocation with no barriers (for CPU adapters, see norm.wgsl).
@compute @workgroup_size(64)
fn rmsnorm_backward_rows(@builtin(global_invocation_id) gid: vec3<u32>) {
  let n = gid.x;
  if (n >= p.tokens) { return; }
  let dy = n * p.dy_stride;
  let x = n * p.x_stride;
  var s = 0.0;
  for (var k = 0u; k < p.k; k++) { s += G[k] * DY[dy + k] * X[x + k]; }
  let r = RS[n];
  let c = r * r * r * s / f32(p.k);
  let o = n * p.out_stride;
  for (var k = 0u; k < p.k; k++) {
    let v = r * (G[k] * DY[dy + k]) - X[x + k] * c;
    if (p.accumulate != 0u) { OUT[o + k] += v; } else { OUT[o + k] = v; }
  }
}
