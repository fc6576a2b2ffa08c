// Packed ternary weights W [rows][words] (weights.py's layout: 16 a u32, weight k of a row at byte
// lane k % 4, bit pair (k % 16) / 4 of word k / 16, as the code t + 1) transposed into the same
// layout, TT [16 · words][t_words]: row k of TT holds column k of W, its rows j past W's padded with
// code 1 (the value 0) to t_words · 16. The input gradient on the matrix units reads its weights so
// (bitlinear_t_mma.wgsl): the outputs k along TT's rows, as a projection reads W. Built once.

struct Params {
  rows: u32,     // W's rows (J)
  words: u32,    // W's u32 words a row
  t_words: u32,  // TT's u32 words a row
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> W: array<u32>;
@group(0) @binding(2) var<storage, read_write> TT: array<u32>;

// An invocation a word of TT: row gid.x (k; neighbours read the same word of W), word gid.y.
@compute @workgroup_size(64)
fn transpose_packed(@builtin(global_invocation_id) gid: vec3<u32>) {
  let k = gid.x;
  let w = gid.y;
  if (k >= 16u * p.words || w >= p.t_words) { return; }
  let shift = 8u * (k % 4u) + 2u * ((k % 16u) / 4u);
  var word = 0u;
  for (var i = 0u; i < 16u; i++) {
    let j = 16u * w + i;
    var code = 1u;
    if (j < p.rows) { code = (W[j * p.words + k / 16u] >> shift) & 3u; }
    word |= code << (8u * (i % 4u) + 2u * (i / 4u));
  }
  TT[k * p.t_words + w] = word;
}
