// The adapter's arithmetic ceilings, as copy.wgsl gives its streaming bandwidth: long chains of
// independent multiply-adds per thread, registers only, one store at the end (so the compiler
// keeps them). The engine's kernels are compared against these rates (benchmarks/timing.py).
//   fma_chain   16 vec4 float32 fma a loop step (128 flops), four independent chains
//   dp4a_chain  16 dot4I8Packed accumulations a loop step (128 int8 ops), eight independent sums
// Both store a value the test recomputes: OUT[i] = the thread's chains summed.

struct Params {
  iters: u32,
  seed: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> OUT: array<u32>;

override WG: u32 = 256u;

@compute @workgroup_size(WG)
fn fma_chain(@builtin(global_invocation_id) gid: vec3<u32>) {
  let x = f32((gid.x ^ p.seed) % 1024u) * 1e-3;
  var a0 = vec4<f32>(x, x + 1.0, x + 2.0, x + 3.0);
  var a1 = a0 + 0.5;
  var a2 = a0 + 0.25;
  var a3 = a0 + 0.125;
  let m = vec4<f32>(0.999, 0.998, 0.997, 0.996);
  let c = vec4<f32>(1e-3);
  for (var i = 0u; i < p.iters; i++) {
    a0 = fma(a0, m, c); a1 = fma(a1, m, c); a2 = fma(a2, m, c); a3 = fma(a3, m, c);
    a0 = fma(a0, m, c); a1 = fma(a1, m, c); a2 = fma(a2, m, c); a3 = fma(a3, m, c);
    a0 = fma(a0, m, c); a1 = fma(a1, m, c); a2 = fma(a2, m, c); a3 = fma(a3, m, c);
    a0 = fma(a0, m, c); a1 = fma(a1, m, c); a2 = fma(a2, m, c); a3 = fma(a3, m, c);
  }
  OUT[gid.x] = bitcast<u32>(dot(a0 + a1 + a2 + a3, vec4<f32>(1.0)));
}

@compute @workgroup_size(WG)
fn dp4a_chain(@builtin(global_invocation_id) gid: vec3<u32>) {
  let g = gid.x ^ p.seed;
  let a = vec4<u32>(g, g * 3u, g * 5u, g * 7u);
  var b = vec4<u32>(g * 11u, g * 13u, g * 17u, g * 19u);
  var s0 = 0i; var s1 = 0i; var s2 = 0i; var s3 = 0i; var s4 = 0i; var s5 = 0i; var s6 = 0i; var s7 = 0i;
  for (var i = 0u; i < p.iters; i++) {
    s0 += dot4I8Packed(a.x, b.x); s1 += dot4I8Packed(a.y, b.y); s2 += dot4I8Packed(a.z, b.z); s3 += dot4I8Packed(a.w, b.w);
    s4 += dot4I8Packed(a.x, b.y); s5 += dot4I8Packed(a.y, b.z); s6 += dot4I8Packed(a.z, b.w); s7 += dot4I8Packed(a.w, b.x);
    s0 += dot4I8Packed(a.x, b.z); s1 += dot4I8Packed(a.y, b.w); s2 += dot4I8Packed(a.z, b.x); s3 += dot4I8Packed(a.w, b.y);
    s4 += dot4I8Packed(a.x, b.w); s5 += dot4I8Packed(a.y, b.x); s6 += dot4I8Packed(a.z, b.y); s7 += dot4I8Packed(a.w, b.z);
    b = b.yzwx;
  }
  OUT[gid.x] = bitcast<u32>(s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7);
}
