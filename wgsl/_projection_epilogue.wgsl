// Shared by bitlinear.wgsl and matmul.wgsl (// @include): a projection's epilogue. The including
// file declares Params (tokens, out_stride, out_offset, lora_rank, segments, aux_stride), the
// bindings OUT, H and LB (array<vec4<f32>>), LORA, AUX, and the overrides MODE and SAVE.

// The LoRA segments' contribution to output row j of token n: scale_s · B_s[j'] · h[n][c_s ..]. H and
// LB are bound as vec4s: where a segment's rank, B row and h columns start on 16 bytes (ranks a
// multiple of 4) the sum reads four values a load, a quarter of the loads (the lanes of a subgroup
// read rows of B rank floats apart); else one value a load. The sum runs in rank order either way.
fn lora(n: u32, j: u32) -> f32 {
  var v = 0.0;
  for (var s = 0u; s < p.segments; s++) {
    let hdr = s * 8u;
    let begin = LORA[hdr];
    let step = LORA[hdr + 2u];
    if (j >= begin && j < LORA[hdr + 1u] && (j - begin) % step == 0u) {
      let rank = LORA[hdr + 5u];
      let b = LORA[hdr + 4u] + ((j - begin) / step) * rank;
      let h = n * p.lora_rank + LORA[hdr + 3u];
      var sum = 0.0;
      if ((rank | b | h) % 4u == 0u) {
        for (var r = 0u; r < rank; r += 4u) {
          let bv = LB[(b + r) / 4u];
          let hv = H[(h + r) / 4u];
          sum += bv.x * hv.x;
          sum += bv.y * hv.y;
          sum += bv.z * hv.z;
          sum += bv.w * hv.w;
        }
      } else {
        for (var r = 0u; r < rank; r++) { sum += LB[(b + r) / 4u][(b + r) % 4u] * H[(h + r) / 4u][(h + r) % 4u]; }
      }
      v += bitcast<f32>(LORA[hdr + 6u]) * sum;
    }
  }
  return v;
}

// Store (MODE 0) or add (MODE 1) one output; an add with SAVE also keeps the sum in AUX (a
// training pass's copy of the residual stream for its backward, without a copy launch).
fn put(n: u32, j: u32, v: f32) {
  put_final(n, j, with_residual(n, j, v));
}

// What output j of token n becomes: v, or with MODE 1 the sum OUT holds plus v. Split from the store
// (put_final) so that a loop over many outputs can read them all before it writes any: a read of OUT
// after a write to OUT waits for it.
fn with_residual(n: u32, j: u32, v: f32) -> f32 {
  if (MODE == 1u) { return OUT[n * p.out_stride + p.out_offset + j] + v; }
  return v;
}

fn put_final(n: u32, j: u32, v: f32) {
  OUT[n * p.out_stride + p.out_offset + j] = v;
  if (MODE == 1u && SAVE) { AUX[n * p.aux_stride + j] = v; }
}

// A gate/up pair (rows 2i, 2i + 1) for token n: relu(gate)² · up.
fn put_pair(n: u32, i: u32, gate: f32, up: f32) {
  let g = max(gate, 0.0);
  OUT[n * p.out_stride + p.out_offset + i] = g * g * up;
  if (SAVE) {
    AUX[n * p.aux_stride + 2u * i] = gate;
    AUX[n * p.aux_stride + 2u * i + 1u] = up;
  }
}
