// Split-K pass 2: merge the partitions' softmax states into the output.
// partial_acc [tokens, tiles, partitions, HG, D], partial_ml [tokens, tiles, partitions, HG, 2].
// Grid (32 * NSG, tiles, tokens), threadgroup (32 * NSG, 1, 1).
const int tile = int(threadgroup_position_in_grid.y);
const int token = int(threadgroup_position_in_grid.z);
const int tiles = partial_ml_shape[1];
const int partitions = partial_ml_shape[2];
const int partial = (token * tiles + tile) * partitions;
for (int e = int(thread_index_in_threadgroup); e < HG * D; e += NSG * 32) {
  int g = e / D;
  int d = e % D;
  float top = NO_SCORE;
  float sum = 0.0f;
  float acc = 0.0f;
  merge_states(partial_ml + (partial * HG + g) * 2, partial_ml + (partial * HG + g) * 2 + 1,
               partial_acc + (partial * HG + g) * D + d, partitions, HG * 2, HG * D, top, sum, acc);
  add_sink<SINKS>(float(sinks[(tile * HG + g) % sinks_shape[0]]), top, sum, acc);
  out[((token * tiles + tile) * HG + g) * D + d] = static_cast<T>(acc / sum);
}
