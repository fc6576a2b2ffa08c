// The gradient of BitNet's MLP activation, h = relu(gate)² · up, into the interleaved gate/up
// pairs the fused projection produced (gate i at 2i, up i at 2i + 1):
//   d gate = dh · up · 2 · relu(gate),   d up = dh · relu(gate)²

struct Params {
  tokens: u32,
  features: u32,    // F
  dh_stride: u32,
  pair_stride: u32, // floats per row of GU and OUT (2F or more)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> DH: array<f32>;
@group(0) @binding(2) var<storage, read> GU: array<f32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;

override WG: u32 = 256u;

@compute @workgroup_size(WG)
fn relu2_backward(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  let n = gid.y;
  if (i >= p.features) { return; }
  let pair = n * p.pair_stride + 2u * i;
  let g = max(GU[pair], 0.0);
  let dh = DH[n * p.dh_stride + i];
  OUT[pair] = dh * GU[pair + 1u] * 2.0 * g;
  OUT[pair + 1u] = dh * (g * g);
}
