// Paged attention, one pass: out[token, tile * HG + g, :] over the keys token_pos[token] sees,
// for the HG query heads of head tile `tile` (G / HG tiles per KV head).
// Grid (32 * NSG, q_heads / HG, tokens), threadgroup (32 * NSG, 1, 1), NSG = ceil(HG / H) * KS.
threadgroup float tg_ml[KS > 1 ? (KS - 1) * ((HG + H - 1) / H * H) * 2 : 1];
threadgroup float tg_acc[KS > 1 ? (KS - 1) * ((HG + H - 1) / H * H) * D : 1];
constexpr int EPL = (D + 31) / 32;
const int tile = int(threadgroup_position_in_grid.y);
const int token = int(threadgroup_position_in_grid.z);
const int q_heads = queries_shape[1];
const int width = page_tables_shape[1];
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const Merged<H, EPL> r = attend_and_merge<D, PS, HG, H, KT, KS, SOFTCAP>(
    queries, k_rows, v_rows, page_tables + token_rows[token] * width, (token * q_heads + tile * HG) * D,
    k_pages_shape[1], tile / (G / HG), first_key<WINDOWED, CHUNKED>(token_pos[token], window), token_pos[token] + 1, scale,
    softcap, tg_ml, tg_acc, sg, lane);
if (int(sg) < (HG + H - 1) / H) {
  MLXKV_UNROLL
  for (int h = 0; h < H; h++) {
    const int g = int(sg) * H + h;
    MLXKV_UNROLL
    for (int i = 0; i < EPL; i++) {
      const int d = int(lane) * EPL + i;
      float top = r.m[h][i];
      float sum = r.l[h][i];
      float acc = r.acc[h][i];
      add_sink<SINKS>(float(sinks[(tile * HG + g) % sinks_shape[0]]), top, sum, acc);
      if (d < D && g < HG) {  // g >= HG: a head padding the last head set
        out[(token * q_heads + tile * HG + g) * D + d] = static_cast<T>(acc / sum);
      }
    }
  }
}
