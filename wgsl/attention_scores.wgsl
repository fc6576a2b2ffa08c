// The attention backward's probabilities and score gradients of a training pass (queries from
// position 0), kept whole for the GEMMs that follow (attention_kv_grad.wgsl, attention_apply.wgsl):
//   MODE 0: SC[n][j] = Σ_d Q[b, i, h, d] · K[b, g, j, d]                       (S)
//   MODE 1: dP[n][j] = Σ_d dO[b, i, h, d] · V[b, g, j, d], and as it is stored
//           SC[n][j] ← P = exp(scale·S − lse)   DS[n][j] ← dS = P ∘ (dP − D)
//   MODE 2: the same dP where SC already holds P (the forward's, kept): DS[n][j] ← P ∘ (dP − D)
// for row n = (b·H + h)·TP + i (TP: T rounded up to 64, so a workgroup's 64 rows are one head's),
// key j ≤ lim = min(i, len_b − 1) (len_b = LENS[b] clamped to 1..S, as attention.wgsl has it),
// g = h / R. Entries past a row's limit are written only where they share a vec4 with a seen key,
// and never read (the GEMMs that read them mask them); a tile whose keys all lie past its rows'
// limits sums nothing. In a packed pass (PACKED: several examples in a row) a query sees only
// the keys of its own example, from i − POS[b·T + i] on: MODE 1 writes P = 0 (and so dS = 0) for
// the keys before (MODE 2's P, the forward's softmax, is 0 there already).
// Layouts: A = Q or dO [B·T, H, D]; K or V [B, KVH, S, D4] vec4; SC, DS [B·H·TP, TP] as vec4s (rows
// padded like the heads', so that every row starts on a vec4); LSE (the forward's, natural log)
// and DR (D = rowsum(dO ∘ O), row_dot's) [B·T, H]; POS [B·T].
//
// Tiling (_gemm_t_tile.wgsl): 64 rows × 64 keys a workgroup of 128 threads, the head dim in
// steps of 32 through workgroup memory.

struct Params {
  tokens: u32,    // B·H·TP: rows n
  rows: u32,      // D: the sum's length
  a_stride: u32,  // unused (A's rows are addressed per head)
  padded: u32,    // TP
  seq: u32,       // T: tokens (and keys) of a sequence in the pass
  heads: u32,     // H
  kv_heads: u32,  // KVH
  max_len: u32,   // S: cache rows per (b, g)
  scale: f32,     // softmax scale (head_dim ** -0.5)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> LENS: array<u32>;
@group(0) @binding(2) var<storage, read> A: array<f32>;          // Q (MODE 0) or dO
@group(0) @binding(3) var<storage, read> KV: array<vec4<f32>>;   // K (MODE 0) or V
@group(0) @binding(4) var<storage, read_write> SC: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> DS: array<vec4<f32>>;  // MODES 1, 2
@group(0) @binding(6) var<storage, read> LSE: array<f32>;        // MODE 1
@group(0) @binding(7) var<storage, read> DR: array<f32>;         // MODES 1, 2
@group(0) @binding(8) var<storage, read> POS: array<u32>;        // PACKED: each token's position id

override MODE: u32 = 0u;
override PACKED: bool = false;

const LOG2E: f32 = 1.4426950408889634;

struct Staged {
  a: mat4x4<f32>,  // A: rows n0 + 4(t / 32) + 16c .. + 3 at feature j0 + t % 32 (column c)
  w: mat4x4<f32>,  // KV: features j0 + 4(t % 8) .. + 3 of keys k0 + t / 8 + 16c (column c)
}

fn keys_of(b: u32) -> u32 { return clamp(LENS[b], 1u, p.max_len); }

// A's features j of rows n .. n + 3 (tokens i .. i + 3 of sequence b, head h; padding rows read
// the last token, and are not stored).
fn a_rows(b: u32, h: u32, i: u32, j: u32) -> vec4<f32> {
  var v = vec4<f32>(0.0);
  if (j >= p.rows) { return v; }  // past the head dim (a last step of fewer than 32)
  for (var r = 0u; r < 4u; r++) {
    v[r] = A[((b * p.seq + min(i + r, p.seq - 1u)) * p.heads + h) * p.rows + j];
  }
  return v;
}

fn fetch(t: u32, n0: u32, k0: u32, j0: u32) -> Staged {
  var s: Staged;
  let bh = n0 / p.padded;
  let b = bh / p.heads;
  let h = bh % p.heads;
  let i = n0 - bh * p.padded + 4u * (t / STEP);
  let j = j0 + t % STEP;
  s.a = mat4x4<f32>(a_rows(b, h, i, j), a_rows(b, h, i + 16u, j), a_rows(b, h, i + 32u, j),
                    a_rows(b, h, i + 48u, j));
  let keys = min(p.seq, keys_of(b));  // cache rows at or past the length are never read
  let cache = (b * p.kv_heads + h / (p.heads / p.kv_heads)) * p.max_len;
  let quads = p.rows / 4u;
  let quad = j0 / 4u + t % 8u;
  for (var c = 0u; c < 4u; c++) {
    let key = k0 + t / 8u + 16u * c;
    s.w[c] = select(vec4<f32>(0.0), KV[(cache + min(key, keys - 1u)) * quads + min(quad, quads - 1u)],
                    key < keys && quad < quads);
  }
  return s;
}

// W[j][key] = KV[key][j]: each loaded vec4 (4 features of a key) goes to four rows of the tile.
fn stage(t: u32, s: Staged) {
  put_a(t, s.a);
  let j = 4u * (t % 8u);
  for (var c = 0u; c < 4u; c++) {
    let key = t / 8u + 16u * c;
    for (var e = 0u; e < 4u; e++) { tile[W_TILE + at(j + e, key / 4u)][key % 4u] = s.w[c][e]; }
  }
}

// The last key any of rows n0 .. n0 + 63 sees, one past.
fn keys_seen(n0: u32) -> u32 {
  let bh = n0 / p.padded;
  let last = min(n0 - bh * p.padded + 63u, p.seq - 1u);
  return min(last, keys_of(bh / p.heads) - 1u) + 1u;
}

fn row_span(n0: u32, k0: u32) -> vec2<u32> {
  return vec2<u32>(0u, select(0u, p.rows, k0 < keys_seen(n0)));
}

// Keys k .. k + 3 of row n as one vec4 where key k is seen: the keys past the row's limit in it get
// values no reader uses (the GEMMs that follow mask them as they load).
fn store(n: u32, k: u32, v: vec4<f32>) {
  let bh = n / p.padded;
  let i = n - bh * p.padded;
  if (n >= p.tokens || i >= p.seq) { return; }
  let b = bh / p.heads;
  if (k > min(i, keys_of(b) - 1u)) { return; }
  let at = (n * p.padded + k) / 4u;
  if (MODE == 0u) {
    SC[at] = v;
    return;
  }
  let row = (b * p.seq + i) * p.heads + bh % p.heads;
  var pr = SC[at];
  if (MODE == 1u) {
    pr = exp2(pr * (p.scale * LOG2E) - LSE[row] * LOG2E);
    if (PACKED) {
      let first = i - min(POS[b * p.seq + i], i);  // the query's example's first key
      pr = select(pr, vec4<f32>(0.0), vec4<u32>(k) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(first));
    }
    SC[at] = pr;
  }
  DS[at] = pr * (v - DR[row]);
}

// @include _gemm_t_tile.wgsl
