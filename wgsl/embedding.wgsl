// Embedding gather: OUT[n] = E[ids[n] − row_begin] for the ids this vocabulary chunk holds
// (rows past the feature count are left as the plan zeroed them). E rows are float32, or with
// BF16 the raw bfloat16 bits two to a u32, widened exactly. Also any gather of float32 rows by
// index (the engine's LM head over the labelled rows); with ZERO_MISSING (one chunk) an id
// outside the chunk gives a row of zeros instead of leaving the row alone.

struct Params {
  tokens: u32,
  k: u32,           // features
  stride: u32,      // floats per output row
  e_words: u32,     // u32 words per row of E
  row_begin: u32,   // first vocabulary id of this chunk
  rows: u32,        // ids in this chunk
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> IDS: array<u32>;
@group(0) @binding(2) var<storage, read> E: array<u32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;

override WG: u32 = 256u;
override BF16: bool = false;
override ZERO_MISSING: bool = false;

@compute @workgroup_size(WG)
fn gather(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let n = wg.y;
  let id = IDS[n];
  let k = wg.x * WG + t;
  if (k >= p.k) { return; }
  if (id < p.row_begin || id >= p.row_begin + p.rows) {
    if (ZERO_MISSING) { OUT[n * p.stride + k] = 0.0; }
    return;
  }
  let row = (id - p.row_begin) * p.e_words;
  var v: f32;
  if (BF16) {
    let w = E[row + k / 2u];
    v = bitcast<f32>(select(w << 16u, w & 0xffff0000u, k % 2u == 1u));
  } else {
    v = bitcast<f32>(E[row + k]);
  }
  OUT[n * p.stride + k] = v;
}
