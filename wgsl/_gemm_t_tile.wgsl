// Shared by bitlinear_t.wgsl, matmul_t.wgsl and matmul.wgsl (// @include): the entry point
// gemm_tiled of OUT[n][k] (+)= Σ_j A'[n][j] · W'[j][k], with A' and W' loaded by the including
// kernel and OUT written by its store: the input-gradient GEMMs (store from _input_grad_store.wgsl)
// and matmul's forward (W' the weights transposed as they are staged; the projection's epilogue).
//
// A workgroup of 128 threads owns 64 tokens × 64 features of OUT and walks the rows j in steps
// of 32 through `tile`. Its two halves (threads t / 64) sum different rows of each step (half h:
// rows 16h..16h + 15) into the same 64 × 64 outputs, 8 tokens × 8 features a thread: a row costs
// a thread four vec4 reads of workgroup memory for 64 FMAs, and the split keeps four warps a
// workgroup to hide latency. At the end each thread adds its partner's (t ^ 64) sums for the
// token quad it stores. The next step's global loads are issued before the multiply and held in
// registers, so their latency overlaps it.
//
// The including file declares Params (tokens, rows, a_stride and store's fields), the bindings
// A (f32, [token][a_stride]), OUT, DH, LA, and
//   struct Staged { a: mat4x4<f32>, ... }: a thread's share of one step, in registers;
//   fn fetch(t: u32, n0: u32, k0: u32, j0: u32) -> Staged: loads it for rows j0.. (fetch_a for
//     A; weights past p.rows zero);
//   fn stage(t: u32, s: Staged): writes it into tile (put_a for A; weights at W_TILE + at(j, quad));
//   fn row_span(n0: u32, k0: u32) -> vec2<u32>: the rows j [begin, end) the tile at tokens n0..
//     and features k0.. sums over ((0, p.rows), or less where the others add nothing to it: a
//     causal mask).

const STEP: u32 = 32u;     // rows j a step
const W_TILE: u32 = 512u;  // first vec4 of the weights in tile

// [j (32)][token quad (16)] of A, then [j (32)][feature quad (16)] of W; after the last step,
// the halves' exchange. 16 KiB, WebGPU's default limit.
var<workgroup> tile: array<vec4<f32>, 1024>;

// Quad `quad` of step row j. XOR-swizzled by the row: the loaders store one quad of 32
// consecutive rows (A) or neighbouring quads of a few rows (W) at once, and without the swizzle
// those land in one or two of workgroup memory's eight 16-byte bank groups.
fn at(j: u32, quad: u32) -> u32 { return j * 16u + (quad ^ (j % 8u)); }

// A[n][a_col + j] for j = j0 + t % 32 and this thread's token quads t / 32 + 4i of the
// workgroup's 64 (column i); zeros for a row past the last.
fn fetch_a(t: u32, n0: u32, j0: u32, a_col: u32) -> mat4x4<f32> {
  let j = j0 + t % STEP;
  if (j >= p.rows) { return mat4x4<f32>(); }
  let n = n0 + 4u * (t / STEP);
  let col = a_col + j;
  return mat4x4<f32>(a_quad(n, col), a_quad(n + 16u, col), a_quad(n + 32u, col), a_quad(n + 48u, col));
}

// A[n..n + 3][col]; tokens past the last repeat it (their sums are not stored).
fn a_quad(n: u32, col: u32) -> vec4<f32> {
  let last = p.tokens - 1u;
  return vec4<f32>(A[min(n, last) * p.a_stride + col], A[min(n + 1u, last) * p.a_stride + col],
                   A[min(n + 2u, last) * p.a_stride + col], A[min(n + 3u, last) * p.a_stride + col]);
}

fn put_a(t: u32, a: mat4x4<f32>) {
  let j = t % STEP;
  let quad = t / STEP;
  tile[at(j, quad)] = a[0];
  tile[at(j, quad + 4u)] = a[1];
  tile[at(j, quad + 8u)] = a[2];
  tile[at(j, quad + 12u)] = a[3];
}

// [token quad (own, own ^ 8)][feature quad (tk, tk + 8)], a column a token: 8 × 8 sums.
var<private> acc: array<mat4x4<f32>, 4>;

fn outer(w: vec4<f32>, x: vec4<f32>) -> mat4x4<f32> { return mat4x4<f32>(w * x.x, w * x.y, w * x.z, w * x.w); }

fn row(j: u32, own: u32, tk: u32) {
  let x0 = tile[at(j, own)];
  let x1 = tile[at(j, own ^ 8u)];
  let w0 = tile[W_TILE + at(j, tk)];
  let w1 = tile[W_TILE + at(j, tk + 8u)];
  acc[0] += outer(w0, x0);
  acc[1] += outer(w1, x0);
  acc[2] += outer(w0, x1);
  acc[3] += outer(w1, x1);
}

fn four_rows(j: u32, own: u32, tk: u32) {
  row(j, own, tk); row(j + 1u, own, tk); row(j + 2u, own, tk); row(j + 3u, own, tk);
}

// Column i of m at tile[first + 128i]: consecutive threads, consecutive vec4s.
fn put_sums(first: u32, m: mat4x4<f32>) {
  tile[first] = m[0]; tile[first + 128u] = m[1]; tile[first + 256u] = m[2]; tile[first + 384u] = m[3];
}

fn sums(first: u32) -> mat4x4<f32> {
  return mat4x4<f32>(tile[first], tile[first + 128u], tile[first + 256u], tile[first + 384u]);
}

fn store_quad(n: u32, k: u32, m: mat4x4<f32>) {
  store(n, k, m[0]); store(n + 1u, k, m[1]); store(n + 2u, k, m[2]); store(n + 3u, k, m[3]);
}

// The grid's z splits the rows j into ranges of whole steps (split-K: more workgroups for a long
// sum over few tokens); the including file's store knows the range by `range`.
var<private> range: u32;

@compute @workgroup_size(128)
fn gemm_tiled(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>,
              @builtin(num_workgroups) groups: vec3<u32>) {
  let split = t / 64u;                    // sums rows 16·split.. of each step
  let own = (t % 64u) / 8u + 8u * split;  // token quad this thread stores
  let tk = t % 8u;                        // feature quads tk and tk + 8
  let n0 = wg.y * 64u;
  let k0 = wg.x * 64u;
  range = wg.z;
  let span = (p.rows + groups.z * STEP - 1u) / (groups.z * STEP) * STEP;
  let rows = row_span(n0, k0);
  let first = max(wg.z * span, rows.x);
  let end = min(wg.z * span + span, rows.y);
  var staged: Staged;
  if (first < end) { staged = fetch(t, n0, k0, first); }
  for (var j0 = first; j0 < end; j0 += STEP) {
    stage(t, staged);
    workgroupBarrier();
    if (j0 + STEP < end) { staged = fetch(t, n0, k0, j0 + STEP); }
    // Unrolled by hand: a WGSL loop here would carry wgpu's loop-bound counter.
    let j = 16u * split;
    four_rows(j, own, tk); four_rows(j + 4u, own, tk); four_rows(j + 8u, own, tk); four_rows(j + 12u, own, tk);
    workgroupBarrier();
  }
  put_sums(t, acc[2]);
  put_sums(t + W_TILE, acc[3]);
  workgroupBarrier();
  let n = n0 + 4u * own;
  let k = k0 + 4u * tk;
  store_quad(n, k, acc[0] + sums(t ^ 64u));
  store_quad(n, k + 32u, acc[1] + sums((t ^ 64u) + W_TILE));
}
