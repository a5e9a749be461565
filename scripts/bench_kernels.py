"""Paged attention against `mx.fast.scaled_dot_product_attention` on the same K/V, for decode.

For each batch size and context length the K/V are written into a paged pool (pages handed
out in shuffled order) and also laid out contiguously per sequence; both attentions run on
them and the script prints the K/V bytes read per second and the paged/SDPA time ratio.
With `--kv-bits` both hold quantized K/V and the baseline is mlx-lm's own quantized attention
(`mx.quantized_matmul` over the packed K/V, as its `QuantizedKVCache` runs).
On a Mac this times the Metal kernels; elsewhere it times the pure-MLX reference path
(there is no Metal) and says so.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from mlxkv import KVBatch, reference_attention
from mlxkv.attention.kernels import PagedAttentionKernels
from mlxkv.cache.storage import QuantizedPages, kv_bytes_per_token


def timed(fn, repeats: int) -> float:
    mx.eval(fn())
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn())
    return (time.perf_counter() - start) / repeats


def case(attention, batch: int, context: int, args) -> tuple[float, float]:
    """(paged seconds, SDPA seconds) for one decode step of `batch` sequences of `context` tokens."""
    rng = np.random.default_rng(0)
    bs, kv_heads, q_heads, d = args.block_size, args.kv_heads, args.q_heads, args.head_dim
    dtype = getattr(mx, args.dtype)
    pages_per_seq = -(-context // bs)
    pages = rng.permutation(batch * pages_per_seq).astype(np.int32).reshape(batch, pages_per_seq)
    k_pool = mx.random.normal((batch * pages_per_seq, kv_heads, bs, d)).astype(dtype)
    v_pool = mx.random.normal((batch * pages_per_seq, kv_heads, bs, d)).astype(dtype)
    ones = np.ones(batch, np.int32)
    meta = KVBatch(tuple(range(batch)), ones, np.full(batch, context, np.int32), pages, np.zeros(batch, np.int32), bs)
    q = mx.random.normal((batch, q_heads, d)).astype(dtype)
    order = mx.array(pages.reshape(-1))
    k = k_pool[order].reshape(batch, pages_per_seq, kv_heads, bs, d).transpose(0, 2, 1, 3, 4)
    k = k.reshape(batch, kv_heads, pages_per_seq * bs, d)[:, :, :context]
    v = v_pool[order].reshape(batch, pages_per_seq, kv_heads, bs, d).transpose(0, 2, 1, 3, 4)
    v = v.reshape(batch, kv_heads, pages_per_seq * bs, d)[:, :, :context]
    scale = d ** -0.5
    if args.kv_bits:
        quantized = dict(group_size=args.kv_group_size, bits=args.kv_bits)
        k_pool, v_pool = (QuantizedPages.quantize(pool, args.kv_bits, args.kv_group_size) for pool in (k_pool, v_pool))
        k, v = mx.quantize(k, **quantized), mx.quantize(v, **quantized)

        def baseline():
            return quantized_scaled_dot_product_attention(q[:, :, None], k, v, scale, None, **quantized)
    else:
        def baseline():
            return mx.fast.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale)
    mx.eval(q, k, v, [getattr(pool, "parts", pool) for pool in (k_pool, v_pool)])
    paged = timed(lambda: attention(q, k_pool, v_pool, meta, scale), args.repeats)
    return paged, timed(baseline, args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--kv-bits", type=int, choices=[8, 4], default=None, help="quantized K/V [default: floats]")
    parser.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    if mx.metal.is_available():
        attention, what = PagedAttentionKernels(), "Metal paged-attention kernels"
    else:
        attention, what = reference_attention, "the pure-MLX reference path (no Metal on this machine)"
    print(f"paged: {what}; device {mx.default_device()}, MLX {mx.__version__}, {args.dtype}, "
          f"{args.q_heads}/{args.kv_heads} heads, head_dim {args.head_dim}, block {args.block_size}, "
          + (f"{args.kv_bits}-bit K/V in groups of {args.kv_group_size} (baseline: mlx-lm's quantized attention)"
             if args.kv_bits else "float K/V (baseline: MLX's SDPA)"))
    print(f"{'batch':>6} {'context':>8} {'paged GB/s':>11} {'base GB/s':>10} {'paged/base time':>16}")
    per_token = kv_bytes_per_token(1, args.kv_heads, args.head_dim, getattr(mx, args.dtype), args.kv_bits,
                                   args.kv_group_size)
    for batch in args.batches:
        for context in args.contexts:
            kv_bytes = batch * context * per_token
            if kv_bytes > 8 * 2**30:
                continue
            paged, sdpa = case(attention, batch, context, args)
            print(f"{batch:>6} {context:>8} {kv_bytes / paged / 1e9:>11.2f} {kv_bytes / sdpa / 1e9:>10.2f} "
                  f"{paged / sdpa:>16.2f}")


if __name__ == "__main__":
    main()
