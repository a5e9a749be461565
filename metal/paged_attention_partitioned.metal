// Split-K pass 1: each threadgroup attends one PARTITION-token slice of the keys of one
// (token, KV head) and writes its softmax state, merged over its SIMD groups:
// partial_acc[token, kv_head, part, g, :] (unnormalised) and partial_ml[..., g, 0:2] (max, sum).
// Grid (32 * NSG, kv_heads, tokens * partitions), threadgroup (32 * NSG, 1, 1).
threadgroup float sg_m[NSG * G];
threadgroup float sg_l[NSG * G];
threadgroup float sg_acc[NSG * G * D];
const int kv_head = int(threadgroup_position_in_grid.y);
const int token = int(threadgroup_position_in_grid.z) / partitions;
const int part = int(threadgroup_position_in_grid.z) % partitions;
const int q_heads = queries_shape[1];
const int kv_heads = k_pool_shape[1];
const int width = block_tables_shape[1];
const int first = part * PARTITION;
const int last = metal::min(first + PARTITION, token_pos[token] + 1);
attend_keys<T, D, BS, G, NSG>(
    queries, k_pool, v_pool, block_tables + token_rows[token] * width,
    (token * q_heads + kv_head * G) * D, kv_heads, kv_head, first, last, scale,
    sg_m, sg_l, sg_acc, simdgroup_index_in_threadgroup, thread_index_in_simdgroup);
threadgroup_barrier(mem_flags::mem_threadgroup);
const int slot = (token * kv_heads + kv_head) * partitions + part;
for (int e = int(thread_index_in_threadgroup); e < G * D; e += NSG * 32) {
  int g = e / D;
  int d = e % D;
  float top, sum, acc;
  merge_states(sg_m + g, sg_l + g, sg_acc + g * D + d, NSG, G, G * D, top, sum, acc);
  partial_acc[(slot * G + g) * D + d] = acc;
  if (d == 0) {
    partial_ml[(slot * G + g) * 2] = top;
    partial_ml[(slot * G + g) * 2 + 1] = sum;
  }
}
