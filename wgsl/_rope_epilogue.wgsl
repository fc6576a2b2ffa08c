// Shared by bitlinear.wgsl (gemv_rope, gemv_norm_rope) and bitlinear_mma.wgsl (split_epilogue_rope)
// (// @include): decoding's q/k/v epilogue (MODE 3), which rotates the fused q/k/v rows by
// transformers' rotate_half rule and writes them where attention reads them: rotated queries into
// OUT, rotated keys and the values into the caches KC, VC [batch, kv_heads, cache_len, HEAD_DIM].
// Token n is position STARTS[b] + n % tokens_per_seq of sequence b = n / tokens_per_seq (rope.wgsl's
// rule). The including file declares Params (out_stride, out_offset, cache_len, tokens_per_seq), the
// bindings OUT, COS, SIN, STARTS, KC, VC, and the overrides MODE, HEADS, KV_HEADS, HEAD_DIM (even).

// MODE 3: the grid's row g → its weight row; rotation partners d, d + D/2 of a head at g, g + 1.
fn qkv_row(g: u32) -> u32 {
  if (MODE != 3u || g >= (HEADS + KV_HEADS) * HEAD_DIM) { return g; }
  let half = HEAD_DIM / 2u;
  let pair = g / 2u;
  return (pair / half) * HEAD_DIM + (g % 2u) * half + pair % half;
}

// MODE 3: the grid's rows g, g + 1 (g even) of token n, with values a, b.
fn put_rotated(n: u32, g: u32, a: f32, b: f32) {
  let seq = n / p.tokens_per_seq;
  let pos = STARTS[seq] + n % p.tokens_per_seq;
  let half = HEAD_DIM / 2u;
  let rotated = (HEADS + KV_HEADS) * HEAD_DIM;
  if (g < rotated) {
    let head = g / HEAD_DIM;
    let d = (g / 2u) % half;
    let c = COS[pos * half + d];
    let sn = SIN[pos * half + d];
    let r1 = a * c + (-b) * sn;
    let r2 = b * c + a * sn;
    if (head < HEADS) {
      let o = n * p.out_stride + p.out_offset + head * HEAD_DIM + d;
      OUT[o] = r1;
      OUT[o + half] = r2;
    } else {
      let o = ((seq * KV_HEADS + head - HEADS) * p.cache_len + pos) * HEAD_DIM + d;
      KC[o] = r1;
      KC[o + half] = r2;
    }
  } else {  // values, in order: features i, i + 1 of one head (HEAD_DIM is even)
    let i = g - rotated;
    let o = ((seq * KV_HEADS + i / HEAD_DIM) * p.cache_len + pos) * HEAD_DIM + i % HEAD_DIM;
    VC[o] = a;
    VC[o + 1u] = b;
  }
}
