// The forward's softmax of a training pass (queries from position 0) over the scores that
// attention_scores.wgsl (MODE 0) kept whole, in place, one row a workgroup:
//   lse = ln Σ_{first ≤ j ≤ lim} exp(scale·S[n][j])   SC[n][j] ← P = exp(scale·S[n][j] − lse)
// for row n = (b·H + h)·TP + i, lim = min(i, len_b − 1) (len_b = LENS[b] clamped to 1..S, as
// attention.wgsl has it), first = 0, or in a packed pass (PACKED: several examples in a row) the
// first key of the query's own example, i − POS[b·T + i]; LSE[(b·T + i)·H + h] ← lse, the natural
// log the backward expects. Keys before first get P = 0, and so do keys past the limit in a row's
// last vec4; later vec4s are not touched. A sequence that does not start at position 0 gets NaN
// in LSE (attention_apply.wgsl, which reads P, gives NaN outputs too).
// Layouts: SC [B·H·TP, TP] as vec4s (TP: T rounded up to 64); LSE [B·T, H]; POS [B·T].

struct Params {
  seq: u32,      // T
  heads: u32,    // H
  padded: u32,   // TP
  max_len: u32,  // S: cache rows per (b, g)
  scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> STARTS: array<u32>;  // [B]: each sequence's first position (0 here)
@group(0) @binding(2) var<storage, read> LENS: array<u32>;
@group(0) @binding(3) var<storage, read_write> SC: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> LSE: array<f32>;
@group(0) @binding(5) var<storage, read> POS: array<u32>;  // PACKED: each token's position id

override WG: u32 = 64u;
override PACKED: bool = false;

// @include _reductions.wgsl

const LOG2E: f32 = 1.4426950408889634;
const LN2: f32 = 0.6931471805599453;

// Which of keys 4q .. 4q + 3 a row seeing keys first .. keys - 1 does not see.
fn unseen(q: u32, first: u32, keys: u32) -> vec4<bool> {
  let key = vec4<u32>(4u * q) + vec4<u32>(0u, 1u, 2u, 3u);
  return (key >= vec4<u32>(keys)) | (key < vec4<u32>(first));
}

// Row i of (sequence, head) bh = wg.y: workgroup (i, bh).
@compute @workgroup_size(WG)
fn rows(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  let t = inv.t;
  let i = wg.x;
  let bh = wg.y;
  let b = bh / p.heads;
  let keys = min(i, clamp(LENS[b], 1u, p.max_len) - 1u) + 1u;  // keys first .. keys - 1 are seen
  var first = 0u;
  if (PACKED) { first = i - min(POS[b * p.seq + i], i); }
  let quads = (keys + 3u) / 4u;
  let base = (bh * p.padded + i) * (p.padded / 4u);
  let c = p.scale * LOG2E;  // exp(scale·s) = exp2(c·s)
  var m = -0x1.fffffep+127f;
  for (var q = first / 4u + t; q < quads; q += WG) {
    let s = select(SC[base + q], vec4<f32>(-0x1.fffffep+127f), unseen(q, first, keys));
    m = max(m, max(max(s.x, s.y), max(s.z, s.w)));
  }
  m = max_all(t, m);
  var l = 0.0;
  for (var q = first / 4u + t; q < quads; q += WG) {
    let e = select(exp2(c * (SC[base + q] - m)), vec4<f32>(0.0), unseen(q, first, keys));
    l += e.x + e.y + e.z + e.w;
  }
  let lse2 = c * m + log2(sum_all(t, l));  // in base 2
  for (var q = t; q < quads; q += WG) {  // from key 0: the GEMMs that read P read keys before first
    SC[base + q] = select(exp2(c * SC[base + q] - lse2), vec4<f32>(0.0), unseen(q, first, keys));
  }
  if (t == 0u) {
    var nan_bits = 0x7fc00000u;  // not a constant: WGSL's constant evaluation refuses NaN
    let nan = bitcast<f32>(nan_bits);
    LSE[(b * p.seq + i) * p.heads + bh % p.heads] = select(nan, lse2 * LN2, STARTS[b] == 0u);
  }
}
