"""The Metal paged-attention kernels: sources from `metal/`, launched through `mx.fast.metal_kernel`.

Decode rows and short prefill chunks run on the paged kernel, one threadgroup per query token
and KV head, split into partitions when a step would leave the GPU's cores idle; chunks
of `PREFILL_FROM` tokens or more run on MLX's SDPA over their gathered pages (`prefill.py`). The
contiguous layout runs through the same kernels: its storage is one page of `max_model_len`
tokens per sequence, so the page table has one column and the kernel's indexing is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np

from ..cache.batch import KVBatch
from ..cache.storage import Pages, QuantizedPages, arrays_of
from .heads import FLOAT32, Heads
from .prefill import PREFILL_FROM, with_chunks_on_sdpa
from .prefill import temporary_bytes as sdpa_temporary_bytes
from .reference import reference_attention
from .variant import PLAIN, Variant

_PACKAGED = Path(__file__).parents[1] / "metal"  # inside the wheel
METAL_DIR = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).parents[2] / "metal"

SIMDGROUPS = 4  # SIMD groups a threadgroup aims for (128 threads): more key splits when fewer head sets
THREADGROUP_MEMORY = 32 * 1024  # bytes of threadgroup memory an Apple GPU gives a threadgroup
MAX_THREADS = 256  # per threadgroup: MLX refuses a launch over a pipeline's limit, below 1,024 for heavy kernels
MIN_PARTITION = 256  # keys per split-K partition at the least: its merge moves 6% of its K/V bytes (GQA 8, d 128)
THREADGROUPS_PER_CORE = 4  # split-K when a decode step would give the GPU's cores fewer threadgroups than this
# GPU cores by the last letter of MLX's architecture name (applegpu_g14c: an M2 Max): phone, base,
# Pro, Max, Ultra chips. The smallest of each class, so that a split is never missed for want of cores.
GPU_CORES = {"p": 4, "g": 8, "s": 14, "c": 24, "d": 48}
KV_INPUTS = {
    False: ["k_pages", "v_pages"],  # float pages; quantized ones pass their three arrays each
    True: ["k_pages", "k_scales", "k_biases", "v_pages", "v_scales", "v_biases"],
}
TOLERANCE = {mx.float32: 1e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}  # largest |kernel - reference|

Factory = Callable[..., Any]  # mx.fast.metal_kernel, or the simulator's


@dataclass(frozen=True)
class LaunchShape:
    """How a threadgroup covers one query token and one KV head's GQA group of `heads` query
    heads: `heads // heads_per_simdgroup` head sets times `splits` key splits of SIMD groups,
    each walking tiles of `keys_per_tile` keys of a page."""

    heads: int
    heads_per_simdgroup: int
    keys_per_tile: int
    splits: int
    head_dim: int

    @property
    def head_sets(self) -> int:
        """SIMD groups across the heads; the last is padded when `heads_per_simdgroup` does not
        divide `heads` (GQA 5 or 7), its extra heads computed and never written."""
        return -(-self.heads // self.heads_per_simdgroup)

    @property
    def simdgroups(self) -> int:
        return self.head_sets * self.splits

    @property
    def threadgroup_memory(self) -> int:
        """Bytes: the states the key splits other than the first hand over to be merged."""
        padded = self.head_sets * self.heads_per_simdgroup
        return (self.splits - 1) * padded * (self.head_dim + 2) * 4 if self.splits > 1 else 8

    def template(self) -> list[tuple[str, int]]:
        return [
            ("HG", self.heads),
            ("H", self.heads_per_simdgroup),
            ("KT", self.keys_per_tile),
            ("KS", self.splits),
            ("NSG", self.simdgroups),
        ]


def launch_shape(group: int, head_dim: int, page_size: int) -> LaunchShape:
    """The threadgroup shape for GQA `group` at `head_dim` over pages of `page_size` keys.

    A SIMD group takes as many of the group's heads as its registers hold without spilling
    (4 at head_dim 128, as MLX found for its SDPA; 8 at 64, 2 at 256), the rest go to other
    SIMD groups reading the same rows, up to `MAX_THREADS` (a larger group takes several
    threadgroups); key splits fill the threadgroup to `SIMDGROUPS`. A tile has 32 / heads keys
    (rounded to powers of two), so that one reduce-scatter sums all of a tile's dot products,
    and at most a page.
    """
    lane_dims = 32 * -(-head_dim // 32)
    most = max(1, min(8, 512 // lane_dims))
    fewest = -(-group // most)  # head sets
    if fewest <= MAX_THREADS // 32:  # one threadgroup: the fewest head sets, the last padded
        head_sets = fewest
        per_simdgroup = -(-group // head_sets)
        heads = group
    else:  # several threadgroups, each a whole number of head sets
        per_simdgroup = max(h for h in range(1, most + 1) if group % h == 0)
        sets = group // per_simdgroup
        head_sets = max(n for n in range(1, MAX_THREADS // 32 + 1) if sets % n == 0)
        heads = head_sets * per_simdgroup
    keys_per_tile = min(32 // (1 << (per_simdgroup - 1).bit_length()), 1 << (page_size.bit_length() - 1))
    splits = max(1, SIMDGROUPS // head_sets)
    shape = LaunchShape(heads, per_simdgroup, keys_per_tile, splits, head_dim)
    if shape.threadgroup_memory > THREADGROUP_MEMORY:
        raise ValueError(f"head_dim={head_dim} is too large for the Metal kernels' threadgroup memory")
    return shape


def partition_keys(threadgroups: int, longest: int, cores: int) -> int | None:
    """Keys per split-K partition for a step of `threadgroups` threadgroups whose longest row
    has `longest` keys, or None for no split. A step that would give each of the GPU's `cores`
    fewer than `THREADGROUPS_PER_CORE` threadgroups splits its rows into partitions that make up
    about that many: a power of two of keys (a few kernel variants), `MIN_PARTITION` at least."""
    wanted = THREADGROUPS_PER_CORE * cores
    if threadgroups >= wanted or longest <= MIN_PARTITION:
        return None
    per_row = -(-wanted // threadgroups)
    keys = max(MIN_PARTITION, 1 << (-(-longest // per_row) - 1).bit_length())
    return keys if keys < longest else None


@lru_cache(maxsize=64)
def _constant(value: float, dtype: mx.Dtype, shape: tuple[int, ...] = ()) -> mx.array:
    """A constant kernel input (scale, window, soft-cap, partition count, no sinks), made once
    for every layer and step that passes the same value rather than once per layer call."""
    return mx.full(shape, value, dtype)


@lru_cache(maxsize=8)
def _batch_inputs(batch: KVBatch) -> tuple[mx.array, mx.array, mx.array]:
    """The kernels' per-step inputs: page tables, each token's row and position (made once per
    step for all layers)."""
    return mx.array(batch.page_tables), mx.array(batch.token_rows), mx.array(batch.positions)


def gpu_cores() -> int:
    """The GPU's core count by its class (MLX names the architecture), or a base chip's off Metal."""
    if not mx.metal.is_available():
        return GPU_CORES["g"]
    # The GPU's own info: without a device, mx.device_info() describes the default one, the CPU
    # after mx.set_default_device(mx.cpu).
    info = mx.device_info(mx.gpu)
    return GPU_CORES.get(str(info.get("architecture", "g"))[-1:], GPU_CORES["g"])


def _check_batch(
    dtype: mx.Dtype, head_dim: int, page_size: int, q_heads: int, kv_heads: int, kv_bits: int | None, kv_group_size: int
):
    """A small batch for the start-up check: a decode row over two split-K partitions, pages
    out of order, and a 3-token prefill chunk whose page table fits MLX's `constant` space."""
    contexts, query_lens = np.array([MIN_PARTITION + 3, 5], np.int32), np.array([1, 3], np.int32)
    pages = -(-contexts // page_size)
    tables = np.zeros((2, int(pages.max())), np.int32)
    tables[0, : pages[0]] = np.arange(pages[0])[::-1]
    tables[1, : pages[1]] = pages[0] + np.arange(pages[1])
    batch = KVBatch((0, 1), query_lens, contexts, tables, page_size)
    keys = mx.random.split(mx.random.key(0), 3)
    shape = (int(pages.sum()), kv_heads, page_size, head_dim)
    floats = [mx.random.normal(shape, key=k).astype(dtype) for k in keys[:2]]
    stored: list[Pages] = list(floats)
    if kv_bits is not None:
        stored = [QuantizedPages.quantize(array, kv_bits, kv_group_size) for array in floats]
    queries = mx.random.normal((4, q_heads, head_dim), key=keys[2]).astype(dtype)
    return queries, stored[0], stored[1], batch


def kernel_temporary_bytes(heads: Heads, queries: int, context: int, prefill_from: int = PREFILL_FROM) -> int:
    """Most bytes the kernels' attention holds in one layer for a row of `queries` new tokens over
    `context` keys: a chunk on SDPA holds what `prefill.temporary_bytes` says; the paged kernel reads
    the pages where they are, and holds only its split-K partials (at most one partition per
    `MIN_PARTITION` keys) and its output."""
    if queries >= prefill_from:
        return sdpa_temporary_bytes(heads, queries, context)
    partitions = -(-context // MIN_PARTITION)
    return queries * heads.q_heads * (partitions * (heads.head_dim + 2) * FLOAT32 + heads.head_dim * heads.itemsize)


class PagedAttentionKernels:
    """Paged attention for packed batches, reading K/V through the page tables in Metal.

    `metal_kernel` is `mx.fast.metal_kernel`, or anything with its signature (the
    project's CPU simulator in tests). Each attention kernel comes in a float-page and a
    quantized-page variant (`direct[quantized]`, `partitioned[quantized]`): the same body
    after a different K/V reader prologue. Each template variant compiles once per process.
    """

    def __init__(
        self,
        metal_kernel: Factory = mx.fast.metal_kernel,
        verbose: bool = False,
        cores: int | None = None,
        prefill_from: int = PREFILL_FROM,
    ) -> None:
        self.verbose = verbose
        self.cores = gpu_cores() if cores is None else cores
        self.prefill_from = prefill_from
        header = (METAL_DIR / "paged_attention.h").read_text()

        def build(name: str, input_names: list[str], output_names: list[str], quantized: bool | None = None):
            source = (METAL_DIR / f"{name}.metal").read_text()
            if quantized is not None:
                source = (METAL_DIR / ("kv_quantized.metal" if quantized else "kv_float.metal")).read_text() + source
                name += "_quantized" if quantized else ""
            return metal_kernel(
                name=f"mlxkv_{name}", input_names=input_names, output_names=output_names, source=source, header=header
            )

        self.direct, self.partitioned = {}, {}
        for quantized, kv in KV_INPUTS.items():
            inputs = ["queries", *kv, "page_tables", "token_rows", "token_pos", "scale", "window", "softcap", "sinks"]
            self.direct[quantized] = build("paged_attention", inputs, ["out"], quantized)
            self.partitioned[quantized] = build(
                "paged_attention_partitioned", inputs + ["partitions"], ["partial_acc", "partial_ml"], quantized
            )
        self.reduce = build("paged_attention_reduce", ["partial_acc", "partial_ml", "sinks"], ["out"])

    def __call__(
        self,
        queries: mx.array,
        k_pages: Pages,
        v_pages: Pages,
        batch: KVBatch,
        scale: float | None = None,
        variant: Variant = PLAIN,
        split: bool | None = None,
    ) -> mx.array:
        """Same contract as `reference_attention`: chunks of `prefill_from` tokens or more on
        MLX's SDPA, the other rows on the paged kernel (`split` forces its split-K on or off)."""
        scale = 1.0 / math.sqrt(queries.shape[-1]) if scale is None else scale
        return with_chunks_on_sdpa(
            partial(self.paged, split=split),
            queries,
            k_pages,
            v_pages,
            batch,
            scale,
            variant,
            self.prefill_from,
        )

    def temporary_bytes(self, heads: Heads, queries: int, context: int) -> int:
        """What `kernel_temporary_bytes` says, for this object's `prefill_from`."""
        return kernel_temporary_bytes(heads, queries, context, self.prefill_from)

    def paged(
        self,
        queries: mx.array,
        k_pages: Pages,
        v_pages: Pages,
        batch: KVBatch,
        scale: float,
        variant: Variant = PLAIN,
        split: bool | None = None,
        partition: int | None = None,
    ) -> mx.array:
        """The paged kernel for every row. Each of `variant`'s window, chunk, soft-cap and sinks is a
        template switch, so plain attention pays for none of them. `partition` (keys per split-K
        partition) replaces what `partition_keys` decides for this step: the cost model counts
        one row as it would run inside a larger step."""
        assert batch.blocks is None, "the paged kernel is causal: rows with blocks run on SDPA (with_chunks_on_sdpa)"
        tokens, q_heads, head_dim = queries.shape
        group = q_heads // k_pages.shape[1]
        shape = launch_shape(group, head_dim, k_pages.shape[2])
        tiles = q_heads // shape.heads
        longest = int(batch.context_lens.max()) if tokens else 0
        if partition is None:
            partition = partition_keys(tokens * tiles, longest, self.cores)
        if split is None:
            split = partition is not None
        kv = [*arrays_of(k_pages), *arrays_of(v_pages)]
        packing = [("BITS", k_pages.bits), ("GS", k_pages.group_size)] if isinstance(k_pages, QuantizedPages) else []
        quantized = bool(packing)
        sinks = _constant(0.0, mx.float32, (1,)) if variant.sinks is None else variant.sinks.astype(mx.float32)
        args = [
            queries,
            *kv,
            *_batch_inputs(batch),
            _constant(scale, mx.float32),
            _constant(variant.window or variant.chunk or 0, mx.int32),
            _constant(variant.softcap or 0.0, mx.float32),
            sinks,
        ]
        template = [
            ("T", queries.dtype),
            ("D", head_dim),
            ("PS", k_pages.shape[2]),
            ("G", group),
            *shape.template(),
            ("WINDOWED", variant.window is not None),
            ("CHUNKED", variant.chunk is not None),
            ("SOFTCAP", variant.softcap is not None),
            ("SINKS", variant.sinks is not None),
        ]
        template += packing
        threads = 32 * shape.simdgroups
        launch = dict(threadgroup=(threads, 1, 1), verbose=self.verbose)
        if not split:
            return self.direct[quantized](
                inputs=args,
                template=template,
                grid=(threads, tiles, tokens),
                output_shapes=[queries.shape],
                output_dtypes=[queries.dtype],
                **launch,
            )[0]
        partition = partition or MIN_PARTITION
        parts = max(1, -(-longest // partition))
        acc, ml = self.partitioned[quantized](
            inputs=args + [_constant(parts, mx.int32)],
            template=template + [("PARTITION", partition)],
            grid=(threads, tiles, tokens * parts),
            output_shapes=[(tokens, tiles, parts, shape.heads, head_dim), (tokens, tiles, parts, shape.heads, 2)],
            output_dtypes=[mx.float32, mx.float32],
            **launch,
        )
        return self.reduce(
            inputs=[acc, ml, sinks],
            template=template,
            grid=(threads, tiles, tokens),
            output_shapes=[queries.shape],
            output_dtypes=[queries.dtype],
            **launch,
        )[0]

    def warm(
        self,
        dtype: mx.Dtype,
        head_dim: int,
        page_size: int,
        q_heads: int,
        kv_heads: int,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        variants: Sequence[Variant] = (PLAIN,),
    ) -> str | None:
        """Compile both paths for one model's shapes, pages and attention variants (one check per
        template: window, chunk, soft-cap and sinks each on or off) and check them against the reference.

        Returns None when all agree within the dtype's tolerance, else which kernel failed
        and why (it did not compile or run, or its numbers differ), so the caller can fall
        back to the reference path instead of crashing or writing wrong text.
        """
        queries, k_pages, v_pages, batch = _check_batch(
            dtype, head_dim, page_size, q_heads, kv_heads, kv_bits, kv_group_size
        )
        templates = {(v.window is None, v.chunk is None, v.softcap is None, v.sinks is None): v for v in variants}
        for variant in templates.values():
            expected = reference_attention(queries, k_pages, v_pages, batch, None, variant).astype(mx.float32)
            for split, name in ((False, "paged_attention"), (True, "paged_attention_partitioned + _reduce")):
                try:
                    out = self(queries, k_pages, v_pages, batch, None, variant, split=split)
                    diff = cast(float, mx.abs(out.astype(mx.float32) - expected).max().item())
                except Exception as exc:  # a compile error from Metal's compiler, or any launch failure
                    return f"{name} failed to compile or run: {str(exc).strip().splitlines()[0]}"
                if not diff <= TOLERANCE[dtype]:
                    return (
                        f"{name} differs from the reference attention by up to {diff:.3g} "
                        f"(tolerance {TOLERANCE[dtype]})"
                    )
        return None
