// Shared by attention_apply.wgsl and attention_kv_grad.wgsl (// @include): gemm_tiled's store of
// four head-dim features of row n, straight into the output (the including file's put4) or, with
// SPLITS > 1 (the sum cut into ranges over the grid's z), into the range's slice of PART
// [SPLITS, tokens, head_dim], which split_sum adds up in order and puts. The including file
// declares Params (tokens, head_dim, a multiple of 4), the binding PART (vec4s) and
// fn put4(n: u32, k: u32, x: vec4<f32>) (features k .. k + 3 of row n).

override SPLITS: u32 = 1u;

fn store(n: u32, k: u32, v: vec4<f32>) {
  if (n >= p.tokens || k >= p.head_dim) { return; }
  if (SPLITS > 1u) { PART[((range * p.tokens + n) * p.head_dim + k) / 4u] = v; } else { put4(n, k, v); }
}

// The ranges' sums of every (row, feature quad), one invocation each (a 2-D grid of 256-wide groups).
@compute @workgroup_size(256)
fn split_sum(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let e = gid.y * nwg.x * 256u + gid.x;  // vec4 e: row 4e / head_dim
  let quads = p.tokens * p.head_dim / 4u;
  if (e >= quads) { return; }
  var x = vec4<f32>(0.0);
  for (var s = 0u; s < SPLITS; s++) { x += PART[s * quads + e]; }
  put4(4u * e / p.head_dim, 4u * e % p.head_dim, x);
}
