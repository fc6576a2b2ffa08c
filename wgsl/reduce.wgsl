// Sum partial results over their splits, scale, optionally accumulate:
//   OUT[i] = scale * sum over s < splits of P[s * len + i]   (+ OUT[i] when accumulate != 0)
// Finishes gradA and gradB (row splits from lora_outer.wgsl; accumulate gives the
// `+=` of gradient accumulation) and h or dh (column splits from lora_down.wgsl).

struct Params {
  len: u32,
  splits: u32,
  accumulate: u32,
  scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> P: array<f32>;
@group(0) @binding(2) var<storage, read_write> OUT: array<f32>;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn reduce_partials(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= p.len) { return; }
  var s = 0.0;
  for (var k = 0u; k < p.splits; k++) { s += P[k * p.len + i]; }
  var v = p.scale * s;
  if (p.accumulate != 0u) { v += OUT[i]; }
  OUT[i] = v;
}
