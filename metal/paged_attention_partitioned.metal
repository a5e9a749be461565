// Split-K pass 1: each threadgroup attends one PARTITION-token slice of the keys of one
// (token, head tile) and writes its softmax state, merged over its SIMD groups:
// partial_acc[token, tile, part, g, :] (unnormalised) and partial_ml[..., g, 0:2] (max, sum).
// Grid (32 * NSG, q_heads / HG, tokens * partitions), threadgroup (32 * NSG, 1, 1).
threadgroup float sg_m[NSG * HG];
threadgroup float sg_l[NSG * HG];
threadgroup float sg_acc[NSG * HG * D];
const int tile = int(threadgroup_position_in_grid.y);
const int token = int(threadgroup_position_in_grid.z) / partitions;
const int part = int(threadgroup_position_in_grid.z) % partitions;
const int q_heads = queries_shape[1];
const int width = block_tables_shape[1];
const int first = metal::max(part * PARTITION, first_key<WINDOWED>(token_pos[token], window));
const int last = metal::min(part * PARTITION + PARTITION, token_pos[token] + 1);
attend_keys<D, BS, HG, NSG, SOFTCAP>(
    queries, k_rows, v_rows, block_tables + token_rows[token] * width,
    (token * q_heads + tile * HG) * D, k_pool_shape[1], tile / (G / HG), first, last, scale, softcap,
    sg_m, sg_l, sg_acc, simdgroup_index_in_threadgroup, thread_index_in_simdgroup);
threadgroup_barrier(mem_flags::mem_threadgroup);
const int slot = (token * (q_heads / HG) + tile) * partitions + part;
for (int e = int(thread_index_in_threadgroup); e < HG * D; e += NSG * 32) {
  int g = e / D;
  int d = e % D;
  float top, sum, acc;
  merge_states(sg_m + g, sg_l + g, sg_acc + g * D + d, NSG, HG, HG * D, top, sum, acc);
  partial_acc[(slot * HG + g) * D + d] = acc;
  if (d == 0) {
    partial_ml[(slot * HG + g) * 2] = top;
    partial_ml[(slot * HG + g) * 2 + 1] = sum;
  }
}
