// RoPE's backward, into the fused q/k/v projection's output gradient (one token a workgroup):
// the transpose of the rotation, forward  r1 = x1·c − x2·s,  r2 = x2·c + x1·s,  gives
//   dx1 = dr1·c + dr2·s,   dx2 = −dr1·s + dr2·c
// for the queries (DQ [tokens, heads·D]) and the keys (DK [batch, kv_heads, S, D]); the values'
// gradient (DV, the same layout) is copied through. Token n is cache row STARTS[n / T] + n % T,
// rotated at that position, or in a packed pass (PACKED) at its own position id POS[n] (rope.wgsl).

struct Params {
  tokens_per_seq: u32,
  heads: u32,
  kv_heads: u32,
  head_dim: u32,
  cache_len: u32,
  qkv_stride: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> DQ: array<f32>;
@group(0) @binding(2) var<storage, read> DK: array<f32>;
@group(0) @binding(3) var<storage, read> DV: array<f32>;
@group(0) @binding(4) var<storage, read> COS: array<f32>;
@group(0) @binding(5) var<storage, read> SIN: array<f32>;
@group(0) @binding(6) var<storage, read> STARTS: array<u32>;
@group(0) @binding(7) var<storage, read_write> DQKV: array<f32>;
@group(0) @binding(8) var<storage, read> POS: array<u32>;  // PACKED: [tokens]: each token's position id

override WG: u32 = 128u;
override PACKED: bool = false;

@compute @workgroup_size(WG)
fn rope_backward(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let n = wg.x;
  let b = n / p.tokens_per_seq;
  let slot = STARTS[b] + n % p.tokens_per_seq;  // the cache row
  var pos = slot;  // the rotation's position
  if (PACKED) { pos = POS[n]; }
  let half = p.head_dim / 2u;
  let row = n * p.qkv_stride;
  let q_size = p.heads * p.head_dim;
  let kv_size = p.kv_heads * p.head_dim;
  for (var i = t; i < (p.heads + p.kv_heads) * half; i += WG) {
    let head = i / half;
    let d = i % half;
    let c = COS[pos * half + d];
    let s = SIN[pos * half + d];
    var src: u32;
    var r1: f32;
    var r2: f32;
    if (head < p.heads) {
      src = n * q_size + head * p.head_dim + d;
      r1 = DQ[src];
      r2 = DQ[src + half];
    } else {
      src = ((b * p.kv_heads + head - p.heads) * p.cache_len + slot) * p.head_dim + d;
      r1 = DK[src];
      r2 = DK[src + half];
    }
    let dst = row + head * p.head_dim + d;
    DQKV[dst] = r1 * c + r2 * s;
    DQKV[dst + half] = -r1 * s + r2 * c;
  }
  for (var i = t; i < kv_size; i += WG) {
    let g = i / p.head_dim;
    DQKV[row + q_size + kv_size + i] = DV[((b * p.kv_heads + g) * p.cache_len + slot) * p.head_dim + i % p.head_dim];
  }
}
