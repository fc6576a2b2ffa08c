// The input gradient of a float projection (the dense flavour's projections, the LM head):
//   OUT[n][k] (+)= Σ_j A[n][a_col + j] · W[j][k]   (+ Σ_r DH[n][r] · LA[r][k] with lora_rank > 0)
// W is the forward's weight, rows j of K features (padded to 64) as float32 or, with BF16, raw
// bfloat16 pairs (widened once as each step's tile is loaded). The LoRA term is the adapters' own
// input gradient (DH = s·dY·B, LA their A).
//
// 64 tokens × 64 features a workgroup of 128 threads, 8 tokens × 4 features a thread, rows j in
// steps of 16 through workgroup memory.

struct Params {
  tokens: u32,
  rows: u32,        // J
  w_words: u32,     // u32 words per weight row
  a_stride: u32,    // floats per row of A
  a_col: u32,       // A[n][j] is read at column a_col + j (a vocabulary chunk of dlogits)
  out_stride: u32,
  k: u32,           // features written
  lora_rank: u32,
  dh_stride: u32,
  la_stride: u32,
  accumulate: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(4) var<storage, read> DH: array<f32>;
@group(0) @binding(5) var<storage, read> LA: array<f32>;

override BF16: bool = false;

var<workgroup> as_: array<vec4<f32>, 256>;  // [j (16)][token quad (16)]
var<workgroup> ws_: array<vec4<f32>, 256>;  // [j (16)][feature quad (16)]

fn lo(w: u32) -> f32 { return bitcast<f32>(w << 16u); }
fn hi(w: u32) -> f32 { return bitcast<f32>(w & 0xffff0000u); }

@compute @workgroup_size(128)
fn gemm_t(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let tk = t % 16u;
  let tt = t / 16u;
  let n0 = wg.y * 64u;
  let k0 = wg.x * 64u;
  var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
  var a4 = vec4<f32>(0.0); var a5 = vec4<f32>(0.0); var a6 = vec4<f32>(0.0); var a7 = vec4<f32>(0.0);
  let jl = t % 16u;
  let row_words = p.w_words / 4u;  // vec4 words per weight row
  for (var j0 = 0u; j0 < p.rows; j0 += 16u) {
    let j = j0 + jl;
    for (var h = 0u; h < 2u; h++) {  // A: rows t % 16 of the step, token quads t / 16 and t / 16 + 8
      let quad = t / 16u + 8u * h;
      var v = vec4<f32>(0.0);
      if (j < p.rows) {
        for (var i = 0u; i < 4u; i++) {
          v[i] = A[min(n0 + 4u * quad + i, p.tokens - 1u) * p.a_stride + p.a_col + j];
        }
      }
      as_[jl * 16u + quad] = v;
    }
    if (BF16) {  // a row's 64 features are 8 words of 8 bfloat16 values: one word a thread
      let j = j0 + t / 8u;
      let w = W[min(j, p.rows - 1u) * row_words + k0 / 8u + t % 8u];
      let live = select(0.0, 1.0, j < p.rows);
      let at = (t / 8u) * 16u + 2u * (t % 8u);
      ws_[at] = live * vec4<f32>(lo(w.x), hi(w.x), lo(w.y), hi(w.y));
      ws_[at + 1u] = live * vec4<f32>(lo(w.z), hi(w.z), lo(w.w), hi(w.w));
    } else {  // 16 words of 4 floats a row: two a thread
      for (var i = 0u; i < 2u; i++) {
        let idx = t + 128u * i;
        let j = j0 + idx / 16u;
        let live = select(0.0, 1.0, j < p.rows);
        ws_[idx] = live * bitcast<vec4<f32>>(W[min(j, p.rows - 1u) * row_words + k0 / 4u + idx % 16u]);
      }
    }
    workgroupBarrier();
    for (var jj = 0u; jj < 16u; jj++) {
      let w = ws_[jj * 16u + tk];
      let x0 = as_[jj * 16u + 2u * tt];
      let x1 = as_[jj * 16u + 2u * tt + 1u];
      a0 += x0.x * w; a1 += x0.y * w; a2 += x0.z * w; a3 += x0.w * w;
      a4 += x1.x * w; a5 += x1.y * w; a6 += x1.z * w; a7 += x1.w * w;
    }
    workgroupBarrier();
  }
  let n = n0 + 8u * tt;
  let k = k0 + 4u * tk;
  store(n, k, a0); store(n + 1u, k, a1); store(n + 2u, k, a2); store(n + 3u, k, a3);
  store(n + 4u, k, a4); store(n + 5u, k, a5); store(n + 6u, k, a6); store(n + 7u, k, a7);
}

// @include _input_grad_store.wgsl
