// The global-norm clip of an optimizer step, on the GPU, over a flat gradient G (every
// adapter of a model):
//   sumsq   PART[w] = Σ G[i]² over workgroup w's grid-stride share
//   stats   STATS = [‖G‖, clip coefficient, non-finite flag, loss sum]: the global-norm clip of
//           torch.nn.utils.clip_grad_norm_ (coef = min(1, max_norm / (‖G‖ + 1e-6)); max_norm 0: off),
//           and a flag when the norm or the loss is not finite (the step is then skipped)
// adamw.wgsl then updates the adapters from coef · G unless the flag is set; only STATS goes
// back to the host.

struct Params {
  n: u32,
  losses: u32,        // stats: rows of LOSS
  max_norm: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> G: array<f32>;
@group(0) @binding(2) var<storage, read_write> PART: array<f32>;
@group(0) @binding(3) var<storage, read> PARTS: array<f32>;
@group(0) @binding(4) var<storage, read> LOSS: array<f32>;
@group(0) @binding(5) var<storage, read_write> STATS: array<f32>;

override WG: u32 = 256u;
override PARTIALS: u32 = 256u;  // workgroups of sumsq

// @include _reductions.wgsl

@compute @workgroup_size(WG)
fn sumsq(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  let t = inv.t;
  var s = 0.0;
  for (var i = wg.x * WG + t; i < p.n; i += PARTIALS * WG) { let g = G[i]; s += g * g; }
  let total = sum_all(t, s);
  if (t == 0u) { PART[wg.x] = total; }
}

@compute @workgroup_size(WG)
fn stats(inv: Invocation) {
  enter(inv);
  let t = inv.t;
  var s = 0.0;
  for (var i = t; i < PARTIALS; i += WG) { s += PARTS[i]; }
  let total = sum_all(t, s);
  var l = 0.0;
  for (var i = t; i < p.losses; i += WG) { l += LOSS[i]; }
  let loss = sum_all(t, l);
  if (t == 0u) {
    let norm = sqrt(total);
    let finite = norm <= 0x1.fffffep+127f && loss <= 0x1.fffffep+127f && loss >= -0x1.fffffep+127f;  // false for NaN too
    var coef = 1.0;
    if (p.max_norm > 0.0) { coef = min(1.0, p.max_norm / (norm + 1e-6)); }
    STATS[0] = norm;
    STATS[1] = coef;
    STATS[2] = select(1.0, 0.0, finite);
    STATS[3] = loss;
  }
}
