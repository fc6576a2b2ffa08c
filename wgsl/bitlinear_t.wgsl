// BitLinear's straight-through backward: the input gradient through ternary weights read packed,
//   OUT[n][k] (+)= Σ_j (A[n][j] ∘ c_j) · t[j][k]  (+ Σ_r DH[n][r] · LA[r][k] with lora_rank > 0)
// where ∘ is division by WS[j] (DIVIDE: BitLinear and online AutoBitLinear, y = dot / (ws·s)) or
// multiplication (offline AutoBitLinear, y = dot / s · ws): activation quantisation counts as the
// identity, as transformers' STE and this package's packed-BitLinear STE have it. The LoRA term
// is the adapters' own input gradient (DH = s·dY·B per adapter, LA their stacked A).
//
// 64 tokens × 64 input features a workgroup of 128 threads, 8 tokens × 4 features a thread, the
// output rows j in steps of 16 through workgroup memory. Each step's 16 × 64 weights are decoded
// once, by the threads that load them (one shift and mask gives four codes), into floats the
// whole workgroup reads.

struct Params {
  tokens: u32,
  rows: u32,        // J: weight rows (output features of the forward projection)
  k_words: u32,     // u32 words per weight row
  a_stride: u32,    // floats per row of A
  out_stride: u32,  // floats per row of OUT
  k: u32,           // input features written (the rest of a row is left alone)
  lora_rank: u32,   // rows of LA / floats per row of DH used (0: none)
  dh_stride: u32,
  la_stride: u32,
  accumulate: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> W: array<u32>;
@group(0) @binding(3) var<storage, read> WS: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(5) var<storage, read> DH: array<f32>;
@group(0) @binding(6) var<storage, read> LA: array<f32>;

override DIVIDE: bool = true;

var<workgroup> as_: array<vec4<f32>, 256>;  // [j (16)][token quad (16)]: A scaled, 4 tokens a vec4
var<workgroup> ws_: array<vec4<f32>, 256>;  // [j (16)][feature quad (16)]: decoded weights

@compute @workgroup_size(128)
fn gemm_t(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
  let tk = t % 16u;   // features 4tk.. of the tile
  let tt = t / 16u;   // tokens 8tt..
  let n0 = wg.y * 64u;
  let k0 = wg.x * 64u;
  var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
  var a4 = vec4<f32>(0.0); var a5 = vec4<f32>(0.0); var a6 = vec4<f32>(0.0); var a7 = vec4<f32>(0.0);
  // loads: A, rows t % 16 of the step for token quads t / 16 and t / 16 + 8 (whole vec4 stores);
  // W, t < 64: row t / 4, word t % 4
  let jl = t % 16u;
  for (var j0 = 0u; j0 < p.rows; j0 += 16u) {
    let j = j0 + jl;
    var c = 0.0;
    if (j < p.rows) { c = WS[j]; }
    for (var h = 0u; h < 2u; h++) {
      let quad = t / 16u + 8u * h;
      var v = vec4<f32>(0.0);
      if (j < p.rows) {
        for (var i = 0u; i < 4u; i++) {
          let dy = A[min(n0 + 4u * quad + i, p.tokens - 1u) * p.a_stride + j];
          if (DIVIDE) { v[i] = dy / c; } else { v[i] = dy * c; }
        }
      }
      as_[jl * 16u + quad] = v;
    }
    if (t < 64u) {
      let j = j0 + t / 4u;
      let word = select(0x55555555u, W[min(j, p.rows - 1u) * p.k_words + wg.x * 4u + t % 4u], j < p.rows);
      let base = (t / 4u) * 16u + 4u * (t % 4u);
      for (var pair = 0u; pair < 4u; pair++) {
        ws_[base + pair] = vec4<f32>(unpack4xU8((word >> (2u * pair)) & 0x03030303u)) - vec4<f32>(1.0);
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
