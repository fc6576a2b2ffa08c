// Shared by norm.wgsl and bitlinear.wgsl (// @include): reading a row to normalise, and
// BitLinear's per-token absmax int8 activation quantisation, so that a GEMV that quantises its
// own input makes norm.wgsl's codes:
//   s = 127 / max(max|y|, 1e-5),  q = clamp(round(y · s), −128, 127)   (round half to even)
// The including file declares the row X, the norm's weights G and the override K (features).

fn row_features(row: u32, k: u32) -> vec4<f32> {  // X[row + k ..][0..4], zeros past K
  var v = vec4<f32>(0.0);
  for (var l = 0u; l < 4u; l++) {
    if (k + l < K) { v[l] = X[row + k + l]; }
  }
  return v;
}

fn norm_weights(k: u32) -> vec4<f32> {  // G[k ..][0..4], zeros past K
  var g = vec4<f32>(0.0);
  for (var l = 0u; l < 4u; l++) {
    if (k + l < K) { g[l] = G[k + l]; }
  }
  return g;
}

fn absmax4(v: vec4<f32>) -> f32 {
  let a = abs(v);
  return max(max(a.x, a.y), max(a.z, a.w));
}

fn quant_scale(absmax: f32) -> f32 { return 127.0 / max(absmax, 1e-5); }

fn codes4(y: vec4<f32>, s: f32) -> vec4<i32> {
  return vec4<i32>(clamp(round(y * s), vec4<f32>(-128.0), vec4<f32>(127.0)));
}
