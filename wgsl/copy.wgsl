// DST = SRC over vec4s with a grid-stride loop: the streaming bandwidth a plain kernel
// reaches on this adapter, the ceiling benchmark figures are compared against.

struct Params {
  len4: u32,  // vec4s to copy
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> SRC: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> DST: array<vec4<f32>>;

override WG: u32 = 256u;

@compute @workgroup_size(WG)
fn copy(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
  for (var i = gid.x; i < p.len4; i += groups.x * WG) {
    DST[i] = SRC[i];
  }
}
