// Not used by the engine: the cost model's calibration kernel, the structure of MLX's vector
// SDPA for decode (sdpa_vector_2pass_1) in this project's words, so that the model can be
// checked against MLX's published speeds before it is quoted for the paged kernel.
// One SIMD group per query head: the G heads of a KV head are the G SIMD groups of one
// threadgroup, and each reads every K/V row of its block itself (G loads of each row; the
// repeats come from the core's cache). A lane holds EPL dims; each key costs one 32-lane sum.
// Threadgroup (kv_head, block) takes keys block, block + blocks, ...; pass 2 (merging the blocks'
// softmax states) is left to the caller.
// keys, values [kv_heads, N, D]; queries [kv_heads * G, D]; partial_acc [heads, blocks, D],
// partial_ml [heads, blocks, 2]. Grid (32 * G, kv_heads, blocks), threadgroup (32 * G, 1, 1).
constexpr int EPL = D / 32;
const int kv_head = int(threadgroup_position_in_grid.y);
const int block = int(threadgroup_position_in_grid.z);
const int blocks = int(threadgroups_per_grid.z);
const int head = kv_head * G + int(simdgroup_index_in_threadgroup);
const uint lane = thread_index_in_simdgroup;
const int n = keys_shape[1];
typedef DenseRows<D, T> Rows;
const Rows k_rows = dense_rows<D>(keys).page(int64_t(kv_head) * n);
const Rows v_rows = dense_rows<D>(values).page(int64_t(kv_head) * n);
float q[EPL];
float o[EPL];
MLXKV_UNROLL
for (int i = 0; i < EPL; i++) {
  q[i] = float(queries[head * D + int(lane) * EPL + i]) * scale * LOG2_E;
  o[i] = 0.0f;
}
float m = NO_SCORE;
float l = 0.0f;
for (int j = block; j < n; j += blocks) {
  typename Rows::template Part<EPL> k;
  typename Rows::template Part<EPL> v;
  k_rows.template load<EPL>(j, lane, k);
  v_rows.template load<EPL>(j, lane, v);
  float dot = 0.0f;
  MLXKV_UNROLL
  for (int i = 0; i < EPL; i++) {
    dot += q[i] * Rows::value(k.w[i]);
  }
  const float s = simd_sum(dot);
  const float m_new = metal::max(m, s);
  const float c = metal::fast::exp2(m - m_new);
  const float p = metal::fast::exp2(s - m_new);
  l = l * c + p;
  m = m_new;
  MLXKV_UNROLL
  for (int i = 0; i < EPL; i++) {
    o[i] = o[i] * c + p * Rows::value(v.w[i]);
  }
}
const int part = head * blocks + block;
if (lane == 0) {
  partial_ml[part * 2] = m;
  partial_ml[part * 2 + 1] = l;
}
MLXKV_UNROLL
for (int i = 0; i < EPL; i++) {
  partial_acc[part * D + int(lane) * EPL + i] = o[i];
}
