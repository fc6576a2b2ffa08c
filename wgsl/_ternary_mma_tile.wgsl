// Shared by bitlinear_mma.wgsl and bitlinear_t_mma.wgsl (// @include, beside _mma_tile.wgsl, the
// loop it stages for): the staging of a GEMM on the matrix units, int8 rows × ternary weights → i32.
// The runtime writes SM_M, SM_N, SM_K (the int8 × int8 → i32 configuration: 16 × 16 × 32 on NVIDIA,
// 8 × 8 × 8 on lavapipe), SM_SUBGROUP (its subgroup size) and SM_STORAGE (the device's bytes of
// workgroup memory) before the source.
//
//   C[r][c] = Σ_κ A[r][κ] · T[c][κ]
//
// A: int8 rows, four to a u32 (vec4 loads of 16), its rows in DIGITS planes of `a_tokens` rows each
// (a projection's codes: one plane; an input gradient's digits: one plane a digit). T: packed
// ternary weights (weights.py's layout: 16 a u32, codes t + 1), a row a column of C: a projection's
// own weights, an input gradient's transposed copy (bitlinear.py's transposed_weights), so that both
// stage their weights alike, as [BN][KSTEP] (on the H100 a row-major int8 right matrix loaded 2.2×
// slower than a column-major one, and an input gradient that transposed the weights' words as it
// staged them took 1.16-1.35× the time it takes from the transposed copy: device run 27).
// A step is staged as A's rows as they are and the weights unpacked to int8, rows padded by PAD
// bytes; rows, columns and sums past their ends are staged as zeros (KSTEP a multiple of 64: a vec4
// of packed weights holds 64). The results are staged in the same workgroup memory, after the loop.
//
// The including file declares Params with a_tokens (rows of a plane), a_words (u32 words a row of
// A), t_rows (T's rows), t_words (u32 words a row of T: a multiple of 4), and the bindings AQ
// (array<vec4<u32>>) and T4 (array<vec4<u32>>).

alias L = subgroup_matrix_left<i8, SM_K, SM_M>;
alias R = subgroup_matrix_right<i8, SM_N, SM_K>;
alias O = subgroup_matrix_result<i32, SM_N, SM_M>;

override A_STRIDE: u32 = KSTEP + PAD;              // bytes a staged row of A
override T_STRIDE: u32 = KSTEP + PAD;              // bytes a staged row of weights: [BN][KSTEP]
override A_LOADS: u32 = (BM * KSTEP / 16u + WG - 1u) / WG;         // vec4 loads a thread a step (≤ 8)
override B_LOADS: u32 = (BN * KSTEP / 64u + WG - 1u) / WG;          // of 64 weights each

override A_WORDS: u32 = BM * A_STRIDE / 4u;  // the staged A [BM][A_STRIDE] bytes, then the weights
// Workgroup memory: the device's (SM_STORAGE, which the runtime writes too), a constant, as
// subgroupMatrixLoad takes arrays of a constant length (gemms.mma_shape checks that the staged step,
// and the results put_results stages after the loop, fit).
const STAGED_WORDS: u32 = SM_STORAGE / 4u;
const ZERO_CODES: u32 = 0x55555555u;  // sixteen weights of value 0 (code 1)

var<workgroup> Staged: array<i32, STAGED_WORDS>;  // A's rows, then the weights' [BN][T_STRIDE] bytes

// The four int8 weights of bit pair `shift / 2` of each byte lane: code c = t + 1 → t (no byte
// borrows: every byte is at least 0x80 when 1 is taken away).
fn unpacked(word: u32, shift: u32) -> i32 {
  return bitcast<i32>(((((word >> shift) & 0x03030303u) | 0x80808080u) - 0x01010101u) ^ 0x80808080u);
}

// The staged A's vec4 v (this thread's q-th: v = t + WG · q) of step kk: row v / (KSTEP / 16), 16 bytes
// (v % (KSTEP / 16)); zero past the tokens, the sum's end or the tile.
fn load_a(v: u32, tok0: u32, kk: u32, k_end: u32) -> vec4<u32> {
  let r = v / (KSTEP / 16u);
  let tok = tok0 + r % (BM / DIGITS);
  let kb = kk + 16u * (v % (KSTEP / 16u));
  if (v >= BM * KSTEP / 16u || tok >= p.a_tokens || kb >= k_end) { return vec4<u32>(0u); }
  return AQ[((r / (BM / DIGITS)) * p.a_tokens + tok) * (p.a_words / 4u) + kb / 16u];
}

// The staged weights' load v of step kk: the vec4 of row c0 + v / (KSTEP / 64) holding the sum's
// weights 64 (v % (KSTEP / 64)).. of the step; zero past the rows or a row's end (A is zero past the
// sum's end, k_end).
fn load_b(v: u32, c0: u32, kk: u32, k_end: u32) -> vec4<u32> {
  let row = c0 + v / (KSTEP / 64u);
  let col = kk + 64u * (v % (KSTEP / 64u));
  if (v >= BN * KSTEP / 64u || row >= p.t_rows || col >= 16u * p.t_words) { return vec4<u32>(ZERO_CODES); }
  return T4[(row * p.t_words + col / 16u) / 4u];
}

fn a_offset(v: u32) -> u32 { return (v / (KSTEP / 16u)) * A_STRIDE + 16u * (v % (KSTEP / 16u)); }  // bytes

fn t_offset(v: u32) -> u32 { return (v / (KSTEP / 64u)) * T_STRIDE + 64u * (v % (KSTEP / 64u)); }  // bytes

fn put_a(v: u32, a: vec4<u32>) {
  if (v >= BM * KSTEP / 16u) { return; }
  let b = a_offset(v) / 4u;
  Staged[b] = bitcast<i32>(a.x); Staged[b + 1u] = bitcast<i32>(a.y); Staged[b + 2u] = bitcast<i32>(a.z);
  Staged[b + 3u] = bitcast<i32>(a.w);
}

// Staged weights [BN][KSTEP] (the columns of C as rows, the sum along them, so that the right
// matrices load column-major, the layout int8 matrix units read natively).
fn put_b(v: u32, w: vec4<u32>) {
  if (v >= BN * KSTEP / 64u) { return; }
  let b = A_WORDS + t_offset(v) / 4u;
  Staged[b] = unpacked(w.x, 0u); Staged[b + 1u] = unpacked(w.x, 2u); Staged[b + 2u] = unpacked(w.x, 4u);
  Staged[b + 3u] = unpacked(w.x, 6u);
  Staged[b + 4u] = unpacked(w.y, 0u); Staged[b + 5u] = unpacked(w.y, 2u); Staged[b + 6u] = unpacked(w.y, 4u);
  Staged[b + 7u] = unpacked(w.y, 6u);
  Staged[b + 8u] = unpacked(w.z, 0u); Staged[b + 9u] = unpacked(w.z, 2u); Staged[b + 10u] = unpacked(w.z, 4u);
  Staged[b + 11u] = unpacked(w.z, 6u);
  Staged[b + 12u] = unpacked(w.w, 0u); Staged[b + 13u] = unpacked(w.w, 2u); Staged[b + 14u] = unpacked(w.w, 4u);
  Staged[b + 15u] = unpacked(w.w, 6u);
}

// Right matrix j of the subgroup's column sc at sub-step q of the staged step.
fn right(sc: u32, j: u32, q: u32) -> R {
  return subgroupMatrixLoad<R>(&Staged, 4u * A_WORDS + (sc * TN * SM_N + j * SM_N) * T_STRIDE + q * SM_K, true,
                               T_STRIDE);
}

fn left(sr: u32, i: u32, q: u32) -> L {
  return subgroupMatrixLoad<L>(&Staged, (sr * TM * SM_M + i * SM_M) * A_STRIDE + q * SM_K, false, A_STRIDE);
}

// Integer sums are exact on the matrix units: nothing to do between steps.
fn after_step(acc: ptr<function, Acc>, sr: u32, sc: u32, kk: u32, k_begin: u32, k_end: u32) {}

// Result matrix j of the subgroup's row being put, beside the row's others (RESULT_STRIDE words a row).
fn stage_result(m: O, sg: u32, j: u32) {
  subgroupMatrixStore(&Staged, sg * SM_M * RESULT_STRIDE + j * SM_N, m, false, RESULT_STRIDE);
}

// Element e (row e / RESULT_ROW) of subgroup sg's staged row of result matrices.
fn staged_result(sg: u32, e: u32) -> i32 {
  return Staged[sg * SM_M * RESULT_STRIDE + e / RESULT_ROW * RESULT_STRIDE + e % RESULT_ROW];
}

