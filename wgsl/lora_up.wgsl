// Expand rank-space rows back to full width, scaled, optionally accumulating:
//   Y[n, d] = scale * sum_j H[n, j] * M[j, d]   (+ Y[n, d] when accumulate != 0)
// H is [rows, rank4] (rank zero-padded to a multiple of 4, as lora_down.wgsl writes it),
// or `splits` such blocks whose sum is H (lora_down's partials when rows are few:
// summing them here saves a dispatch). M [rank, d4] and Y [rows, d4] are row-major
// vec4 arrays. LoRA uses it for y = s·h·Bᵀ (H = h, M = Bᵀ: the B projection and the
// scale in one pass) and for inputGrad, dx += s·dh·A (H = dh, M = A).
//
// A workgroup owns 8 rows: it first sums their H (over the splits) into workgroup
// memory, then each thread produces one vec4 column of the 8 rows (eight vec4
// accumulators): every M vector it loads serves 8 rows, and ranks go 4 at a time
// (4 M loads in flight).

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

override WG: u32 = 128u;  // threads (vec4 columns) per workgroup; at least 8 * Q
override Q: u32 = 4u;   // rank quads: ceil(rank / 4)

var<workgroup> h_tile: array<vec4<f32>, 8u * Q>;  // [row][quad] of this workgroup's 8 rows

fn store(n: u32, d: u32, v: vec4<f32>) {
  if (n < p.rows && d < p.d4) {
    let o = n * p.d4 + d;
    var out = p.scale * v;
    if (p.accumulate != 0u) { out += Y[o]; }
    Y[o] = out;
  }
}

fn mix(g: vec4<f32>, m0: vec4<f32>, m1: vec4<f32>, m2: vec4<f32>, m3: vec4<f32>) -> vec4<f32> {
  return g.x * m0 + g.y * m1 + g.z * m2 + g.w * m3;
}

@compute @workgroup_size(WG)
fn up(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let n0 = wg.y * 8u;
  if (t < 8u * Q) {
    let row = min(n0 + t / Q, p.rows - 1u) * Q + t % Q;  // rows past the edge repeat the last one
    var g = H[row];
    for (var s = 1u; s < p.splits; s++) { g += H[s * p.rows * Q + row]; }
    h_tile[t] = g;
  }
  workgroupBarrier();
  let d = min(wg.x * WG + t, p.d4 - 1u);  // columns past the edge repeat the last one; not stored
  let last = (p.rank - 1u) * p.d4;
  var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
  var a4 = vec4<f32>(0.0); var a5 = vec4<f32>(0.0); var a6 = vec4<f32>(0.0); var a7 = vec4<f32>(0.0);
  for (var q = 0u; q < Q; q++) {
    let j = 4u * q;  // ranks past the end have H = 0; their M rows repeat the last one
    let m0 = M[j * p.d4 + d];
    let m1 = M[min((j + 1u) * p.d4, last) + d];
    let m2 = M[min((j + 2u) * p.d4, last) + d];
    let m3 = M[min((j + 3u) * p.d4, last) + d];
    a0 += mix(h_tile[q], m0, m1, m2, m3);
    a1 += mix(h_tile[Q + q], m0, m1, m2, m3);
    a2 += mix(h_tile[2u * Q + q], m0, m1, m2, m3);
    a3 += mix(h_tile[3u * Q + q], m0, m1, m2, m3);
    a4 += mix(h_tile[4u * Q + q], m0, m1, m2, m3);
    a5 += mix(h_tile[5u * Q + q], m0, m1, m2, m3);
    a6 += mix(h_tile[6u * Q + q], m0, m1, m2, m3);
    a7 += mix(h_tile[7u * Q + q], m0, m1, m2, m3);
  }
  let col = wg.x * WG + t;
  store(n0, col, a0); store(n0 + 1u, col, a1); store(n0 + 2u, col, a2); store(n0 + 3u, col, a3);
  store(n0 + 4u, col, a4); store(n0 + 5u, col, a5); store(n0 + 6u, col, a6); store(n0 + 7u, col, a7);
}
