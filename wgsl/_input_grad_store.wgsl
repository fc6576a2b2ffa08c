// Shared by bitlinear_t.wgsl and matmul_t.wgsl (// @include): storing four input-gradient
// features of token n, plus the adapters' own input gradient Σ_r DH[n][r] · LA[r][k]. The
// including file declares Params (tokens, out_stride, k, lora_rank, dh_stride, la_stride,
// accumulate) and the bindings OUT, DH, LA.

fn store(n: u32, k: u32, v: vec4<f32>) {
  if (n >= p.tokens) { return; }
  for (var c = 0u; c < 4u; c++) {
    let kc = k + c;
    if (kc < p.k) {
      var x = v[c];
      for (var r = 0u; r < p.lora_rank; r++) { x += DH[n * p.dh_stride + r] * LA[r * p.la_stride + kc]; }
      let o = n * p.out_stride + kc;
      if (p.accumulate != 0u) { OUT[o] += x; } else { OUT[o] = x; }
    }
  }
}
