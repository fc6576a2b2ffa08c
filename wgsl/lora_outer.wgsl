// Sums of outer products over a split of rows (the weight gradients):
//   OUT[s, j, d] = scale * sum over n in split s of G[n, j] * X[n, d]   (+ OUT when accumulate != 0)
// G is [rows, rank] f32; X [rows, d4] and OUT [splits, rank, d4] are vec4 arrays.
// LoRA uses it for gradB as dBᵀ = s·hᵀ·dY (G = h, X = dY) and for gradA, dA = s·dhᵀ·x
// (G = dh, X = x). With one split it writes the gradient itself, scaled and with the
// `+=` of gradient accumulation; with several it writes unscaled partial sums and
// reduce.wgsl finishes them.
//
// A thread owns one (rank, vec4 column) pair and walks its split's rows, four at a
// time for memory-level parallelism; threads of one workgroup share TD columns, so
// each X load is reused by the K ranks from cache. No workgroup memory, no barriers.

struct Params {
  rows: u32,
  d4: u32,
  rank: u32,
  split_rows: u32,  // rows per split
  accumulate: u32,
  scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> G: array<f32>;
@group(0) @binding(2) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> OUT: array<vec4<f32>>;

const TD: u32 = 16u;  // vec4 columns per workgroup
const K: u32 = 16u;   // ranks per workgroup (grid.z covers the rest): TD * K threads

@compute @workgroup_size(TD * K)
fn outer(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let d = wg.x * TD + t % TD;
  let j = wg.z * K + t / TD;
  if (d >= p.d4 || j >= p.rank) { return; }
  let n_begin = wg.y * p.split_rows;
  let n_end = min(n_begin + p.split_rows, p.rows);
  var a0 = vec4<f32>(0.0);
  var a1 = vec4<f32>(0.0);
  var a2 = vec4<f32>(0.0);
  var a3 = vec4<f32>(0.0);
  var n = n_begin;
  for (; n + 3u < n_end; n += 4u) {
    a0 += G[n * p.rank + j] * X[n * p.d4 + d];
    a1 += G[(n + 1u) * p.rank + j] * X[(n + 1u) * p.d4 + d];
    a2 += G[(n + 2u) * p.rank + j] * X[(n + 2u) * p.d4 + d];
    a3 += G[(n + 3u) * p.rank + j] * X[(n + 3u) * p.d4 + d];
  }
  for (; n < n_end; n++) {
    a0 += G[n * p.rank + j] * X[n * p.d4 + d];
  }
  let o = (wg.y * p.rank + j) * p.d4 + d;
  var v = p.scale * ((a0 + a1) + (a2 + a3));
  if (p.accumulate != 0u) { v += OUT[o]; }
  OUT[o] = v;
}
