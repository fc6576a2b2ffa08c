// Backward of the causal grouped-query attention of attention.wgsl, float32, flash-attention-2
// style: the probabilities are recomputed from the forward's lse, never stored.
//   for sequence b, query token i at position pos + i, query head h, KV head g = h / R, keys
//   j <= lim = min(pos + i, len_b - 1)   (pos = STARTS[b], len_b = LENS[b] clamped to 1..S) and, in
//   a packed pass (dq, dkdv with PACKED: several examples in a row), j >= pos + i - POS[b*T + i]
//   (the first key of the query's own example):
//   P_ij  = exp(scale * q_i·k_j - lse_i)          D_i  = dO_i·O_i            (row_dot)
//   dP_ij = dO_i·v_j                               dS_ij = P_ij (dP_ij - D_i)
//   dQ_i  = scale * sum_j dS_ij k_j                                           (dq)
//   dV_j  = sum_i P_ij dO_i     dK_j = scale * sum_i dS_ij q_i                (dkdv)
// dK and dV of a KV head sum over the R query heads of its group and every query of the pass.
// Layouts (vec4 arrays, D4 = head_dim / 4): Q, O, DOUT, DQ [B*T, H, D4]; K, V, DK, DV
// [B, KVH, S, D4]; LSE, DR [B*T, H]. As in attention.wgsl, the T*R (query, head-of-the-group)
// pairs of one (b, g) are rows m = i*R + r (head h = g*R + r).
//
// Entry points (no binding aliases: each uses a subset of the bindings below):
//   row_dot  D_i = dO_i·O_i for every row: RL lanes per row, RW threads a workgroup.
//   dq       one workgroup per (block of BQ rows, KV head, sequence); loops over key tiles of
//            BK keys from the block's first key (0, or packed, its first row's example's first)
//            up to its last key (heaviest blocks launch first).
//   dkdv     one workgroup per (block of BK keys starting at pos, KV head, sequence, split);
//            loops over tiles of BQ rows: every query of the pass that sees the block (queries
//            from the block's first key on), all R heads of the group, cut into SPLITS
//            contiguous ranges of tiles. No atomics: with SPLITS = 1 a key's dK/dV is summed by
//            the one workgroup that owns it; with more, each split writes its partial sums to
//            its own slice of DK, DV (then scratch) and dkdv_sum adds the slices (a block of
//            keys has up to T·R / BQ tiles: one workgroup walking them all leaves most of a
//            GPU idle at training lengths). Key positions >= len_b get zeros.
//   dkdv_sum the SPLITS partial slices (DK_PART, DV_PART) summed into DK, DV.
//
// Both tile kernels share the tile step. Workgroup memory holds BQ rows of q and dO and BK rows
// of k and v (rows padded to D4+1 vec4s against bank conflicts). Per tile:
//   1. load the looped operand (dq: k/v tile; dkdv: q/dO tile, lse, D, row limits, first keys);
//      barrier
//   2. scores: a unit computes a 4-row x 4-key block of S = q·k and dP = dO·v (rows rq + RB*n,
//      keys kq + KB*n) over one of KL lane slices of the head dim -> SP; barrier
//   3. per (row, key quad): sum the lanes, P = exp2(S * scale*log2e - lse*log2e), dS, masked
//      with select (a masked key contributes exactly 0) -> Pm / dSm; barrier
//   4. accumulate: dkdv thread (kq, ct) holds keys kq + KB*n x columns ct, ct + CT of dK and dV
//      (16 vec4 registers); dq thread (rq, ct) rows rq + RB*n x the same columns of dQ (8).
//      barrier (the next tile overwrites what this one read)
// Cache rows at or past len_b are never read (loads clamp to the last valid key).

struct Params {
  batch: u32,     // B
  tokens: u32,    // T: queries per sequence in this pass
  kv_heads: u32,  // KVH
  max_len: u32,   // S: key rows per (b, g) in the caches and dK/dV
  scale: f32,     // softmax scale (head_dim ** -0.5)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> STARTS: array<u32>;
@group(0) @binding(2) var<storage, read> LENS: array<u32>;
@group(0) @binding(3) var<storage, read> Q: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> K: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> V: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> DOUT: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read> LSE: array<f32>;
@group(0) @binding(8) var<storage, read> DR: array<f32>;
@group(0) @binding(9) var<storage, read_write> DQ: array<vec4<f32>>;
@group(0) @binding(10) var<storage, read_write> DK: array<vec4<f32>>;
@group(0) @binding(11) var<storage, read_write> DV: array<vec4<f32>>;
@group(0) @binding(12) var<storage, read> O: array<vec4<f32>>;
@group(0) @binding(13) var<storage, read_write> DR_OUT: array<f32>;
@group(0) @binding(14) var<storage, read> DK_PART: array<vec4<f32>>;
@group(0) @binding(15) var<storage, read> DV_PART: array<vec4<f32>>;
@group(0) @binding(16) var<storage, read> POS: array<u32>;  // dq, dkdv with PACKED: [B*T] position ids

override D4: u32 = 32u;  // head_dim / 4
override R: u32 = 1u;    // query heads per KV head
override SPLITS: u32 = 1u;  // dkdv, dkdv_sum: ranges of query tiles a key block's work is cut into
override PACKED: bool = false;  // dq, dkdv: queries see their own example's keys only (POS)

const LOG2E: f32 = 1.4426950408889634;

fn seq_len(b: u32) -> u32 {
  return clamp(LENS[b], 1u, p.max_len);
}

// The first key query i of sequence b (at pos + i) sees in a packed pass: its example's first.
fn example_first(b: u32, i: u32, pos: u32) -> u32 {
  return pos + i - min(POS[b * p.tokens + i], pos + i);
}

// Index of (b, row m of KV head g) in the [B*T, H] row layouts.
fn row_id(b: u32, g: u32, m: u32) -> u32 {
  return (b * p.tokens + m / R) * (p.kv_heads * R) + g * R + m % R;
}

// ---------------------------------------------------------------------------------------------
// row_dot: thread (row, lane) sums lanes lane, lane + RL, ... of the row's dO·O; lane 0 adds
// the RL partials. The grid may be 2-D (rows past the end do nothing).
override RL: u32 = 8u;    // lanes per row
override RW: u32 = 256u;  // threads per workgroup, a multiple of RL

var<workgroup> rdRed: array<f32, RW>;

@compute @workgroup_size(RW)
fn row_dot(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>,
           @builtin(num_workgroups) nwg: vec3<u32>) {
  let rows = p.batch * p.tokens * p.kv_heads * R;
  let row = (wg.y * nwg.x + wg.x) * (RW / RL) + t / RL;
  let lane = t % RL;
  var s = 0.0;
  if (row < rows) {
    for (var c = lane; c < D4; c += RL) {
      s += dot(O[row * D4 + c], DOUT[row * D4 + c]);
    }
  }
  rdRed[t] = s;
  workgroupBarrier();
  if (lane == 0u && row < rows) {
    var total = 0.0;
    for (var l = 0u; l < RL; l++) { total += rdRed[t + l]; }
    DR_OUT[row] = total;
  }
}

// ---------------------------------------------------------------------------------------------
// The tile kernels.
override BQ: u32 = 16u;  // rows in workgroup memory (dq: the block; dkdv: a tile), a multiple of 4
override BK: u32 = 16u;  // keys in workgroup memory (dq: a tile; dkdv: the block), a multiple of 4
override KL: u32 = 4u;   // lanes splitting the head dim in the score phase
override CT: u32 = 16u;  // column threads: (D4 + 1) / 2, each owns columns ct and ct + CT
override NT: u32 = 64u;  // threads: dq (BQ / 4) * CT, dkdv (BK / 4) * CT
override RB: u32 = BQ / 4u;
override KB: u32 = BK / 4u;
override QST: u32 = D4 + 1u;            // padded row stride (vec4s)
override DH: u32 = (D4 + KL - 1u) / KL;  // head-dim columns per score lane

var<workgroup> Qs: array<vec4<f32>, BQ * (D4 + 1u)>;
var<workgroup> dOs: array<vec4<f32>, BQ * (D4 + 1u)>;
var<workgroup> Ks: array<vec4<f32>, BK * (D4 + 1u)>;
var<workgroup> Vs: array<vec4<f32>, BK * (D4 + 1u)>;
var<workgroup> SP: array<vec4<f32>, KL * 2u * BQ * (BK / 4u)>;  // [lane][S, dP][row][key quad]
var<workgroup> Pm: array<vec4<f32>, BQ * (BK / 4u)>;            // dkdv: [row][key quad] over keys kq + KB*n
var<workgroup> dSm: array<vec4<f32>, BQ * (BK / 4u)>;           // dkdv: as Pm; dq: [key][row quad] over rows rq + RB*n
var<workgroup> RowL: array<f32, BQ>;  // lse * log2(e)
var<workgroup> RowD: array<f32, BQ>;  // D
var<workgroup> RowN: array<u32, BQ>;  // the row sees keys j < RowN (0 for rows past the end)
var<workgroup> RowF: array<u32, BQ>;  // PACKED: and keys j >= RowF

// Rows row0 .. row0+BQ-1 of (b, g): q, dO, lse, D and key limits into workgroup memory.
fn load_rows(t: u32, b: u32, g: u32, row0: u32, rows: u32, pos: u32, len: u32) {
  for (var idx = t; idx < BQ * D4; idx += NT) {
    let r = idx / D4;
    let c = idx % D4;
    let src = row_id(b, g, min(row0 + r, rows - 1u)) * D4 + c;  // rows past the end repeat the last
    let x = Q[src];
    let y = DOUT[src];
    Qs[r * QST + c] = x;
    dOs[r * QST + c] = y;
  }
  for (var r = t; r < BQ; r += NT) {
    let m = row0 + r;
    let id = row_id(b, g, min(m, rows - 1u));
    RowL[r] = LSE[id] * LOG2E;
    RowD[r] = DR[id];
    RowN[r] = select(0u, min(pos + m / R, len - 1u) + 1u, m < rows);
    if (PACKED) { RowF[r] = example_first(b, min(m, rows - 1u) / R, pos); }
  }
}

// Keys k0 .. k0+BK-1 of the cache rows from kvbase into workgroup memory (past `last`: repeats).
fn load_keys(t: u32, kvbase: u32, k0: u32, last: u32) {
  for (var idx = t; idx < BK * D4; idx += NT) {
    let r = idx / D4;
    let c = idx % D4;
    let src = (kvbase + min(k0 + r, last)) * D4 + c;
    let x = K[src];
    let y = V[src];
    Ks[r * QST + c] = x;
    Vs[r * QST + c] = y;
  }
}

// Step 2: lane slices of the 4x4 blocks of S and dP -> SP.
fn tile_scores(t: u32) {
  let blocks = RB * KB;
  let rst = RB * QST;
  let kst = KB * QST;
  for (var u = t; u < blocks * KL; u += NT) {
    let lane = u / blocks;
    let rq = (u % blocks) / KB;
    let kq = u % KB;
    let qa = rq * QST;
    let ka = kq * QST;
    let d_lo = lane * DH;
    let d_hi = min(d_lo + DH, D4);
    var s0 = vec4<f32>(0.0); var s1 = vec4<f32>(0.0); var s2 = vec4<f32>(0.0); var s3 = vec4<f32>(0.0);
    var e0 = vec4<f32>(0.0); var e1 = vec4<f32>(0.0); var e2 = vec4<f32>(0.0); var e3 = vec4<f32>(0.0);
    for (var d = d_lo; d < d_hi; d++) {
      let q0 = Qs[qa + d]; let q1 = Qs[qa + rst + d]; let q2 = Qs[qa + 2u * rst + d]; let q3 = Qs[qa + 3u * rst + d];
      let k0 = Ks[ka + d]; let k1 = Ks[ka + kst + d]; let k2 = Ks[ka + 2u * kst + d]; let k3 = Ks[ka + 3u * kst + d];
      s0 += vec4<f32>(dot(q0, k0), dot(q0, k1), dot(q0, k2), dot(q0, k3));
      s1 += vec4<f32>(dot(q1, k0), dot(q1, k1), dot(q1, k2), dot(q1, k3));
      s2 += vec4<f32>(dot(q2, k0), dot(q2, k1), dot(q2, k2), dot(q2, k3));
      s3 += vec4<f32>(dot(q3, k0), dot(q3, k1), dot(q3, k2), dot(q3, k3));
      let o0 = dOs[qa + d]; let o1 = dOs[qa + rst + d];
      let o2 = dOs[qa + 2u * rst + d]; let o3 = dOs[qa + 3u * rst + d];
      let v0 = Vs[ka + d]; let v1 = Vs[ka + kst + d]; let v2 = Vs[ka + 2u * kst + d]; let v3 = Vs[ka + 3u * kst + d];
      e0 += vec4<f32>(dot(o0, v0), dot(o0, v1), dot(o0, v2), dot(o0, v3));
      e1 += vec4<f32>(dot(o1, v0), dot(o1, v1), dot(o1, v2), dot(o1, v3));
      e2 += vec4<f32>(dot(o2, v0), dot(o2, v1), dot(o2, v2), dot(o2, v3));
      e3 += vec4<f32>(dot(o3, v0), dot(o3, v1), dot(o3, v2), dot(o3, v3));
    }
    let sa = lane * 2u * BQ * KB + rq * KB + kq;  // row rq + RB*n at + n * RB * KB
    let ea = sa + BQ * KB;
    SP[sa] = s0; SP[sa + RB * KB] = s1; SP[sa + 2u * RB * KB] = s2; SP[sa + 3u * RB * KB] = s3;
    SP[ea] = e0; SP[ea + RB * KB] = e1; SP[ea + 2u * RB * KB] = e2; SP[ea + 3u * RB * KB] = e3;
  }
}

struct PD {
  p: vec4<f32>,
  ds: vec4<f32>,
}

// Step 3 for element e = row * KB + kq of the tile whose first key is k0: P and dS of the row
// and keys k0 + kq + KB*n.
fn tile_pds(e: u32, k0: u32) -> PD {
  var s = SP[e];
  var dp = SP[BQ * KB + e];
  for (var l = 1u; l < KL; l++) {
    s += SP[l * 2u * BQ * KB + e];
    dp += SP[(l * 2u + 1u) * BQ * KB + e];
  }
  let r = e / KB;
  let j = k0 + e % KB;
  let keys = vec4<u32>(j, j + KB, j + 2u * KB, j + 3u * KB);
  var ok = keys < vec4<u32>(RowN[r]);
  if (PACKED) { ok = ok & (keys >= vec4<u32>(RowF[r])); }
  let pr = select(vec4<f32>(0.0), exp2(s * (p.scale * LOG2E) - RowL[r]), ok);
  return PD(pr, select(vec4<f32>(0.0), pr * (dp - RowD[r]), ok));
}

// ---------------------------------------------------------------------------------------------
// dq: grid (row blocks, KVH, B); thread (rq, ct).
@compute @workgroup_size(NT)
fn dq(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>,
      @builtin(num_workgroups) nwg: vec3<u32>) {
  let rows = p.tokens * R;
  let g = wg.y;
  let b = wg.z;
  let row0 = (nwg.x - 1u - wg.x) * BQ;  // last blocks (most keys) first
  let pos = STARTS[b];
  let len = seq_len(b);
  let maxlim = min(pos + (min(row0 + BQ, rows) - 1u) / R, len - 1u);  // the block's last key
  let kvbase = (b * p.kv_heads + g) * p.max_len;
  load_rows(t, b, g, row0, rows, pos, len);

  let rq = t / CT;
  let ct = t % CT;
  let c0 = ct;
  let c1 = min(ct + CT, D4 - 1u);  // loads clamp, the store checks
  var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
  var b0 = vec4<f32>(0.0); var b1 = vec4<f32>(0.0); var b2 = vec4<f32>(0.0); var b3 = vec4<f32>(0.0);

  let ntiles = maxlim / BK + 1u;
  var tile0 = 0u;  // the tile of the block's first key
  if (PACKED) { tile0 = example_first(b, row0 / R, pos) / BK; }
  for (var tile = tile0; tile < ntiles; tile++) {
    let k0 = tile * BK;
    load_keys(t, kvbase, k0, maxlim);
    workgroupBarrier();
    tile_scores(t);
    workgroupBarrier();
    for (var e = t; e < BQ * KB; e += NT) {
      let ds = tile_pds(e, k0).ds;
      let r = e / KB;
      let kq = e % KB;
      let at = kq * RB + r % RB;  // key kq + KB*n at + n * KB * RB; row r = rq' + RB * comp
      dSm[at][r / RB] = ds.x;
      dSm[at + KB * RB][r / RB] = ds.y;
      dSm[at + 2u * KB * RB][r / RB] = ds.z;
      dSm[at + 3u * KB * RB][r / RB] = ds.w;
    }
    workgroupBarrier();
    for (var j = 0u; j < BK; j++) {
      let ds = dSm[j * RB + rq];
      let x = Ks[j * QST + c0];
      let y = Ks[j * QST + c1];
      a0 += ds.x * x; a1 += ds.y * x; a2 += ds.z * x; a3 += ds.w * x;
      b0 += ds.x * y; b1 += ds.y * y; b2 += ds.z * y; b3 += ds.w * y;
    }
    workgroupBarrier();
  }

  let sc = p.scale;
  dq_store(b, g, row0 + rq, rows, ct, a0 * sc, b0 * sc);
  dq_store(b, g, row0 + rq + RB, rows, ct, a1 * sc, b1 * sc);
  dq_store(b, g, row0 + rq + 2u * RB, rows, ct, a2 * sc, b2 * sc);
  dq_store(b, g, row0 + rq + 3u * RB, rows, ct, a3 * sc, b3 * sc);
}

fn dq_store(b: u32, g: u32, m: u32, rows: u32, ct: u32, x: vec4<f32>, y: vec4<f32>) {
  if (m >= rows) { return; }
  let base = row_id(b, g, m) * D4;
  if (ct < D4) { DQ[base + ct] = x; }
  if (ct + CT < D4) { DQ[base + ct + CT] = y; }
}

// ---------------------------------------------------------------------------------------------
// dkdv: grid (key blocks, KVH, B · SPLITS); block x owns keys pos + x*BK .. +BK-1; thread (kq, ct).
@compute @workgroup_size(NT)
fn dkdv(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let rows = p.tokens * R;
  let g = wg.y;
  let b = wg.z / SPLITS;
  let split = wg.z % SPLITS;
  let pos = STARTS[b];
  let len = seq_len(b);
  let k0 = pos + wg.x * BK;
  let kvbase = (b * p.kv_heads + g) * p.max_len;
  load_keys(t, kvbase, k0, len - 1u);

  // queries i >= k0 - pos see the block's keys; none does when the block starts past the length
  let first = wg.x * BK * R;
  var ntiles = 0u;
  if (k0 < len && first < rows) { ntiles = (rows - first + BQ - 1u) / BQ; }
  let per = (ntiles + SPLITS - 1u) / SPLITS;  // this split's tiles: [split·per, its end)
  let tiles_end = min(split * per + per, ntiles);

  let kq = t / CT;
  let ct = t % CT;
  let c0 = ct;
  let c1 = min(ct + CT, D4 - 1u);
  var v0 = vec4<f32>(0.0); var v1 = vec4<f32>(0.0); var v2 = vec4<f32>(0.0); var v3 = vec4<f32>(0.0);
  var w0 = vec4<f32>(0.0); var w1 = vec4<f32>(0.0); var w2 = vec4<f32>(0.0); var w3 = vec4<f32>(0.0);
  var k0a = vec4<f32>(0.0); var k1a = vec4<f32>(0.0); var k2a = vec4<f32>(0.0); var k3a = vec4<f32>(0.0);
  var k0b = vec4<f32>(0.0); var k1b = vec4<f32>(0.0); var k2b = vec4<f32>(0.0); var k3b = vec4<f32>(0.0);

  for (var tile = split * per; tile < tiles_end; tile++) {
    let row0 = first + tile * BQ;
    load_rows(t, b, g, row0, rows, pos, len);
    workgroupBarrier();
    tile_scores(t);
    workgroupBarrier();
    for (var e = t; e < BQ * KB; e += NT) {
      let pd = tile_pds(e, k0);
      Pm[e] = pd.p;
      dSm[e] = pd.ds;
    }
    workgroupBarrier();
    for (var r = 0u; r < BQ; r++) {
      let pr = Pm[r * KB + kq];
      let ds = dSm[r * KB + kq];
      let oa = dOs[r * QST + c0];
      let ob = dOs[r * QST + c1];
      let qa = Qs[r * QST + c0];
      let qb = Qs[r * QST + c1];
      v0 += pr.x * oa; v1 += pr.y * oa; v2 += pr.z * oa; v3 += pr.w * oa;
      w0 += pr.x * ob; w1 += pr.y * ob; w2 += pr.z * ob; w3 += pr.w * ob;
      k0a += ds.x * qa; k1a += ds.y * qa; k2a += ds.z * qa; k3a += ds.w * qa;
      k0b += ds.x * qb; k1b += ds.y * qb; k2b += ds.z * qb; k3b += ds.w * qb;
    }
    workgroupBarrier();
  }

  let end = min(pos + p.tokens, p.max_len);  // key positions this pass writes
  let sc = p.scale;
  let base = split * cache_rows() + kvbase;  // this split's slice
  dkdv_store(base, k0 + kq, end, ct, k0a * sc, k0b * sc, v0, w0);
  dkdv_store(base, k0 + kq + KB, end, ct, k1a * sc, k1b * sc, v1, w1);
  dkdv_store(base, k0 + kq + 2u * KB, end, ct, k2a * sc, k2b * sc, v2, w2);
  dkdv_store(base, k0 + kq + 3u * KB, end, ct, k3a * sc, k3b * sc, v3, w3);
}

fn cache_rows() -> u32 {  // rows of D4 vec4s in one [B, KVH, S, D4] cache-shaped buffer
  return p.batch * p.kv_heads * p.max_len;
}

// dkdv_sum: one invocation a vec4 of DK and DV (a 2-D grid of 256-wide workgroups), at this
// pass's key positions only, as dkdv writes them.
@compute @workgroup_size(256)
fn dkdv_sum(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let n = cache_rows() * D4;
  let i = gid.y * nwg.x * 256u + gid.x;
  let j = (i / D4) % p.max_len;
  if (i >= n) { return; }
  let pos = STARTS[(i / D4) / (p.kv_heads * p.max_len)];
  if (j < pos || j >= min(pos + p.tokens, p.max_len)) { return; }
  var k = vec4<f32>(0.0);
  var v = vec4<f32>(0.0);
  for (var s = 0u; s < SPLITS; s++) {
    k += DK_PART[s * n + i];
    v += DV_PART[s * n + i];
  }
  DK[i] = k;
  DV[i] = v;
}

fn dkdv_store(kvbase: u32, j: u32, end: u32, ct: u32, ka: vec4<f32>, kb: vec4<f32>, va: vec4<f32>, vb: vec4<f32>) {
  if (j >= end) { return; }
  let base = (kvbase + j) * D4;  // kvbase: the first row of (b, g) in the split's slice
  if (ct < D4) { DK[base + ct] = ka; DV[base + ct] = va; }
  if (ct + CT < D4) { DK[base + ct + CT] = kb; DV[base + ct + CT] = vb; }
}
