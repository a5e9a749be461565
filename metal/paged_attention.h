// Paged attention shared by the kernels in this folder. One threadgroup serves one query
// token and HG query heads of one KV head (all G of its GQA group unless threadgroup memory
// forces fewer): its NSG SIMD groups split the keys, each lane holds D/32 of the head
// dimensions, and the K/V row of a key is loaded once for the HG query heads.
// Scores and the online softmax are kept in float32.
//
// Pools are [pages, kv_heads, BS, D]; key j of a sequence lives in page
// block_table[j / BS] at offset j % BS. Helpers take kernel inputs through template pointer
// types: MLX passes an input of fewer than 8 elements in the `constant` address space and
// a larger one in `device`, and Metal converts neither to the other.
// Rules for the simulator as for the GPU: SIMD functions and barriers sit in uniform
// control flow, loads are guarded, one threadgroup array per declaration.

// Element offset of key j's row for one KV head. 64-bit: a pool passes 2^31 elements at
// 4 GiB of float16 per layer.
template <int BS, int D>
int64_t kv_row(int page, int kv_heads, int kv_head, int j) {
  return ((int64_t(page) * kv_heads + kv_head) * BS + j % BS) * D;
}

// Online softmax over keys [first, last) for query heads q_base/D .. + HG - 1 of one KV head.
// Leaves each SIMD group's running max, sum and unnormalised output in sg_m, sg_l
// ([NSG * HG]) and sg_acc ([NSG * HG * D]).
template <int D, int BS, int HG, int NSG, typename Q, typename K, typename V, typename Table>
void attend_keys(
    Q queries,
    K k_pool,
    V v_pool,
    Table block_table,
    int q_base,
    int kv_heads,
    int kv_head,
    int first,
    int last,
    float scale,
    threadgroup float* sg_m,
    threadgroup float* sg_l,
    threadgroup float* sg_acc,
    uint sg,
    uint lane) {
  constexpr int EPL = (D + 31) / 32;
  float q[HG][EPL];
  float acc[HG][EPL];
  float m[HG];
  float l[HG];
  for (int g = 0; g < HG; g++) {
    for (int i = 0; i < EPL; i++) {
      int d = int(lane) + 32 * i;
      q[g][i] = d < D ? float(queries[q_base + g * D + d]) * scale : 0.0f;
      acc[g][i] = 0.0f;
    }
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  for (int j = first + int(sg); j < last; j += NSG) {
    int64_t base = kv_row<BS, D>(block_table[j / BS], kv_heads, kv_head, j);
    float k[EPL];
    float v[EPL];
    for (int i = 0; i < EPL; i++) {
      int d = int(lane) + 32 * i;
      k[i] = d < D ? float(k_pool[base + d]) : 0.0f;
      v[i] = d < D ? float(v_pool[base + d]) : 0.0f;
    }
    for (int g = 0; g < HG; g++) {
      float partial = 0.0f;
      for (int i = 0; i < EPL; i++) {
        partial += q[g][i] * k[i];
      }
      float s = simd_sum(partial);
      float m_new = metal::max(m[g], s);
      float correction = metal::exp(m[g] - m_new);
      float p = metal::exp(s - m_new);
      l[g] = l[g] * correction + p;
      for (int i = 0; i < EPL; i++) {
        acc[g][i] = acc[g][i] * correction + p * v[i];
      }
      m[g] = m_new;
    }
  }
  for (int g = 0; g < HG; g++) {
    if (lane == 0) {
      sg_m[sg * HG + g] = m[g];
      sg_l[sg * HG + g] = l[g];
    }
    for (int i = 0; i < EPL; i++) {
      int d = int(lane) + 32 * i;
      if (d < D) {
        sg_acc[(sg * HG + g) * D + d] = acc[g][i];
      }
    }
  }
}

// Merge `count` softmax states (max, sum, unnormalised output element) spaced by the
// given strides; an empty state has max -inf and weighs nothing. The states may sit in
// threadgroup memory or in device/constant buffers, each in its own space.
template <typename ML, typename Acc>
void merge_states(ML m, ML l, Acc acc, int count, int ml_stride, int acc_stride,
                  thread float& max_out, thread float& sum_out, thread float& acc_out) {
  float top = -INFINITY;
  for (int s = 0; s < count; s++) {
    top = metal::max(top, float(m[s * ml_stride]));
  }
  float sum = 0.0f;
  float out = 0.0f;
  for (int s = 0; s < count; s++) {
    float ms = float(m[s * ml_stride]);
    float w = ms == -INFINITY ? 0.0f : metal::exp(ms - top);
    sum += w * float(l[s * ml_stride]);
    out += w * float(acc[s * acc_stride]);
  }
  max_out = top;
  sum_out = sum;
  acc_out = out;
}
