// K/V readers of the attention kernels for quantized pages (put before their bodies).
const auto k_rows = quantized_rows<D, BITS, GS>(k_pages, k_scales, k_biases);
const auto v_rows = quantized_rows<D, BITS, GS>(v_pages, v_scales, v_biases);
