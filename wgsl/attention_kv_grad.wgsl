// dV or dK of a training pass (queries from position 0) as a GEMM over attention_scores.wgsl's P
// or dS:
//   OUT[b, g, j, :] = scale · Σ_{m = i·R + r} A[(b·H + g·R + r)·TP + i][j] · X[b, i, g·R + r, :]
// over the queries that see key j (j ≤ lim = min(i, len_b − 1)): dV with A = P, X = dO, scale 1;
// dK with A = dS, X = q, scale the softmax scale. Keys at or past len_b get zeros. A sequence
// that does not start at position 0 gets NaN in its rows (see attention_apply.wgsl).
// GEMM rows n = (b·KVH + g)·TP + j (each (b, g)'s keys padded to TP, a multiple of 64); the sum
// runs over m from j·R of the tile's first key (earlier queries see none of its keys).
// Layouts: A [B·H·TP, TP]; X [B·T, H, D4] vec4; OUT [B, KVH, S, D], written at keys j < T.
//
// Tiling (_gemm_t_tile.wgsl): 64 keys × 64 head-dim features a workgroup of 128 threads, the
// queries m in steps of 32 through workgroup memory; with SPLITS > 1 the sum over m is cut into
// ranges (few keys, long sums: more workgroups) whose raw sums split_sum adds up.

struct Params {
  tokens: u32,    // B·KVH·TP: rows n
  rows: u32,      // T·R: the sum's length
  a_stride: u32,  // TP: floats per row of A
  padded: u32,    // TP
  seq: u32,       // T
  heads: u32,     // H
  kv_heads: u32,  // KVH
  max_len: u32,   // S
  head_dim: u32,  // D (a multiple of 4)
  scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> STARTS: array<u32>;  // [B]: each sequence's first position (0 here)
@group(0) @binding(2) var<storage, read> LENS: array<u32>;
@group(0) @binding(3) var<storage, read> A: array<f32>;         // P or dS
@group(0) @binding(4) var<storage, read> X: array<vec4<f32>>;   // dO or q
@group(0) @binding(5) var<storage, read_write> OUT: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> PART: array<vec4<f32>>;  // SPLITS > 1: the ranges' raw sums

struct Staged {
  a: mat4x4<f32>,  // A: keys n0 + 4(t % 16) .. + 3 of queries m = j0 + t / 16 + 8c (column c)
  w: mat4x4<f32>,  // X: quad k0 / 4 + t % 16 of queries j0 + t / 16 + 8c (column c)
}

fn fetch(t: u32, n0: u32, k0: u32, j0: u32) -> Staged {
  var s: Staged;
  let bg = n0 / p.padded;
  let b = bg / p.kv_heads;
  let g = bg % p.kv_heads;
  let group = p.heads / p.kv_heads;
  let last_key = clamp(LENS[b], 1u, p.max_len) - 1u;
  // Sixteen threads read one query's 64 keys, four each: consecutive threads, consecutive keys.
  let key = n0 - bg * p.padded + 4u * (t % 16u);
  for (var c = 0u; c < 4u; c++) {
    let m = j0 + t / 16u + 8u * c;
    let i = min(m, p.rows - 1u) / group;  // past the sum (the last step's tail): masked below, read in bounds
    let row = ((b * p.heads + g * group + m % group) * p.padded + i) * p.a_stride;
    let lim = select(0u, min(i, last_key) + 1u, m < p.rows);  // keys < lim are seen
    let at = row + key;  // key + 3 < TP = a_stride: within the row; keys not seen are masked below
    let seen = vec4<u32>(key, key + 1u, key + 2u, key + 3u) < vec4<u32>(lim);
    s.a[c] = select(vec4<f32>(0.0), vec4<f32>(A[at], A[at + 1u], A[at + 2u], A[at + 3u]), seen);
  }
  let d4 = p.head_dim / 4u;
  let quad = k0 / 4u + t % 16u;
  for (var c = 0u; c < 4u; c++) {
    let mw = j0 + t / 16u + 8u * c;
    let x = ((b * p.seq + min(mw / group, p.seq - 1u)) * p.heads + g * group + mw % group) * d4 + min(quad, d4 - 1u);
    s.w[c] = select(vec4<f32>(0.0), X[x], mw < p.rows && quad < d4);
  }
  return s;
}

fn stage(t: u32, s: Staged) {
  for (var c = 0u; c < 4u; c++) {
    tile[at(t / 16u + 8u * c, t % 16u)] = s.a[c];
    tile[W_TILE + at(t / 16u + 8u * c, t % 16u)] = s.w[c];
  }
}

fn row_span(n0: u32, k0: u32) -> vec2<u32> {
  let first_key = n0 % p.padded;
  return vec2<u32>(min(first_key * (p.heads / p.kv_heads), p.rows), p.rows);
}

// Features k .. k + 3 of row n, the whole sum: into OUT (keys of the pass only).
fn put4(n: u32, k: u32, x: vec4<f32>) {
  let bg = n / p.padded;
  let j = n - bg * p.padded;
  if (j >= p.seq) { return; }
  var nan_bits = 0x7fc00000u;  // not a constant: WGSL's constant evaluation refuses NaN
  let nan = bitcast<f32>(nan_bits);
  // bg = b·KVH + g
  let from_start = STARTS[bg / p.kv_heads] == 0u;
  OUT[((bg * p.max_len + j) * p.head_dim + k) / 4u] = select(vec4<f32>(nan), x * p.scale, from_start);
}

// @include _gemm_t_tile.wgsl
// @include _attention_gemm_store.wgsl
