// Rows of one buffer into chosen rows of another: DST row ROWS[i] takes SRC row i, for i < rows.
// A row is `blocks` blocks of `width` 32-bit words, contiguous in SRC and `dst_block` words apart
// in DST (a KV cache's row is its heads, each `positions × head_dim` floats: a cache of fewer
// positions goes into the first positions of a longer one's heads). Words are copied as bits,
// whatever they hold (floats, token ids, flags). Grid: (chunks of the width, blocks, rows).

struct Params {
  width: u32,      // words of a block
  dst_block: u32,  // words between the blocks of a DST row
  dst_row: u32,    // words between DST rows
  blocks: u32,     // blocks of a row
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> SRC: array<u32>;
@group(0) @binding(2) var<storage, read> ROWS: array<u32>;
@group(0) @binding(3) var<storage, read_write> DST: array<u32>;

override WG: u32 = 256u;

@compute @workgroup_size(WG)
fn scatter(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>,
           @builtin(num_workgroups) groups: vec3<u32>) {
  let block = wg.y;
  let i = wg.z;
  let src = (i * p.blocks + block) * p.width;
  let dst = ROWS[i] * p.dst_row + block * p.dst_block;
  for (var e = wg.x * WG + t; e < p.width; e += groups.x * WG) {
    DST[dst + e] = SRC[src + e];
  }
}
