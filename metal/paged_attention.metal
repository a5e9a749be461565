// Paged attention, one pass: out[token, kv_head * G + g, :] over keys 0 .. token_pos[token].
// Grid (32 * NSG, kv_heads, tokens), threadgroup (32 * NSG, 1, 1).
threadgroup float sg_m[NSG * G];
threadgroup float sg_l[NSG * G];
threadgroup float sg_acc[NSG * G * D];
const int kv_head = int(threadgroup_position_in_grid.y);
const int token = int(threadgroup_position_in_grid.z);
const int q_heads = queries_shape[1];
const int width = block_tables_shape[1];
attend_keys<T, D, BS, G, NSG>(
    queries, k_pool, v_pool, block_tables + token_rows[token] * width,
    (token * q_heads + kv_head * G) * D, k_pool_shape[1], kv_head, 0, token_pos[token] + 1, scale,
    sg_m, sg_l, sg_acc, simdgroup_index_in_threadgroup, thread_index_in_simdgroup);
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int e = int(thread_index_in_threadgroup); e < G * D; e += NSG * 32) {
  int g = e / D;
  int d = e % D;
  float top, sum, acc;
  merge_states(sg_m + g, sg_l + g, sg_acc + g * D + d, NSG, G, G * D, top, sum, acc);
  out[(token * q_heads + kv_head * G + g) * D + d] = static_cast<T>(acc / sum);
}
