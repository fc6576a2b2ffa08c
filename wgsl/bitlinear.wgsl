// Ternary BitLinear projections: int8 activation codes × 2-bit weights, exact integer dots.
//   dot[n][j] = Σ_k q[n][k] · t[j][k]           dot4I8Packed on packed codes (see engine/weights.py):
//               gemm as Σ q · (t + 1) − Σ q (the codes t + 1 straight from the 2-bit fields, the
//               row's code sum from the quantisation kernel), gemv on signed bytes (one add and
//               one xor a word: no code sum, so a GEMV that quantises needs no reduction for it)
//   v         = dot / (WS[j] · s[n])   (DIVIDE)   or   dot / s[n] · WS[j]
//   v        += scale_s · Σ_r B_s[j'][r] · h[n][c_s + r]   for a LoRA segment s holding row j (j' its row in B_s)
// then the epilogue (MODE): 0 store, 1 add into OUT (a residual stream), 2 gate/up pairs
// (rows 2i, 2i+1): OUT[n][i] = relu(gate)² · up, and with SAVE the raw pair into AUX (MODE 1:
// the sums); 3 (gemv)
// rope: the fused q/k/v rows rotated and written where attention reads them (below).
//
// Two kinds of entry point. gemv (decoding: a stream of the weights at memory bandwidth): ROWS
// weight rows a workgroup, LANES threads a row, each reading 16 bytes (64 weights) at a time
// through W4 (the same weights as W), the row's length a pipeline constant so that every load of
// a thread is issued at once. The thread holds its share of the row in registers and serves
// GROUP tokens from it, one after another (the grid's y is the launch's tokens in groups of
// GROUP): it stages a token's codes, dots them with the held weights, one barrier, then one thread
// a row sums its lanes and runs the epilogue. Every token's values are those of a launch of that
// token alone: integer dots, and the same float operations per token. gemm: 32 (or 64) tokens ×
// 64 rows a workgroup, 4 × 4 a thread, K in steps of 64 through workgroup memory; weights decoded
// once per step with one shift and mask per four of them.
//
// XQ holds each token's codes as vec4<u32> (16 codes), K padded to a multiple of 64 with
// zero codes; XM holds the per-token scales s[n] at [0, N) and code sums (as i32 bits) at
// [N, 2N). LORA holds `segments` headers of 8 words (row_begin, row_end, row_step, h_col,
// b_offset, rank, scale bits, 0); each segment's B [rows, rank] starts at float b_offset of LB (LB is
// the engine's flat buffer of every adapter parameter).
//
// Decoding fuses into gemv what would be launches of their own (each a dependent launch, a few
// µs when a token's whole work is a few hundred of them), one entry point per fusion, each binding
// only what it reads and writes (WebGPU counts a binding an entry point's code names, taken or
// not, against the 16 storage buffers a stage may have on Dawn):
// * gemv_norm, gemv_norm_rope: each workgroup makes its tokens' codes itself, from the float rows X
//   (x_stride apart) and the norm's weight G: norm.wgsl's RMSNorm and quantisation, the same
//   operations in the same order, into workgroup memory; the first workgroup of each group also
//   writes them, and the meta, to XQW and XMW (as norm.wgsl writes XQ and XM: captures and tests
//   read them). gemv_combine: so, from attention's output, merged from its decode partials PO, PML
//   as they are read (o_proj: no combine launch).
// * gemv_rope, gemv_norm_rope (MODE 3): the grid's rows are the weight rows in an order that puts each rotation's
//   two partners (features d and d + D/2 of a q or k head) side by side, so one thread holds both:
//   transformers' rotate_half rule with the COS/SIN tables at the token's position, rotated
//   queries into OUT, rotated keys and the values into the caches KC, VC [batch, kv_heads, S, D].
//   Token n is position STARTS[b] + n % tokens_per_seq of sequence b = n / tokens_per_seq (rope.wgsl's
//   rule).

struct Params {
  tokens: u32,
  rows: u32,
  k_words: u32,      // u32 words per weight row = vec4 words per token of XQ
  out_stride: u32,   // floats per output row
  out_offset: u32,   // first output column written
  lora_rank: u32,    // floats per row of H
  segments: u32,     // LoRA segments in LORA (0: none)
  aux_stride: u32,   // floats per row of AUX
  x_stride: u32,     // gemv_norm*: floats per row of X
  cache_len: u32,    // MODE 3: positions per sequence in KC, VC
  tokens_per_seq: u32,  // MODE 3
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> XQ: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> XM: array<f32>;
@group(0) @binding(3) var<storage, read> W: array<u32>;
@group(0) @binding(4) var<storage, read> WS: array<f32>;
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(6) var<storage, read> H: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read> LORA: array<u32>;
@group(0) @binding(8) var<storage, read> LB: array<vec4<f32>>;
@group(0) @binding(9) var<storage, read_write> AUX: array<f32>;
@group(0) @binding(10) var<storage, read> W4: array<vec4<u32>>;
@group(0) @binding(11) var<storage, read> X: array<f32>;
@group(0) @binding(12) var<storage, read> G: array<f32>;
@group(0) @binding(13) var<storage, read_write> XQW: array<u32>;
@group(0) @binding(14) var<storage, read_write> XMW: array<f32>;
@group(0) @binding(15) var<storage, read> COS: array<f32>;
@group(0) @binding(16) var<storage, read> SIN: array<f32>;
@group(0) @binding(17) var<storage, read> STARTS: array<u32>;
@group(0) @binding(18) var<storage, read_write> KC: array<f32>;
@group(0) @binding(19) var<storage, read_write> VC: array<f32>;
@group(0) @binding(20) var<storage, read> PO: array<vec4<f32>>;
@group(0) @binding(21) var<storage, read> PML: array<vec2<f32>>;

override MODE: u32 = 0u;
override DIVIDE: bool = true;
override SAVE: bool = false;
override ROWS: u32 = 16u;   // gemv: weight rows per workgroup, 128 / LANES (even: gate/up pairs stay together)
override LANES: u32 = 8u;   // gemv: threads per row (gemv_lanes picks them per projection)
override ROW_VECS: u32 = 4u;  // gemv: vec4 words per weight row (k_words / 4)
override WG: u32 = ROWS * LANES;  // gemv's invocations (a multiple of 32)
override GROUP: u32 = 1u;     // gemv: tokens a workgroup serves from one read of its weights
override SPREAD: bool = false;  // gemv: the weights held decoded (signed bytes), not as 2-bit words (below)
override K: u32 = 64u;        // gemv_norm*, gemv_combine: the row's features (at most 4 · NORM_WORDS · WG)
override EPS: f32 = 1e-5;     // gemv_norm*, gemv_combine
override SPANS: u32 = 1u;     // gemv_combine: key spans of the partials
override HEADS: u32 = 1u;     // MODE 3: query heads, key/value heads, their width (gemv_combine: HEADS, HEAD_DIM)
override KV_HEADS: u32 = 1u;
override HEAD_DIM: u32 = 4u;  // even (rope) and whole vec4s (gemv_combine): its default compiles for both
// Trip counts of the loops over registers, as overrides rather than functions or `let`s: Tint (Dawn)
// puts a counter into every loop whose bound it cannot prove constant, such a loop is not unrolled,
// and the arrays it indexes leave the registers. (naga wants them declared before any use of an override.)
override ROW_LOADS: u32 = (ROW_VECS + LANES - 1u) / LANES;          // gemv: weight words a thread reads
override CODE_LOADS: u32 = (4u * ROW_VECS + WG - 1u) / WG;          // gemv: vec4s of codes an invocation stages
override NORM_WORDS_HELD: u32 = (ROW_VECS * 16u + WG - 1u) / WG;    // gemv_norm*: 4-feature words an invocation holds

const M2: u32 = 0x03030303u;

fn spread(w: u32) -> vec4<u32> {
  return vec4<u32>(w, w >> 2u, w >> 4u, w >> 6u) & vec4<u32>(M2);
}

// spread's bytes 0, 1, 2 as signed −1, 0, 1: + 0x7F never carries out of a byte, ^ 0x80 recentres.
fn spread_signed(w: u32) -> vec4<u32> {
  return (spread(w) + vec4<u32>(0x7F7F7F7Fu)) ^ vec4<u32>(0x80808080u);
}

fn dot16(a: vec4<u32>, d: vec4<u32>) -> i32 {
  return dot4I8Packed(a.x, d.x) + dot4I8Packed(a.y, d.y) + dot4I8Packed(a.z, d.z) + dot4I8Packed(a.w, d.w);
}

// @include _projection_epilogue.wgsl

// A row's float value from the exact integer dot, the token's scale s and the row's scale ws.
fn scaled(exact: i32, s: f32, ws: f32) -> f32 {
  if (DIVIDE) { return f32(exact) / (ws * s); }
  return f32(exact) / s * ws;
}

// The projection's value for token n, row j (gemm).
fn value(n: u32, j: u32, exact: i32, s: f32) -> f32 {
  var v = scaled(exact, s, WS[j]);
  if (p.segments > 0u) { v += lora(n, j); }
  return v;
}

// @include _reductions.wgsl
// @include _quantise.wgsl

var<workgroup> partial: array<i32, WG>;
// gemv: the token's codes, 16 a vec4. The four vec4s c = 4u .. 4u + 3 that meet weight word u are
// stored a plane apart (xq_at), so that the lanes of a row, reading consecutive words u, read
// consecutive vec4s: stored as they come, lane reads land 64 bytes apart, in two of the eight
// 16-byte bank groups.
var<workgroup> xq: array<vec4<u32>, ROW_VECS * 4u>;

fn xq_at(c: u32) -> u32 { return (c % 4u) * ROW_VECS + c / 4u; }

// gemv: the invocation that holds lane `lane` of the workgroup's row r. One token (GROUP 1): a row's
// lanes are neighbours, so that a warp reads long runs of one row's weights. A group: they are
// ROWS apart, so that a warp spans several rows and each of its reads of xq (a token's codes, read
// once per token where the weights are read once per group) serves them all.
fn gemv_slot(r: u32, lane: u32) -> u32 {
  if (GROUP == 1u) { return r * LANES + lane; }
  return lane * ROWS + r;
}

// gemv: token i of the workgroup's group; the group's tokens (the last group may be short: a
// uniform count, barriers follow); whether token n, the group's i-th, has a next one in the group.
fn group_token(wg: vec3<u32>, i: u32) -> u32 { return wg.y * GROUP + i; }
fn group_size(wg: vec3<u32>) -> u32 {
  if (GROUP == 1u) { return 1u; }
  return min(GROUP, p.tokens - wg.y * GROUP);
}
fn has_next(i: u32, n: u32) -> bool { return i + 1u < GROUP && n + 1u < p.tokens; }

const NORM_WORDS: u32 = 16u;  // gemv_norm*, gemv_combine: 4-feature words an invocation holds

// @include _attention_partials.wgsl

// gemv_norm*: the invocation's words of token n's row of X (fetched before they are normalised:
// a group issues the next token's loads while it works on this one).
fn fetch_row(t: u32, n: u32) -> array<vec4<f32>, NORM_WORDS> {
  var y: array<vec4<f32>, NORM_WORDS>;
  for (var i = 0u; i < NORM_WORDS_HELD; i++) { y[i] = row_features(n * p.x_stride, 4u * (t + WG * i)); }
  return y;
}

// gemv_combine: the same of attention's output, merged from its decode partials as read.
fn fetch_attention(t: u32, n: u32) -> array<vec4<f32>, NORM_WORDS> {
  var y: array<vec4<f32>, NORM_WORDS>;
  for (var i = 0u; i < NORM_WORDS_HELD; i++) {
    let k = 4u * (t + WG * i);
    var v = vec4<f32>(0.0);
    if (k < K) { v = attention_out(n, k / 4u); }  // K = HEADS · HEAD_DIM: whole words
    y[i] = v;
  }
  return y;
}

// gemv_norm*, gemv_combine: token n's codes into xq (and XQW, XMW from its group's first
// workgroup), from its fetched row y, as rmsnorm in norm.wgsl makes them; returns s. y is
// consumed (it holds the normalised row after).
fn normalise(t: u32, n: u32, first: bool, y: ptr<function, array<vec4<f32>, NORM_WORDS>>) -> f32 {
  var g: array<vec4<f32>, NORM_WORDS>;
  var ss = 0.0;
  for (var i = 0u; i < NORM_WORDS_HELD; i++) {
    g[i] = norm_weights(4u * (t + WG * i));
    ss += dot((*y)[i], (*y)[i]);
  }
  let row_words = ROW_VECS * 16u;  // 4-feature words of the padded row
  let r = inverseSqrt(sum_all(t, ss) / f32(K) + EPS);
  var m = 0.0;
  for (var i = 0u; i < NORM_WORDS_HELD; i++) {
    let v = g[i] * ((*y)[i] * r);
    (*y)[i] = v;
    m = max(m, absmax4(v));
  }
  let s = quant_scale(max_all(t, m));
  var total = 0i;
  for (var i = 0u; i < NORM_WORDS_HELD; i++) {
    let w = t + WG * i;
    if (w < row_words) {
      let q = codes4((*y)[i], s);
      let packed = pack4xI8(q);
      xq[xq_at(w / 4u)][w % 4u] = packed;
      if (first) { XQW[n * row_words + w] = packed; }
      total += q.x + q.y + q.z + q.w;
    }
  }
  if (first) {  // the meta as norm.wgsl writes it (workgroup-uniform: the reduction's barriers are allowed)
    let sum = sum_all_i(t, total);
    if (t == 0u) {
      XMW[n] = s;
      XMW[p.tokens + n] = bitcast<f32>(sum);
    }
  }
  workgroupBarrier();  // xq complete
  return s;
}

// Token n (the group's i-th) normalised from its fetched row y (X's, or attention's), the next
// token's row fetched into y; returns n's scale.
fn stage_row(t: u32, i: u32, n: u32, first: bool, y: ptr<function, array<vec4<f32>, NORM_WORDS>>) -> f32 {
  let s = normalise(t, n, first, y);
  if (has_next(i, n)) { *y = fetch_row(t, n + 1u); }
  return s;
}

fn stage_attention(t: u32, i: u32, n: u32, first: bool, y: ptr<function, array<vec4<f32>, NORM_WORDS>>) -> f32 {
  let s = normalise(t, n, first, y);
  if (has_next(i, n)) { *y = fetch_attention(t, n + 1u); }
  return s;
}

const CODE_LOADS_MAX: u32 = 8u;  // gemv: vec4s of a token's codes an invocation stages (4 · ROW_VECS ≤ 8 · WG)

// gemv, gemv_rope: the invocation's vec4s of token n's codes (XQ: the rows a norm launch wrote),
// fetched ahead as fetch_row's words are; stage_codes puts them into xq.
fn fetch_codes(t: u32, n: u32) -> array<vec4<u32>, CODE_LOADS_MAX> {
  var c: array<vec4<u32>, CODE_LOADS_MAX>;
  for (var i = 0u; i < CODE_LOADS; i++) { c[i] = XQ[n * p.k_words + min(t + WG * i, 4u * ROW_VECS - 1u)]; }
  return c;
}

// Token n (the group's i-th) staged from its fetched codes c, the next token's fetched into c;
// returns n's scale.
fn stage_codes(t: u32, i: u32, n: u32, c: ptr<function, array<vec4<u32>, CODE_LOADS_MAX>>) -> f32 {
  let s = XM[n];
  for (var l = 0u; l < CODE_LOADS; l++) {
    let v = t + WG * l;
    if (v < 4u * ROW_VECS) { xq[xq_at(v)] = (*c)[l]; }
  }
  workgroupBarrier();
  if (has_next(i, n)) { *c = fetch_codes(t, n + 1u); }
  return s;
}

// @include _rope_epilogue.wgsl

fn lanes_sum(r: u32) -> i32 {  // row r's lanes' dots, in lane order
  var s = 0i;
  for (var i = 0u; i < LANES; i++) { s += partial[gemv_slot(r, i)]; }
  return s;
}

// gemv: what a thread holds of its row: ROW_LOADS_MAX vec4s, the row's 2-bit words (up to 16 of
// them: ROW_VECS ≤ 16 · LANES) or with SPREAD four words decoded to signed bytes (ROW_VECS ≤ 4 ·
// LANES), each word decoded once for a group's tokens rather than once per token (bitlinear.py's
// gemv_spread says when). The same registers either way, whatever GROUP.
const ROW_LOADS_MAX: u32 = 16u;

// A gemv invocation's row (g in the grid, j and the next grid row's j2 among the weights) and the
// rows' scales.
struct GemvRow {
  t: u32,
  lane: u32,
  r: u32,
  g: u32,
  j: u32,
  j2: u32,
  ws: vec2<f32>,
}

// The thread's share of the weights first, into wv (the loop's trip count is a pipeline constant:
// unrolled, every load in flight at once); then the rows' scales, so that they and the codes'
// staging or the norm prologue which the entry point does next overlap the stream.
fn gemv_row(t: u32, wg: vec3<u32>, wv: ptr<function, array<vec4<u32>, ROW_LOADS_MAX>>) -> GemvRow {
  var lane = t % LANES;
  var r = t / LANES;
  if (GROUP > 1u) {  // gemv_slot's order
    lane = t / ROWS;
    r = t % ROWS;
  }
  let g = wg.x * ROWS + r;  // the grid's row (MODE 3 reorders the weight rows)
  let j = qkv_row(min(g, p.rows - 1u));  // rows past the edge repeat the last one; not stored
  let row = j * ROW_VECS;
  for (var i = 0u; i < ROW_LOADS; i++) {
    let w = W4[row + min(lane + LANES * i, ROW_VECS - 1u)];
    if (SPREAD) {
      (*wv)[4u * i] = spread_signed(w.x);
      (*wv)[4u * i + 1u] = spread_signed(w.y);
      (*wv)[4u * i + 2u] = spread_signed(w.z);
      (*wv)[4u * i + 3u] = spread_signed(w.w);
    } else {
      (*wv)[i] = w;
    }
  }
  let j2 = qkv_row(min(g + 1u, p.rows - 1u));
  return GemvRow(t, lane, r, g, j, j2, vec2<f32>(WS[j], WS[j2]));
}

// What the epilogue adds for token n: the LoRA terms of the row and, for pairs, the next.
fn gemv_extra(row: GemvRow, n: u32) -> vec2<f32> {
  if (p.segments == 0u || row.lane != 0u) { return vec2<f32>(0.0); }
  return vec2<f32>(lora(n, row.j), select(0.0, lora(n, row.j2), MODE >= 2u));
}

// The row's lanes' dots with the codes in xq, into partial; true for the invocation that stores
// the row (its first lane, a row of the projection).
fn gemv_dot(row: GemvRow, wv: ptr<function, array<vec4<u32>, ROW_LOADS_MAX>>) -> bool {
  var acc = 0i;
  for (var i = 0u; i < ROW_LOADS; i++) {
    let u = row.lane + LANES * i;
    if (u < ROW_VECS) {
      if (SPREAD) {
        acc += dot16(xq[u], (*wv)[4u * i]) + dot16(xq[ROW_VECS + u], (*wv)[4u * i + 1u])
             + dot16(xq[2u * ROW_VECS + u], (*wv)[4u * i + 2u]) + dot16(xq[3u * ROW_VECS + u], (*wv)[4u * i + 3u]);
      } else {
        let w = (*wv)[i];
        acc += dot16(xq[u], spread_signed(w.x)) + dot16(xq[ROW_VECS + u], spread_signed(w.y))
             + dot16(xq[2u * ROW_VECS + u], spread_signed(w.z)) + dot16(xq[3u * ROW_VECS + u], spread_signed(w.w));
      }
    }
  }
  partial[row.t] = acc;
  workgroupBarrier();
  return row.lane == 0u && row.g < p.rows;
}

// The row's values for a token of scale s: its own (x) and, for pairs (MODE ≥ 2, held by the even
// row's thread), the next (y).
fn gemv_values(row: GemvRow, s: f32, extra: vec2<f32>) -> vec2<f32> {
  let a = scaled(lanes_sum(row.r), s, row.ws.x) + extra.x;
  if (MODE < 2u || row.r % 2u != 0u) { return vec2<f32>(a, 0.0); }
  return vec2<f32>(a, scaled(lanes_sum(row.r + 1u), s, row.ws.y) + extra.y);
}

// The epilogue of MODE 0-2 for token n.
fn gemv_put(row: GemvRow, n: u32, s: f32, extra: vec2<f32>) {
  let v = gemv_values(row, s, extra);
  if (MODE < 2u) {
    put(n, row.j, v.x);
  } else if (row.r % 2u == 0u) {
    put_pair(n, row.j / 2u, v.x, v.y);
  }
}

// The epilogue of MODE 3: rotated pairs.
fn gemv_put_rotated(row: GemvRow, n: u32, s: f32, extra: vec2<f32>) {
  if (row.r % 2u == 0u) {
    let v = gemv_values(row, s, extra);
    put_rotated(n, row.g, v.x, v.y);
  }
}

// The entry points: each token of the group staged (from XQ, or normalised from X or attention's
// partials) while the next one's loads are issued, then its dots and epilogue.
@compute @workgroup_size(WG)
fn gemv(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  var wv: array<vec4<u32>, ROW_LOADS_MAX>;
  let row = gemv_row(inv.t, wg, &wv);
  var codes = fetch_codes(inv.t, group_token(wg, 0u));
  for (var i = 0u; i < group_size(wg); i++) {
    let n = group_token(wg, i);
    let extra = gemv_extra(row, n);
    let s = stage_codes(inv.t, i, n, &codes);
    if (gemv_dot(row, &wv)) { gemv_put(row, n, s, extra); }
  }
}

@compute @workgroup_size(WG)
fn gemv_rope(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  var wv: array<vec4<u32>, ROW_LOADS_MAX>;
  let row = gemv_row(inv.t, wg, &wv);
  var codes = fetch_codes(inv.t, group_token(wg, 0u));
  for (var i = 0u; i < group_size(wg); i++) {
    let n = group_token(wg, i);
    let extra = gemv_extra(row, n);
    let s = stage_codes(inv.t, i, n, &codes);
    if (gemv_dot(row, &wv)) { gemv_put_rotated(row, n, s, extra); }
  }
}

@compute @workgroup_size(WG)
fn gemv_norm(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  var wv: array<vec4<u32>, ROW_LOADS_MAX>;
  let row = gemv_row(inv.t, wg, &wv);
  var y = fetch_row(inv.t, group_token(wg, 0u));
  for (var i = 0u; i < group_size(wg); i++) {
    let n = group_token(wg, i);
    let extra = gemv_extra(row, n);
    let s = stage_row(inv.t, i, n, wg.x == 0u, &y);
    if (gemv_dot(row, &wv)) { gemv_put(row, n, s, extra); }
  }
}

@compute @workgroup_size(WG)
fn gemv_norm_rope(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  var wv: array<vec4<u32>, ROW_LOADS_MAX>;
  let row = gemv_row(inv.t, wg, &wv);
  var y = fetch_row(inv.t, group_token(wg, 0u));
  for (var i = 0u; i < group_size(wg); i++) {
    let n = group_token(wg, i);
    let extra = gemv_extra(row, n);
    let s = stage_row(inv.t, i, n, wg.x == 0u, &y);
    if (gemv_dot(row, &wv)) { gemv_put_rotated(row, n, s, extra); }
  }
}

@compute @workgroup_size(WG)
fn gemv_combine(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  var wv: array<vec4<u32>, ROW_LOADS_MAX>;
  let row = gemv_row(inv.t, wg, &wv);
  var y = fetch_attention(inv.t, group_token(wg, 0u));
  for (var i = 0u; i < group_size(wg); i++) {
    let n = group_token(wg, i);
    let extra = gemv_extra(row, n);
    let s = stage_attention(inv.t, i, n, wg.x == 0u, &y);
    if (gemv_dot(row, &wv)) { gemv_put(row, n, s, extra); }
  }
}

// gemm: TILE_TOKENS (32 or 64) tokens × 64 rows a workgroup of 4·TILE_TOKENS threads; thread
// (tr, tt) owns rows 4tr.. and tokens 4tt.. (bitlinear.py's gemm_tile_tokens says which tile).
override TILE_TOKENS: u32 = 64u;
override GEMM_THREADS: u32 = 4u * TILE_TOKENS;
var<workgroup> xs: array<vec4<u32>, 256>;  // [token][word] of the current K step
// [word][row quad]: words of rows 4q .. 4q + 3 in one vec4, so that a thread's four rows are one
// 16-byte read and the 16 row quads a warp reads are 256 contiguous bytes ([row][word] u32s put
// them 64 bytes apart, in two of the 32 banks: 10-11% slower at BitNet-2B's shapes on the H200)
var<workgroup> ws: array<vec4<u32>, 64>;

@compute @workgroup_size(GEMM_THREADS)
fn gemm(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let tr = t % 16u;
  let tt = t / 16u;
  let n0 = wg.y * TILE_TOKENS;
  let j0 = wg.x * 64u;
  // what this thread loads each step: token t / 4, row t / 4 (and with 32 tokens row t / 4 + 32), word t % 4
  let load_n = min(n0 + t / 4u, p.tokens - 1u) * p.k_words + t % 4u;
  let load_j = min(j0 + t / 4u, p.rows - 1u) * p.k_words + t % 4u;
  let load_j2 = min(j0 + t / 4u + 32u, p.rows - 1u) * p.k_words + t % 4u;
  var a0 = vec4<i32>(0); var a1 = vec4<i32>(0); var a2 = vec4<i32>(0); var a3 = vec4<i32>(0);
  for (var u = 0u; u < p.k_words; u += 4u) {
    xs[t] = XQ[load_n + u];
    ws[(t % 4u) * 16u + t / 16u][(t / 4u) % 4u] = W[load_j + u];
    if (TILE_TOKENS == 32u) { ws[(t % 4u) * 16u + t / 16u + 8u][(t / 4u) % 4u] = W[load_j2 + u]; }
    workgroupBarrier();
    for (var w = 0u; w < 4u; w++) {
      let d = ws[w * 16u + tr];
      let d0 = spread(d.x);
      let d1 = spread(d.y);
      let d2 = spread(d.z);
      let d3 = spread(d.w);
      let x0 = xs[(4u * tt) * 4u + w];
      let x1 = xs[(4u * tt + 1u) * 4u + w];
      let x2 = xs[(4u * tt + 2u) * 4u + w];
      let x3 = xs[(4u * tt + 3u) * 4u + w];
      a0 += vec4<i32>(dot16(x0, d0), dot16(x0, d1), dot16(x0, d2), dot16(x0, d3));
      a1 += vec4<i32>(dot16(x1, d0), dot16(x1, d1), dot16(x1, d2), dot16(x1, d3));
      a2 += vec4<i32>(dot16(x2, d0), dot16(x2, d1), dot16(x2, d2), dot16(x2, d3));
      a3 += vec4<i32>(dot16(x3, d0), dot16(x3, d1), dot16(x3, d2), dot16(x3, d3));
    }
    workgroupBarrier();
  }
  let j = j0 + 4u * tr;
  store4(n0 + 4u * tt, j, a0);
  store4(n0 + 4u * tt + 1u, j, a1);
  store4(n0 + 4u * tt + 2u, j, a2);
  store4(n0 + 4u * tt + 3u, j, a3);
}

// Four consecutive rows j.. of token n (two gate/up pairs in MODE 2).
fn store4(n: u32, j: u32, acc: vec4<i32>) {
  if (n >= p.tokens) { return; }
  let s = XM[n];
  let code_sum = bitcast<i32>(XM[p.tokens + n]);
  if (MODE == 2u) {
    if (j + 1u < p.rows) {
      put_pair(n, j / 2u, value(n, j, acc.x - code_sum, s), value(n, j + 1u, acc.y - code_sum, s));
    }
    if (j + 3u < p.rows) {
      put_pair(n, j / 2u + 1u, value(n, j + 2u, acc.z - code_sum, s), value(n, j + 3u, acc.w - code_sum, s));
    }
    return;
  }
  for (var r = 0u; r < 4u; r++) {
    if (j + r < p.rows) { put(n, j + r, value(n, j + r, acc[r] - code_sum, s)); }
  }
}
