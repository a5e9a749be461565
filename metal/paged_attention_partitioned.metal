// Split-K pass 1: each threadgroup attends one PARTITION-key slice of the keys of one
// (token, head tile) and writes its softmax partial, merged over its SIMD groups:
// partial_acc[token, tile, part, g, :] (unnormalised) and partial_ml[..., g, 0:2] (max in
// log2 units, sum). Grid (32 * NSG, q_heads / HG, tokens * partitions), threadgroup (32 * NSG, 1, 1).
threadgroup float tg_ml[KS > 1 ? (KS - 1) * ((HG + H - 1) / H * H) * 2 : 1];
threadgroup float tg_acc[KS > 1 ? (KS - 1) * ((HG + H - 1) / H * H) * D : 1];
constexpr int EPL = (D + 31) / 32;
const int tile = int(threadgroup_position_in_grid.y);
const int token = int(threadgroup_position_in_grid.z) / partitions;
const int part = int(threadgroup_position_in_grid.z) % partitions;
const int q_heads = queries_shape[1];
const int width = page_tables_shape[1];
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const int first = metal::max(part * PARTITION, first_key<WINDOWED, CHUNKED>(token_pos[token], window));
const int last = metal::min(part * PARTITION + PARTITION, token_pos[token] + 1);
const Merged<H, EPL> r = attend_and_merge<D, PS, HG, H, KT, KS, SOFTCAP>(
    queries, k_rows, v_rows, page_tables + token_rows[token] * width, (token * q_heads + tile * HG) * D,
    k_pages_shape[1], tile / (G / HG), first, last, scale, softcap, tg_ml, tg_acc, sg, lane);
const int partial = (token * (q_heads / HG) + tile) * partitions + part;
if (int(sg) < (HG + H - 1) / H) {
  MLXKV_UNROLL
  for (int h = 0; h < H; h++) {
    const int g = int(sg) * H + h;
    MLXKV_UNROLL
    for (int i = 0; i < EPL; i++) {
      const int d = int(lane) * EPL + i;
      if (d < D && g < HG) {  // g >= HG: a head padding the last head set
        partial_acc[(partial * HG + g) * D + d] = r.acc[h][i];
      }
      if (d == 0 && g < HG) {
        partial_ml[(partial * HG + g) * 2] = r.m[h][i];
        partial_ml[(partial * HG + g) * 2 + 1] = r.l[h][i];
      }
    }
  }
}
