// Shared reductions (// @include) over a workgroup of WG invocations (an override, a multiple of
// 32) in two barriers: every value into workgroup memory, WG / 32 invocations each fold 32 of
// them, then every invocation folds those few. (A tree takes log2(WG) barriers, each of which
// costs a GPU more than the short serial loops; on a CPU adapter, far more.) Call in uniform
// control flow; every invocation gets the result.
//
// On adapters with subgroups the runtime includes _reductions.subgroup.wgsl instead: the same
// functions and Invocation, folding each subgroup in registers first. An entry point takes an
// Invocation and calls enter(it) first. Its workgroup_id is a parameter of its own, not a member:
// uniformity analysis (Tint's) takes a struct for non-uniform when any member is, and branches
// on the workgroup around these barriers must be seen to be uniform.

struct Invocation {
  @builtin(local_invocation_index) t: u32,
}

fn enter(inv: Invocation) {}

var<workgroup> red: array<f32, WG>;
var<workgroup> red2: array<f32, WG / 32u>;

fn sum_all(t: u32, v: f32) -> f32 {
  red[t] = v;
  workgroupBarrier();
  if (t < WG / 32u) {
    var s = 0.0;
    for (var i = 0u; i < 32u; i++) { s += red[32u * t + i]; }
    red2[t] = s;
  }
  workgroupBarrier();
  var total = 0.0;
  for (var i = 0u; i < WG / 32u; i++) { total += red2[i]; }
  return total;
}

fn max_all(t: u32, v: f32) -> f32 {
  red[t] = v;
  workgroupBarrier();
  if (t < WG / 32u) {
    var m = red[32u * t];
    for (var i = 1u; i < 32u; i++) { m = max(m, red[32u * t + i]); }
    red2[t] = m;
  }
  workgroupBarrier();
  var total = red2[0];
  for (var i = 1u; i < WG / 32u; i++) { total = max(total, red2[i]); }
  return total;
}

// The same for integer sums and for four sums at once.
var<workgroup> red_i: array<i32, WG>;
var<workgroup> red2_i: array<i32, WG / 32u>;
var<workgroup> red4: array<vec4<f32>, WG>;
var<workgroup> red24: array<vec4<f32>, WG / 32u>;

fn sum_all_i(t: u32, v: i32) -> i32 {
  red_i[t] = v;
  workgroupBarrier();
  if (t < WG / 32u) {
    var s = 0i;
    for (var i = 0u; i < 32u; i++) { s += red_i[32u * t + i]; }
    red2_i[t] = s;
  }
  workgroupBarrier();
  var total = 0i;
  for (var i = 0u; i < WG / 32u; i++) { total += red2_i[i]; }
  return total;
}

fn sum_all4(t: u32, v: vec4<f32>) -> vec4<f32> {
  red4[t] = v;
  workgroupBarrier();
  if (t < WG / 32u) {
    var s = vec4<f32>(0.0);
    for (var i = 0u; i < 32u; i++) { s += red4[32u * t + i]; }
    red24[t] = s;
  }
  workgroupBarrier();
  var total = vec4<f32>(0.0);
  for (var i = 0u; i < WG / 32u; i++) { total += red24[i]; }
  return total;
}
