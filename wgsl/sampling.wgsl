// Choosing the next token of each sequence (row) of a batch on the GPU from its last position's
// logits, and advancing the row's decode state for the next step (engine/kernels/sampling.py
// builds the launches). Every launch has a row of workgroups per sequence (workgroup_id.y);
// a row whose length is 0 has finished (at an EOS token, or ended by the host) and is skipped.
//
// Each step, in Hugging Face's order: repetition penalty (CTRL: on every token whose
// SEEN flag is set, positive logits divided by the penalty, negative ones multiplied), EOS
// tokens (EOS flag) to -inf while the row has generated fewer than min_new tokens, then for
// sampling: divide by the temperature, keep the top-k or the top-p nucleus or both (top-p
// within the top k), and draw from the softmax of what is kept. The divisions are correctly rounded (`div_exact`,
// an integer long division: WGSL's `/` may be off by 2.5 ulp), so the processed logits are
// bitwise torch's and greedy picks exactly torch.argmax's token.
//
// Greedy (2 launches):
//   greedy_partial  [groups]  per workgroup: argmax over its chunk (ties: smallest id)
//   greedy_final    [1]       argmax of the partials; advance
// top_k / top_p (PASSES + 1 launches; top_k then top_p: 2 PASSES + 1):
//   search_first [groups]  search pass 1, which also stores z = the processed logits
//   search       [groups]  passes 2..PASSES. The keep threshold T (an ordered-u32 key, below)
//                          is the largest key with F(T) >= goal, where F(c) = sum over tokens
//                          with key >= c of w (top_k: w = 1 and goal = min(k, V); top_p:
//                          w = exp(z - max) and goal = top_p * sum of all w, torch's
//                          `cumulative <= 1 - p` rule). Each pass evaluates 16 candidates that
//                          split the interval [lo, hi] left by the pass before in 17 (pass 1:
//                          all keys): every workgroup folds the previous pass's per-workgroup
//                          sums itself (the same arithmetic in the same order, so all agree),
//                          and the first one stores the interval for the pass after. 17^8 >
//                          2^32: 8 folds narrow any interval of keys to one key. Pass 1 weighs
//                          by exp(z - its workgroup's max) and pass 2 rescales (online softmax).
//                          top_k then top_p (MODE 2): passes 1..PASSES search the top-k
//                          threshold T_k (counts; the last one also sums the mass), pass
//                          PASSES + 1 folds them and starts the top-p search over [T_k, all]
//                          with total = the mass at or above T_k.
//   draw         [1]       the last fold (T final; the last pass's per-workgroup kept mass at
//                          T are the block sums); u = uniform(seed, token count); the first
//                          token, in id order, whose running kept mass exceeds u * total
//                          (blocks, then the chosen block's threads, then their 4 lanes;
//                          running sums are sequential at each level, so "first to exceed" is
//                          well defined); advance.
// No atomics and no state carried between steps: every scratch value is written in the
// step before it is read, so the same launches can be recorded for every token.
//
// Keys: a float's bits mapped to a u32 with the same order (-0 counts as +0, NaN as the
// largest, as torch.argmax treats it). The advance of row b (one thread of the last launch):
// history[b][count] = token, seen[b][token] |= SEEN, next_token[b] = token, count += 1, and
// the row's next pass goes at its end: starts[b] = lengths[b], lengths[b] += 1; or, when the
// token is an EOS token or the row's last (count reaches its limit), lengths[b] = 0 (finished).
//
// Per row state (u32 [B, 3]): the sampling seed, the tokens generated, the most it may generate.
// Seen flags u32 [B, 4 v4]: SEEN (1) the repetition penalty applies, EOS (2) an end-of-sequence
// token.
//
// Scratch (vec4<u32>, `groups` = W; scratch_rows of them per row): [0, 10W) and [10W, 20W) the partial sums of even and
// odd search passes, 10 vec4s per workgroup: F of the 16 candidates (4 vec4s), F(lo) (.x),
// then the same in probability mass (top_k's last pass only: the draw's block sums);
// [20W, 21W) one vec4 per workgroup (greedy's (key, id), pass 1's max key); [21W, 21W+2)
// the search state of even and odd passes: (lo, hi, bits of the max, bits of the total).

struct Params {
  vocab: u32,        // V: token ids 0..V-1
  v4: u32,           // ceil(V / 4): vec4s of a row
  chunk: u32,        // vec4s per workgroup of the multi-workgroup launches
  groups: u32,       // workgroups of the multi-workgroup launches (at most WG)
  pass_index: u32,   // search: 1..PASSES; draw: PASSES + 1
  history_len: u32,  // elements of history
  top_k: u32,        // min(top_k, V)
  top_p: f32,
  penalty: f32,      // repetition penalty (read when PENALIZE != 0)
  temperature: f32,  // read when SCALE != 0
  min_new: u32,      // EOS tokens are banned while a row has generated fewer (read when BAN != 0)
  scratch_rows: u32, // vec4s of scratch per row
}

@group(0) @binding(0) var<uniform> p: Params;

// Bindings per entry point (the caller's buffers are either only read, or all read_write,
// so arena views of one wgpu buffer may be passed together):
//   greedy_partial  scratch, logits, seen, row_state, row_lengths
//   search_first    scratch, logits, seen, z_out, row_state, row_lengths
//   search          scratch, z, row_lengths
//   greedy_final    scratch, seen_flags, state, starts, lengths, history, next_token
//   draw            scratch, seen_flags, state, starts, lengths, history, next_token, z_draw
// (logits, seen, z: rows of v4 vec4s; history: rows of history_len.)
@group(0) @binding(1) var<storage, read_write> scratch: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> logits: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> seen: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> z_out: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> row_state: array<u32>;
@group(0) @binding(6) var<storage, read> row_lengths: array<u32>;
@group(0) @binding(2) var<storage, read_write> z: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> seen_flags: array<u32>;
@group(0) @binding(3) var<storage, read_write> state: array<u32>;
@group(0) @binding(4) var<storage, read_write> starts: array<u32>;
@group(0) @binding(5) var<storage, read_write> lengths: array<u32>;
@group(0) @binding(6) var<storage, read_write> history: array<u32>;
@group(0) @binding(7) var<storage, read_write> next_token: array<u32>;
@group(0) @binding(8) var<storage, read_write> z_draw: array<vec4<f32>>;

override WG: u32 = 128u;      // threads per workgroup; a power of two, >= 16
override PASSES: u32 = 8u;    // search passes (>= 2)
override PENALIZE: u32 = 0u;  // 1: apply the repetition penalty
override SCALE: u32 = 0u;     // 1: divide by the temperature
override BAN: u32 = 0u;       // 1: ban EOS tokens below min_new tokens
override MODE: u32 = 0u;      // search: 0 top_k (counts), 1 top_p (probability mass), 2 top_k then top_p

const NONE: u32 = 0xffffffffu;
const SEEN: u32 = 1u;
const EOS: u32 = 2u;
const SEED: u32 = 0u;   // fields of a row's state
const COUNT: u32 = 1u;
const LIMIT: u32 = 2u;
const FIELDS: u32 = 3u;

var<private> row: u32;   // this workgroup's sequence
var<private> base: u32;  // its first scratch vec4

fn enter(wg: vec3<u32>) {
  row = wg.y;
  base = row * p.scratch_rows;
}

fn partials_at(pass_index: u32) -> u32 { return base + (pass_index & 1u) * 10u * p.groups; }
fn aux_at() -> u32 { return base + 20u * p.groups; }
fn state_at() -> u32 { return base + 21u * p.groups; }

// Whether search pass `pass_at` tallies counts (top_k) rather than probability mass (top_p).
fn counts(pass_at: u32) -> bool { return MODE == 0u || (MODE == 2u && pass_at <= PASSES); }

// ---------------------------------------------------------------------------------------
// Processing the logits

// x / d correctly rounded (round to nearest even), d a positive normal float: WGSL's `/`
// may be off by 2.5 ulp. Long division of the 24-bit significands, one quotient bit a step.
fn div_exact(x: f32, d: f32) -> f32 {
  let xb = bitcast<u32>(x);
  let sign = xb & 0x80000000u;
  let ax = xb & 0x7fffffffu;
  if (ax == 0u || ax >= 0x7f800000u) { return x; }  // zero, inf, NaN: x / d keeps them
  var mx = ax & 0x7fffffu;
  var ex = i32(ax >> 23u);
  if (ex == 0) {  // subnormal x: normalise
    let sh = countLeadingZeros(mx) - 8u;
    mx = mx << sh;
    ex = 1 - i32(sh);
  } else {
    mx = mx | 0x800000u;
  }
  let db = bitcast<u32>(d);
  let md = (db & 0x7fffffu) | 0x800000u;
  var e = ex - i32(db >> 23u);  // biased exponent of the quotient, for a quotient in [1, 2)
  var r = mx;
  if (r < md) { r = r << 1u; e -= 1; }  // now md <= r < 2 md: the first quotient bit is 1
  e += 127;
  // a normal result has 24 significant bits; a subnormal one fewer (none below 2^-149)
  let bits = select(23 + e, 24, e >= 1);
  if (bits < 0) { return bitcast<f32>(sign); }
  var q = 0u;
  for (var i = 0; i < bits; i++) {
    q = q << 1u;
    if (r >= md) { r -= md; q |= 1u; }
    r = r << 1u;
  }
  // r is twice the remainder: round half to even
  if (r > md || (r == md && (q & 1u) == 1u)) { q += 1u; }
  if (e < 1) { return bitcast<f32>(sign | q); }  // subnormal (a carry to 2^23 is the smallest normal)
  if (q == 0x1000000u) { q = 0x800000u; e += 1; }
  if (e >= 255) { return bitcast<f32>(sign | 0x7f800000u); }
  return bitcast<f32>(sign | (u32(e) << 23u) | (q & 0x7fffffu));
}

fn penalize(x: f32, flag: u32) -> f32 {
  if (flag == 0u) { return x; }
  if (x < 0.0) { return x * p.penalty; }
  return div_exact(x, p.penalty);
}

// The processed logits of the row's vec4 q: penalty (when PENALIZE), EOS banned (when BAN and the
// row is below min_new tokens), then temperature (when SCALE).
fn processed(q: u32) -> vec4<f32> {
  var v = logits[row * p.v4 + q];
  var s = vec4<u32>(0u);
  if (PENALIZE != 0u || BAN != 0u) { s = seen[row * p.v4 + q]; }  // read only when used
  if (PENALIZE != 0u) {
    let f = s & vec4<u32>(SEEN);
    v = vec4<f32>(penalize(v.x, f.x), penalize(v.y, f.y), penalize(v.z, f.z), penalize(v.w, f.w));
  }
  if (BAN != 0u && row_state[FIELDS * row + COUNT] < p.min_new) {
    var neg_inf_bits = 0xff800000u;  // not a constant: WGSL's constant evaluation refuses infinities
    let neg_inf = bitcast<f32>(neg_inf_bits);
    v = select(v, vec4<f32>(neg_inf), (s & vec4<u32>(EOS)) != vec4<u32>(0u));
  }
  if (SCALE != 0u) {
    let d = p.temperature;
    v = vec4<f32>(div_exact(v.x, d), div_exact(v.y, d), div_exact(v.z, d), div_exact(v.w, d));
  }
  return v;
}

// Order-preserving u32 keys of floats: -0 as +0, NaN as the largest.
fn key4(v: vec4<f32>) -> vec4<u32> {
  let b0 = bitcast<vec4<u32>>(v);
  let mag = b0 & vec4<u32>(0x7fffffffu);
  let b = select(b0, vec4<u32>(0u), mag == vec4<u32>(0u));
  let k = select(b | vec4<u32>(0x80000000u), ~b, (b & vec4<u32>(0x80000000u)) != vec4<u32>(0u));
  return select(k, vec4<u32>(NONE), mag > vec4<u32>(0x7f800000u));
}

fn value_of(k: u32) -> f32 {
  return bitcast<f32>(select(~k, k & 0x7fffffffu, (k & 0x80000000u) != 0u));
}

// Which lanes of vec4 q are token ids (< V).
fn valid4(q: u32) -> vec4<bool> {
  return vec4<u32>(q * 4u) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(p.vocab);
}

// exp(x) for x <= 0 to about 1 ulp (Cody-Waite reduction and a degree-7 polynomial, as
// Cephes' expf); 0 below -87.3 (a probability under 1e-38 of the largest) and for NaN.
// WGSL's exp may be off by 3 + 2|x| ulp.
fn exp4(x: vec4<f32>) -> vec4<f32> {
  let xc = max(x, vec4<f32>(-87.5));
  let n = floor(xc * 1.44269504088896341 + 0.5);
  let r = (xc - n * 0.693359375) - n * -2.12194440e-4;
  var y = vec4<f32>(1.9875691500e-4);
  y = y * r + 1.3981999507e-3;
  y = y * r + 8.3334519073e-3;
  y = y * r + 4.1665795894e-2;
  y = y * r + 1.6666665459e-1;
  y = y * r + 5.0000001201e-1;
  y = y * (r * r) + r + 1.0;
  return select(ldexp(y, vec4<i32>(n)), vec4<f32>(0.0), !(x >= vec4<f32>(-87.3)));  // NaN (-inf - -inf) too
}

// ---------------------------------------------------------------------------------------
// The counter-based random number generator (uniform() in sampling.py is the same)

fn pcg(v: u32) -> u32 {
  let s = v * 747796405u + 2891336453u;
  let w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
  return (w >> 22u) ^ w;
}

// A uniform float in [0, 1) with 24 random bits, from (seed, count).
fn uniform01(seed: u32, count: u32) -> f32 {
  let h = pcg(pcg(count) ^ pcg(seed ^ 0x5bd1e995u));
  return f32(h >> 8u) * (1.0 / 16777216.0);
}

// ---------------------------------------------------------------------------------------
// The advance (one thread of the last launch, for a row that has not finished)

fn advance(token: u32) {
  if (lengths[row] == 0u) { return; }
  let count = state[FIELDS * row + COUNT];
  if (count < p.history_len) { history[row * p.history_len + count] = token; }
  let at = row * 4u * p.v4 + token;
  let flags = seen_flags[at];
  seen_flags[at] = flags | SEEN;
  next_token[row] = token;
  state[FIELDS * row + COUNT] = count + 1u;
  if ((flags & EOS) != 0u || count + 1u >= state[FIELDS * row + LIMIT]) {
    lengths[row] = 0u;
  } else {
    starts[row] = lengths[row];
    lengths[row] = lengths[row] + 1u;
  }
}

// ---------------------------------------------------------------------------------------
// Greedy

var<workgroup> best_key: array<u32, WG>;
var<workgroup> best_id: array<u32, WG>;

// (key, id) pairs: the larger key wins, then the smaller id.
fn better(k1: u32, i1: u32, k2: u32, i2: u32) -> bool {
  return k1 > k2 || (k1 == k2 && i1 < i2);
}

fn reduce_best(t: u32, k: u32, i: u32) {
  best_key[t] = k;
  best_id[t] = i;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s >>= 1u) {
    if (t < s && better(best_key[t + s], best_id[t + s], best_key[t], best_id[t])) {
      best_key[t] = best_key[t + s];
      best_id[t] = best_id[t + s];
    }
    workgroupBarrier();
  }
}

@compute @workgroup_size(WG)
fn greedy_partial(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(wg);
  if (row_lengths[wg.y] == 0u) { return; }  // a finished row
  let begin = wg.x * p.chunk;
  let end = min(begin + p.chunk, p.v4);
  var bk = 0u;  // no token's key is 0 (-NaN counts as the largest)
  var bi = NONE;
  for (var q = begin + t; q < end; q += WG) {
    let k = select(vec4<u32>(0u), key4(processed(q)), valid4(q));
    // ids increase along a thread's loads: the first of equal keys stays
    if (k.x > bk) { bk = k.x; bi = 4u * q; }
    if (k.y > bk) { bk = k.y; bi = 4u * q + 1u; }
    if (k.z > bk) { bk = k.z; bi = 4u * q + 2u; }
    if (k.w > bk) { bk = k.w; bi = 4u * q + 3u; }
  }
  reduce_best(t, bk, bi);
  if (t == 0u) { scratch[aux_at() + wg.x] = vec4<u32>(best_key[0], best_id[0], 0u, 0u); }
}

@compute @workgroup_size(WG)
fn greedy_final(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(wg);
  var bk = 0u;
  var bi = NONE;
  for (var w = t; w < p.groups; w += WG) {
    let e = scratch[aux_at() + w];
    if (better(e.x, e.y, bk, bi)) { bk = e.x; bi = e.y; }
  }
  reduce_best(t, bk, bi);
  if (t == 0u) { advance(min(best_id[0], p.vocab - 1u)); }
}

// ---------------------------------------------------------------------------------------
// top_k / top_p: the search

var<workgroup> red: array<vec4<f32>, 4u * WG>;
var<workgroup> red1: array<f32, WG>;
var<workgroup> red_key: array<u32, WG>;

// The largest of every thread's `k` (all threads return it).
fn max_key(t: u32, k: u32) -> u32 {
  red_key[t] = k;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s >>= 1u) {
    if (t < s) { red_key[t] = max(red_key[t], red_key[t + s]); }
    workgroupBarrier();
  }
  let top = red_key[0];
  workgroupBarrier();  // red_key may be written again next
  return top;
}

// The 16 candidates of interval [lo, hi], 4 from j0: lo + (j + 1) * stride, stride =
// span / 17 + 1 (offsets past the span are clamped to hi, and ignored when folded).
fn offsets(lo: u32, hi: u32, j0: u32) -> vec4<u32> {
  let stride = (hi - lo) / 17u + 1u;
  return (vec4<u32>(1u, 2u, 3u, 4u) + vec4<u32>(j0)) * stride;  // < 2^32: 16 * (2^32 / 17 + 1)
}

fn candidates(lo: u32, hi: u32, j0: u32) -> vec4<u32> {
  return vec4<u32>(lo) + min(offsets(lo, hi, j0), vec4<u32>(hi - lo));
}

// Narrow (nlo, nhi) by candidates j0..j0+3 of [lo, hi] whose F is `f`: F >= goal keeps
// the threshold at or above the candidate, F < goal puts it below.
fn fold(n: vec2<u32>, lo: u32, hi: u32, j0: u32, f: vec4<f32>, goal: f32) -> vec2<u32> {
  let off = offsets(lo, hi, j0);
  let c = vec4<u32>(lo) + off;
  let live = off <= vec4<u32>(hi - lo);
  let ok = f >= vec4<f32>(goal);
  let up = select(vec4<u32>(n.x), c, live & ok);
  let down = select(vec4<u32>(n.y), c - vec4<u32>(1u), live & !ok);
  return vec2<u32>(max(n.x, max(max(up.x, up.y), max(up.z, up.w))),
                   min(n.y, min(min(down.x, down.y), min(down.z, down.w))));
}

// The state of the previous pass (lo, hi, max bits, total bits). Pass 1 searched all keys
// and left the per-workgroup maxima: pass 2 takes their maximum (all threads call this).
fn previous_state(t: u32) -> vec4<u32> {
  if (p.pass_index == 2u) {
    var mk = 0u;
    for (var w = t; w < p.groups; w += WG) { mk = max(mk, scratch[aux_at() + w].x); }
    let top = max_key(t, mk);
    return vec4<u32>(0u, NONE, bitcast<u32>(value_of(top)), 0u);
  }
  return scratch[state_at() + ((p.pass_index - 1u) & 1u)];
}

// This pass's state: the previous pass's partial sums folded into its interval. Every
// workgroup computes the same values in the same order (a tree over workgroups). Pass 2
// rescales pass 1's top_p sums from each workgroup's max to the global one, and takes the
// total from them. MODE 2's pass PASSES + 1 starts the top-p search above T_k (below).
fn current_state(t: u32, prev: vec4<u32>) -> vec4<u32> {
  let top = bitcast<f32>(prev.z);
  // thread t loads workgroup t's sums (groups <= WG): independent loads, one round trip
  var f0 = vec4<f32>(0.0);
  var f1 = vec4<f32>(0.0);
  var f2 = vec4<f32>(0.0);
  var f3 = vec4<f32>(0.0);
  var f4 = 0.0;
  if (t < p.groups) {
    let at = partials_at(p.pass_index - 1u) + 10u * t;
    f0 = bitcast<vec4<f32>>(scratch[at]);
    f1 = bitcast<vec4<f32>>(scratch[at + 1u]);
    f2 = bitcast<vec4<f32>>(scratch[at + 2u]);
    f3 = bitcast<vec4<f32>>(scratch[at + 3u]);
    f4 = bitcast<f32>(scratch[at + 4u].x);
    if (MODE == 1u && p.pass_index == 2u) {
      let scale = exp4(vec4<f32>(value_of(scratch[aux_at() + t].x) - top)).x;
      f0 *= scale;
      f1 *= scale;
      f2 *= scale;
      f3 *= scale;
      f4 *= scale;
    }
  }
  sum_over_threads(t, f0, f1, f2, f3, f4);
  let s0 = red[0];
  let s1 = red[WG];
  let s2 = red[2u * WG];
  let s3 = red[3u * WG];
  let everything = red1[0];  // F(lo)
  workgroupBarrier();  // red is written again next
  var total = bitcast<f32>(prev.w);
  if (p.pass_index == 2u) { total = everything; }  // pass 1's F(lo) summed every token's weight
  var goal = f32(p.top_k);
  if (!counts(p.pass_index - 1u)) { goal = p.top_p * total; }
  let lo = prev.x;
  let hi = prev.y;
  var n = vec2<u32>(lo, hi);
  n = fold(n, lo, hi, 0u, s0, goal);
  n = fold(n, lo, hi, 4u, s1, goal);
  n = fold(n, lo, hi, 8u, s2, goal);
  n = fold(n, lo, hi, 12u, s3, goal);
  if (MODE == 2u && p.pass_index == PASSES + 1u) {  // T_k found: top-p over [T_k, all], its mass the total
    let mass = kept_sums(t, prev, n.x, 5u);
    return vec4<u32>(n.x, NONE, prev.z, bitcast<u32>(mass));
  }
  return vec4<u32>(n.x, n.y, prev.z, bitcast<u32>(total));
}

// Which of the previous pass's candidates (16: its lo) the final threshold is.
fn candidate_index(prev: vec4<u32>, threshold: u32) -> u32 {
  if (threshold == prev.x) { return 16u; }
  return (threshold - prev.x) / ((prev.y - prev.x) / 17u + 1u) - 1u;
}

// The previous pass's per-workgroup sums at the final `threshold` (`at`: 0 the tallies, 5 the
// mass): the value of workgroup t (0 for t >= groups), and in red1[0] their total, which every
// thread returns (all threads call this).
fn kept_sums(t: u32, prev: vec4<u32>, threshold: u32, at: u32) -> f32 {
  let c = candidate_index(prev, threshold);
  var v = 0.0;
  if (t < p.groups) {
    v = bitcast<vec4<f32>>(scratch[partials_at(p.pass_index - 1u) + at + c / 4u + 10u * t])[c & 3u];
  }
  let zero = vec4<f32>(0.0);
  sum_over_threads(t, zero, zero, zero, zero, v);
  let total = red1[0];
  workgroupBarrier();  // red1 is written again next
  return total;
}

var<private> cand0: vec4<u32>;
var<private> cand1: vec4<u32>;
var<private> cand2: vec4<u32>;
var<private> cand3: vec4<u32>;
var<private> cand_lo: u32;
var<private> acc0: vec4<f32>;  // F: count (top_k) or mass (top_p)
var<private> acc1: vec4<f32>;
var<private> acc2: vec4<f32>;
var<private> acc3: vec4<f32>;
var<private> acc_lo: f32;
var<private> mass0: vec4<f32>;  // top_k's last pass: the mass too
var<private> mass1: vec4<f32>;
var<private> mass2: vec4<f32>;
var<private> mass3: vec4<f32>;
var<private> mass_lo: f32;

fn start_tally(lo: u32, hi: u32) {
  cand0 = candidates(lo, hi, 0u);
  cand1 = candidates(lo, hi, 4u);
  cand2 = candidates(lo, hi, 8u);
  cand3 = candidates(lo, hi, 12u);
  cand_lo = lo;
  acc0 = vec4<f32>(0.0);
  acc1 = vec4<f32>(0.0);
  acc2 = vec4<f32>(0.0);
  acc3 = vec4<f32>(0.0);
  acc_lo = 0.0;
  mass0 = vec4<f32>(0.0);
  mass1 = vec4<f32>(0.0);
  mass2 = vec4<f32>(0.0);
  mass3 = vec4<f32>(0.0);
  mass_lo = 0.0;
}

fn tally(k: u32, w: f32) {
  let kk = vec4<u32>(k);
  let ww = vec4<f32>(w);
  let zero = vec4<f32>(0.0);
  acc0 += select(zero, ww, kk >= cand0);
  acc1 += select(zero, ww, kk >= cand1);
  acc2 += select(zero, ww, kk >= cand2);
  acc3 += select(zero, ww, kk >= cand3);
  acc_lo += select(0.0, w, k >= cand_lo);
}

fn tally_mass(k: u32, w: f32) {
  let kk = vec4<u32>(k);
  let ww = vec4<f32>(w);
  let zero = vec4<f32>(0.0);
  mass0 += select(zero, ww, kk >= cand0);
  mass1 += select(zero, ww, kk >= cand1);
  mass2 += select(zero, ww, kk >= cand2);
  mass3 += select(zero, ww, kk >= cand3);
  mass_lo += select(0.0, w, k >= cand_lo);
}

// Tally vec4 q of z: weight 1 (counts) or exp(z - top) (mass); also the mass when `both`.
fn tally4(q: u32, v: vec4<f32>, top: f32, both: bool) {
  let k = key4(v);
  let ok = valid4(q);
  let mass = !counts(p.pass_index);
  var e = vec4<f32>(0.0);
  if (mass || both) { e = select(vec4<f32>(0.0), exp4(v - top), ok); }
  var w = select(vec4<f32>(0.0), vec4<f32>(1.0), ok);
  if (mass) { w = e; }
  tally(k.x, w.x);
  tally(k.y, w.y);
  tally(k.z, w.z);
  tally(k.w, w.w);
  if (both) {
    tally_mass(k.x, e.x);
    tally_mass(k.y, e.y);
    tally_mass(k.z, e.z);
    tally_mass(k.w, e.w);
  }
}

// Sum 4 vec4s and a float over the workgroup's threads (a tree; all threads call this):
// the sums land in red[0], red[WG], red[2 WG], red[3 WG] and red1[0].
fn sum_over_threads(t: u32, a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>, a4: f32) {
  red[t] = a0;
  red[WG + t] = a1;
  red[2u * WG + t] = a2;
  red[3u * WG + t] = a3;
  red1[t] = a4;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s >>= 1u) {
    if (t < s) {
      red[t] += red[t + s];
      red[WG + t] += red[WG + t + s];
      red[2u * WG + t] += red[2u * WG + t + s];
      red[3u * WG + t] += red[3u * WG + t + s];
      red1[t] += red1[t + s];
    }
    workgroupBarrier();
  }
}

// The same, stored at slots `at`..`at`+4 of the scratch.
fn store_sums(t: u32, at: u32, a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>, a4: f32) {
  sum_over_threads(t, a0, a1, a2, a3, a4);
  if (t < 4u) { scratch[at + t] = bitcast<vec4<u32>>(red[t * WG]); }
  if (t == 4u) { scratch[at + 4u] = bitcast<vec4<u32>>(vec4<f32>(red1[0], 0.0, 0.0, 0.0)); }
  workgroupBarrier();  // red may be written again next
}

@compute @workgroup_size(WG)
fn search_first(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(wg);
  if (row_lengths[wg.y] == 0u) { return; }  // a finished row
  let begin = wg.x * p.chunk;
  let end = min(begin + p.chunk, p.v4);
  let zrow = row * p.v4;
  var mk = 0u;
  for (var q = begin + t; q < end; q += WG) {
    let v = processed(q);
    z_out[zrow + q] = v;
    let k = select(vec4<u32>(0u), key4(v), valid4(q));
    mk = max(mk, max(max(k.x, k.y), max(k.z, k.w)));
  }
  let top_key = max_key(t, mk);
  if (t == 0u) { scratch[aux_at() + wg.x] = vec4<u32>(top_key, 0u, 0u, 0u); }
  let top = value_of(top_key);
  start_tally(0u, NONE);
  for (var q = begin + t; q < end; q += WG) { tally4(q, z_out[zrow + q], top, false); }  // this thread's own writes
  store_sums(t, partials_at(1u) + 10u * wg.x, acc0, acc1, acc2, acc3, acc_lo);
}

@compute @workgroup_size(WG)
fn search(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(wg);
  if (row_lengths[wg.y] == 0u) { return; }  // a finished row
  let st = current_state(t, previous_state(t));
  if (wg.x == 0u && t == 0u) { scratch[state_at() + (p.pass_index & 1u)] = st; }
  let lo = st.x;
  let hi = st.y;
  let top = bitcast<f32>(st.z);
  let last = p.pass_index % PASSES == 0u;  // the last pass of a search
  let both = counts(p.pass_index) && last;  // the top-k search's last pass also sums the mass
  start_tally(lo, hi);
  let begin = wg.x * p.chunk;
  var end = min(begin + p.chunk, p.v4);
  if (lo == hi && !last) { end = begin; }  // converged: nothing left to count until the last pass
  let zrow = row * p.v4;
  for (var q = begin + t; q < end; q += 2u * WG) {  // two loads in flight
    let q2 = q + WG;
    let a = z[zrow + q];
    let b = z[zrow + min(q2, end - 1u)];
    tally4(q, a, top, both);
    if (q2 < end) { tally4(q2, b, top, both); }
  }
  let at = partials_at(p.pass_index) + 10u * wg.x;
  store_sums(t, at, acc0, acc1, acc2, acc3, acc_lo);
  if (both) { store_sums(t, at + 5u, mass0, mass1, mass2, mass3, mass_lo); }
}

// ---------------------------------------------------------------------------------------
// top_k / top_p: draw

var<workgroup> level_v: array<f32, WG>;
var<workgroup> level_g: array<f32, WG / 8u>;
var<workgroup> lanes: array<vec4<f32>, WG>;

// One level of the descent: every thread's value, and sequential sums of groups of 8.
fn level(t: u32, v: f32) {
  level_v[t] = v;
  workgroupBarrier();
  if (t < WG / 8u) {
    var s = 0.0;
    for (var i = 0u; i < 8u; i++) { s += level_v[8u * t + i]; }
    level_g[t] = s;
  }
  workgroupBarrier();
}

fn level_total() -> f32 {
  var s = 0.0;
  for (var g = 0u; g < WG / 8u; g++) { s += level_g[g]; }
  return s;
}

struct Pick {
  index: u32,     // NONE when every value is 0
  residual: f32,  // what is left of the goal inside the picked entry
}

// The first entry of the level whose running sum exceeds `goal` (the last positive one
// when none does, a rounding difference between levels), group by group.
fn pick(goal: f32) -> Pick {
  var run = 0.0;
  var chosen = NONE;
  var before = 0.0;
  var done = false;
  for (var g = 0u; g < WG / 8u; g++) {
    let v = level_g[g];
    if (!done && v > 0.0) {
      chosen = g;
      before = run;
      run += v;
      done = run > goal;
    }
  }
  if (chosen == NONE) { return Pick(NONE, goal); }
  let r = goal - before;
  let g0 = 8u * chosen;
  run = 0.0;
  chosen = NONE;
  before = 0.0;
  done = false;
  for (var i = 0u; i < 8u; i++) {
    let v = level_v[g0 + i];
    if (!done && v > 0.0) {
      chosen = g0 + i;
      before = run;
      run += v;
      done = run > r;
    }
  }
  return Pick(chosen, r - before);
}

// The same over the 4 lanes of a vec4.
fn pick_lane(e: vec4<f32>, goal: f32) -> u32 {
  var lane = NONE;
  var run = 0.0;
  var done = false;
  if (e.x > 0.0) { lane = 0u; run += e.x; done = run > goal; }
  if (!done && e.y > 0.0) { lane = 1u; run += e.y; done = run > goal; }
  if (!done && e.z > 0.0) { lane = 2u; run += e.z; done = run > goal; }
  if (!done && e.w > 0.0) { lane = 3u; }
  return lane;
}

@compute @workgroup_size(WG)
fn draw(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(wg);
  // the last fold: T is the last pass's lo or one of its candidates, c
  let prev = previous_state(t);
  let st = current_state(t, prev);
  if (t == 0u) { scratch[state_at() + (p.pass_index & 1u)] = st; }  // for inspection
  let threshold = st.x;
  let top = bitcast<f32>(st.z);
  let c = candidate_index(prev, threshold);
  // level 1: the blocks, the last pass's workgroups, with their kept mass at T
  let at = partials_at(p.pass_index - 1u) + select(0u, 5u, counts(p.pass_index - 1u)) + c / 4u;
  var v = 0.0;
  if (t < p.groups) { v = bitcast<vec4<f32>>(scratch[at + 10u * t])[c & 3u]; }
  level(t, v);
  let u = uniform01(state[FIELDS * row + SEED], state[FIELDS * row + COUNT]);
  let block = pick(u * level_total());
  var residual = block.residual;
  let begin = select(block.index, 0u, block.index == NONE) * p.chunk;
  let end = min(begin + p.chunk, p.v4);
  workgroupBarrier();  // the level arrays are written again next
  // levels 2 and 3: the block's vec4s, WG at a time, then the 4 lanes of the chosen one
  var token = NONE;
  var last = NONE;
  let tiles = (p.chunk + WG - 1u) / WG;
  for (var i = 0u; i < tiles; i++) {
    let q0 = begin + i * WG;
    let q = q0 + t;
    var e = vec4<f32>(0.0);
    if (q < end) {
      let v4 = z_draw[row * p.v4 + q];
      e = select(vec4<f32>(0.0), exp4(v4 - top), valid4(q) & (key4(v4) >= vec4<u32>(threshold)));
    }
    lanes[t] = e;
    level(t, ((e.x + e.y) + e.z) + e.w);
    if (token == NONE) {
      let total = level_total();
      if (residual < total) {
        let th = pick(residual);
        if (th.index != NONE) { token = 4u * (q0 + th.index) + pick_lane(lanes[th.index], th.residual); }
      } else if (total > 0.0) {
        residual -= total;
        let th = pick(3.4e38);
        last = 4u * (q0 + th.index) + pick_lane(lanes[th.index], 3.4e38);
      }
    }
    workgroupBarrier();
  }
  if (token == NONE) { token = last; }
  if (token >= p.vocab) { token = 0u; }  // only non-finite logits get here
  if (t == 0u) { advance(token); }
}
