// The input gradient of a float projection (the dense flavour's projections, the LM head):
//   OUT[n][k] (+)= Σ_j A[n][a_col + j] · W[j][k]   (+ Σ_r DH[n][r] · LA[r][k] with lora_rank > 0)
// W is the forward's weight, rows j of K features (padded to 64) as float32 or, with BF16, raw
// bfloat16 pairs (widened once as each step's tile is loaded). The LoRA term is the adapters' own
// input gradient (DH = s·dY·B, LA their A; with DROPOUT each adapter's term masked by its dropout).
//
// Tiling (_gemm_t_tile.wgsl): 64 tokens × 64 features a workgroup of 128 threads, 8 tokens × 8
// features a thread, rows j in steps of 32 through workgroup memory, each half of the workgroup
// summing 16 rows of a step.

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
  drop_key: u32,
  drop_split1: u32,
  drop_split2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> OUT: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> DH: array<f32>;
@group(0) @binding(5) var<storage, read> LA: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> PART: array<vec4<f32>>;  // SPLITS > 1: the ranges' raw sums
@group(0) @binding(7) var<storage, read> DROP: array<u32>;  // DROPOUT: _dropout.wgsl's state

override BF16: bool = false;

fn lo(w: u32) -> f32 { return bitcast<f32>(w << 16u); }
fn hi(w: u32) -> f32 { return bitcast<f32>(w & 0xffff0000u); }

struct Staged {
  a: mat4x4<f32>,          // fetch_a
  w: array<vec4<u32>, 4>,  // float32: quad t % 16 of rows j0 + t / 16 + 8i; BF16 (w[0], w[1]):
                           // word t % 8 (8 bfloat16 values) of rows j0 + t / 8 + 16i
}

// W's vec4 word `word` of row j; zeros past the last row.
fn weight_word(j: u32, word: u32) -> vec4<u32> {
  return select(vec4<u32>(0u), W[min(j, p.rows - 1u) * (p.w_words / 4u) + word], j < p.rows);
}

fn fetch(t: u32, n0: u32, k0: u32, j0: u32) -> Staged {
  var s: Staged;
  s.a = fetch_a(t, n0, j0, p.a_col);
  if (BF16) {  // a row's 64 features are 8 words
    let j = j0 + t / 8u;
    let word = k0 / 8u + t % 8u;
    s.w[0] = weight_word(j, word);
    s.w[1] = weight_word(j + 16u, word);
  } else {  // 16 words a row
    let j = j0 + t / 16u;
    let word = k0 / 4u + t % 16u;
    s.w[0] = weight_word(j, word);
    s.w[1] = weight_word(j + 8u, word);
    s.w[2] = weight_word(j + 16u, word);
    s.w[3] = weight_word(j + 24u, word);
  }
  return s;
}

// Eight bfloat16 values, widened exactly, into quads `quad` and quad + 1 of step row j.
fn put_bf16(j: u32, quad: u32, w: vec4<u32>) {
  tile[W_TILE + at(j, quad)] = vec4<f32>(lo(w.x), hi(w.x), lo(w.y), hi(w.y));
  tile[W_TILE + at(j, quad + 1u)] = vec4<f32>(lo(w.z), hi(w.z), lo(w.w), hi(w.w));
}

fn stage(t: u32, s: Staged) {
  put_a(t, s.a);
  if (BF16) {
    let j = t / 8u;
    let quad = 2u * (t % 8u);
    put_bf16(j, quad, s.w[0]);
    put_bf16(j + 16u, quad, s.w[1]);
  } else {
    let j = t / 16u;
    let quad = t % 16u;
    tile[W_TILE + at(j, quad)] = bitcast<vec4<f32>>(s.w[0]);
    tile[W_TILE + at(j + 8u, quad)] = bitcast<vec4<f32>>(s.w[1]);
    tile[W_TILE + at(j + 16u, quad)] = bitcast<vec4<f32>>(s.w[2]);
    tile[W_TILE + at(j + 24u, quad)] = bitcast<vec4<f32>>(s.w[3]);
  }
}

fn row_span(n0: u32, k0: u32) -> vec2<u32> { return vec2<u32>(0u, p.rows); }

// @include _gemm_t_tile.wgsl
// @include _dropout.wgsl
// @include _input_grad_store.wgsl
