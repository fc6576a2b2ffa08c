// Float projections y = x·Wᵀ (the dense flavour's projections and the LM head), with the
// epilogues of bitlinear.wgsl: v += LoRA segments; MODE 0 store, 1 add into OUT (a residual
// stream; SAVE: the sums into AUX too), 2 gate/up pairs (rows 2i, 2i + 1) → relu(gate)² · up (SAVE: raw
// pair into AUX).
//
// X: f32 [tokens, K] as vec4, rows padded to a multiple of 64 with zeros. W: the weight rows,
// K padded likewise, as vec4<u32> words: float32 bits, or with BF16 the raw bfloat16 bits
// two to a u32 (element 2i in the low half), widened exactly in registers.
//
// gemv: ROWS rows a workgroup, LANES threads a row striding over its vec4 words (coalesced), each
// thread reading a weight word once for GROUP tokens (the grid's y is the tokens in groups of
// GROUP: the LM head, larger than a GPU's L2, is read from memory once for all of them) with a
// sum of its own for each; then a token at a time, one barrier and a thread a row sums its lanes.
// Each token's sums run in the order of a launch of that token alone. gemm_tiled
// (_gemm_t_tile.wgsl): 64 tokens × 64 output rows a workgroup of 128 threads, 8 × 8 a thread, K
// in steps of 32 through workgroup memory; each weight row's K values are read along the row
// (coalesced) and transposed as they are staged into the tile.

struct Params {
  tokens: u32,
  rows: u32,         // gemm_tiled: K padded (the tile's rows j, summed over)
  features: u32,     // output rows: the weight's rows
  w_words: u32,      // vec4<u32> words per weight row
  x_words: u32,      // vec4 words per token of X
  a_stride: u32,     // floats per token of X
  out_stride: u32,
  out_offset: u32,
  lora_rank: u32,
  segments: u32,
  aux_stride: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // gemv
@group(0) @binding(1) var<storage, read> A: array<f32>;         // gemm_tiled: X again, as the tile reads it
@group(0) @binding(2) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(4) var<storage, read> H: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> LORA: array<u32>;
@group(0) @binding(6) var<storage, read> LB: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> AUX: array<f32>;

override MODE: u32 = 0u;
override BF16: bool = false;
override SAVE: bool = false;
override ROWS: u32 = 8u;
override LANES: u32 = 32u;
override GEMV_WG: u32 = ROWS * LANES;
override GROUP: u32 = 1u;     // gemv: tokens a workgroup serves from one read of its weights
const GROUP_MAX: u32 = 64u;   // gemv: GROUP's largest (a sum a token, each thread's own)

fn lo(w: u32) -> f32 { return bitcast<f32>(w << 16u); }
fn hi(w: u32) -> f32 { return bitcast<f32>(w & 0xffff0000u); }

// @include _projection_epilogue.wgsl

fn value(n: u32, j: u32, acc: f32) -> f32 {
  if (p.segments > 0u) { return acc + lora(n, j); }
  return acc;
}

var<workgroup> partial: array<f32, GEMV_WG>;

// gemv: the invocation that holds lane `lane` of the workgroup's row r. One token (GROUP 1): a
// row's lanes are neighbours (a warp reads a long run of one row). A group: they are ROWS apart,
// so that a warp spans several rows and each of its reads of a token's X serves them all.
fn gemv_slot(r: u32, lane: u32) -> u32 {
  if (GROUP == 1u) { return r * LANES + lane; }
  return lane * ROWS + r;
}

fn lanes_sum(r: u32) -> f32 {  // row r's lanes' sums, in lane order
  var s = 0.0;
  for (var i = 0u; i < LANES; i++) { s += partial[gemv_slot(r, i)]; }
  return s;
}

@compute @workgroup_size(GEMV_WG)
fn gemv(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  var lane = t % LANES;
  var r = t / LANES;
  if (GROUP > 1u) {  // gemv_slot's order
    lane = t / ROWS;
    r = t % ROWS;
  }
  let j = wg.x * ROWS + r;
  let row = min(j, p.features - 1u) * p.w_words;  // rows past the edge repeat the last one; not stored
  let n0 = wg.y * GROUP;
  var acc: array<f32, GROUP_MAX>;
  for (var u = lane; u < p.w_words; u += LANES) {
    let w = W[row + u];
    var wa = bitcast<vec4<f32>>(w);  // float32: four weights; BF16: eight, widened once for the group
    var wb = wa;
    if (BF16) {
      wa = vec4<f32>(lo(w.x), hi(w.x), lo(w.y), hi(w.y));
      wb = vec4<f32>(lo(w.z), hi(w.z), lo(w.w), hi(w.w));
    }
    for (var i = 0u; i < GROUP; i++) {
      let x = min(n0 + i, p.tokens - 1u) * p.x_words;  // a short group's last tokens: computed, not stored
      if (BF16) {
        acc[i] += dot(X[x + 2u * u], wa) + dot(X[x + 2u * u + 1u], wb);
      } else {
        acc[i] += dot(X[x + u], wa);
      }
    }
  }
  for (var i = 0u; i < GROUP; i++) {
    let n = n0 + i;
    if (GROUP > 1u && n >= p.tokens) { break; }  // uniform: the last group may be short
    partial[t] = acc[i];
    workgroupBarrier();  // then one thread a row sums its lanes: one barrier, not log2(LANES)
    if (lane == 0u && j < p.features) {
      if (MODE == 2u) {
        if (r % 2u == 0u) { put_pair(n, j / 2u, value(n, j, lanes_sum(r)), value(n, j + 1u, lanes_sum(r + 1u))); }
      } else {
        put(n, j, value(n, j, lanes_sum(r)));
      }
    }
    if (i + 1u < GROUP) { workgroupBarrier(); }  // the sums read before the next token's are written
  }
}

struct Staged {
  a: mat4x4<f32>,          // fetch_a
  w: array<vec4<u32>, 4>,  // float32: word idx % 8 of output row idx / 8 (idx = t + 128i, four a thread);
                           // BF16 (w[0], w[1]): word idx % 4 of output row idx / 4 (two a thread)
}

// W's vec4 word `word` of output row j; zeros past the last row.
fn weight_word(j: u32, word: u32) -> vec4<u32> {
  return select(vec4<u32>(0u), W[min(j, p.features - 1u) * p.w_words + word], j < p.features);
}

// The 32 K values from k = j0 of the workgroup's 64 output rows from k0: each row's read along it.
fn fetch(t: u32, n0: u32, k0: u32, j0: u32) -> Staged {
  var s: Staged;
  s.a = fetch_a(t, n0, j0, 0u);
  if (BF16) {  // 8 values a word, 4 words a row
    s.w[0] = weight_word(k0 + t / 4u, j0 / 8u + t % 4u);
    s.w[1] = weight_word(k0 + 32u + t / 4u, j0 / 8u + t % 4u);
  } else {  // 4 values a word, 8 words a row
    for (var i = 0u; i < 4u; i++) { s.w[i] = weight_word(k0 + 16u * i + t / 8u, j0 / 4u + t % 8u); }
  }
  return s;
}

fn tile_w(k: u32, row: u32, v: f32) {  // W'[k][row] = W[row][k] of this step
  tile[W_TILE + at(k, row / 4u)][row % 4u] = v;
}

fn stage(t: u32, s: Staged) {
  put_a(t, s.a);
  if (BF16) {
    for (var i = 0u; i < 2u; i++) {
      let row = 32u * i + t / 4u;
      let k = 8u * (t % 4u);
      let w = s.w[i];
      tile_w(k, row, lo(w.x)); tile_w(k + 1u, row, hi(w.x)); tile_w(k + 2u, row, lo(w.y)); tile_w(k + 3u, row, hi(w.y));
      tile_w(k + 4u, row, lo(w.z)); tile_w(k + 5u, row, hi(w.z)); tile_w(k + 6u, row, lo(w.w)); tile_w(k + 7u, row, hi(w.w));
    }
  } else {
    for (var i = 0u; i < 4u; i++) {
      let row = 16u * i + t / 8u;
      let k = 4u * (t % 8u);
      let w = bitcast<vec4<f32>>(s.w[i]);
      tile_w(k, row, w.x); tile_w(k + 1u, row, w.y); tile_w(k + 2u, row, w.z); tile_w(k + 3u, row, w.w);
    }
  }
}

// Output rows j..j + 3 of token n through the epilogue (j is a multiple of 4: gate/up pairs whole).
fn store(n: u32, j: u32, acc: vec4<f32>) {
  if (n >= p.tokens) { return; }
  if (MODE == 2u) {
    if (j + 1u < p.features) { put_pair(n, j / 2u, value(n, j, acc.x), value(n, j + 1u, acc.y)); }
    if (j + 3u < p.features) { put_pair(n, j / 2u + 1u, value(n, j + 2u, acc.z), value(n, j + 3u, acc.w)); }
    return;
  }
  for (var r = 0u; r < 4u; r++) {
    if (j + r < p.features) { put(n, j + r, value(n, j + r, acc[r])); }
  }
}

fn row_span(n0: u32, k0: u32) -> vec2<u32> { return vec2<u32>(0u, p.rows); }

// @include _gemm_t_tile.wgsl
