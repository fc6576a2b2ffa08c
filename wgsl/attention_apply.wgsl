// A pass's kept score matrix applied to cache rows, for passes whose queries start at position 0
// (training), as a GEMM:
//   OUT[b, i, h, :] = scale · Σ_{j ≤ lim} A[(b·H + h)·TP + i][j] · C[b, g, j, :]    g = h / R,
//   lim = min(i, len_b - 1)  (len_b = LENS[b] clamped to 1..S, as attention.wgsl has it)
// The forward's O = P·V (A = attention_softmax.wgsl's P, C the value cache, scale 1) and the
// backward's dQ = scale · dS·K (A = attention_scores.wgsl's dS, C the key cache).
// Layouts: A [B·H·TP, TP] (TP = T rounded up to 64, so a workgroup's 64 rows are one head's);
// C [B, KVH, S, D4] vec4; OUT [B·T, H, D] as the forward's q.
// Entries of A past a row's limit are never read: they are masked to zero as loaded, and a
// workgroup's keys end after its last row's limit (row_span). A sequence that does not start at
// position 0 gets NaN in its rows: its keys before the pass have no scores here.
//
// Tiling (_gemm_t_tile.wgsl): 64 rows × 64 head-dim features a workgroup of 128 threads, keys in
// steps of 32 through workgroup memory; with SPLITS > 1 the sum over keys is cut into ranges
// whose raw sums split_sum adds up.

struct Params {
  tokens: u32,    // B·H·TP: rows n
  rows: u32,      // T: keys j (the pass's own)
  a_stride: u32,  // TP: floats per row of A
  padded: u32,    // TP
  heads: u32,     // H
  kv_heads: u32,  // KVH
  max_len: u32,   // S: cache rows per (b, g)
  head_dim: u32,  // D (a multiple of 4)
  scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> STARTS: array<u32>;  // [B]: each sequence's first position (0 here)
@group(0) @binding(2) var<storage, read> LENS: array<u32>;
@group(0) @binding(3) var<storage, read> A: array<f32>;  // P or dS
@group(0) @binding(4) var<storage, read> C: array<vec4<f32>>;  // the value or key cache
@group(0) @binding(5) var<storage, read_write> OUT: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> PART: array<vec4<f32>>;  // SPLITS > 1: the ranges' raw sums

struct Staged {
  a: mat4x4<f32>,  // A: rows n0 + 4(t / 32) + 16c .. + 3, key j0 + t % 32 (column c)
  w: mat4x4<f32>,  // C: quad t % 16 of keys j0 + t / 16 + 8c (column c)
}

// The last key of sequence b, one past: what no row of it sees.
fn keys_of(b: u32) -> u32 { return clamp(LENS[b], 1u, p.max_len); }

// A of rows n .. n + 3, tokens i .. i + 3 of one head, at key j; zero where the row does not see
// the key (past min(i, seq_keys - 1)) or is padding.
fn masked_quad(n: u32, i: u32, seq_keys: u32, j: u32) -> vec4<f32> {
  var v = vec4<f32>(0.0);
  for (var r = 0u; r < 4u; r++) {
    let seen = i + r < p.rows && j <= min(i + r, seq_keys - 1u);
    v[r] = select(0.0, A[min(n + r, p.tokens - 1u) * p.a_stride + min(j, p.rows - 1u)], seen);
  }
  return v;
}

fn fetch(t: u32, n0: u32, k0: u32, j0: u32) -> Staged {
  var s: Staged;
  let bh = n0 / p.padded;  // the workgroup's (sequence, head)
  let b = bh / p.heads;
  let seq_keys = keys_of(b);
  let j = j0 + t % STEP;
  let n = n0 + 4u * (t / STEP);
  let i = n - bh * p.padded;
  s.a = mat4x4<f32>(masked_quad(n, i, seq_keys, j), masked_quad(n + 16u, i + 16u, seq_keys, j),
                    masked_quad(n + 32u, i + 32u, seq_keys, j), masked_quad(n + 48u, i + 48u, seq_keys, j));
  let g = (bh % p.heads) / (p.heads / p.kv_heads);
  let d4 = p.head_dim / 4u;
  let cache = (b * p.kv_heads + g) * p.max_len;
  let quad = k0 / 4u + t % 16u;
  let keys = min(p.rows, seq_keys);  // cache rows at or past the length are never read
  for (var c = 0u; c < 4u; c++) {
    let key = j0 + t / 16u + 8u * c;
    s.w[c] = select(vec4<f32>(0.0), C[(cache + min(key, keys - 1u)) * d4 + min(quad, d4 - 1u)],
                    key < keys && quad < d4);
  }
  return s;
}

fn stage(t: u32, s: Staged) {
  put_a(t, s.a);
  for (var c = 0u; c < 4u; c++) { tile[W_TILE + at(t / 16u + 8u * c, t % 16u)] = s.w[c]; }
}

// Keys past the limit of the last row of n0 .. n0 + 63 (one head's tokens, in order) add nothing.
fn row_span(n0: u32, k0: u32) -> vec2<u32> {
  let bh = n0 / p.padded;
  let last = min(n0 - bh * p.padded + 63u, p.rows - 1u);
  return vec2<u32>(0u, min(last, keys_of(bh / p.heads) - 1u) + 1u);
}

// Features k .. k + 3 of row n, the whole sum: into OUT (rows of the pass only).
fn put4(n: u32, k: u32, x: vec4<f32>) {
  let bh = n / p.padded;
  let i = n - bh * p.padded;
  if (i >= p.rows) { return; }
  var nan_bits = 0x7fc00000u;  // not a constant: WGSL's constant evaluation refuses NaN
  let nan = bitcast<f32>(nan_bits);
  OUT[(((bh / p.heads * p.rows + i) * p.heads + bh % p.heads) * p.head_dim + k) / 4u] =
    select(vec4<f32>(nan), x * p.scale, STARTS[bh / p.heads] == 0u);
}

// @include _gemm_t_tile.wgsl
// @include _attention_gemm_store.wgsl
