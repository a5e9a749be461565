"""The Metal paged-attention kernels: sources from `metal/`, launched through `mx.fast.metal_kernel`.

The contiguous layout runs through the same kernels: its storage is one page of
`max_seq_len` tokens per sequence, so the block table has one column and the kernel's
indexing is unchanged. MLX's own SDPA is not used for it because a packed batch needs a
different causal offset per token (prefill chunks beside decode rows), which SDPA could
only take as a dense per-sequence mask after padding every sequence.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..cache.manager import KVBatch
from .reference import reference_attention

_PACKAGED = Path(__file__).parents[1] / "metal"  # inside the wheel
METAL_DIR = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).parents[2] / "metal"

ENV_VAR = "MLXKV_ATTENTION"
SIMDGROUPS = 4          # SIMD groups per threadgroup: 128 threads
PARTITION = 256         # keys per split-K partition
SPLIT_BELOW = 128       # split when fewer (token, KV head) threadgroups than this ...
SPLIT_FROM = 2 * PARTITION  # ... would each walk at least this many keys

Factory = Callable[..., Callable]


class PagedAttentionKernels:
    """Paged attention for packed batches, reading K/V through the block tables in Metal.

    `metal_kernel` is `mx.fast.metal_kernel`, or anything with its signature (the
    project's CPU simulator in tests). Each template variant compiles once per process.
    """

    def __init__(self, metal_kernel: Factory = mx.fast.metal_kernel, verbose: bool = False) -> None:
        self.verbose = verbose
        header = (METAL_DIR / "paged_attention.h").read_text()
        inputs = ["queries", "k_pool", "v_pool", "block_tables", "token_rows", "token_pos", "scale"]

        def build(name: str, input_names: list[str], output_names: list[str]):
            return metal_kernel(name=f"mlxkv_{name}", input_names=input_names, output_names=output_names,
                                source=(METAL_DIR / f"{name}.metal").read_text(), header=header)

        self.direct = build("paged_attention", inputs, ["out"])
        self.partitioned = build("paged_attention_partitioned", inputs + ["partitions"], ["partial_acc", "partial_ml"])
        self.reduce = build("paged_attention_reduce", ["partial_acc", "partial_ml"], ["out"])

    def __call__(self, queries: mx.array, k_pool: mx.array, v_pool: mx.array, batch: KVBatch,
                 scale: float | None = None, split: bool | None = None) -> mx.array:
        """Same contract as `reference_attention`; `split` forces split-K on or off."""
        tokens, q_heads, head_dim = queries.shape
        kv_heads, block_size = k_pool.shape[1], k_pool.shape[2]
        group = q_heads // kv_heads
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        rows = np.repeat(np.arange(len(batch.query_lens), dtype=np.int32), batch.query_lens)
        longest = int(batch.context_lens.max()) if tokens else 0
        if split is None:
            split = tokens * kv_heads < SPLIT_BELOW and longest >= SPLIT_FROM
        args = [queries, k_pool, v_pool, mx.array(batch.block_tables), mx.array(rows), mx.array(batch.positions),
                mx.array(scale, mx.float32)]
        template = [("T", queries.dtype), ("D", head_dim), ("BS", block_size), ("G", group), ("NSG", SIMDGROUPS)]
        launch = dict(threadgroup=(32 * SIMDGROUPS, 1, 1), verbose=self.verbose)
        if not split:
            return self.direct(inputs=args, template=template, grid=(32 * SIMDGROUPS, kv_heads, tokens),
                               output_shapes=[queries.shape], output_dtypes=[queries.dtype], **launch)[0]
        parts = max(1, -(-longest // PARTITION))
        acc, ml = self.partitioned(
            inputs=args + [mx.array(parts, mx.int32)], template=template + [("PARTITION", PARTITION)],
            grid=(32 * SIMDGROUPS, kv_heads, tokens * parts),
            output_shapes=[(tokens, kv_heads, parts, group, head_dim), (tokens, kv_heads, parts, group, 2)],
            output_dtypes=[mx.float32, mx.float32], **launch)
        return self.reduce(inputs=[acc, ml], template=template, grid=(32 * SIMDGROUPS, kv_heads, tokens),
                           output_shapes=[queries.shape], output_dtypes=[queries.dtype], **launch)[0]

    def warm(self, dtype: mx.Dtype, head_dim: int, block_size: int, q_heads: int, kv_heads: int) -> None:
        """Compile both paths for one model's shapes now rather than on the first request."""
        pool = mx.zeros((1, kv_heads, block_size, head_dim), dtype)
        one = np.ones(1, np.int32)
        batch = KVBatch((0,), one, one, np.zeros((1, 1), np.int32), np.zeros(1, np.int32), block_size)
        for split in (False, True):
            mx.eval(self(mx.zeros((1, q_heads, head_dim), dtype), pool, pool, batch, split=split))


def select_attention(choice: str | None = None) -> Callable:
    """The attention the engine runs: `choice`, else `MLXKV_ATTENTION`, else Metal where available."""
    source, value = ("attention", choice) if choice is not None else (ENV_VAR, os.environ.get(ENV_VAR))
    value = (value or ("metal" if mx.metal.is_available() else "reference")).strip().lower()
    if value == "reference":
        return reference_attention
    if value != "metal":
        raise ValueError(f"{source}={value!r} is not an attention backend; expected 'metal' or 'reference'")
    if not mx.metal.is_available():
        raise ValueError(f"{source}='metal' but Metal is not available on this machine "
                         "(mx.metal.is_available() is False); use 'reference'")
    return PagedAttentionKernels()
