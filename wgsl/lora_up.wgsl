// Expand rank-space rows back to full width, scaled, optionally accumulating:
//   Y[n, d] = scale * sum_j H[n, j] * M[j, d]   (+ Y[n, d] when accumulate != 0)
// H is [rows, rank4] (rank zero-padded to a multiple of 4, as lora_down.wgsl writes it),
// or `splits` such blocks whose sum is H (lora_down's partials when rows are few:
// summing them here saves a dispatch). M [rank, d4] and Y [rows, d4] are row-major
// vec4 arrays. LoRA uses it for y = s·h·Bᵀ (H = h, M = Bᵀ: the B projection and the
// scale in one pass) and for inputGrad, dx += s·dh·A (H = dh, M = A).
//
// A thread owns one vec4 column of 8 rows (eight vec4 accumulators): each M vector
// it loads serves 8 rows, and ranks go 4 at a time (4 M loads in flight, H read as
// vec4s). All threads of a workgroup read the same H entries (a broadcast).

struct Params {
  rows: u32,
  d4: u32,
  rank: u32,
  splits: u32,  // blocks of H to sum
  accumulate: u32,
  scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> H: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> M: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> Y: array<vec4<f32>>;

const WG: u32 = 128u;  // threads (vec4 columns) per workgroup

fn h_row(n: u32) -> u32 {
  return min(n, p.rows - 1u) * ((p.rank + 3u) / 4u);  // rows past the edge repeat the last one; not stored
}

// H[n, 4q..4q+3], summed over the splits.
fn h4(row: u32, q: u32) -> vec4<f32> {
  let block = p.rows * ((p.rank + 3u) / 4u);
  var g = H[row + q];
  for (var s = 1u; s < p.splits; s++) { g += H[s * block + row + q]; }
  return g;
}

fn store(n: u32, d: u32, v: vec4<f32>) {
  if (n < p.rows) {
    let o = n * p.d4 + d;
    var out = p.scale * v;
    if (p.accumulate != 0u) { out += Y[o]; }
    Y[o] = out;
  }
}

@compute @workgroup_size(WG)
fn up(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let d = wg.x * WG + t;
  if (d >= p.d4) { return; }
  let n0 = wg.y * 8u;
  let h0 = h_row(n0); let h1 = h_row(n0 + 1u); let h2 = h_row(n0 + 2u); let h3 = h_row(n0 + 3u);
  let h4r = h_row(n0 + 4u); let h5 = h_row(n0 + 5u); let h6 = h_row(n0 + 6u); let h7 = h_row(n0 + 7u);
  let last = (p.rank - 1u) * p.d4;
  var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
  var a4 = vec4<f32>(0.0); var a5 = vec4<f32>(0.0); var a6 = vec4<f32>(0.0); var a7 = vec4<f32>(0.0);
  for (var q = 0u; q < (p.rank + 3u) / 4u; q++) {
    let j = 4u * q;  // ranks past the end have H = 0; their M rows repeat the last one
    let m0 = M[j * p.d4 + d];
    let m1 = M[min((j + 1u) * p.d4, last) + d];
    let m2 = M[min((j + 2u) * p.d4, last) + d];
    let m3 = M[min((j + 3u) * p.d4, last) + d];
    var g = h4(h0, q);  a0 += g.x * m0 + g.y * m1 + g.z * m2 + g.w * m3;
    g = h4(h1, q);      a1 += g.x * m0 + g.y * m1 + g.z * m2 + g.w * m3;
    g = h4(h2, q);      a2 += g.x * m0 + g.y * m1 + g.z * m2 + g.w * m3;
    g = h4(h3, q);      a3 += g.x * m0 + g.y * m1 + g.z * m2 + g.w * m3;
    g = h4(h4r, q);     a4 += g.x * m0 + g.y * m1 + g.z * m2 + g.w * m3;
    g = h4(h5, q);      a5 += g.x * m0 + g.y * m1 + g.z * m2 + g.w * m3;
    g = h4(h6, q);      a6 += g.x * m0 + g.y * m1 + g.z * m2 + g.w * m3;
    g = h4(h7, q);      a7 += g.x * m0 + g.y * m1 + g.z * m2 + g.w * m3;
  }
  store(n0, d, a0); store(n0 + 1u, d, a1); store(n0 + 2u, d, a2); store(n0 + 3u, d, a3);
  store(n0 + 4u, d, a4); store(n0 + 5u, d, a5); store(n0 + 6u, d, a6); store(n0 + 7u, d, a7);
}
