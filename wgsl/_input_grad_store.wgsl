// Shared by bitlinear_t.wgsl and matmul_t.wgsl (// @include): storing four input-gradient
// features of token n, plus the adapters' own input gradient Σ_r DH[n][r] · LA[r][k] (with
// DROPOUT each term times row r's adapter's dropout mask at [n][k]). The including file declares
// Params (tokens, out_stride, k, lora_rank, dh_stride, la_stride, accumulate and _dropout.wgsl's
// fields), the bindings OUT, LA and PART (vec4s), DH and DROP, and includes _dropout.wgsl.
//
// With SPLITS > 1 the rows j were split into ranges over the grid's z (gemm_tiled's `range`): each
// range stores its raw sums into its slice of PART [SPLITS, tokens, ceil(k / 4)] (vec4s: a row's
// features past k are written and never read), and split_sum adds the slices up in order, then
// the LoRA term, into OUT.

override SPLITS: u32 = 1u;
override DROPOUT: bool = false;

// The LoRA term of features k .. k + 3 (k a multiple of 4; LA's rows are padded to 64 floats):
// with DROPOUT one mask hash a word and adapter (rows r of one adapter are consecutive).
fn lora_term4(n: u32, k: u32) -> vec4<f32> {
  var x = vec4<f32>(0.0);
  if (DROPOUT) {
    var key = drop_key(0u);
    var m = drop_mask4(key, n, k / 4u);
    for (var r = 0u; r < p.lora_rank; r++) {
      if (drop_key(r) != key) {
        key = drop_key(r);
        m = drop_mask4(key, n, k / 4u);
      }
      x += DH[n * p.dh_stride + r] * LA[(r * p.la_stride + k) / 4u] * m;
    }
    return x;
  }
  for (var r = 0u; r < p.lora_rank; r++) { x += DH[n * p.dh_stride + r] * LA[(r * p.la_stride + k) / 4u]; }
  return x;
}

// Features k .. k + 3 of token n into OUT (k a multiple of 4; OUT's rows whole vec4s), stored or
// added; those at or past p.k keep their values.
fn put_grad4(n: u32, k: u32, x: vec4<f32>) {
  let o = (n * p.out_stride + k) / 4u;
  if (p.accumulate == 0u && k + 4u <= p.k) {
    OUT[o] = x;
    return;
  }
  let old = OUT[o];
  let past = vec4<u32>(k, k + 1u, k + 2u, k + 3u) >= vec4<u32>(p.k);
  OUT[o] = select(select(x, x + old, p.accumulate != 0u), old, past);
}

// The first vec4 of range s's row n in PART.
fn part_row(s: u32, n: u32) -> u32 { return (s * p.tokens + n) * ((p.k + 3u) / 4u); }

fn store(n: u32, k: u32, v: vec4<f32>) {
  if (n >= p.tokens || k >= p.k) { return; }
  if (SPLITS > 1u) {
    PART[part_row(range, n) + k / 4u] = v;
    return;
  }
  put_grad4(n, k, v + lora_term4(n, k));
}

// An invocation a word: features 4·gid.x .. + 3 of token gid.y.
@compute @workgroup_size(256)
fn split_sum(@builtin(global_invocation_id) gid: vec3<u32>) {
  let n = gid.y;
  let k = 4u * gid.x;
  if (k >= p.k || n >= p.tokens) { return; }
  var x = lora_term4(n, k);
  for (var s = 0u; s < SPLITS; s++) { x += PART[part_row(s, n) + gid.x]; }
  put_grad4(n, k, x);
}
