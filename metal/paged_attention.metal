// Paged attention, one pass: out[token, tile * HG + g, :] over keys 0 .. token_pos[token],
// for the HG query heads of head tile `tile` (G / HG tiles per KV head).
// Grid (32 * NSG, q_heads / HG, tokens), threadgroup (32 * NSG, 1, 1).
threadgroup float sg_m[NSG * HG];
threadgroup float sg_l[NSG * HG];
threadgroup float sg_acc[NSG * HG * D];
const int tile = int(threadgroup_position_in_grid.y);
const int token = int(threadgroup_position_in_grid.z);
const int q_heads = queries_shape[1];
const int width = block_tables_shape[1];
attend_keys<D, BS, HG, NSG, SOFTCAP>(
    queries, k_rows, v_rows, block_tables + token_rows[token] * width,
    (token * q_heads + tile * HG) * D, k_pool_shape[1], tile / (G / HG),
    first_key<WINDOWED>(token_pos[token], window), token_pos[token] + 1, scale, softcap,
    sg_m, sg_l, sg_acc, simdgroup_index_in_threadgroup, thread_index_in_simdgroup);
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int e = int(thread_index_in_threadgroup); e < HG * D; e += NSG * 32) {
  int g = e / D;
  int d = e % D;
  float top, sum, acc;
  merge_states(sg_m + g, sg_l + g, sg_acc + g * D + d, NSG, HG, HG * D, top, sum, acc);
  add_sink<SINKS>(float(sinks[(tile * HG + g) % sinks_shape[0]]), top, sum, acc);
  out[(token * q_heads + tile * HG + g) * D + d] = static_cast<T>(acc / sum);
}
