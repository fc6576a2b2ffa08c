// Row-by-row dot products with a low-rank matrix, optionally split along the row:
//   P[s, n, j] = sum over d in split s of X[n, d] * M[j, d]
// X [rows, d4] and M [rank, d4] are row-major vec4 arrays; P is [splits, rows, rank].
// LoRA uses it for h = x·Aᵀ (X = x, M = A) and for gradDh, dh = dY·B (X = dY, M = Bᵀ).
// With one split P is the result; with several (small N: more workgroups to keep
// the GPU busy) reduce.wgsl sums them.
//
// A workgroup owns ROWS rows, RB ranks and one split. Its threads stride over the
// split's vec4 columns, each keeping ROWS*RB partial dots in registers; a two-level
// workgroup reduction then sums them CHUNK at a time.

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

const WG: u32 = 256u;    // threads per workgroup
const ROWS: u32 = 4u;    // rows per workgroup
const RB: u32 = 16u;     // ranks per workgroup; grid.z covers the rest
const CHUNK: u32 = 8u;   // accumulators reduced per round; divides ROWS * RB and WG
const ACC: u32 = ROWS * RB;

var<workgroup> scratch: array<f32, WG * CHUNK>;
var<workgroup> seg_sums: array<f32, WG>;

@compute @workgroup_size(WG)
fn down(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let n0 = wg.x * ROWS;
  let split = wg.y;
  let j0 = wg.z * RB;
  let d_begin = split * p.split_d4;
  let d_end = min(d_begin + p.split_d4, p.d4);

  // Rows and ranks past the edge repeat the last valid one; their sums are not stored.
  var x_row: array<u32, ROWS>;
  for (var i = 0u; i < ROWS; i++) { x_row[i] = min(n0 + i, p.rows - 1u) * p.d4; }
  var m_row: array<u32, RB>;
  for (var jj = 0u; jj < RB; jj++) { m_row[jj] = min(j0 + jj, p.rank - 1u) * p.d4; }

  var acc: array<f32, ACC>;
  for (var d = d_begin + t; d < d_end; d += WG) {
    var xv: array<vec4<f32>, ROWS>;
    for (var i = 0u; i < ROWS; i++) { xv[i] = X[x_row[i] + d]; }
    for (var jj = 0u; jj < RB; jj++) {
      let m = M[m_row[jj] + d];
      for (var i = 0u; i < ROWS; i++) { acc[i * RB + jj] += dot(xv[i], m); }
    }
  }

  for (var c = 0u; c < ACC; c += CHUNK) {
    for (var k = 0u; k < CHUNK; k++) { scratch[t * CHUNK + k] = acc[c + k]; }
    workgroupBarrier();
    // Level 1: thread t sums accumulator k = t % CHUNK over CHUNK consecutive threads.
    let k = t % CHUNK;
    let seg = t / CHUNK;
    var s = 0.0;
    for (var i = 0u; i < CHUNK; i++) { s += scratch[(seg * CHUNK + i) * CHUNK + k]; }
    seg_sums[t] = s;
    workgroupBarrier();
    // Level 2: CHUNK threads sum the WG / CHUNK segment sums and store.
    if (t < CHUNK) {
      var total = 0.0;
      for (var g = 0u; g < WG / CHUNK; g++) { total += seg_sums[g * CHUNK + t]; }
      let a = c + t;
      let n = n0 + a / RB;
      let j = j0 + a % RB;
      if (n < p.rows && j < p.rank) { P[(split * p.rows + n) * p.rank + j] = total; }
    }
  }
}
