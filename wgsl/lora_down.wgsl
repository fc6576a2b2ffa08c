// Row-by-row dot products with a low-rank matrix, optionally split along the row:
//   P[s, n, j] = sum over d in split s of X[n, d] * M[j, d]
// X [rows, d4] and M [rank, d4] are row-major vec4 arrays. P holds the splits one
// after another, each [rows, rank4]: the rank padded with zeros to a multiple of 4
// (`rank4`), so consumers load a row's ranks as vec4s. LoRA uses it for h = x·Aᵀ (X = x, M = A) and for
// gradDh, dh = dY·B (X = dY, M = Bᵀ). With one split P is the result; with several
// (few rows: more workgroups keep the GPU busy) lora_up.wgsl sums the blocks as it
// reads them, and reduce.wgsl sums them for lora_outer.wgsl.
//
// A workgroup owns 8 rows, 4*Q ranks and one split. A thread owns 4 ranks; LANES
// threads share them and stride over the split's vec4 columns (consecutive lanes,
// consecutive memory). Each step loads 8 x and 4 M vectors (12 loads in flight) and
// does 32 dot products into eight vec4 accumulators (one per rank and row quad, one
// component per row): no per-thread arrays, and every M vector serves 8 rows. A tree
// over the lanes in workgroup memory finishes the sums.

struct Params {
  rows: u32,
  d4: u32,
  rank: u32,
  split_d4: u32,  // vec4 columns per split
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> M: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> P: array<vec4<f32>>;

override LANES: u32 = 16u;  // threads sharing 4 ranks; a power of two
override Q: u32 = 4u;    // rank quads per workgroup; grid.z covers the rest
override WG: u32 = LANES * Q;

var<workgroup> sums: array<vec4<f32>, 8u * WG>;

fn row_offset(n: u32) -> u32 {
  return min(n, p.rows - 1u) * p.d4;  // rows past the edge repeat the last one; not stored
}

// Ranks j0..j0+3 of row n; ranks past the end are stored as 0 (the padding).
fn store(split: u32, n: u32, j0: u32, v: vec4<f32>) {
  if (n < p.rows) {
    let live = vec4<f32>(1.0, f32(j0 + 1u < p.rank), f32(j0 + 2u < p.rank), f32(j0 + 3u < p.rank));
    let quads = (p.rank + 3u) / 4u;
    P[(split * p.rows + n) * quads + j0 / 4u] = select(vec4<f32>(0.0), v, live > vec4<f32>(0.5));
  }
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
  let n0 = wg.x * 8u;
  let r0 = row_offset(n0);
  let r1 = row_offset(n0 + 1u);
  let r2 = row_offset(n0 + 2u);
  let r3 = row_offset(n0 + 3u);
  let r4 = row_offset(n0 + 4u);
  let r5 = row_offset(n0 + 5u);
  let r6 = row_offset(n0 + 6u);
  let r7 = row_offset(n0 + 7u);
  let d_begin = wg.y * p.split_d4;
  let d_end = min(d_begin + p.split_d4, p.d4);

  // a_k: rank j0+k, rows n0..n0+3; b_k: rank j0+k, rows n0+4..n0+7.
  var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
  var b0 = vec4<f32>(0.0); var b1 = vec4<f32>(0.0); var b2 = vec4<f32>(0.0); var b3 = vec4<f32>(0.0);
  for (var d = d_begin + lane; d < d_end; d += LANES) {
    let x0 = X[r0 + d]; let x1 = X[r1 + d]; let x2 = X[r2 + d]; let x3 = X[r3 + d];
    let x4 = X[r4 + d]; let x5 = X[r5 + d]; let x6 = X[r6 + d]; let x7 = X[r7 + d];
    let w0 = M[m0 + d]; let w1 = M[m1 + d]; let w2 = M[m2 + d]; let w3 = M[m3 + d];
    a0 += vec4<f32>(dot(x0, w0), dot(x1, w0), dot(x2, w0), dot(x3, w0));
    a1 += vec4<f32>(dot(x0, w1), dot(x1, w1), dot(x2, w1), dot(x3, w1));
    a2 += vec4<f32>(dot(x0, w2), dot(x1, w2), dot(x2, w2), dot(x3, w2));
    a3 += vec4<f32>(dot(x0, w3), dot(x1, w3), dot(x2, w3), dot(x3, w3));
    b0 += vec4<f32>(dot(x4, w0), dot(x5, w0), dot(x6, w0), dot(x7, w0));
    b1 += vec4<f32>(dot(x4, w1), dot(x5, w1), dot(x6, w1), dot(x7, w1));
    b2 += vec4<f32>(dot(x4, w2), dot(x5, w2), dot(x6, w2), dot(x7, w2));
    b3 += vec4<f32>(dot(x4, w3), dot(x5, w3), dot(x6, w3), dot(x7, w3));
  }
  sums[t] = a0; sums[WG + t] = a1; sums[2u * WG + t] = a2; sums[3u * WG + t] = a3;
  sums[4u * WG + t] = b0; sums[5u * WG + t] = b1; sums[6u * WG + t] = b2; sums[7u * WG + t] = b3;
  workgroupBarrier();
  for (var s = LANES / 2u; s > 0u; s >>= 1u) {
    if (lane < s) {
      for (var k = 0u; k < 8u; k++) { sums[k * WG + t] += sums[k * WG + t + s]; }
    }
    workgroupBarrier();
  }
  if (lane == 0u && j0 < p.rank) {
    // sums[k] holds rank j0+k for rows n0..n0+3 (sums[k+4]: rows n0+4..n0+7): transpose to rows.
    let a0 = sums[t]; let a1 = sums[WG + t]; let a2 = sums[2u * WG + t]; let a3 = sums[3u * WG + t];
    let b0 = sums[4u * WG + t]; let b1 = sums[5u * WG + t]; let b2 = sums[6u * WG + t]; let b3 = sums[7u * WG + t];
    store(wg.y, n0, j0, vec4<f32>(a0.x, a1.x, a2.x, a3.x));
    store(wg.y, n0 + 1u, j0, vec4<f32>(a0.y, a1.y, a2.y, a3.y));
    store(wg.y, n0 + 2u, j0, vec4<f32>(a0.z, a1.z, a2.z, a3.z));
    store(wg.y, n0 + 3u, j0, vec4<f32>(a0.w, a1.w, a2.w, a3.w));
    store(wg.y, n0 + 4u, j0, vec4<f32>(b0.x, b1.x, b2.x, b3.x));
    store(wg.y, n0 + 5u, j0, vec4<f32>(b0.y, b1.y, b2.y, b3.y));
    store(wg.y, n0 + 6u, j0, vec4<f32>(b0.z, b1.z, b2.z, b3.z));
    store(wg.y, n0 + 7u, j0, vec4<f32>(b0.w, b1.w, b2.w, b3.w));
  }
}
