"""Paged attention timed against MLX's own attention on the same K/V, for `mlxkv doctor` and
`scripts/bench_kernels.py`: decode steps (K/V bytes read per second) and prefill chunks.

The K/V sit in a paged pool, pages handed out in shuffled order, and also contiguously per
sequence for the baseline: `mx.fast.scaled_dot_product_attention` for float pages, mlx-lm's
quantized attention (`mx.quantized_matmul` over the packed K/V, as its `QuantizedKVCache` runs)
for quantized ones.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from ...cache.batch import KVBatch
from ...cache.storage import Pages, QuantizedPages, arrays_of, kv_bytes_per_token
from ..prefill import chunk_attention


def timed(fn: Callable[[], mx.array], repeats: int) -> float:
    """Seconds per call of `fn`, after one call that compiles and warms."""
    mx.eval(fn())
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn())
    return (time.perf_counter() - start) / repeats


@dataclass(frozen=True)
class Geometry:
    """The attention of one model: heads, head size, dtype, pages, K/V format."""

    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: mx.Dtype = mx.float16
    page_size: int = 16
    kv_bits: int | None = None
    kv_group_size: int = 64

    def kv_bytes(self, batch: int, context: int) -> int:
        """K/V bytes a decode step of `batch` rows of `context` keys reads."""
        per_token = kv_bytes_per_token(1, self.kv_heads, self.head_dim, self.dtype, self.kv_bits, self.kv_group_size)
        return batch * context * per_token


def ram() -> int:
    """Bytes of this machine's memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory() -> int:
    """Bytes the timings may use: the GPU's recommended working set on a Mac, else the RAM."""
    if mx.metal.is_available():
        return int(mx.device_info(mx.gpu)["max_recommended_working_set_size"])
    return ram()


def too_big(geometry: Geometry, batch: int, context: int, budget: int) -> str | None:
    """Why `decode` leaves a case out, or None: its K/V past a third of `budget` bytes (the
    pages, the baseline's contiguous copy and the temporaries that make them), or a gathered K
    of 2**31 elements, on which MLX 0.32's SDPA crashes (seen on the CPU)."""
    kv = geometry.kv_bytes(batch, context)
    if 3 * kv > budget:
        return f"{kv / 2**30:.1f} GiB of K/V, over a third of {budget / 2**30:.0f} GiB"
    if batch * context * geometry.kv_heads * geometry.head_dim >= 2**31:
        return "a gathered K of 2**31 elements, on which MLX 0.32's SDPA crashes"
    return None


def decode(attention, geometry: Geometry, batch: int, context: int, repeats: int) -> tuple[float, float]:
    """(paged seconds, baseline seconds) for one decode step of `batch` rows of `context` keys."""
    g = geometry
    rng = np.random.default_rng(0)
    pages_per_seq = -(-context // g.page_size)
    pages = rng.permutation(batch * pages_per_seq).astype(np.int32).reshape(batch, pages_per_seq)
    shape = (batch * pages_per_seq, g.kv_heads, g.page_size, g.head_dim)
    k_pages, v_pages = (mx.random.normal(shape).astype(g.dtype) for _ in range(2))
    meta = KVBatch(tuple(range(batch)), np.ones(batch, np.int32), np.full(batch, context, np.int32), pages, g.page_size)
    q = mx.random.normal((batch, g.q_heads, g.head_dim)).astype(g.dtype)
    order = mx.array(pages.reshape(-1))

    def contiguous(paged: mx.array) -> mx.array:
        rows = paged[order].reshape(batch, pages_per_seq, g.kv_heads, g.page_size, g.head_dim)
        rows = rows.transpose(0, 2, 1, 3, 4).reshape(batch, g.kv_heads, pages_per_seq * g.page_size, g.head_dim)
        return rows[:, :, :context]

    k, v = contiguous(k_pages), contiguous(v_pages)
    scale = g.head_dim**-0.5
    kv_pages: tuple[Pages, Pages] = (k_pages, v_pages)
    if g.kv_bits:
        bits, size = g.kv_bits, g.kv_group_size
        kv_pages = (QuantizedPages.quantize(k_pages, bits, size), QuantizedPages.quantize(v_pages, bits, size))
        qk, qv = mx.quantize(k, group_size=size, bits=bits), mx.quantize(v, group_size=size, bits=bits)
        baseline = partial(
            quantized_scaled_dot_product_attention, q[:, :, None], qk, qv, scale, None, group_size=size, bits=bits
        )
        mx.eval(qk, qv)
    else:
        baseline = partial(mx.fast.scaled_dot_product_attention, q[:, :, None], k, v, scale=scale)
    mx.eval(q, k, v, *[arrays_of(pages) for pages in kv_pages])
    paged = timed(lambda: attention(q, *kv_pages, meta, scale), repeats)
    return paged, timed(baseline, repeats)


def prefill(kernels, geometry: Geometry, length: int, context: int, repeats: int) -> tuple[float, float]:
    """(paged seconds, SDPA seconds) for a prefill chunk of `length` tokens ending at `context`
    keys: the paged kernel over the pages against MLX's SDPA over the gathered pages, the two
    choices `PREFILL_FROM` decides between."""
    g = geometry
    pages = -(-context // g.page_size)
    k_pages, v_pages = (
        mx.random.normal((pages, g.kv_heads, g.page_size, g.head_dim)).astype(g.dtype) for _ in range(2)
    )
    table = np.random.default_rng(0).permutation(pages).astype(np.int32)
    q = mx.random.normal((length, g.q_heads, g.head_dim)).astype(g.dtype)
    batch = KVBatch((0,), np.array([length], np.int32), np.array([context], np.int32), table[None], g.page_size)
    mx.eval(q, k_pages, v_pages)
    scale = g.head_dim**-0.5
    paged = timed(partial(kernels.paged, q, k_pages, v_pages, batch, scale), repeats)
    return paged, timed(partial(chunk_attention, q, k_pages, v_pages, table, context, scale), repeats)
