// K/V readers of the attention kernels for float pages (put before their bodies).
const auto k_rows = dense_rows<D>(k_pages);
const auto v_rows = dense_rows<D>(v_pages);
