// Shared by attention_dq.wgsl and attention_kv_grad.wgsl (// @include): gemm_tiled's store of
// four head-dim features of row n, straight into the output (the including file's put) or, with
// SPLITS > 1 (the sum cut into ranges over the grid's z), into the range's slice of PART
// [SPLITS, tokens, head_dim], which split_sum adds up in order and puts. The including file
// declares Params (tokens, head_dim), the binding PART and fn put(n: u32, kc: u32, x: f32).

override SPLITS: u32 = 1u;

fn store(n: u32, k: u32, v: vec4<f32>) {
  if (n >= p.tokens) { return; }
  for (var c = 0u; c < 4u; c++) {
    if (k + c < p.head_dim) {
      if (SPLITS > 1u) { PART[(range * p.tokens + n) * p.head_dim + k + c] = v[c]; } else { put(n, k + c, v[c]); }
    }
  }
}

// The ranges' sums of every (row, feature), one invocation each (a 2-D grid of 256-wide groups).
@compute @workgroup_size(256)
fn split_sum(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let e = gid.y * nwg.x * 256u + gid.x;
  if (e >= p.tokens * p.head_dim) { return; }
  var x = 0.0;
  for (var s = 0u; s < SPLITS; s++) { x += PART[s * p.tokens * p.head_dim + e]; }
  put(e / p.head_dim, e % p.head_dim, x);
}
