// Sums of outer products over a split of rows (the weight gradients):
//   OUT[s, j, d] = scale * sum over n in split s of G[n, j] * X[n, d]   (+ OUT when accumulate != 0)
// G is [rows, rank4] (rank zero-padded to a multiple of 4, as lora_down.wgsl writes it);
// X [rows, d4] and OUT [splits, rank, d4] are vec4 arrays.
// LoRA uses it for gradB as dBᵀ = s·hᵀ·dY (G = h, X = dY) and for gradA, dA = s·dhᵀ·x
// (G = dh, X = x). With one split it writes the gradient itself, scaled and with the
// `+=` of gradient accumulation; with several it writes unscaled partial sums and
// reduce.wgsl finishes them.
//
// A thread owns 4 ranks of one vec4 column and walks its split's rows 4 at a time
// (4 X loads in flight), each X vector feeding four accumulators. Threads of a
// workgroup cover TD consecutive columns (Q rank quads each). No workgroup memory,
// no barriers.

struct Params {
  rows: u32,
  d4: u32,
  rank: u32,
  split_rows: u32,  // rows per split
  accumulate: u32,
  scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> G: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> OUT: array<vec4<f32>>;

override TD: u32 = 64u;  // vec4 columns per workgroup
override Q: u32 = 4u; // rank quads per workgroup (grid.z covers the rest): TD * Q threads

// G[n, j0..j0+3] (j0 a multiple of 4).
fn g4(n: u32, j0: u32) -> vec4<f32> {
  return G[n * ((p.rank + 3u) / 4u) + j0 / 4u];
}

fn store(split: u32, j: u32, d: u32, v: vec4<f32>) {
  if (j < p.rank) {
    let o = (split * p.rank + j) * p.d4 + d;
    var out = p.scale * v;
    if (p.accumulate != 0u) { out += OUT[o]; }
    OUT[o] = out;
  }
}

@compute @workgroup_size(TD * Q)
fn outer(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let d = wg.x * TD + t % TD;
  let j0 = (wg.z * Q + t / TD) * 4u;
  if (d >= p.d4 || j0 >= p.rank) { return; }
  let n_end = min((wg.y + 1u) * p.split_rows, p.rows);
  var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
  var n = wg.y * p.split_rows;
  for (; n + 3u < n_end; n += 4u) {
    let x0 = X[n * p.d4 + d];
    let x1 = X[(n + 1u) * p.d4 + d];
    let x2 = X[(n + 2u) * p.d4 + d];
    let x3 = X[(n + 3u) * p.d4 + d];
    let g0 = g4(n, j0); let g1 = g4(n + 1u, j0); let g2 = g4(n + 2u, j0); let g3 = g4(n + 3u, j0);
    a0 += g0.x * x0 + g1.x * x1 + g2.x * x2 + g3.x * x3;
    a1 += g0.y * x0 + g1.y * x1 + g2.y * x2 + g3.y * x3;
    a2 += g0.z * x0 + g1.z * x1 + g2.z * x2 + g3.z * x3;
    a3 += g0.w * x0 + g1.w * x1 + g2.w * x2 + g3.w * x3;
  }
  for (; n < n_end; n++) {
    let xv = X[n * p.d4 + d];
    let g = g4(n, j0);
    a0 += g.x * xv; a1 += g.y * xv; a2 += g.z * xv; a3 += g.w * xv;
  }
  store(wg.y, j0, d, a0);
  store(wg.y, j0 + 1u, d, a1);
  store(wg.y, j0 + 2u, d, a2);
  store(wg.y, j0 + 3u, d, a3);
}
