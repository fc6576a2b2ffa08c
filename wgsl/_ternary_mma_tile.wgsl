// Shared by bitlinear_mma.wgsl and bitlinear_t_mma.wgsl (// @include): the main loop of a GEMM on
// the matrix units, int8 rows × ternary weights → i32, generic over the adapter's subgroup-matrix
// shape. The runtime writes SM_M, SM_N, SM_K (the int8 × int8 → i32 configuration: 16 × 16 × 32 on
// NVIDIA, 8 × 8 × 8 on lavapipe), SM_SUBGROUP (its subgroup size) and SM_STORAGE (the device's bytes
// of workgroup memory) before the source.
//
//   C[r][c] = Σ_κ A[r][κ] · T[c][κ]    (W_T false: the weights' rows are C's columns, a projection)
//   C[r][c] = Σ_κ A[r][κ] · T[κ][c]    (W_T true: the weights' rows are the sum, an input gradient)
//
// A: int8 rows, four to a u32 (vec4 loads of 16), its rows in DIGITS planes of `a_tokens` rows each
// (a projection's codes: one plane; an input gradient's digits: one plane a digit). T: the packed
// ternary weights (weights.py's layout: 16 a u32, codes t + 1).
//
// A workgroup of SUB_M × SUB_N subgroups owns BM staged rows of A × BN columns of C; subgroup
// (sr, sc) holds TM × TN result matrices. The staged rows are the DIGITS planes' rows of the
// workgroup's BM / DIGITS tokens, plane by plane, so with DIGITS = SUB_M subgroup row sr holds plane
// sr. Each step of KSTEP along the sum is staged in workgroup memory (A as it is; the weights
// unpacked to int8), rows padded by PAD bytes against bank conflicts; the next step's global loads are
// issued right after the barrier, before this step's multiplies. Rows, columns and sums past their
// ends are staged as zeros. Every loop over registers has an override bound (runtime/backends/dawn.py).
//
// The including file declares Params with a_tokens (rows of a plane), a_words (u32 words a row of
// A), rows (the weights' rows), t_words (u32 words a weight row), and the bindings AQ
// (array<vec4<u32>>) and T4 (array<vec4<u32>>).

alias L = subgroup_matrix_left<i8, SM_K, SM_M>;
alias R = subgroup_matrix_right<i8, SM_N, SM_K>;
alias O = subgroup_matrix_result<i32, SM_N, SM_M>;

override SUB_M: u32 = 4u;     // subgroups along the rows of A
override SUB_N: u32 = 2u;     // subgroups along the columns of C
override TM: u32 = 2u;        // result matrices a subgroup along the rows (TM · TN ≤ ACC_MAX)
override TN: u32 = 4u;        // and along the columns (≤ 4)
override KSTEP: u32 = 128u;   // the sum's step staged at once: a multiple of 64 and of SM_K
override PAD: u32 = 16u;      // bytes after each staged row
override DIGITS: u32 = 1u;    // planes of A rows (1, or SUB_M)
override W_T: bool = false;
override WG: u32 = SUB_M * SUB_N * SM_SUBGROUP;
override BM: u32 = SUB_M * TM * SM_M;              // staged rows of A
override BN: u32 = SUB_N * TN * SM_N;              // columns of C
override A_STRIDE: u32 = KSTEP + PAD;              // bytes a staged row of A
override T_ROWS: u32 = select(BN, KSTEP, W_T);     // staged weights: [T_ROWS][T_COLS]
override T_COLS: u32 = select(KSTEP, BN, W_T);
override T_STRIDE: u32 = T_COLS + PAD;
override A_LOADS: u32 = (BM * KSTEP / 16u + WG - 1u) / WG;         // vec4 loads a thread a step (≤ LOADS_MAX)
override T_LOADS: u32 = (T_ROWS * T_COLS / 64u + WG - 1u) / WG;

const ACC_MAX: u32 = 16u;
const LOADS_MAX: u32 = 8u;
// Workgroup memory for the staged rows: half the device's each (SM_STORAGE, which the runtime writes
// too), a constant, as subgroupMatrixLoad takes arrays of a constant length (gemms.mma_shape checks
// that a tile fits).
const STAGED_WORDS: u32 = SM_STORAGE / 8u;
const ZERO_CODES: u32 = 0x55555555u;  // sixteen weights of value 0 (code 1)

var<workgroup> As: array<i32, STAGED_WORDS>;  // [BM][KSTEP + PAD] bytes; after the loop, put_result's
var<workgroup> Ts: array<i32, STAGED_WORDS>;  // [T_ROWS][T_COLS + PAD] bytes

// The four int8 weights of bit pair `shift / 2` of each byte lane: code c = t + 1 → t (no byte
// borrows: every byte is at least 0x80 when 1 is taken away).
fn unpacked(word: u32, shift: u32) -> i32 {
  return bitcast<i32>(((((word >> shift) & 0x03030303u) | 0x80808080u) - 0x01010101u) ^ 0x80808080u);
}

struct Fetched {
  a: array<vec4<u32>, LOADS_MAX>,
  t: array<vec4<u32>, LOADS_MAX>,
}

// Step kk's global loads for the workgroup at staged row r0's tokens (a token offset) and column c0.
fn fetch(t: u32, tok0: u32, c0: u32, kk: u32, k_end: u32) -> Fetched {
  var f: Fetched;
  for (var q = 0u; q < A_LOADS; q++) {
    let v = t + WG * q;  // vec4 v of the staged A: row v / (KSTEP / 16), 16 bytes (v % (KSTEP / 16))
    let r = v / (KSTEP / 16u);
    let tok = tok0 + r % (BM / DIGITS);
    let kb = kk + 16u * (v % (KSTEP / 16u));
    f.a[q] = vec4<u32>(0u);
    if (v < BM * KSTEP / 16u && tok < p.a_tokens && kb < k_end) {
      f.a[q] = AQ[((r / (BM / DIGITS)) * p.a_tokens + tok) * (p.a_words / 4u) + kb / 16u];
    }
  }
  for (var q = 0u; q < T_LOADS; q++) {
    let v = t + WG * q;  // vec4 v of the staged weights: row v / (T_COLS / 64), 64 weights (v % (T_COLS / 64))
    let r = v / (T_COLS / 64u);
    let cb = 64u * (v % (T_COLS / 64u));
    var row = c0 + r;  // W_T false: the weights' row is C's column, its words run along the sum
    var col = kk + cb;
    if (W_T) {         // W_T true: the weights' row is along the sum, its words along C's columns
      row = kk + r;
      col = c0 + cb;
    }
    f.t[q] = vec4<u32>(ZERO_CODES);  // past the rows or a row's end (A is zero past the sum's end)
    if (v < T_ROWS * T_COLS / 64u && row < p.rows && col < 16u * p.t_words) {
      f.t[q] = T4[(row * p.t_words + col / 16u) / 4u];
    }
  }
  return f;
}

fn stage(t: u32, f: ptr<function, Fetched>) {
  for (var q = 0u; q < A_LOADS; q++) {
    let v = t + WG * q;
    if (v < BM * KSTEP / 16u) {
      let b = ((v / (KSTEP / 16u)) * A_STRIDE + 16u * (v % (KSTEP / 16u))) / 4u;
      let a = (*f).a[q];
      As[b] = bitcast<i32>(a.x); As[b + 1u] = bitcast<i32>(a.y); As[b + 2u] = bitcast<i32>(a.z);
      As[b + 3u] = bitcast<i32>(a.w);
    }
  }
  for (var q = 0u; q < T_LOADS; q++) {
    let v = t + WG * q;
    if (v < T_ROWS * T_COLS / 64u) {
      let b = ((v / (T_COLS / 64u)) * T_STRIDE + 64u * (v % (T_COLS / 64u))) / 4u;
      let w = (*f).t[q];
      Ts[b] = unpacked(w.x, 0u); Ts[b + 1u] = unpacked(w.x, 2u); Ts[b + 2u] = unpacked(w.x, 4u);
      Ts[b + 3u] = unpacked(w.x, 6u);
      Ts[b + 4u] = unpacked(w.y, 0u); Ts[b + 5u] = unpacked(w.y, 2u); Ts[b + 6u] = unpacked(w.y, 4u);
      Ts[b + 7u] = unpacked(w.y, 6u);
      Ts[b + 8u] = unpacked(w.z, 0u); Ts[b + 9u] = unpacked(w.z, 2u); Ts[b + 10u] = unpacked(w.z, 4u);
      Ts[b + 11u] = unpacked(w.z, 6u);
      Ts[b + 12u] = unpacked(w.w, 0u); Ts[b + 13u] = unpacked(w.w, 2u); Ts[b + 14u] = unpacked(w.w, 4u);
      Ts[b + 15u] = unpacked(w.w, 6u);
    }
  }
}

// Right matrix j of the subgroup's column sc at sub-step q of the staged step.
fn right(sc: u32, j: u32, q: u32) -> R {
  let c = sc * TN * SM_N + j * SM_N;
  if (W_T) { return subgroupMatrixLoad<R>(&Ts, q * SM_K * T_STRIDE + c, false, T_STRIDE); }
  return subgroupMatrixLoad<R>(&Ts, c * T_STRIDE + q * SM_K, true, T_STRIDE);
}

// Adds to acc the subgroup (sr, sc)'s sums over [k_begin, k_end) of the workgroup at token tok0 and
// column c0 (every invocation of the workgroup calls it: it stages with barriers).
fn multiply(t: u32, sr: u32, sc: u32, tok0: u32, c0: u32, k_begin: u32, k_end: u32,
            acc: ptr<function, array<O, ACC_MAX>>) {
  var f = fetch(t, tok0, c0, k_begin, k_end);
  for (var kk = k_begin; kk < k_end; kk += KSTEP) {
    stage(t, &f);
    workgroupBarrier();
    if (kk + KSTEP < k_end) { f = fetch(t, tok0, c0, kk + KSTEP, k_end); }
    for (var q = 0u; q < KSTEP / SM_K; q++) {
      var b: array<R, 4>;
      for (var j = 0u; j < TN; j++) { b[j] = right(sc, j, q); }
      for (var i = 0u; i < TM; i++) {
        let a = subgroupMatrixLoad<L>(&As, (sr * TM * SM_M + i * SM_M) * A_STRIDE + q * SM_K, false, A_STRIDE);
        for (var j = 0u; j < TN; j++) {
          (*acc)[i * TN + j] = subgroupMatrixMultiplyAccumulate(a, b[j], (*acc)[i * TN + j]);
        }
      }
    }
    workgroupBarrier();
  }
}

// The epilogue's staging: result matrix m of subgroup sg at As[sg · SM_M · SM_N ..] (row-major, SM_N a row).
fn put_result(sg: u32, m: O) {
  subgroupMatrixStore(&As, sg * SM_M * SM_N, m, false, SM_N);
}
