// Rotary position embedding of the fused q/k/v projection's output, workgroup (n, c) doing chunk
// c of token n (a chunk: WG rotation pairs and WG value elements; one row's work spread over
// several workgroups, so that decoding's single token is not a long serial loop):
// rotated queries into QR [tokens, heads·D]; rotated keys and the values into the KV caches
// [batch, kv_heads, S, D] at the token's position. transformers' rule, with its own cos/sin
// table (COS, SIN: [positions, D/2]; the second half of each row repeats the first):
//   out[d]       = x[d] · cos − x[d + D/2] · sin
//   out[d + D/2] = x[d + D/2] · cos + x[d] · sin          (d < D/2)
// Token n of sequence b = n / T (T tokens per sequence in this pass) is cache row STARTS[b] + n % T,
// rotated at that position; in a packed pass (PACKED) it is rotated at its own position id POS[n]
// instead (several examples in a row, each numbered from 0), still stored at row STARTS[b] + n % T.

struct Params {
  tokens_per_seq: u32,
  heads: u32,
  kv_heads: u32,
  head_dim: u32,
  cache_len: u32,    // S
  qkv_stride: u32,   // floats per row of QKV
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> QKV: array<f32>;
@group(0) @binding(2) var<storage, read> COS: array<f32>;
@group(0) @binding(3) var<storage, read> SIN: array<f32>;
@group(0) @binding(4) var<storage, read> STARTS: array<u32>;  // [batch]: each sequence's first position
@group(0) @binding(5) var<storage, read_write> QR: array<f32>;
@group(0) @binding(6) var<storage, read_write> KC: array<f32>;
@group(0) @binding(7) var<storage, read_write> VC: array<f32>;
@group(0) @binding(8) var<storage, read> POS: array<u32>;  // PACKED: [tokens]: each token's position id

override WG: u32 = 128u;
override PACKED: bool = false;

@compute @workgroup_size(WG)
fn rope(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let n = wg.x;
  let i = wg.y * WG + t;
  let b = n / p.tokens_per_seq;
  let slot = STARTS[b] + n % p.tokens_per_seq;  // the cache row
  var pos = slot;  // the rotation's position
  if (PACKED) { pos = POS[n]; }
  let half = p.head_dim / 2u;
  let row = n * p.qkv_stride;
  let q_size = p.heads * p.head_dim;
  let kv_size = p.kv_heads * p.head_dim;
  if (i < (p.heads + p.kv_heads) * half) {
    let head = i / half;
    let d = i % half;
    let c = COS[pos * half + d];
    let s = SIN[pos * half + d];
    let src = row + head * p.head_dim + d;  // kv heads follow the q heads in QKV
    let x1 = QKV[src];
    let x2 = QKV[src + half];
    let r1 = x1 * c + (-x2) * s;
    let r2 = x2 * c + x1 * s;
    if (head < p.heads) {
      let dst = n * q_size + head * p.head_dim + d;
      QR[dst] = r1;
      QR[dst + half] = r2;
    } else {
      let dst = ((b * p.kv_heads + head - p.heads) * p.cache_len + slot) * p.head_dim + d;
      KC[dst] = r1;
      KC[dst + half] = r2;
    }
  }
  if (i < kv_size) {
    let g = i / p.head_dim;
    VC[((b * p.kv_heads + g) * p.cache_len + slot) * p.head_dim + i % p.head_dim] = QKV[row + q_size + kv_size + i];
  }
}
