// Shared by norm.wgsl, lora_grad.wgsl, bitlinear_t.wgsl and matmul_t.wgsl (// @include): LoRA
// dropout, as a mask computed where it is used rather than stored. Adapter `key` keeps feature k
// of token row n when
//   pcg4d(seed, key, n, k / 4)[k % 4] ≥ threshold     (threshold = round(p · 2³²))
// and scales what it keeps by 1 / (1 − p): the forward's h = A·(m ⊙ x) (norm.wgsl), dA = dhᵀ·(m ⊙ x)
// (lora_grad.wgsl's da) and the input gradient's (dh·A) ⊙ m (_input_grad_store.wgsl) all derive
// the same mask from these four numbers. pcg4d is Jarzynski and Olano's hash ("Hash Functions for
// GPU Rendering", JCGT 2020): four 32-bit words in, four out, one per feature of a word.
//
// The including file declares Params fields drop_key (the site's first adapter's key),
// drop_split1 and drop_split2 (the site's rank rows where its second and third adapters begin),
// the binding DROP (u32 [4]: seed, threshold, the scale's f32 bits, unused), which the plan
// writes before each pass, and `override DROPOUT: bool = false;` beside its other overrides
// (declared here, it made naga 29 panic compiling norm.wgsl). With DROPOUT false nothing here runs.

fn pcg4d(seed: vec4<u32>) -> vec4<u32> {
  var v = seed * 1664525u + 1013904223u;
  v.x += v.y * v.w; v.y += v.z * v.x; v.z += v.x * v.y; v.w += v.y * v.z;
  v ^= v >> vec4<u32>(16u);
  v.x += v.y * v.w; v.y += v.z * v.x; v.z += v.x * v.y; v.w += v.y * v.z;
  return v;
}

fn drop_key(rank_row: u32) -> u32 {  // the key of the adapter owning this row of the site's stacked A
  return p.drop_key + u32(rank_row >= p.drop_split1) + u32(rank_row >= p.drop_split2);
}

fn drop_mask4(key: u32, n: u32, w: u32) -> vec4<f32> {  // features 4w .. 4w + 3: 0 or the scale
  let bits = pcg4d(vec4<u32>(DROP[0], key, n, w));
  return select(vec4<f32>(0.0), vec4<f32>(bitcast<f32>(DROP[2])), bits >= vec4<u32>(DROP[1]));
}

fn drop_mask(key: u32, n: u32, k: u32) -> f32 { return drop_mask4(key, n, k / 4u)[k % 4u]; }

// Rank rows first .. first + 3 (a quad of the stacked A, possibly spanning adapters): the mask of
// each at feature word w, one column a row (one hash when the quad is one adapter's).
fn drop_quad4(first: u32, n: u32, w: u32) -> mat4x4<f32> {
  let key = drop_key(first);
  let m = drop_mask4(key, n, w);
  var q = mat4x4<f32>(m, m, m, m);
  if (drop_key(first + 1u) != key) { q[1] = drop_mask4(drop_key(first + 1u), n, w); }
  if (drop_key(first + 2u) != key) { q[2] = drop_mask4(drop_key(first + 2u), n, w); }
  if (drop_key(first + 3u) != key) { q[3] = drop_mask4(drop_key(first + 3u), n, w); }
  return q;
}
