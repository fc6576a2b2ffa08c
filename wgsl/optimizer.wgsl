// One optimizer step of the engine's adapters, entirely on the GPU, over the flat gradient G
// and parameter P buffers (every adapter, one layout):
//   sumsq   PART[w] = Σ G[i]² over workgroup w's grid-stride share
//   stats   STATS = [‖G‖, clip coefficient, non-finite flag, loss sum]: the global-norm clip of
//           torch.nn.utils.clip_grad_norm_ (coef = min(1, max_norm / (‖G‖ + 1e-6)); max_norm 0: off),
//           and a flag when the norm or the loss is not finite (the step is then skipped)
//   adamw   torch.optim.AdamW's update (adamw.wgsl's, op for op) of P, M, V from coef · G,
//           unless the flag is set
// Only STATS goes back to the host.

struct Params {
  n: u32,
  losses: u32,        // stats: rows of LOSS
  max_norm: f32,
  decay: f32,
  w1: f32,
  beta2: f32,
  w2: f32,
  neg_step_size: f32,
  bc2_sqrt: f32,
  eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> G: array<f32>;
@group(0) @binding(2) var<storage, read_write> PART: array<f32>;
@group(0) @binding(3) var<storage, read> PARTS: array<f32>;
@group(0) @binding(4) var<storage, read> LOSS: array<f32>;
@group(0) @binding(5) var<storage, read_write> STATS: array<f32>;
@group(0) @binding(6) var<storage, read_write> P: array<f32>;
@group(0) @binding(7) var<storage, read_write> M: array<f32>;
@group(0) @binding(8) var<storage, read_write> V: array<f32>;
@group(0) @binding(9) var<storage, read> STATS_IN: array<f32>;

override WG: u32 = 256u;
override PARTIALS: u32 = 256u;  // workgroups of sumsq

var<workgroup> red: array<f32, WG>;

fn reduce(t: u32, v: f32) -> f32 {
  red[t] = v;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s >>= 1u) {
    if (t < s) { red[t] += red[t + s]; }
    workgroupBarrier();
  }
  let r = red[0];
  workgroupBarrier();
  return r;
}

@compute @workgroup_size(WG)
fn sumsq(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  var s = 0.0;
  for (var i = wg.x * WG + t; i < p.n; i += PARTIALS * WG) { let g = G[i]; s += g * g; }
  let total = reduce(t, s);
  if (t == 0u) { PART[wg.x] = total; }
}

@compute @workgroup_size(WG)
fn stats(@builtin(local_invocation_index) t: u32) {
  var s = 0.0;
  for (var i = t; i < PARTIALS; i += WG) { s += PARTS[i]; }
  let total = reduce(t, s);
  var l = 0.0;
  for (var i = t; i < p.losses; i += WG) { l += LOSS[i]; }
  let loss = reduce(t, l);
  if (t == 0u) {
    let norm = sqrt(total);
    let finite = norm <= 3.4028235e38 && loss <= 3.4028235e38 && loss >= -3.4028235e38;  // false for NaN too
    var coef = 1.0;
    if (p.max_norm > 0.0) { coef = min(1.0, p.max_norm / (norm + 1e-6)); }
    STATS[0] = norm;
    STATS[1] = coef;
    STATS[2] = select(1.0, 0.0, finite);
    STATS[3] = loss;
  }
}

@compute @workgroup_size(WG)
fn adamw(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
  let i = gid.y * groups.x * WG + gid.x;
  if (i >= p.n || STATS_IN[2] != 0.0) { return; }
  let g = G[i] * STATS_IN[1];
  let param = P[i] * p.decay;
  let m_old = M[i];
  var m: f32;
  if (abs(p.w1) < 0.5) {  // torch's two-branch lerp
    m = fma(p.w1, g - m_old, m_old);
  } else {
    m = fma(-(g - m_old), 1.0 - p.w1, g);
  }
  let v = fma(p.w2 * g, g, V[i] * p.beta2);
  let denom = sqrt(v) / p.bc2_sqrt + p.eps;
  M[i] = m;
  V[i] = v;
  P[i] = param + p.neg_step_size * m / denom;
}
