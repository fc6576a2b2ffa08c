// Cross-entropy of logit rows against their targets, and its gradient in place, one row a
// workgroup (the rows the LM head just wrote; the vocabulary is not split here):
//   lse = max + log Σ exp(l − max),   LOSS[n] = lse − l[label]        (0 where label < 0)
//   L[n][v] ← (exp(l[v] − lse) − [v = label]) · SCALE[0]
// A row whose label is < 0 is not read and keeps its values (the engine's head runs over the
// labelled rows only; such rows fill its last tile, and their gradient goes nowhere).
// SCALE is a buffer (the step's 1 / labelled tokens, or the loss's incoming gradient) so the
// launch stays the same from step to step.

struct Params {
  vocab: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> L: array<f32>;
@group(0) @binding(2) var<storage, read> TARGET: array<i32>;
@group(0) @binding(3) var<storage, read> SCALE: array<f32>;
@group(0) @binding(4) var<storage, read_write> LOSS: array<f32>;

override WG: u32 = 256u;

// @include _reductions.wgsl

@compute @workgroup_size(WG)
fn rows(inv: Invocation, @builtin(workgroup_id) wg: vec3<u32>) {
  enter(inv);
  let t = inv.t;
  let n = wg.x;
  let row = n * p.vocab;
  let label = TARGET[n];
  let end = select(0u, p.vocab, label >= 0);  // the reductions' barriers stay in uniform control flow
  var m = -0x1.fffffep+127f;
  for (var v = t; v < end; v += WG) { m = max(m, L[row + v]); }
  m = max_all(t, m);
  var s = 0.0;
  for (var v = t; v < end; v += WG) { s += exp(L[row + v] - m); }
  let lse = m + log(sum_all(t, s));
  if (t == 0u && label < 0) { LOSS[n] = 0.0; }
  let scale = SCALE[0];
  for (var v = t; v < end; v += WG) {
    let l = L[row + v];
    var d = exp(l - lse);
    if (i32(v) == label) {  // the thread that owns the label reads it before overwriting it
      LOSS[n] = lse - l;
      d -= 1.0;
    }
    L[row + v] = d * scale;
  }
}
