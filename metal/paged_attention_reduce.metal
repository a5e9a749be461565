// Split-K pass 2: merge the partitions' softmax states into the output.
// partial_acc [tokens, kv_heads, partitions, G, D], partial_ml [tokens, kv_heads, partitions, G, 2].
// Grid (32 * NSG, kv_heads, tokens), threadgroup (32 * NSG, 1, 1).
const int kv_head = int(threadgroup_position_in_grid.y);
const int token = int(threadgroup_position_in_grid.z);
const int kv_heads = partial_ml_shape[1];
const int partitions = partial_ml_shape[2];
const int slot = (token * kv_heads + kv_head) * partitions;
for (int e = int(thread_index_in_threadgroup); e < G * D; e += NSG * 32) {
  int g = e / D;
  int d = e % D;
  float top, sum, acc;
  merge_states(partial_ml + (slot * G + g) * 2, partial_ml + (slot * G + g) * 2 + 1,
               partial_acc + (slot * G + g) * D + d, partitions, G * 2, G * D, top, sum, acc);
  out[(token * kv_heads * G + kv_head * G + g) * D + d] = static_cast<T>(acc / sum);
}
