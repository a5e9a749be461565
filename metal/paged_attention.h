// Paged attention shared by the kernels in this folder. One threadgroup serves one query
// token and the HG query heads of one KV head. Its SIMD groups form HS = ceil(HG / H) head
// sets of H query heads each (at most 4 at head_dim 128: more spill registers; the last set
// padded when H does not divide HG) times KS key splits; a SIMD group walks tiles of KT keys
// of one page (one page-table lookup a page),
// each lane holding EPL consecutive head dimensions and reading them with vector loads.
// The head sets of one key split read the same rows at the same time, so a K/V byte comes
// from device memory once per threadgroup and from the core's cache after that.
//
// Per tile, the H * KT dot products are summed across the 32 lanes with one reduce-scatter
// (lane e ends up with entry e: 31 shuffles instead of H * KT 32-lane reductions), so the
// online softmax is lane-parallel: one exp2 per score, one per head for the rescale. Scores
// are in log2 units (log2(e) is folded into the scale) and kept in float32.
//
// K and V pages are [pages, kv_heads, PS, D]; key j of a sequence lives in page
// page_table[j / PS] at offset j % PS. Float pages are read through DenseRows, quantized
// ones (mx.quantize's affine format) through QuantizedRows, which unpack a lane's integers
// from one load of packed words, with one scale and bias applied per group, not per value. K/V pages are always `device` buffers
// (MLX passes only inputs under 8 elements as `constant`); other helpers take kernel inputs
// through template pointer types, since Metal converts neither space to the other.
// Rules for the simulator as for the GPU: SIMD functions and barriers sit in uniform
// control flow, loads are guarded, one threadgroup array per declaration.

// Before every loop whose trip count is a compile-time constant: unrolled, its private arrays are
// indexed by constants and stay in registers (an array indexed at run time lives in memory).
#define MLXKV_UNROLL _Pragma("clang loop unroll(full)")

static constant constexpr const float LOG2_E = 1.4426950408889634f;
// The lowest score, finite: running maxima start here and masked scores sit here, as in MLX's
// kernels, because Metal defines fast::exp2 for finite inputs only. exp2(NO_SCORE - m) is 0
// for any real score m, and an empty state (max NO_SCORE, sum 0) weighs nothing in a merge.
static constant constexpr const float NO_SCORE = -3.402823466e38f;  // -FLT_MAX

// Index of the first row of one KV head in physical page `page`, counting rows of D values.
// 64-bit: one layer's pages pass 2^31 elements at 4 GiB of float16 per layer. Computed once per
// page; rows within the page are then 32-bit offsets (64-bit arithmetic is emulated on Apple GPUs).
template <int PS>
int64_t page_row(int page, int kv_heads, int kv_head) {
  return (int64_t(page) * kv_heads + kv_head) * PS;
}

// How values of T pages are held in registers until used: as T (a half takes a 16-bit register
// and converts for free where an instruction reads it), bfloat16 as its bits, which every Metal
// version can put in a vector.
template <typename T>
struct Bits {
  typedef T type;
  static float to_float(T x) { return float(x); }
};
template <>
struct Bits<bfloat16_t> {
  typedef ushort type;
  static float to_float(ushort x) { return as_type<float>(uint(x) << 16); }
};

// N (1, 2 or 4) consecutive values of T pages in one load, held as Bits<T>::type.
template <typename T, int N>
struct Chunk {
  static void load(const device T* p, thread typename Bits<T>::type* out) {
    typedef vec<typename Bits<T>::type, N> V;
    const V v = *reinterpret_cast<const device V*>(p);
    MLXKV_UNROLL
    for (int i = 0; i < N; i++) {
      out[i] = v[i];
    }
  }
};
template <typename T>
struct Chunk<T, 1> {
  static void load(const device T* p, thread typename Bits<T>::type* out) {
    out[0] = *reinterpret_cast<const device typename Bits<T>::type*>(p);
  }
};

// A lane's EPL values of one K or V row, value i = Rows::value(w[i]) * scale + bias: float pages
// hold their values as loaded (W = Bits<T>::type: a row of half takes half the registers of
// floats) with scale 1 and bias 0; quantized pages hold their integers as floats and their
// group's scale and bias, so that a dot product or an accumulation applies them once per group
// (MLX's qdot form), not once per value.
template <typename W, int EPL>
struct RowPart {
  W w[EPL];
  float scale;
  float bias;
};

// Lane `lane`'s EPL values (dims lane * EPL ...) of row `row` of float pages [.., D]: vector
// loads when D is a multiple of 32, else guarded single loads.
template <int D, typename T>
struct DenseRows {
  typedef typename Bits<T>::type Held;
  template <int EPL>
  using Part = RowPart<Held, EPL>;
  static float value(Held x) { return Bits<T>::to_float(x); }
  const device T* pages;
  // The rows from `first_row` on, to index with 32-bit row numbers.
  DenseRows page(int64_t first_row) const {
    return DenseRows{pages + first_row * D};
  }
  template <int EPL>
  void load(int row, uint lane, thread Part<EPL>& out) const {
    const device T* p = pages + row * D + int(lane) * EPL;
    out.scale = 1.0f;
    out.bias = 0.0f;
    if (D % 32 == 0) {
      constexpr int C = EPL % 4 == 0 ? 4 : EPL % 2 == 0 ? 2 : 1;
      MLXKV_UNROLL
      for (int c = 0; c < EPL; c += C) {
        Chunk<T, C>::load(p + c, out.w + c);
      }
    } else {
      MLXKV_UNROLL
      for (int i = 0; i < EPL; i++) {
        out.w[i] = int(lane) * EPL + i < D ? *reinterpret_cast<const device Held*>(p + i) : Held(0);
      }
    }
  }
};

// Lane `lane`'s EPL values of row `row` of quantized pages: BITS-bit integers packed lowest
// bits first into 32-bit words [.., D * BITS / 32], and per group of GS values a scale and a
// bias [.., D / GS]: value = scale * q + bias. When a lane's values fill whole words or share
// one, and one group, they come from one load of words and one scale and bias; otherwise
// (e.g. head_dim 96) each value is read on its own.
template <int D, int BITS, int GS, typename S>
struct QuantizedRows {
  template <int EPL>
  using Part = RowPart<float, EPL>;
  static float value(float x) { return x; }
  const device uint* words;
  const device S* scales;
  const device S* biases;
  // The rows from `first_row` on, to index with 32-bit row numbers.
  QuantizedRows page(int64_t first_row) const {
    return QuantizedRows{words + first_row * (D * BITS / 32), scales + first_row * (D / GS),
                         biases + first_row * (D / GS)};
  }
  template <int EPL>
  void load(int row, uint lane, thread Part<EPL>& out) const {
    constexpr int PER_WORD = 32 / BITS;
    constexpr int WORDS = EPL >= PER_WORD ? EPL / PER_WORD : 1;
    constexpr bool ALIGNED = D == 32 * EPL && (EPL % PER_WORD == 0 || PER_WORD % EPL == 0) && GS % EPL == 0;
    const int first = int(lane) * EPL;
    const device uint* w = words + row * (D / PER_WORD);
    if (ALIGNED) {
      uint packed[WORDS];
      if (WORDS == 4 || WORDS == 2) {
        typedef vec<uint, (WORDS == 4 ? 4 : 2)> V;
        const V v = *reinterpret_cast<const device V*>(w + first / PER_WORD);
        MLXKV_UNROLL
        for (int i = 0; i < WORDS; i++) {
          packed[i] = v[i];
        }
      } else {
        MLXKV_UNROLL
        for (int i = 0; i < WORDS; i++) {
          packed[i] = w[first / PER_WORD + i];
        }
      }
      const int group = row * (D / GS) + first / GS;
      out.scale = float(scales[group]);
      out.bias = float(biases[group]);
      MLXKV_UNROLL
      for (int i = 0; i < EPL; i++) {
        const int d = first + i;
        const uint q = (packed[EPL >= PER_WORD ? i / PER_WORD : 0] >> (BITS * (d % PER_WORD))) & ((1u << BITS) - 1u);
        out.w[i] = float(q);
      }
    } else {
      out.scale = 1.0f;
      out.bias = 0.0f;
      MLXKV_UNROLL
      for (int i = 0; i < EPL; i++) {
        const int d = first + i;
        if (d < D) {
          const uint q = (w[d / PER_WORD] >> (BITS * (d % PER_WORD))) & ((1u << BITS) - 1u);
          const int group = row * (D / GS) + d / GS;
          out.w[i] = float(scales[group]) * float(q) + float(biases[group]);
        } else {
          out.w[i] = 0.0f;
        }
      }
    }
  }
};

template <int D, typename T>
DenseRows<D, T> dense_rows(const device T* pages) {
  return DenseRows<D, T>{pages};
}

template <int D, int BITS, int GS, typename S>
QuantizedRows<D, BITS, GS, S> quantized_rows(const device uint* words, const device S* scales,
                                             const device S* biases) {
  return QuantizedRows<D, BITS, GS, S>{words, scales, biases};
}

// Key k of the tile of KT keys at `key0` (`offset` into its page) moved into the page and into
// [first, last): a row of the sequence that is always there, so a tile loads every row
// unconditionally and masks the scores of keys outside, and no load waits behind a branch.
// The tile holds at least one key of [first, last), so the clamped key stays in its page.
template <int PS>
int resident_key(int key0, int offset, int k, int first, int last) {
  const int in_page = key0 + (offset + k < PS ? k : PS - 1 - offset);
  return metal::min(metal::max(in_page, first), last - 1);
}

// Keys k0 .. k0 + N - 1 of the tile at `key0`, each read from its resident key: all N loads
// issued before any row is used. `rows` reads one page (K or V, float or quantized).
template <int PS, int N, int EPL, typename Rows>
void load_rows(Rows rows, int key0, int offset, int k0, int first, int last, uint lane,
               thread typename Rows::template Part<EPL>* out) {
  MLXKV_UNROLL
  for (int b = 0; b < N; b++) {
    rows.template load<EPL>(resident_key<PS>(key0, offset, k0 + b, first, last) % PS, lane, out[b]);
  }
}

// The running softmax state of one SIMD group for its H query heads: every lane holds the
// output of its EPL dims for each head; lane e holds max and sum for head e / KT.
template <int H, int EPL>
struct SoftmaxState {
  float acc[H][EPL];
  float m;  // running max of this lane's head, in log2 units
  float l;  // this lane's share of that head's running sum
};

// Sum `v[0..N)` across the 32 lanes so that lane e holds the total of entry e % N: each
// step keeps half the entries and adds the partner lane's copy of them.
template <int N>
float reduce_scatter(thread float* v, uint lane) {
  MLXKV_UNROLL
  for (int o = N / 2; o >= 1; o /= 2) {
    const bool upper = (lane & uint(o)) != 0;
    MLXKV_UNROLL
    for (int i = 0; i < o; i++) {
      const float lo = v[i];  // values, not `upper ? v[i + o] : v[i]`: that is one load at a chosen
      const float hi = v[i + o];  // address, which keeps v in memory instead of in registers
      v[i] = (upper ? hi : lo) + simd_shuffle_xor(upper ? lo : hi, ushort(o));
    }
  }
  float total = v[0];
  MLXKV_UNROLL
  for (int o = N; o < 32; o *= 2) {
    total += simd_shuffle_xor(total, ushort(o));
  }
  return total;
}

// Online softmax over keys [first, last) for the H query heads q_base/D .. + H - 1 of one KV
// head, taking every KS-th tile of KT keys from tile `split` on. Scores are capped to
// softcap * tanh(score / softcap) when SOFTCAP (Gemma 2).
template <int D, int PS, int H, int KT, int KS, bool SOFTCAP, typename Q, typename K, typename V, typename Table>
SoftmaxState<H, (D + 31) / 32> attend_keys(Q queries, K k_rows, V v_rows, Table page_table, int q_base, int heads,
                                    int kv_heads, int kv_head, int first, int last, float scale, float softcap,
                                    int split, uint lane) {
  constexpr int EPL = (D + 31) / 32;
  constexpr int TILES_PER_PAGE = (PS + KT - 1) / KT;
  // Rows loaded before the first is used: a tile's keys in groups of at most 32 values a lane
  // (a power of two dividing KT), so their loads are in flight together and stay in registers.
  constexpr int FIT = 32 / EPL >= 32 ? 32 : 32 / EPL >= 16 ? 16 : 32 / EPL >= 8 ? 8 : 32 / EPL >= 4 ? 4 : 2;
  constexpr int AT_ONCE = KT < FIT ? KT : FIT;
  // A small tile (at most 16 K and 16 V values a lane, GQA 8 at head_dim 64) loads its V rows with
  // its K rows: one round of load latency a tile instead of two. A larger one would hold more
  // registers than that saves, and fewer SIMD groups would fit a core.
  constexpr bool V_WITH_K = AT_ONCE == KT && KT * EPL <= 16;
  constexpr int EARLY = V_WITH_K ? KT : 1;
  const float q_scale = SOFTCAP ? scale : scale * LOG2_E;
  float q[H][EPL];
  float q_sum[H];   // a head's query over this lane's dims: what a row's bias adds to its dot product
  float v_bias[H];  // the V rows' p * bias of each head, added to every dim of the lane at the end
  SoftmaxState<H, EPL> st;
  MLXKV_UNROLL
  for (int h = 0; h < H; h++) {
    q_sum[h] = 0.0f;
    v_bias[h] = 0.0f;
    MLXKV_UNROLL
    for (int i = 0; i < EPL; i++) {
      const int d = int(lane) * EPL + i;
      q[h][i] = d < D && h < heads ? float(queries[q_base + h * D + d]) * q_scale : 0.0f;
      q_sum[h] += q[h][i];
      st.acc[h][i] = 0.0f;
    }
  }
  st.m = NO_SCORE;
  st.l = 0.0f;
  const int my_head = int(lane) / KT;  // lane e sums entry e = head * KT + key of each tile
  const int tile_first = (first / PS) * TILES_PER_PAGE + (first % PS) / KT;
  const int tile_last = last > first ? ((last - 1) / PS) * TILES_PER_PAGE + ((last - 1) % PS) / KT : tile_first - 1;
  int mapped = -1;  // the page k_page and v_page start at: one page-table load a page, not a tile
  K k_page = k_rows;
  V v_page = v_rows;
  for (int t = tile_first + split; t <= tile_last; t += KS) {
    const int page = t / TILES_PER_PAGE;
    const int offset = (t % TILES_PER_PAGE) * KT;
    const int key0 = page * PS + offset;
    if (page != mapped) {
      const int64_t first_row = page_row<PS>(page_table[page], kv_heads, kv_head);
      k_page = k_rows.page(first_row);
      v_page = v_rows.page(first_row);
      mapped = page;
    }
    typename V::template Part<EPL> early[EARLY];  // the tile's V rows when V_WITH_K
    float part[32];
    MLXKV_UNROLL
    for (int e = 0; e < 32; e++) {
      part[e] = 0.0f;
    }
    MLXKV_UNROLL
    for (int k0 = 0; k0 < KT; k0 += AT_ONCE) {
      typename K::template Part<EPL> kv[AT_ONCE];
      load_rows<PS, AT_ONCE, EPL>(k_page, key0, offset, k0, first, last, lane, kv);
      if (V_WITH_K) {
        load_rows<PS, EARLY, EPL>(v_page, key0, offset, 0, first, last, lane, early);
      }
      MLXKV_UNROLL
      for (int b = 0; b < AT_ONCE; b++) {
        MLXKV_UNROLL
        for (int h = 0; h < H; h++) {
          float dot = 0.0f;
          MLXKV_UNROLL
          for (int i = 0; i < EPL; i++) {
            dot += q[h][i] * K::value(kv[b].w[i]);
          }
          part[h * KT + k0 + b] = dot * kv[b].scale + q_sum[h] * kv[b].bias;
        }
      }
    }
    float s = reduce_scatter<32>(part, lane);
    const int j = key0 + int(lane) % KT;
    const bool valid = my_head < H && j >= first && j < last && offset + int(lane) % KT < PS;
    if (SOFTCAP) {
      s = softcap * metal::tanh(s / softcap) * LOG2_E;
    }
    s = valid ? s : NO_SCORE;
    float tile_max = s;
    MLXKV_UNROLL
    for (int o = 1; o < KT; o *= 2) {
      tile_max = metal::max(tile_max, simd_shuffle_xor(tile_max, ushort(o)));
    }
    const float m_new = metal::max(st.m, tile_max);
    const float correction = metal::fast::exp2(st.m - m_new);
    const float p = valid ? metal::fast::exp2(s - m_new) : 0.0f;
    st.l = st.l * correction + p;
    st.m = m_new;
    MLXKV_UNROLL
    for (int h = 0; h < H; h++) {
      const float c = simd_shuffle(correction, ushort(h * KT));
      MLXKV_UNROLL
      for (int i = 0; i < EPL; i++) {
        st.acc[h][i] *= c;
      }
      v_bias[h] *= c;
    }
    MLXKV_UNROLL
    for (int k0 = 0; k0 < KT; k0 += AT_ONCE) {
      typename V::template Part<EPL> kv[AT_ONCE];
      if (V_WITH_K) {
        MLXKV_UNROLL
        for (int b = 0; b < AT_ONCE; b++) {
          kv[b] = early[(k0 + b) % EARLY];
        }
      } else {
        load_rows<PS, AT_ONCE, EPL>(v_page, key0, offset, k0, first, last, lane, kv);
      }
      MLXKV_UNROLL
      for (int b = 0; b < AT_ONCE; b++) {
        MLXKV_UNROLL
        for (int h = 0; h < H; h++) {
          const float pk = simd_shuffle(p, ushort(h * KT + k0 + b));  // 0 for a masked key
          const float ps = pk * kv[b].scale;
          MLXKV_UNROLL
          for (int i = 0; i < EPL; i++) {
            st.acc[h][i] += ps * V::value(kv[b].w[i]);
          }
          v_bias[h] += pk * kv[b].bias;
        }
      }
    }
  }
  MLXKV_UNROLL
  for (int h = 0; h < H; h++) {
    MLXKV_UNROLL
    for (int i = 0; i < EPL; i++) {
      st.acc[h][i] += v_bias[h];
    }
  }
  MLXKV_UNROLL
  for (int o = 1; o < KT; o *= 2) {
    st.l += simd_shuffle_xor(st.l, ushort(o));
  }
  return st;
}

// The max and sum of head h of a SIMD group's state, read from the head's first lane.
template <int H, int EPL, int KT>
void head_stats(thread const SoftmaxState<H, EPL>& st, int h, thread float& m, thread float& l) {
  m = simd_shuffle(st.m, ushort(h * KT));
  l = simd_shuffle(st.l, ushort(h * KT));
}

// Merge `count` softmax states (max in log2 units, sum, unnormalised output element) spaced
// by the given strides; an empty state (max NO_SCORE, sum 0) weighs nothing. The states may sit
// in threadgroup memory or in device/constant buffers, each in its own space.
template <typename ML, typename Acc>
void merge_states(ML m, ML l, Acc acc, int count, int ml_stride, int acc_stride,
                  thread float& max_out, thread float& sum_out, thread float& acc_out) {
  float top = max_out;
  for (int s = 0; s < count; s++) {
    top = metal::max(top, float(m[s * ml_stride]));
  }
  float w0 = metal::fast::exp2(max_out - top);
  float sum = w0 * sum_out;
  float out = w0 * acc_out;
  for (int s = 0; s < count; s++) {
    float ms = float(m[s * ml_stride]);
    float w = metal::fast::exp2(ms - top);
    sum += w * float(l[s * ml_stride]);
    out += w * float(acc[s * acc_stride]);
  }
  max_out = top;
  sum_out = sum;
  acc_out = out;
}

// The first key a query at `pos` sees: 0, the start of its sliding window when WINDOWED, or the
// start of its chunk of `window` tokens when CHUNKED (Llama 4's chunked local attention).
template <bool WINDOWED, bool CHUNKED>
int first_key(int pos, int window) {
  return CHUNKED ? pos - pos % window : WINDOWED ? metal::max(0, pos - window + 1) : 0;
}

// Fold an attention sink (a logit that joins the softmax and adds no value, GPT-OSS) into a
// merged state when SINKS; a state with no keys (max NO_SCORE) keeps only the sink's weight.
template <bool SINKS>
void add_sink(float sink, thread float& top, thread float& sum, thread float& acc) {
  if (SINKS) {
    float s = sink * LOG2_E;
    float m = metal::max(top, s);
    float w = metal::fast::exp2(top - m);
    sum = sum * w + metal::fast::exp2(s - m);
    acc = acc * w;
    top = m;
  }
}

// A merged softmax state for H heads, each lane's EPL dims: max (log2 units), sum, output.
template <int H, int EPL>
struct Merged {
  float m[H][EPL];
  float l[H][EPL];
  float acc[H][EPL];
};

// Attend one query token's keys [first, last) with every SIMD group of the threadgroup and
// merge the key splits' states in threadgroup memory: split k > 0 writes, split 0 reads and
// returns the merged state of its head set (what other SIMD groups return is not used).
// tg_ml holds (KS - 1) * HP * 2 floats and tg_acc (KS - 1) * HP * D, HP = HS * H: what the
// merge needs, not a copy of every SIMD group's state. When H does not divide HG (GQA 5 or 7)
// the last head set is padded with heads that read no query, and are neither merged nor written.
template <int D, int PS, int HG, int H, int KT, int KS, bool SOFTCAP, typename Q, typename K, typename V,
          typename Table>
Merged<H, (D + 31) / 32> attend_and_merge(Q queries, K k_rows, V v_rows, Table page_table, int q_base, int kv_heads,
                                          int kv_head, int first, int last, float scale, float softcap,
                                          threadgroup float* tg_ml, threadgroup float* tg_acc, uint sg, uint lane) {
  constexpr int EPL = (D + 31) / 32;
  constexpr int HS = (HG + H - 1) / H;
  constexpr int HP = HS * H;
  const int head_set = int(sg) % HS;
  const int split = int(sg) / HS;
  const SoftmaxState<H, EPL> st = attend_keys<D, PS, H, KT, KS, SOFTCAP>(
      queries, k_rows, v_rows, page_table, q_base + head_set * H * D, metal::min(H, HG - head_set * H), kv_heads,
      kv_head, first, last, scale, softcap, split, lane);
  Merged<H, EPL> out;
  MLXKV_UNROLL
  for (int h = 0; h < H; h++) {
    float m, l;
    head_stats<H, EPL, KT>(st, h, m, l);
    MLXKV_UNROLL
    for (int i = 0; i < EPL; i++) {
      out.m[h][i] = m;
      out.l[h][i] = l;
      out.acc[h][i] = st.acc[h][i];
    }
  }
  if (KS > 1) {
    if (split > 0) {
      MLXKV_UNROLL
      for (int h = 0; h < H; h++) {
        const int entry = (split - 1) * HP + head_set * H + h;
        if (lane == 0) {
          tg_ml[entry * 2] = out.m[h][0];
          tg_ml[entry * 2 + 1] = out.l[h][0];
        }
        MLXKV_UNROLL
        for (int i = 0; i < EPL; i++) {
          const int d = int(lane) * EPL + i;
          if (d < D) {
            tg_acc[entry * D + d] = out.acc[h][i];
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (split == 0) {
      MLXKV_UNROLL
      for (int h = 0; h < H; h++) {
        const int g = head_set * H + h;
        MLXKV_UNROLL
        for (int i = 0; i < EPL; i++) {
          const int d = int(lane) * EPL + i;
          if (d < D) {
            merge_states(tg_ml + g * 2, tg_ml + g * 2 + 1, tg_acc + g * D + d, KS - 1, HP * 2, HP * D, out.m[h][i],
                         out.l[h][i], out.acc[h][i]);
          }
        }
      }
    }
  }
  return out;
}
