// Causal grouped-query attention over a KV cache, float32 (transformers' eager attention):
//   for sequence b, query token i at position pos + i, query head h, KV head g = h / R:
//   out[b,i,h,:] = softmax_j(scale * q[b,i,h,:]·K[b,g,j,:]) · V[b,g,j,:]
//   over keys j <= lim = min(pos + i, len_b - 1)   (pos = STARTS[b], len_b = LENS[b] in 1..S)
//   and, in a packed pass (prefill with PACKED: several examples in a row), j >= pos + i - POS[b*T + i]
//   (the first key of the query's own example)
//   lse[b,i,h] = log(sum_j exp(scale * q·K_j))      (natural log; for a backward pass)
// Layouts (vec4 arrays, D4 = head_dim / 4): Q and OUT [B*T, H, D4] (token-major, heads inside a
// token), K and V caches [B, KVH, S, D4], LSE [B*T, H]. R = H / KVH query heads share a KV head.
//
// Rows: the T*R (query, head-of-the-group) pairs of one (b, g) are numbered m = i*R + r
// (head h = g*R + r). A workgroup's rows share every K/V tile it loads: queries of the
// block and the R heads of the group alike.
//
// Scores live in the log2 domain: q is multiplied by scale*log2(e) once, so exp() is exp2().
// Masked scores never enter a sum: their probabilities are set to 0 by select(). Every row sees
// at least its own key; until a tile holds one of its keys, its running max stays MASKED and its
// sums 0 (the rescale exp2(MASKED - MASKED) = 1 scales zeros, and the first real max's
// exp2(MASKED - max) = 0 drops them).
//
// Bindings: the entry points alias binding numbers (each pipeline's auto layout holds only the
// variables its entry point uses), so each takes its buffers at bindings 1.. in order.
//
// Entry points:
//   prefill         one workgroup per (block of 4*RG rows, KV head, batch); a loop over
//                   key tiles with an online (flash-attention) softmax, from the tile of the
//                   block's first key (0, or packed, its first row's example's first key) to
//                   its last. Blocks launch last-first: the causal tail (most tiles) starts early.
//   decode_partial  flash-decoding: one workgroup per (key split, 4-row block x KV head,
//                   batch). The key range 0..n-1 of a block is cut into `splits` spans of
//                   ceil(n / splits) keys (rounded up to a tile); a workgroup whose span
//                   starts past n writes neutral partials (zeros, (MASKED, 0)) and exits.
//                   Writes unnormalised partial sums and (max, sum).
//   decode_combine  merges the partials of each row: out = sum_s w_s acc_s / sum_s w_s l_s,
//                   w_s = exp2(m_s - max_s m_s).

struct Params {
  batch: u32,     // B
  tokens: u32,    // T: queries per sequence in this pass
  kv_heads: u32,  // KVH
  max_len: u32,   // S: key rows per (b, g) in the caches
  splits: u32,    // decode: key spans per row block
  lse_out: u32,   // nonzero: write LSE
  scale: f32,     // softmax scale (head_dim ** -0.5)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> STARTS: array<u32>;  // [B]: each sequence's first position
@group(0) @binding(2) var<storage, read> LENS: array<u32>;
// prefill, decode_partial
@group(0) @binding(3) var<storage, read> Q: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> K: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> V: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> O: array<vec4<f32>>;   // decode_partial: partial sums
@group(0) @binding(7) var<storage, read_write> LSE: array<f32>;       // decode_partial: (max, sum) pairs
@group(0) @binding(8) var<storage, read> POS: array<u32>;            // prefill, PACKED: [B*T] position ids
// decode_combine
@group(0) @binding(3) var<storage, read> PO: array<vec4<f32>>;       // [splits, B*T*H, D4]
@group(0) @binding(4) var<storage, read> PML: array<vec2<f32>>;      // [splits, B*T*H]: (max, sum)
@group(0) @binding(5) var<storage, read_write> OUT: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> LSE_OUT: array<f32>;

override D4: u32 = 32u;  // head_dim / 4
override R: u32 = 1u;    // query heads per KV head
override PACKED: bool = false;  // prefill: queries see their own example's keys only (POS)

const LOG2E: f32 = 1.4426950408889634;
const LN2: f32 = 0.6931471805599453;
const MASKED: f32 = -1.0e30;

// Valid keys of sequence b: LENS[b], read as 1 when 0 and as S when larger (no read can leave
// the sequence's cache rows).
fn seq_len(b: u32) -> u32 {
  return clamp(LENS[b], 1u, p.max_len);
}

// The first key query i of sequence b (at pos + i) sees in a packed pass: its example's first.
fn example_first(b: u32, i: u32, pos: u32) -> u32 {
  return pos + i - min(POS[b * p.tokens + i], pos + i);
}

// ---------------------------------------------------------------------------------------------
// prefill: a workgroup owns M = 4*RG rows and has RG*CT*KL threads. Thread (kl, rg, ct) owns
// rows 4rg..4rg+3 and the vec4 columns ct + CT*n (n < 4) of their outputs: 16 vec4
// accumulators in named registers. Its KL key lanes split the head dim in the score phase and
// the tile's keys in the PV phase; their partial outputs are summed once, at the end.
// Per key tile of BK keys:
//   1. K tile -> KVs (rows padded to D4+1 vec4s: column reads of different rows hit different
//      banks; the pad column stays 0), four independent loads in flight per thread; barrier
//   2. scores: 4-row x 4-key blocks (keys kq + KB*n), q and k from workgroup memory, two
//      columns a step, -> Ps[lane][key][row quad] (vec4 over 4 rows); barrier
//   3. row m's softmax by thread m % NT: tile max of the lanes' summed scores, running max and
//      sum (Mrun, Lrun), p = exp2(s - max) -> Ps[0], rescale factor -> As; meanwhile every
//      thread loads the V tile -> KVs; barrier
//   4. PV: acc = acc * alpha + sum_j P[j] V[j] over the lane's keys (one P vec4 serves 4
//      rows, one V vec4 4 rows), two keys a step; barrier (KVs and Ps are rewritten next tile)
override RG: u32 = 8u;   // row quads per workgroup
override CT: u32 = 8u;   // column threads; 4*CT >= D4
override KL: u32 = 1u;   // key lanes; BK % (2*KL) == 0
override BK: u32 = 32u;  // keys per tile, a multiple of 4
override NT: u32 = RG * CT * KL;
override KB: u32 = BK / 4u;
override QST: u32 = D4 + 1u;  // padded row stride of Qs and KVs (vec4s)
override DH: u32 = 2u * ((D4 + 2u * KL - 1u) / (2u * KL));  // score-phase columns per key lane (even)
override TILE: u32 = BK * D4;  // vec4s of one K or V tile

var<workgroup> Qs: array<vec4<f32>, 4u * RG * (D4 + 1u)>;  // after the loop: the lanes' partial outputs
var<workgroup> KVs: array<vec4<f32>, BK * (D4 + 1u)>;
var<workgroup> Ps: array<vec4<f32>, BK * RG * KL>;
var<workgroup> As: array<vec4<f32>, RG>;   // per row: rescale factor, at the end 1 / sum
var<workgroup> Mrun: array<f32, 4u * RG>;  // per row: running max (log2 domain)
var<workgroup> Lrun: array<f32, 4u * RG>;  // per row: running sum of exp2(s - max)

fn kv_src(i: u32, k0: u32, last: u32, kvbase: u32) -> u32 {
  return (kvbase + min(k0 + i / D4, last)) * D4 + i % D4;  // keys past the block's last repeat it
}

fn kv_dst(i: u32) -> u32 {
  return (i / D4) * QST + i % D4;
}

fn score(j: u32, quad: u32, comp: u32) -> f32 {
  var s = Ps[j * RG + quad][comp];
  for (var k = 1u; k < KL; k++) { s += Ps[(k * BK + j) * RG + quad][comp]; }
  return s;
}

// Slot n (column ct + CT*n) of row quad rg, row r in the lane-reduction scratch (Qs).
fn lane_slot(rg: u32, r: u32, ct: u32, n: u32) -> u32 {
  return (4u * rg + r) * QST + ct + CT * n;
}

fn lane_put(rg: u32, r: u32, ct: u32, v0: vec4<f32>, v1: vec4<f32>, v2: vec4<f32>, v3: vec4<f32>) {
  if (ct < D4) { Qs[lane_slot(rg, r, ct, 0u)] = v0; }
  if (ct + CT < D4) { Qs[lane_slot(rg, r, ct, 1u)] = v1; }
  if (ct + 2u * CT < D4) { Qs[lane_slot(rg, r, ct, 2u)] = v2; }
  if (ct + 3u * CT < D4) { Qs[lane_slot(rg, r, ct, 3u)] = v3; }
}

fn lane_get(rg: u32, r: u32, ct: u32, n: u32) -> vec4<f32> {
  if (ct + CT * n < D4) { return Qs[lane_slot(rg, r, ct, n)]; }
  return vec4<f32>(0.0);
}

@compute @workgroup_size(NT)
fn prefill(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>,
           @builtin(num_workgroups) nwg: vec3<u32>) {
  let rows = p.tokens * R;
  let heads = p.kv_heads * R;
  let g = wg.y;
  let b = wg.z;
  let row0 = (nwg.x - 1u - wg.x) * 4u * RG;  // last blocks first
  let pos = STARTS[b];
  let len = seq_len(b);
  let maxlim = min(pos + (min(row0 + 4u * RG, rows) - 1u) / R, len - 1u);  // the block's last key
  let kvbase = (b * p.kv_heads + g) * p.max_len;
  let qscale = p.scale * LOG2E;

  for (var idx = t; idx < 4u * RG * D4; idx += NT) {
    let m = idx / D4;
    let c = idx % D4;
    let mg = min(row0 + m, rows - 1u);  // rows past the end repeat the last one; not stored
    Qs[m * QST + c] = Q[((b * p.tokens + mg / R) * heads + g * R + mg % R) * D4 + c] * qscale;
  }
  for (var m = t; m < 4u * RG; m += NT) {
    Qs[m * QST + D4] = vec4<f32>(0.0);  // pad columns: the score loop's odd step reads them
    Mrun[m] = MASKED;
    Lrun[m] = 0.0;
  }
  for (var j = t; j < BK; j += NT) {
    KVs[j * QST + D4] = vec4<f32>(0.0);
  }

  let kl = t / (RG * CT);
  let u = t % (RG * CT);
  let rg = u / CT;
  let ct = u % CT;
  let d_lo = kl * DH;
  let d_hi = min(d_lo + DH, D4);
  let c0 = min(ct, D4 - 1u);  // PV columns, clamped for loads (stores check)
  let c1 = min(ct + CT, D4 - 1u);
  let c2 = min(ct + 2u * CT, D4 - 1u);
  let c3 = min(ct + 3u * CT, D4 - 1u);
  var a00 = vec4<f32>(0.0); var a01 = vec4<f32>(0.0); var a02 = vec4<f32>(0.0); var a03 = vec4<f32>(0.0);
  var a10 = vec4<f32>(0.0); var a11 = vec4<f32>(0.0); var a12 = vec4<f32>(0.0); var a13 = vec4<f32>(0.0);
  var a20 = vec4<f32>(0.0); var a21 = vec4<f32>(0.0); var a22 = vec4<f32>(0.0); var a23 = vec4<f32>(0.0);
  var a30 = vec4<f32>(0.0); var a31 = vec4<f32>(0.0); var a32 = vec4<f32>(0.0); var a33 = vec4<f32>(0.0);

  let ntiles = maxlim / BK + 1u;
  var tile0 = 0u;  // the tile of the block's first key
  if (PACKED) { tile0 = example_first(b, row0 / R, pos) / BK; }
  for (var tile = tile0; tile < ntiles; tile++) {
    let k0 = tile * BK;
    for (var idx = t; idx < TILE; idx += 4u * NT) {
      let i1 = min(idx + NT, TILE - 1u);
      let i2 = min(idx + 2u * NT, TILE - 1u);
      let i3 = min(idx + 3u * NT, TILE - 1u);
      let x0 = K[kv_src(idx, k0, maxlim, kvbase)]; let x1 = K[kv_src(i1, k0, maxlim, kvbase)];
      let x2 = K[kv_src(i2, k0, maxlim, kvbase)]; let x3 = K[kv_src(i3, k0, maxlim, kvbase)];
      KVs[kv_dst(idx)] = x0;
      if (idx + NT < TILE) { KVs[kv_dst(i1)] = x1; }
      if (idx + 2u * NT < TILE) { KVs[kv_dst(i2)] = x2; }
      if (idx + 3u * NT < TILE) { KVs[kv_dst(i3)] = x3; }
    }
    workgroupBarrier();

    for (var sb = u; sb < RG * KB; sb += RG * CT) {
      let qa = (sb / KB) * 4u * QST;
      let ka = (sb % KB) * QST;
      let kst = KB * QST;
      var s0 = vec4<f32>(0.0); var s1 = vec4<f32>(0.0); var s2 = vec4<f32>(0.0); var s3 = vec4<f32>(0.0);
      for (var d = d_lo; d < d_hi; d += 2u) {  // d + 1 = D4 reads the zero pad
        let q0 = Qs[qa + d]; let q1 = Qs[qa + QST + d]; let q2 = Qs[qa + 2u * QST + d]; let q3 = Qs[qa + 3u * QST + d];
        let k0v = KVs[ka + d]; let k1v = KVs[ka + kst + d]; let k2v = KVs[ka + 2u * kst + d]; let k3v = KVs[ka + 3u * kst + d];
        let e0 = Qs[qa + d + 1u]; let e1 = Qs[qa + QST + d + 1u]; let e2 = Qs[qa + 2u * QST + d + 1u]; let e3 = Qs[qa + 3u * QST + d + 1u];
        let f0 = KVs[ka + d + 1u]; let f1 = KVs[ka + kst + d + 1u]; let f2 = KVs[ka + 2u * kst + d + 1u]; let f3 = KVs[ka + 3u * kst + d + 1u];
        s0 += vec4<f32>(dot(q0, k0v) + dot(e0, f0), dot(q0, k1v) + dot(e0, f1), dot(q0, k2v) + dot(e0, f2), dot(q0, k3v) + dot(e0, f3));
        s1 += vec4<f32>(dot(q1, k0v) + dot(e1, f0), dot(q1, k1v) + dot(e1, f1), dot(q1, k2v) + dot(e1, f2), dot(q1, k3v) + dot(e1, f3));
        s2 += vec4<f32>(dot(q2, k0v) + dot(e2, f0), dot(q2, k1v) + dot(e2, f1), dot(q2, k2v) + dot(e2, f2), dot(q2, k3v) + dot(e2, f3));
        s3 += vec4<f32>(dot(q3, k0v) + dot(e3, f0), dot(q3, k1v) + dot(e3, f1), dot(q3, k2v) + dot(e3, f2), dot(q3, k3v) + dot(e3, f3));
      }
      // s_r holds row r's scores for keys kq + KB*n (n = component): store per key, rows as a vec4
      let pa = kl * BK * RG + (sb % KB) * RG + sb / KB;
      Ps[pa] = vec4<f32>(s0.x, s1.x, s2.x, s3.x);
      Ps[pa + KB * RG] = vec4<f32>(s0.y, s1.y, s2.y, s3.y);
      Ps[pa + 2u * KB * RG] = vec4<f32>(s0.z, s1.z, s2.z, s3.z);
      Ps[pa + 3u * KB * RG] = vec4<f32>(s0.w, s1.w, s2.w, s3.w);
    }
    workgroupBarrier();

    for (var m = t; m < 4u * RG; m += NT) {  // softmax of row m (one thread per row when NT >= M)
      let i = min(row0 + m, rows - 1u) / R;
      let lim = min(pos + i, len - 1u);
      var first = 0u;
      if (PACKED) { first = example_first(b, i, pos); }
      let quad = m / 4u;
      let comp = m % 4u;
      var tmax = MASKED;
      for (var j = 0u; j < BK; j++) {
        tmax = max(tmax, select(MASKED, score(j, quad, comp), k0 + j <= lim && k0 + j >= first));
      }
      let m_old = Mrun[m];
      let m_new = max(m_old, tmax);
      let alpha = exp2(m_old - m_new);
      var lsum = 0.0;
      for (var j = 0u; j < BK; j++) {
        let pr = select(0.0, exp2(score(j, quad, comp) - m_new), k0 + j <= lim && k0 + j >= first);
        Ps[j * RG + quad][comp] = pr;
        lsum += pr;
      }
      Lrun[m] = Lrun[m] * alpha + lsum;
      Mrun[m] = m_new;
      As[quad][comp] = alpha;
    }
    for (var idx = t; idx < TILE; idx += 4u * NT) {
      let i1 = min(idx + NT, TILE - 1u);
      let i2 = min(idx + 2u * NT, TILE - 1u);
      let i3 = min(idx + 3u * NT, TILE - 1u);
      let x0 = V[kv_src(idx, k0, maxlim, kvbase)]; let x1 = V[kv_src(i1, k0, maxlim, kvbase)];
      let x2 = V[kv_src(i2, k0, maxlim, kvbase)]; let x3 = V[kv_src(i3, k0, maxlim, kvbase)];
      KVs[kv_dst(idx)] = x0;
      if (idx + NT < TILE) { KVs[kv_dst(i1)] = x1; }
      if (idx + 2u * NT < TILE) { KVs[kv_dst(i2)] = x2; }
      if (idx + 3u * NT < TILE) { KVs[kv_dst(i3)] = x3; }
    }
    workgroupBarrier();

    let al = As[rg];
    a00 *= al.x; a01 *= al.x; a02 *= al.x; a03 *= al.x;
    a10 *= al.y; a11 *= al.y; a12 *= al.y; a13 *= al.y;
    a20 *= al.z; a21 *= al.z; a22 *= al.z; a23 *= al.z;
    a30 *= al.w; a31 *= al.w; a32 *= al.w; a33 *= al.w;
    for (var j = kl; j < BK; j += 2u * KL) {
      let pj = Ps[j * RG + rg];
      let v0 = KVs[j * QST + c0]; let v1 = KVs[j * QST + c1]; let v2 = KVs[j * QST + c2]; let v3 = KVs[j * QST + c3];
      let pk = Ps[(j + KL) * RG + rg];
      let jk = (j + KL) * QST;
      let w0 = KVs[jk + c0]; let w1 = KVs[jk + c1]; let w2 = KVs[jk + c2]; let w3 = KVs[jk + c3];
      a00 += pj.x * v0 + pk.x * w0; a01 += pj.x * v1 + pk.x * w1; a02 += pj.x * v2 + pk.x * w2; a03 += pj.x * v3 + pk.x * w3;
      a10 += pj.y * v0 + pk.y * w0; a11 += pj.y * v1 + pk.y * w1; a12 += pj.y * v2 + pk.y * w2; a13 += pj.y * v3 + pk.y * w3;
      a20 += pj.z * v0 + pk.z * w0; a21 += pj.z * v1 + pk.z * w1; a22 += pj.z * v2 + pk.z * w2; a23 += pj.z * v3 + pk.z * w3;
      a30 += pj.w * v0 + pk.w * w0; a31 += pj.w * v1 + pk.w * w1; a32 += pj.w * v2 + pk.w * w2; a33 += pj.w * v3 + pk.w * w3;
    }
    workgroupBarrier();
  }

  // sum the key lanes' partial outputs into lane 0 (Qs is free now)
  for (var k = 1u; k < KL; k++) {
    if (kl == k) {
      lane_put(rg, 0u, ct, a00, a01, a02, a03);
      lane_put(rg, 1u, ct, a10, a11, a12, a13);
      lane_put(rg, 2u, ct, a20, a21, a22, a23);
      lane_put(rg, 3u, ct, a30, a31, a32, a33);
    }
    workgroupBarrier();
    if (kl == 0u) {
      a00 += lane_get(rg, 0u, ct, 0u); a01 += lane_get(rg, 0u, ct, 1u); a02 += lane_get(rg, 0u, ct, 2u); a03 += lane_get(rg, 0u, ct, 3u);
      a10 += lane_get(rg, 1u, ct, 0u); a11 += lane_get(rg, 1u, ct, 1u); a12 += lane_get(rg, 1u, ct, 2u); a13 += lane_get(rg, 1u, ct, 3u);
      a20 += lane_get(rg, 2u, ct, 0u); a21 += lane_get(rg, 2u, ct, 1u); a22 += lane_get(rg, 2u, ct, 2u); a23 += lane_get(rg, 2u, ct, 3u);
      a30 += lane_get(rg, 3u, ct, 0u); a31 += lane_get(rg, 3u, ct, 1u); a32 += lane_get(rg, 3u, ct, 2u); a33 += lane_get(rg, 3u, ct, 3u);
    }
    workgroupBarrier();
  }

  for (var m = t; m < 4u * RG; m += NT) {
    let l = Lrun[m];
    As[m / 4u][m % 4u] = 1.0 / l;
    if (p.lse_out != 0u && row0 + m < rows) {
      let mg = row0 + m;
      LSE[(b * p.tokens + mg / R) * heads + g * R + mg % R] = (Mrun[m] + log2(l)) * LN2;
    }
  }
  workgroupBarrier();
  if (kl == 0u) {
    let inv = As[rg];
    prefill_store(row0 + 4u * rg, rows, heads, b, g, ct, inv.x, a00, a01, a02, a03);
    prefill_store(row0 + 4u * rg + 1u, rows, heads, b, g, ct, inv.y, a10, a11, a12, a13);
    prefill_store(row0 + 4u * rg + 2u, rows, heads, b, g, ct, inv.z, a20, a21, a22, a23);
    prefill_store(row0 + 4u * rg + 3u, rows, heads, b, g, ct, inv.w, a30, a31, a32, a33);
  }
}

fn prefill_store(mg: u32, rows: u32, heads: u32, b: u32, g: u32, ct: u32, inv: f32,
                 v0: vec4<f32>, v1: vec4<f32>, v2: vec4<f32>, v3: vec4<f32>) {
  if (mg >= rows) { return; }
  let base = ((b * p.tokens + mg / R) * heads + g * R + mg % R) * D4 + ct;
  if (ct < D4) { O[base] = v0 * inv; }
  if (ct + CT < D4) { O[base + CT] = v1 * inv; }
  if (ct + 2u * CT < D4) { O[base + 2u * CT] = v2 * inv; }
  if (ct + 3u * CT < D4) { O[base + 3u * CT] = v3 * inv; }
}

// ---------------------------------------------------------------------------------------------
// decode_partial: 4 rows (m = 4*rb .. 4*rb+3 of one (b, g)) per workgroup, DNT threads, key
// tiles of DBK keys inside the workgroup's span. Per tile:
//   1. scores: LPK lanes per key, each lane a strided subset of the key's columns (the lanes of
//      a key read consecutive vec4s of its row: coalesced), partial dots for the 4 rows
//      -> dRed; barrier; thread t < DBK sums key t's LPK partials -> dS[t]; barrier
//   2. every thread takes the tile max of the 4 rows (broadcast reads of dS) and rescales its
//      accumulators; thread t < DBK writes p = exp2(s - max) -> dP[t]; barrier
//   3. PV: thread (kl, c) = (t / D4, t % D4) owns column c of the 4 rows and keys kl, kl+DKL,
//      ...: V read straight from the cache, the D4 threads of a key lane reading its row.
// dRed, dS and dP are next written after barriers that every thread passes only once it has
// finished reading them: 3 barriers a tile. At the end the DKL key lanes are summed through
// dRed, one row at a time, into the span's unnormalised sums and (max, sum) pairs.
override DNT: u32 = 256u;  // threads per workgroup
override LPK: u32 = 8u;    // lanes per key in the score phase; DNT % LPK == 0
override DBK: u32 = 64u;   // keys per tile: a multiple of DNT / LPK, <= DNT
override DKL: u32 = 8u;    // key lanes in the PV phase: min(DNT / D4, DBK); DKL * D4 <= DBK * LPK

var<workgroup> dQ: array<vec4<f32>, 4u * D4>;
var<workgroup> dRed: array<vec4<f32>, DBK * LPK>;
var<workgroup> dS: array<vec4<f32>, DBK>;
var<workgroup> dP: array<vec4<f32>, DBK>;
var<workgroup> dL: array<vec4<f32>, DKL>;

// Keys a 4-row block sees: 0 .. n-1 (its last row's limit + 1).
fn block_keys(rb: u32, b: u32) -> u32 {
  let last = min(4u * rb + 4u, p.tokens * R) - 1u;
  return min(STARTS[b] + last / R, seq_len(b) - 1u) + 1u;
}

// Keys per split span for a block of n keys: ceil(n / splits) rounded up to a tile.
fn split_span(n: u32) -> u32 {
  return (((n + p.splits - 1u) / p.splits + DBK - 1u) / DBK) * DBK;
}

fn row_id(b: u32, g: u32, mg: u32) -> u32 {
  return (b * p.tokens + mg / R) * (p.kv_heads * R) + g * R + mg % R;
}

@compute @workgroup_size(DNT)
fn decode_partial(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let rows = p.tokens * R;
  let blocks = (rows + 3u) / 4u;
  let split = wg.x;
  let g = wg.y / blocks;
  let rb = wg.y % blocks;
  let b = wg.z;
  let n = block_keys(rb, b);
  let span = split_span(n);
  let kbeg = split * span;
  let rows_total = p.batch * p.tokens * p.kv_heads * R;
  let row0 = 4u * rb;
  if (kbeg >= n) {  // uniform: an empty span writes neutral partials (weight 0 when merged) and leaves
    for (var idx = t; idx < 4u * D4; idx += DNT) {
      let r = row0 + idx / D4;
      if (r < rows) { O[(split * rows_total + row_id(b, g, r)) * D4 + idx % D4] = vec4<f32>(0.0); }
    }
    if (t < 4u && row0 + t < rows) {
      let at = 2u * (split * rows_total + row_id(b, g, row0 + t));
      LSE[at] = MASKED;
      LSE[at + 1u] = 0.0;
    }
    return;
  }
  let kend = min(kbeg + span, n);
  let pos = STARTS[b];
  let len = seq_len(b);
  let lim = vec4<u32>(min(pos + min(row0, rows - 1u) / R, len - 1u),
                      min(pos + min(row0 + 1u, rows - 1u) / R, len - 1u),
                      min(pos + min(row0 + 2u, rows - 1u) / R, len - 1u),
                      min(pos + min(row0 + 3u, rows - 1u) / R, len - 1u));
  let kvbase = (b * p.kv_heads + g) * p.max_len;
  let qscale = p.scale * LOG2E;

  for (var idx = t; idx < 4u * D4; idx += DNT) {
    dQ[idx] = Q[row_id(b, g, min(row0 + idx / D4, rows - 1u)) * D4 + idx % D4] * qscale;
  }
  workgroupBarrier();

  let kp = DNT / LPK;  // keys per pass of the score phase
  let kk = t / LPK;
  let lane = t % LPK;
  let c = t % D4;
  let kl = t / D4;
  var m4 = vec4<f32>(MASKED);
  var acc0 = vec4<f32>(0.0); var acc1 = vec4<f32>(0.0); var acc2 = vec4<f32>(0.0); var acc3 = vec4<f32>(0.0);
  var lsum = vec4<f32>(0.0);
  var s = vec4<f32>(MASKED);
  var ok = vec4<bool>(false);

  for (var k0 = kbeg; k0 < kend; k0 += DBK) {
    for (var jj = kk; jj < DBK; jj += kp) {
      let krow = (kvbase + min(k0 + jj, kend - 1u)) * D4;
      var part = vec4<f32>(0.0);
      for (var cc = lane; cc < D4; cc += 2u * LPK) {  // two columns a step, both loads in flight
        let cd = min(cc + LPK, D4 - 1u);
        let kv = K[krow + cc];
        let kw = K[krow + cd] * f32(cc + LPK < D4);  // a column past the end counts 0
        part += vec4<f32>(dot(dQ[cc], kv) + dot(dQ[cd], kw), dot(dQ[D4 + cc], kv) + dot(dQ[D4 + cd], kw),
                          dot(dQ[2u * D4 + cc], kv) + dot(dQ[2u * D4 + cd], kw),
                          dot(dQ[3u * D4 + cc], kv) + dot(dQ[3u * D4 + cd], kw));
      }
      dRed[jj * LPK + lane] = part;
    }
    workgroupBarrier();
    if (t < DBK) {
      var sum = vec4<f32>(0.0);
      for (var l = 0u; l < LPK; l++) { sum += dRed[t * LPK + l]; }
      let j = k0 + t;
      ok = (vec4<u32>(j) <= lim) & vec4<bool>(j < kend);
      s = select(vec4<f32>(MASKED), sum, ok);
      dS[t] = s;
    }
    workgroupBarrier();
    var tmax = vec4<f32>(MASKED);
    for (var j = 0u; j < DBK; j++) { tmax = max(tmax, dS[j]); }
    let m_new = max(m4, tmax);
    let alpha = exp2(m4 - m_new);
    m4 = m_new;
    if (t < DBK) {
      dP[t] = select(vec4<f32>(0.0), exp2(s - m_new), ok);
    }
    workgroupBarrier();
    acc0 *= alpha.x; acc1 *= alpha.y; acc2 *= alpha.z; acc3 *= alpha.w;
    lsum *= alpha;
    if (kl < DKL) {
      for (var j = kl; j < DBK; j += 2u * DKL) {  // two keys a step, both loads in flight
        let jk = min(j + DKL, DBK - 1u);
        let pj = dP[j];
        let pk = dP[jk] * f32(j + DKL < DBK);
        let v = V[(kvbase + min(k0 + j, kend - 1u)) * D4 + c];
        let w = V[(kvbase + min(k0 + jk, kend - 1u)) * D4 + c];
        acc0 += pj.x * v + pk.x * w; acc1 += pj.y * v + pk.y * w;
        acc2 += pj.z * v + pk.z * w; acc3 += pj.w * v + pk.w * w;
        lsum += pj + pk;
      }
    }
  }

  if (kl < DKL && c == 0u) { dL[kl] = lsum; }
  for (var r = 0u; r < 4u; r++) {
    workgroupBarrier();
    if (kl < DKL) {
      var a = acc0;
      if (r == 1u) { a = acc1; }
      if (r == 2u) { a = acc2; }
      if (r == 3u) { a = acc3; }
      dRed[kl * D4 + c] = a;
    }
    workgroupBarrier();
    if (t < D4 && row0 + r < rows) {
      var sum = vec4<f32>(0.0);
      for (var l = 0u; l < DKL; l++) { sum += dRed[l * D4 + t]; }
      O[(split * rows_total + row_id(b, g, row0 + r)) * D4 + t] = sum;
    }
  }
  if (t < 4u && row0 + t < rows) {
    var l = 0.0;
    for (var k = 0u; k < DKL; k++) { l += dL[k][t]; }
    let at = 2u * (split * rows_total + row_id(b, g, row0 + t));
    LSE[at] = m4[t];
    LSE[at + 1u] = l;
  }
}

// ---------------------------------------------------------------------------------------------
// decode_combine: one workgroup per row (b, i, h); thread (lane, c) = (t / D4, t % D4) merges
// the spans lane, lane + CL, ... online (running max, rescaled sums), then lane 0's threads
// merge the CL lanes through workgroup memory.
override CWG: u32 = 64u;  // threads per workgroup; D4 <= CWG
override CL: u32 = 2u;    // span lanes: CWG / D4

var<workgroup> cAcc: array<vec4<f32>, CWG>;
var<workgroup> cML: array<vec2<f32>, CL>;

@compute @workgroup_size(CWG)
fn decode_combine(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>,
                  @builtin(num_workgroups) nwg: vec3<u32>) {
  let heads = p.kv_heads * R;
  let rows_total = p.batch * p.tokens * heads;
  let row = wg.y * nwg.x + wg.x;
  if (row >= rows_total) { return; }
  let lane = t / D4;
  let c = t % D4;
  if (lane < CL) {
    var mx = MASKED;
    var l = 0.0;
    var acc = vec4<f32>(0.0);
    for (var sp = lane; sp < p.splits; sp += CL) {
      let ml = PML[sp * rows_total + row];
      let m_new = max(mx, ml.x);
      let a = exp2(mx - m_new);
      let w = exp2(ml.x - m_new);
      l = l * a + ml.y * w;
      acc = acc * a + PO[(sp * rows_total + row) * D4 + c] * w;
      mx = m_new;
    }
    cAcc[t] = acc;
    if (c == 0u) { cML[lane] = vec2<f32>(mx, l); }
  }
  workgroupBarrier();
  if (t < D4) {
    var mx = MASKED;
    for (var k = 0u; k < CL; k++) { mx = max(mx, cML[k].x); }
    var l = 0.0;
    var acc = vec4<f32>(0.0);
    for (var k = 0u; k < CL; k++) {
      let w = exp2(cML[k].x - mx);
      l += cML[k].y * w;
      acc += cAcc[k * D4 + t] * w;
    }
    OUT[row * D4 + t] = acc / l;
    if (t == 0u && p.lse_out != 0u) {
      LSE_OUT[row] = (mx + log2(l)) * LN2;
    }
  }
}
