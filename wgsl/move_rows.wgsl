// Rows moved within one buffer: row MOVES[count + i] of BUF takes row MOVES[i], for i < count (a
// generation narrowed to its first rows: engine/generate.py). Rows are `row_words` 32-bit words
// apart, copied as bits; no row is both read and written (the moved rows lie past the rows they
// go to). Grid: (chunks of a row, 1, count).

struct Params {
  row_words: u32,  // words of a row
  count: u32,      // rows moved
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> MOVES: array<u32>;  // from rows, then to rows
@group(0) @binding(2) var<storage, read_write> BUF: array<u32>;

override WG: u32 = 256u;

@compute @workgroup_size(WG)
fn move_rows(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>,
             @builtin(num_workgroups) groups: vec3<u32>) {
  let src = MOVES[wg.z] * p.row_words;
  let dst = MOVES[p.count + wg.z] * p.row_words;
  for (var e = wg.x * WG + t; e < p.row_words; e += groups.x * WG) {
    BUF[dst + e] = BUF[src + e];
  }
}
