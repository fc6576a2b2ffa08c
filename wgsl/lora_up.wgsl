// Expand rank-space rows back to full width, scaled, optionally accumulating:
//   Y[n, d] = scale * sum_j H[n, j] * M[j, d]   (+ Y[n, d] when accumulate != 0)
// H is [rows, rank] f32; M [rank, d4] and Y [rows, d4] are row-major vec4 arrays.
// LoRA uses it for y = s·h·Bᵀ (H = h, M = Bᵀ: the B projection and the scale in one
// pass) and for inputGrad, dx += s·dh·A (H = dh, M = A) when it is not fused into
// gradA (see lora_outer.wgsl).
//
// A thread owns one vec4 column and ROWS rows; every thread of a workgroup reads
// the same H entries (a broadcast), and M's column stays in cache across rows.

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

const WG: u32 = 256u;   // threads per workgroup (vec4 columns)
const ROWS: u32 = 8u;   // rows per thread

@compute @workgroup_size(WG)
fn up(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let d = wg.x * WG + t;
  if (d >= p.d4) { return; }
  let n0 = wg.y * ROWS;

  var h_row: array<u32, ROWS>;
  for (var i = 0u; i < ROWS; i++) { h_row[i] = min(n0 + i, p.rows - 1u) * p.rank; }
  var acc: array<vec4<f32>, ROWS>;
  for (var j = 0u; j < p.rank; j++) {
    let m = M[j * p.d4 + d];
    for (var i = 0u; i < ROWS; i++) { acc[i] += H[h_row[i] + j] * m; }
  }
  for (var i = 0u; i < ROWS; i++) {
    let n = n0 + i;
    if (n < p.rows) {
      let o = n * p.d4 + d;
      var v = p.scale * acc[i];
      if (p.accumulate != 0u) { v += Y[o]; }
      Y[o] = v;
    }
  }
}
