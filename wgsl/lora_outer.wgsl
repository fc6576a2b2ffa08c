// Sums of outer products over a split of rows (the weight gradients):
//   P[s, j, d] = sum over n in split s of G[n, j] * X[n, d]
// G is [rows, rank] f32; X [rows, d4] and P [splits, rank, d4] are vec4 arrays.
// LoRA uses it for gradB as dBᵀ = s·hᵀ·dY (G = h, X = dY) and for gradA,
// dA = s·dhᵀ·x (G = dh, X = x); reduce.wgsl applies the scale and the `+=`.
//
// `outer_up` adds inputGrad to the gradA pass, so x is read once and dx written once:
//   DX[n, d] = scale * sum_j G[n, j] * M[j, d]   (+ DX[n, d] when accumulate != 0)
// It needs the whole rank in one workgroup (rank == RB, grid.z == 1).
//
// A workgroup owns TD vec4 columns, RB ranks and one split of rows, walked by TR
// row lanes; the lanes' sums meet in workgroup memory, CH ranks per round.

struct Params {
  rows: u32,
  d4: u32,
  rank: u32,
  split_rows: u32,  // rows per split
  accumulate: u32,  // outer_up: add into DX instead of overwriting
  scale: f32,       // outer_up: scale of DX
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> G: array<f32>;
@group(0) @binding(2) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> P: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> M: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> DX: array<vec4<f32>>;

const TD: u32 = 64u;  // vec4 columns per workgroup
const TR: u32 = 4u;   // row lanes per workgroup: TD * TR threads
const RB: u32 = 16u;  // ranks per workgroup; grid.z covers the rest
const CH: u32 = 4u;   // ranks reduced per round; divides RB

var<workgroup> scratch: array<vec4<f32>, TD * TR * CH>;

// Sum acc over the TR lanes and store this workgroup's split of P.
fn store_partials(acc: ptr<function, array<vec4<f32>, RB>>, t: u32, wg: vec3<u32>) {
  let col = t % TD;
  let lane = t / TD;
  let j0 = wg.z * RB;
  for (var c = 0u; c < RB; c += CH) {
    for (var k = 0u; k < CH; k++) { scratch[(k * TR + lane) * TD + col] = (*acc)[c + k]; }
    workgroupBarrier();
    for (var q = t; q < TD * CH; q += TD * TR) {
      let qc = q % TD;
      let k = q / TD;
      var s = vec4<f32>(0.0);
      for (var r = 0u; r < TR; r++) { s += scratch[(k * TR + r) * TD + qc]; }
      let j = j0 + c + k;
      let d = wg.x * TD + qc;
      if (j < p.rank && d < p.d4) { P[(wg.y * p.rank + j) * p.d4 + d] = s; }
    }
    workgroupBarrier();
  }
}

@compute @workgroup_size(TD * TR)
fn outer(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  // Columns past the edge repeat the last one; store_partials skips them.
  let d = min(wg.x * TD + t % TD, p.d4 - 1u);
  let lane = t / TD;
  let j0 = wg.z * RB;
  var g_col: array<u32, RB>;
  for (var k = 0u; k < RB; k++) { g_col[k] = min(j0 + k, p.rank - 1u); }
  let n_end = min((wg.y + 1u) * p.split_rows, p.rows);
  var acc: array<vec4<f32>, RB>;
  for (var n = wg.y * p.split_rows + lane; n < n_end; n += TR) {
    let xv = X[n * p.d4 + d];
    for (var k = 0u; k < RB; k++) { acc[k] += G[n * p.rank + g_col[k]] * xv; }
  }
  store_partials(&acc, t, wg);
}

@compute @workgroup_size(TD * TR)
fn outer_up(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let d_raw = wg.x * TD + t % TD;
  let in_range = d_raw < p.d4;
  let d = min(d_raw, p.d4 - 1u);
  let lane = t / TD;
  var m_col: array<vec4<f32>, RB>;
  for (var k = 0u; k < RB; k++) { m_col[k] = M[k * p.d4 + d]; }
  let n_end = min((wg.y + 1u) * p.split_rows, p.rows);
  var acc: array<vec4<f32>, RB>;
  for (var n = wg.y * p.split_rows + lane; n < n_end; n += TR) {
    let o = n * p.d4 + d;
    let xv = X[o];
    var dx = vec4<f32>(0.0);
    for (var k = 0u; k < RB; k++) {
      let g = G[n * RB + k];
      acc[k] += g * xv;
      dx += g * m_col[k];
    }
    if (in_range) {
      var v = p.scale * dx;
      if (p.accumulate != 0u) { v += DX[o]; }
      DX[o] = v;
    }
  }
  store_partials(&acc, t, wg);
}
