// Expand rank-space rows back to full width, scaled, optionally accumulating:
//   Y[n, d] = scale * sum_j H[n, j] * M[j, d]   (+ Y[n, d] when accumulate != 0)
// H is [rows, rank] f32; M [rank, d4] and Y [rows, d4] are row-major vec4 arrays.
// LoRA uses it for y = s·h·Bᵀ (H = h, M = Bᵀ: the B projection and the scale in one
// pass) and for inputGrad, dx += s·dh·A (H = dh, M = A).
//
// A thread owns one vec4 column of 4 rows (four vec4 accumulators): each M load
// serves 4 rows, and all threads of a workgroup read the same H entries (a broadcast).

struct Params {
  rows: u32,
  d4: u32,
  rank: u32,
  accumulate: u32,
  scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> H: array<f32>;
@group(0) @binding(2) var<storage, read> M: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> Y: array<vec4<f32>>;

const WG: u32 = 128u;  // threads (vec4 columns) per workgroup

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
  let n0 = wg.y * 4u;
  let last = p.rows - 1u;
  let h0 = min(n0, last) * p.rank;
  let h1 = min(n0 + 1u, last) * p.rank;
  let h2 = min(n0 + 2u, last) * p.rank;
  let h3 = min(n0 + 3u, last) * p.rank;
  var a0 = vec4<f32>(0.0);
  var a1 = vec4<f32>(0.0);
  var a2 = vec4<f32>(0.0);
  var a3 = vec4<f32>(0.0);
  for (var j = 0u; j < p.rank; j++) {
    let m = M[j * p.d4 + d];
    a0 += H[h0 + j] * m;
    a1 += H[h1 + j] * m;
    a2 += H[h2 + j] * m;
    a3 += H[h3 + j] * m;
  }
  store(n0, d, a0);
  store(n0 + 1u, d, a1);
  store(n0 + 2u, d, a2);
  store(n0 + 3u, d, a3);
}
