// Sum partial results over their splits, scale, optionally accumulate, four floats a thread:
//   OUT[i] = scale * sum over s < splits of P[s * stride + i]   (+ OUT[i] when accumulate != 0)
// Finishes gradA and gradB (the row splits of lora_outer.wgsl; accumulate gives the
// `+=` of gradient accumulation) and sums lora_down.wgsl's split blocks of h or dh.
// Lengths and strides are in vec4s (the host pads splits to multiples of 4 floats);
// splits go 4 at a time so 4 loads are in flight.

struct Params {
  len4: u32,
  stride4: u32,
  splits: u32,
  accumulate: u32,
  scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> P: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> OUT: array<vec4<f32>>;

override WG: u32 = 256u;

@compute @workgroup_size(WG)
fn reduce_partials(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= p.len4) { return; }
  var s0 = vec4<f32>(0.0); var s1 = vec4<f32>(0.0); var s2 = vec4<f32>(0.0); var s3 = vec4<f32>(0.0);
  var k = 0u;
  for (; k + 3u < p.splits; k += 4u) {
    s0 += P[k * p.stride4 + i];
    s1 += P[(k + 1u) * p.stride4 + i];
    s2 += P[(k + 2u) * p.stride4 + i];
    s3 += P[(k + 3u) * p.stride4 + i];
  }
  for (; k < p.splits; k++) { s0 += P[k * p.stride4 + i]; }
  var v = p.scale * ((s0 + s1) + (s2 + s3));
  if (p.accumulate != 0u) { v += OUT[i]; }
  OUT[i] = v;
}
