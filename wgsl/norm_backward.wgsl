// RMSNorm's input gradient, one row per workgroup, from the forward's saved r = 1/rms:
//   y = g · (x · r)   ⇒   dx = r · (g · dy) − x · r³ · (Σ_k g_k · dy_k · x_k) / K
// stored, or added into OUT (a residual stream's running gradient: never overwritten there).

struct Params {
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

override WG: u32 = 256u;

var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(WG)
fn rmsnorm_backward(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let n = wg.x;
  let dy = n * p.dy_stride;
  let x = n * p.x_stride;
  var s = 0.0;
  for (var k = t; k < p.k; k += WG) { s += G[k] * DY[dy + k] * X[x + k]; }
  red[t] = s;
  workgroupBarrier();
  for (var st = WG / 2u; st > 0u; st >>= 1u) {
    if (t < st) { red[t] += red[t + st]; }
    workgroupBarrier();
  }
  let r = RS[n];
  let c = r * r * r * red[0] / f32(p.k);
  let o = n * p.out_stride;
  for (var k = t; k < p.k; k += WG) {
    let v = r * (G[k] * DY[dy + k]) - X[x + k] * c;
    if (p.accumulate != 0u) { OUT[o + k] += v; } else { OUT[o + k] = v; }
  }
}
