// One AdamW step over a flat float32 tensor, in torch.optim.AdamW's order of operations
// (its single-tensor path) and with the fused multiply-adds torch's CPU kernels use, so
// the two agree to float32 rounding:
//   P = P * decay                                   decay = 1 - lr * weight_decay
//   M = lerp(M, G, w1)                              w1 = 1 - beta1, torch's two-branch lerp
//   V = V * beta2 + w2 * G * G                      w2 = 1 - beta2 (addcmul: fma(w2*G, G, .))
//   P = P + neg_step_size * M / (sqrt(V) / bc2_sqrt + eps)
// The host works the scalars out in float64 from the step count (step_size = lr / (1 - beta1^t),
// bc2_sqrt = sqrt(1 - beta2^t)), exactly as torch does, and passes them rounded to float32.
// The gradient used is STATS[1] · G, and nothing changes when STATS[2] is not 0: the engine's
// stats kernel (clip.wgsl) puts its clip coefficient and non-finite flag there, so clipping
// and skipping need no readback; WgpuAdamW passes [0, 1, 0, 0] (× 1 is exact).
// P, M and V are updated in place; G and STATS are read only.

struct Params {
  n: u32,
  decay: f32,
  w1: f32,
  beta2: f32,
  w2: f32,
  neg_step_size: f32,
  bc2_sqrt: f32,
  eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> P: array<f32>;
@group(0) @binding(2) var<storage, read> G: array<f32>;
@group(0) @binding(3) var<storage, read_write> M: array<f32>;
@group(0) @binding(4) var<storage, read_write> V: array<f32>;
@group(0) @binding(5) var<storage, read> STATS: array<f32>;  // [norm, gradient factor, skip flag, loss]

override WG: u32 = 256u;

@compute @workgroup_size(WG)
fn adamw_step(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
  // A 2-D grid lets tensors longer than 65535 workgroups * WG elements through.
  let i = gid.y * groups.x * WG + gid.x;
  if (i >= p.n || STATS[2] != 0.0) { return; }
  let g = G[i] * STATS[1];
  let param = P[i] * p.decay;
  let m_old = M[i];
  // torch's lerp: start + w * (end - start) for |w| < 0.5, else end - (end - start) * (1 - w).
  var m: f32;
  if (abs(p.w1) < 0.5) {
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
