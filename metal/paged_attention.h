// Paged attention shared by the kernels in this folder. One threadgroup serves one query
// token and HG query heads of one KV head (all G of its GQA group unless threadgroup memory
// forces fewer): its NSG SIMD groups split the keys, each lane holds EPL = ceil(D / 32)
// consecutive head dimensions, and the K/V row of a key is loaded once for the HG query heads.
// Scores and the online softmax are kept in float32.
//
// Pools are [pages, kv_heads, BS, D]; key j of a sequence lives in page
// block_table[j / BS] at offset j % BS. Float pools are read through DenseRows, quantized
// ones (mx.quantize's affine format) through QuantizedRows, which dequantize each value
// from the packed words where it is read. Helpers take kernel inputs through template
// pointer types: MLX passes an input of fewer than 8 elements in the `constant` address
// space and a larger one in `device`, and Metal converts neither to the other.
// Rules for the simulator as for the GPU: SIMD functions and barriers sit in uniform
// control flow, loads are guarded, one threadgroup array per declaration.

// Index of key j's row for one KV head, counting rows of D values. 64-bit: a pool passes
// 2^31 elements at 4 GiB of float16 per layer.
template <int BS>
int64_t kv_row(int page, int kv_heads, int kv_head, int j) {
  return (int64_t(page) * kv_heads + kv_head) * BS + j % BS;
}

// Value d of row `row` of a float pool [pages, kv_heads, BS, D].
template <int D, typename P>
struct DenseRows {
  P pool;
  float at(int64_t row, int d) const {
    return float(pool[row * D + d]);
  }
};

// Value d of row `row` of a quantized pool: BITS-bit integers packed lowest bits first into
// 32-bit words [.., D * BITS / 32], and per group of GS values a scale and a bias [.., D / GS]:
// value = scale * q + bias.
template <int D, int BITS, int GS, typename W, typename S>
struct QuantizedRows {
  W words;
  S scales;
  S biases;
  float at(int64_t row, int d) const {
    const int per_word = 32 / BITS;
    uint word = words[row * (D / per_word) + d / per_word];
    uint q = (word >> (BITS * (d % per_word))) & ((1u << BITS) - 1u);
    int64_t group = row * (D / GS) + d / GS;
    return float(scales[group]) * float(q) + float(biases[group]);
  }
};

template <int D, typename P>
DenseRows<D, P> dense_rows(P pool) {
  return DenseRows<D, P>{pool};
}

template <int D, int BITS, int GS, typename W, typename S>
QuantizedRows<D, BITS, GS, W, S> quantized_rows(W words, S scales, S biases) {
  return QuantizedRows<D, BITS, GS, W, S>{words, scales, biases};
}

// Online softmax over keys [first, last) for query heads q_base/D .. + HG - 1 of one KV head,
// scores capped to softcap * tanh(score / softcap) when SOFTCAP (Gemma 2).
// Leaves each SIMD group's running max, sum and unnormalised output in sg_m, sg_l
// ([NSG * HG]) and sg_acc ([NSG * HG * D]).
template <int D, int BS, int HG, int NSG, bool SOFTCAP, typename Q, typename K, typename V, typename Table>
void attend_keys(
    Q queries,
    K k_rows,
    V v_rows,
    Table block_table,
    int q_base,
    int kv_heads,
    int kv_head,
    int first,
    int last,
    float scale,
    float softcap,
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
      int d = int(lane) * EPL + i;
      q[g][i] = d < D ? float(queries[q_base + g * D + d]) * scale : 0.0f;
      acc[g][i] = 0.0f;
    }
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  for (int j = first + int(sg); j < last; j += NSG) {
    int64_t row = kv_row<BS>(block_table[j / BS], kv_heads, kv_head, j);
    float k[EPL];
    float v[EPL];
    for (int i = 0; i < EPL; i++) {
      int d = int(lane) * EPL + i;
      k[i] = d < D ? k_rows.at(row, d) : 0.0f;
      v[i] = d < D ? v_rows.at(row, d) : 0.0f;
    }
    for (int g = 0; g < HG; g++) {
      float partial = 0.0f;
      for (int i = 0; i < EPL; i++) {
        partial += q[g][i] * k[i];
      }
      float s = simd_sum(partial);
      if (SOFTCAP) {
        s = softcap * metal::tanh(s / softcap);
      }
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
      int d = int(lane) * EPL + i;
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

// The first key a query at `pos` sees: 0, or the start of its sliding window when WINDOWED.
template <bool WINDOWED>
int first_key(int pos, int window) {
  return WINDOWED ? metal::max(0, pos - window + 1) : 0;
}

// Fold an attention sink (a logit that joins the softmax and adds no value, GPT-OSS) into a
// merged state when SINKS; a state with no keys (max -inf) keeps only the sink's weight.
template <bool SINKS>
void add_sink(float sink, thread float& top, thread float& sum, thread float& acc) {
  if (SINKS) {
    float m = metal::max(top, sink);
    float w = top == -INFINITY ? 0.0f : metal::exp(top - m);
    sum = sum * w + metal::exp(sink - m);
    acc = acc * w;
    top = m;
  }
}
