// Row-by-row dot products with a low-rank matrix, optionally split along the row:
//   P[s, n, j] = sum over d in split s of X[n, d] * M[j, d]
// X [rows, d4] and M [rank, d4] are row-major vec4 arrays; P is [splits, rows, rank].
// LoRA uses it for h = x·Aᵀ (X = x, M = A) and for gradDh, dh = dY·B (X = dY, M = Bᵀ).
// With one split P is the result; with several (few rows: more workgroups keep the
// GPU busy) reduce.wgsl sums them.
//
// A workgroup owns 4 rows, 4*Q ranks and one split. A thread owns 4 ranks; LANES
// threads share them and stride over the split's vec4 columns (consecutive lanes,
// consecutive memory). Each step loads 4 x and 4 M vectors and does 16 dot products
// into four vec4 accumulators (one per rank, one component per row): no per-thread
// arrays. A tree over the lanes in workgroup memory finishes the sums.

struct Params {
  rows: u32,
  d4: u32,
  rank: u32,
  split_d4: u32,  // vec4 columns per split
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> M: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> P: array<f32>;

const LANES: u32 = 64u;  // threads sharing 4 ranks; a power of two
const Q: u32 = 4u;       // rank quads per workgroup; grid.z covers the rest
const WG: u32 = LANES * Q;

var<workgroup> sums: array<vec4<f32>, 4u * WG>;

fn store(split: u32, n: u32, j: u32, v: f32) {
  if (n < p.rows && j < p.rank) { P[(split * p.rows + n) * p.rank + j] = v; }
}

@compute @workgroup_size(WG)
fn down(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let lane = t % LANES;
  let j0 = (wg.z * Q + t / LANES) * 4u;
  let last_rank = p.rank - 1u;  // ranks past the edge repeat the last one; not stored
  let m0 = min(j0, last_rank) * p.d4;
  let m1 = min(j0 + 1u, last_rank) * p.d4;
  let m2 = min(j0 + 2u, last_rank) * p.d4;
  let m3 = min(j0 + 3u, last_rank) * p.d4;
  let n0 = wg.x * 4u;
  let last_row = p.rows - 1u;
  let r0 = min(n0, last_row) * p.d4;
  let r1 = min(n0 + 1u, last_row) * p.d4;
  let r2 = min(n0 + 2u, last_row) * p.d4;
  let r3 = min(n0 + 3u, last_row) * p.d4;
  let d_begin = wg.y * p.split_d4;
  let d_end = min(d_begin + p.split_d4, p.d4);

  var a0 = vec4<f32>(0.0);
  var a1 = vec4<f32>(0.0);
  var a2 = vec4<f32>(0.0);
  var a3 = vec4<f32>(0.0);
  for (var d = d_begin + lane; d < d_end; d += LANES) {
    let x0 = X[r0 + d];
    let x1 = X[r1 + d];
    let x2 = X[r2 + d];
    let x3 = X[r3 + d];
    let w0 = M[m0 + d];
    let w1 = M[m1 + d];
    let w2 = M[m2 + d];
    let w3 = M[m3 + d];
    a0 += vec4<f32>(dot(x0, w0), dot(x1, w0), dot(x2, w0), dot(x3, w0));
    a1 += vec4<f32>(dot(x0, w1), dot(x1, w1), dot(x2, w1), dot(x3, w1));
    a2 += vec4<f32>(dot(x0, w2), dot(x1, w2), dot(x2, w2), dot(x3, w2));
    a3 += vec4<f32>(dot(x0, w3), dot(x1, w3), dot(x2, w3), dot(x3, w3));
  }
  sums[t] = a0;
  sums[WG + t] = a1;
  sums[2u * WG + t] = a2;
  sums[3u * WG + t] = a3;
  workgroupBarrier();
  for (var s = LANES / 2u; s > 0u; s >>= 1u) {
    if (lane < s) {
      sums[t] += sums[t + s];
      sums[WG + t] += sums[WG + t + s];
      sums[2u * WG + t] += sums[2u * WG + t + s];
      sums[3u * WG + t] += sums[3u * WG + t + s];
    }
    workgroupBarrier();
  }
  if (lane == 0u) {
    for (var k = 0u; k < 4u; k++) {
      let v = sums[k * WG + t];
      for (var i = 0u; i < 4u; i++) { store(wg.y, n0 + i, j0 + k, v[i]); }
    }
  }
}
