// Shared by bitlinear.wgsl (gemv_combine) and norm.wgsl (rmsnorm_partials) (// @include): a decoding
// step's attention output read as its key spans' partials merged, so that the launch that reads it
// (o_proj's GEMV, or the norm before o_proj) replaces decode_combine's launch. The including file
// declares the bindings PO (array<vec4<f32>>: unnormalised sums [SPANS][tokens · HEADS][HEAD_DIM])
// and PML (array<vec2<f32>>: their (max, sum) pairs), Params with tokens, and the overrides SPANS,
// HEADS and HEAD_DIM (whole vec4s).

// Features 4w.. of token n's row of attention's output (one head's), its key spans' partials merged
// as attention.wgsl's decode_combine merges them: Σ_s w_s·o_s / Σ_s w_s·l_s with
// w_s = exp2(m_s − max m) (an empty span's partials are (−1e30, 0) and zeros: weight 0).
fn attention_out(n: u32, w: u32) -> vec4<f32> {
  let rows = p.tokens * HEADS;
  let row = n * HEADS + (4u * w) / HEAD_DIM;
  let col = w % (HEAD_DIM / 4u);
  var m = PML[row].x;
  for (var s = 1u; s < SPANS; s++) { m = max(m, PML[s * rows + row].x); }
  var l = 0.0;
  var acc = vec4<f32>(0.0);
  for (var s = 0u; s < SPANS; s++) {
    let ml = PML[s * rows + row];
    let weight = exp2(ml.x - m);
    l += ml.y * weight;
    acc += PO[(s * rows + row) * (HEAD_DIM / 4u) + col] * weight;
  }
  return acc / l;
}
