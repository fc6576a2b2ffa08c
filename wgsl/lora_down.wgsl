// Row-by-row dot products with a low-rank matrix, optionally split along the row:
//   P[s, n, j] = sum over d in split s of X[n, d] * M[j, d]
// X [rows, d4] and M [rank, d4] are row-major vec4 arrays; P is [splits, rows, rank].
// LoRA uses it for h = x·Aᵀ (X = x, M = A) and for gradDh, dh = dY·B (X = dY, M = Bᵀ).
// With one split P is the result; with several (few rows: more workgroups keep the
// GPU busy) reduce.wgsl sums them.
//
// A workgroup owns 4 rows, K ranks and one split. LANES threads share a rank and
// stride over the split's vec4 columns (consecutive lanes read consecutive memory);
// each keeps one vec4 accumulator, one component per row, so no per-thread arrays.
// A tree over the lanes in workgroup memory finishes the sums.

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

const LANES: u32 = 16u;  // threads per rank; a power of two
const K: u32 = 16u;      // ranks per workgroup; grid.z covers the rest
const WG: u32 = LANES * K;

var<workgroup> sums: array<vec4<f32>, WG>;

@compute @workgroup_size(WG)
fn down(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let lane = t % LANES;
  let j_raw = wg.z * K + t / LANES;
  let j = min(j_raw, p.rank - 1u);  // ranks past the edge repeat the last; not stored
  let n0 = wg.x * 4u;
  let last = p.rows - 1u;
  let r0 = min(n0, last) * p.d4;
  let r1 = min(n0 + 1u, last) * p.d4;
  let r2 = min(n0 + 2u, last) * p.d4;
  let r3 = min(n0 + 3u, last) * p.d4;
  let m_row = j * p.d4;
  let d_begin = wg.y * p.split_d4;
  let d_end = min(d_begin + p.split_d4, p.d4);

  var acc = vec4<f32>(0.0);
  for (var d = d_begin + lane; d < d_end; d += LANES) {
    let m = M[m_row + d];
    acc += vec4<f32>(dot(X[r0 + d], m), dot(X[r1 + d], m), dot(X[r2 + d], m), dot(X[r3 + d], m));
  }
  sums[t] = acc;
  workgroupBarrier();
  for (var s = LANES / 2u; s > 0u; s >>= 1u) {
    if (lane < s) { sums[t] += sums[t + s]; }
    workgroupBarrier();
  }
  if (lane == 0u && j_raw < p.rank) {
    let v = sums[t];
    let base = wg.y * p.rows;
    for (var i = 0u; i < 4u; i++) {
      let n = n0 + i;
      if (n < p.rows) { P[(base + n) * p.rank + j] = v[i]; }
    }
  }
}
