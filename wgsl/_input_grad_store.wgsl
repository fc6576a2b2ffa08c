// Shared by bitlinear_t.wgsl and matmul_t.wgsl (// @include): storing four input-gradient
// features of token n, plus the adapters' own input gradient Σ_r DH[n][r] · LA[r][k] (with
// DROPOUT each term times row r's adapter's dropout mask at [n][k]). The including file declares
// Params (tokens, out_stride, k, lora_rank, dh_stride, la_stride, accumulate and _dropout.wgsl's
// fields), the bindings OUT, DH, LA, PART and DROP, and includes _dropout.wgsl.
//
// With SPLITS > 1 the rows j were split into ranges over the grid's z (gemm_tiled's `range`): each
// range stores its raw sums into its slice of PART [SPLITS, tokens, k], and split_sum adds the
// slices up in order, then the LoRA term, into OUT.

override SPLITS: u32 = 1u;
override DROPOUT: bool = false;

fn lora_term(n: u32, kc: u32) -> f32 {
  var x = 0.0;
  if (DROPOUT) {  // one mask per adapter: rows r of one adapter are consecutive
    var key = drop_key(0u);
    var m = drop_mask(key, n, kc);
    for (var r = 0u; r < p.lora_rank; r++) {
      if (drop_key(r) != key) {
        key = drop_key(r);
        m = drop_mask(key, n, kc);
      }
      x += DH[n * p.dh_stride + r] * LA[r * p.la_stride + kc] * m;
    }
    return x;
  }
  for (var r = 0u; r < p.lora_rank; r++) { x += DH[n * p.dh_stride + r] * LA[r * p.la_stride + kc]; }
  return x;
}

fn put_grad(n: u32, kc: u32, x: f32) {
  let o = n * p.out_stride + kc;
  if (p.accumulate != 0u) { OUT[o] += x; } else { OUT[o] = x; }
}

fn store(n: u32, k: u32, v: vec4<f32>) {
  if (n >= p.tokens) { return; }
  for (var c = 0u; c < 4u; c++) {
    let kc = k + c;
    if (kc < p.k) {
      if (SPLITS > 1u) {
        PART[(range * p.tokens + n) * p.k + kc] = v[c];
      } else {
        put_grad(n, kc, v[c] + lora_term(n, kc));
      }
    }
  }
}

@compute @workgroup_size(256)
fn split_sum(@builtin(global_invocation_id) gid: vec3<u32>) {
  let n = gid.y;
  let kc = gid.x;
  if (kc >= p.k || n >= p.tokens) { return; }
  var x = 0.0;
  for (var s = 0u; s < SPLITS; s++) { x += PART[(s * p.tokens + n) * p.k + kc]; }
  put_grad(n, kc, x + lora_term(n, kc));
}
