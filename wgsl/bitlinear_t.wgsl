// BitLinear's straight-through backward: the input gradient through ternary weights read packed,
//   OUT[n][k] (+)= Σ_j (A[n][j] ∘ c_j) · t[j][k]  (+ Σ_r DH[n][r] · LA[r][k] with lora_rank > 0)
// where ∘ is division by WS[j] (DIVIDE: BitLinear and online AutoBitLinear, y = dot / (ws·s)) or
// multiplication (offline AutoBitLinear, y = dot / s · ws): activation quantisation counts as the
// identity, as transformers' STE and this package's packed-BitLinear STE have it. The LoRA term
// is the adapters' own input gradient (DH = s·dY·B per adapter, LA their stacked A; with DROPOUT
// each adapter's term masked by its dropout).
//
// Tiling (_gemm_t_tile.wgsl): 64 tokens × 64 input features a workgroup of 128 threads, 8 tokens
// × 8 features a thread, rows j in steps of 32 through workgroup memory, each half of the
// workgroup summing 16 rows of a step. A step's 32 × 64 weights are 128 packed words, one a
// thread, decoded by that thread (one shift and mask gives four codes) into floats the whole
// workgroup reads; A is scaled by c_j as it is loaded.

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
  drop_key: u32,
  drop_split1: u32,
  drop_split2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> W: array<u32>;
@group(0) @binding(3) var<storage, read> WS: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> DH: array<f32>;
@group(0) @binding(6) var<storage, read> LA: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> PART: array<vec4<f32>>;  // SPLITS > 1: the ranges' raw sums
@group(0) @binding(8) var<storage, read> DROP: array<u32>;  // DROPOUT: _dropout.wgsl's state

override DIVIDE: bool = true;

const ZERO_CODES: u32 = 0x55555555u;  // sixteen weights of value 0 (code 1)

struct Staged {
  a: mat4x4<f32>,  // fetch_a's A times 1 / WS[j] (DIVIDE) or WS[j]
  w: u32,          // word t % 4 of row j0 + t / 4: its 16 features
}

fn fetch(t: u32, n0: u32, k0: u32, j0: u32) -> Staged {
  let c = WS[min(j0 + t % STEP, p.rows - 1u)];  // past the last row A is zero anyway
  let j = j0 + t / 4u;
  let word = W[min(j, p.rows - 1u) * p.k_words + k0 / 16u + t % 4u];
  return Staged(fetch_a(t, n0, j0, 0u) * select(c, 1.0 / c, DIVIDE), select(ZERO_CODES, word, j < p.rows));
}

fn stage(t: u32, s: Staged) {
  put_a(t, s.a);
  let j = t / 4u;
  let quad = 4u * (t % 4u);
  for (var pair = 0u; pair < 4u; pair++) {  // features 4·pair.. of the word are its bytes' bit pair `pair`
    tile[W_TILE + at(j, quad + pair)] = vec4<f32>(unpack4xU8((s.w >> (2u * pair)) & 0x03030303u)) - vec4<f32>(1.0);
  }
}

fn row_span(n0: u32, k0: u32) -> vec2<u32> { return vec2<u32>(0u, p.rows); }

// @include _gemm_t_tile.wgsl
// @include _dropout.wgsl
// @include _input_grad_store.wgsl
