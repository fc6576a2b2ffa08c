// _reductions.wgsl for adapters with subgroups (the runtime picks this file there): each
// subgroup folds its values in registers (subgroupAdd, subgroupMax), its first invocation puts
// the result in workgroup memory, and every invocation folds those few (WG / subgroup size).
// No serial loop over 32 values as in the barrier version: a single-workgroup launch (a decoded
// token's RMSNorm) is a chain of these, so their latency is the launch's.

struct Invocation {
  @builtin(local_invocation_index) t: u32,
  @builtin(subgroup_invocation_id) lane: u32,
  @builtin(subgroup_id) subgroup: u32,
  @builtin(num_subgroups) subgroups: u32,
}

var<private> sg: Invocation;

fn enter(inv: Invocation) { sg = inv; }

// One slot per subgroup (subgroups have at least 4 invocations). The first barrier of each
// call keeps a call's writes from racing the previous call's reads.
var<workgroup> part: array<f32, WG / 4u>;
var<workgroup> part_i: array<i32, WG / 4u>;
var<workgroup> part4: array<vec4<f32>, WG / 4u>;

fn sum_all(t: u32, v: f32) -> f32 {
  let s = subgroupAdd(v);
  workgroupBarrier();
  if (sg.lane == 0u) { part[sg.subgroup] = s; }
  workgroupBarrier();
  var total = 0.0;
  for (var i = 0u; i < sg.subgroups; i++) { total += part[i]; }
  return total;
}

fn max_all(t: u32, v: f32) -> f32 {
  let s = subgroupMax(v);
  workgroupBarrier();
  if (sg.lane == 0u) { part[sg.subgroup] = s; }
  workgroupBarrier();
  var total = part[0];
  for (var i = 1u; i < sg.subgroups; i++) { total = max(total, part[i]); }
  return total;
}

fn sum_all_i(t: u32, v: i32) -> i32 {
  let s = subgroupAdd(v);
  workgroupBarrier();
  if (sg.lane == 0u) { part_i[sg.subgroup] = s; }
  workgroupBarrier();
  var total = 0i;
  for (var i = 0u; i < sg.subgroups; i++) { total += part_i[i]; }
  return total;
}

fn sum_all4(t: u32, v: vec4<f32>) -> vec4<f32> {
  let s = subgroupAdd(v);
  workgroupBarrier();
  if (sg.lane == 0u) { part4[sg.subgroup] = s; }
  workgroupBarrier();
  var total = vec4<f32>(0.0);
  for (var i = 0u; i < sg.subgroups; i++) { total += part4[i]; }
  return total;
}
