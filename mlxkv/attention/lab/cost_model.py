"""A model of a decode launch's time on an Apple GPU, from what the CPU simulator counts.

The simulator counts what the GPU would execute (`simulator.Counters`: device bytes, load
instructions and bytes, shuffles, 32-lane reductions, exp2 calls); the arithmetic it cannot see
(multiply-adds, selects, integer and 64-bit address work) is tallied here from each kernel's
loop structure, term by term. A launch then takes the longest of five bounds, plus a fixed cost:

- DRAM: distinct K/V bytes at the share of bandwidth a streaming kernel reaches;
- issue: every SIMD instruction at its issue cost on the core's 4 schedulers, scaled down when
  resident SIMD groups (registers limit them) times the independent chains each has in flight
  (its ILP) fall short of the 24 that keep a core's ALUs busy;
- L1: load bytes through each core's 64 bytes a cycle (repeated reads of a row come from here);
- latency: bytes in flight (resident SIMD groups x the bytes one load round issues) over the load
  latency (Little's law);
- chain: one SIMD group's load rounds, each a full latency, plus its own issue cycles, in waves
  when there are more threadgroups than fit: what bounds a single sequence at batch 1.

Instruction costs come from Philip Turner's metal-benchmarks (M1/M2 generation); clocks, core
counts and launch cost are assumptions, printed with every table; the load latency is fitted
(`calibration_points`, `fit_latency`) to MLX's published SDPA speeds before anything is quoted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cache
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ...cache.batch import KVBatch
from ...cache.storage import kv_bytes_per_token
from ..kernels import METAL_DIR, PagedAttentionKernels, launch_shape, partition_keys
from . import count_cache
from .simulator import Counters, cost_counters, metal_kernel

# Issue cycles of one SIMD instruction on one of a core's four schedulers (metal-benchmarks).
FMA = 1.0  # FFMA32, FADD32, FMUL32, select, compare, 32-bit integer add
INT64 = 4.0  # a 64-bit integer add, emulated with four 32-bit instructions
EXP2 = 4.0  # fast::exp2 (a quarter-rate unit)
SHUFFLE = 2.0  # simd_shuffle and simd_shuffle_xor
REDUCTION = 14.5  # simd_sum / simd_max over 32 lanes
LOAD = 1.0  # issuing one load instruction (its bytes are the L1 bound's)


ASSUMED_LATENCY = 700e-9  # s from a device load's issue to its data, before calibration


@dataclass(frozen=True)
class Gpu:
    """An Apple GPU as the model sees it."""

    name: str
    bandwidth: float  # bytes/s of unified memory, the chip's specification
    streaming: float  # share of it a streaming kernel reaches (measured where stated)
    cores: int
    clock: float  # Hz (assumed: Apple does not publish GPU clocks)
    schedulers: int = 4  # SIMD instructions a core issues per cycle
    full_issue: int = 24  # resident SIMD groups at ILP 1 a core needs to issue at full rate (metal-benchmarks)
    max_simdgroups: int = 96  # resident SIMD groups a core holds at most (3,072 threads)
    registers: int = 208 * 1024  # bytes of register file per core
    l1: int = 64  # bytes a cycle a core's data cache delivers
    threadgroup_memory: int = 60 * 1024  # per core
    latency: float = ASSUMED_LATENCY  # s from a device load's issue to its data
    launch: float = 4e-6  # s of fixed dispatch and tail per kernel launch (assumed)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.bandwidth / 1e9:.0f} GB/s x {self.streaming:.0%} streaming, {self.cores} cores "
            f"at {self.clock / 1e9:.2f} GHz, {self.schedulers} SIMD instructions a core a cycle (full from "
            f"{self.full_issue} resident SIMD groups, at most {self.max_simdgroups}), {self.registers // 1024} KiB of "
            f"registers and {self.l1} B/cycle of L1 a core, {self.latency * 1e9:.0f} ns load latency, "
            f"{self.launch * 1e6:.0f} us a launch; issue cycles: FMA/select {FMA:g}, 64-bit add {INT64:g}, exp2 "
            f"{EXP2:g}, shuffle {SHUFFLE:g}, 32-lane sum {REDUCTION:g}, load {LOAD:g}"
        )


# The chip in MLX's published decode figures (ml-explore/mlx issue 4076): 307 GB/s, of which a
# dense float16 matrix-vector product streams 266 GB/s; its core count and clock are assumed, and
# its load latency is the one `fit_latency` finds on those figures (ASSUMED_LATENCY before).
M5_PRO = Gpu("M5 Pro (20-core GPU)", 307e9, 266 / 307, 20, 1.6e9, latency=370e-9)


@dataclass(frozen=True)
class Work:
    """One launch for one replica (one sequence's decode row of one KV head), counted and tallied."""

    counters: Counters
    arithmetic: float  # issue cycles of the ALU work the counters do not see, all SIMD groups
    rounds: int  # load rounds one SIMD group waits through in sequence
    chain_cycles: float  # issue cycles of one SIMD group's own instructions
    live: float  # 32-bit registers a lane keeps live
    ilp: int  # independent dependency chains a SIMD group's instructions form
    kv_bytes: int  # K/V bytes the replica reads from DRAM (shared reads counted once)
    threadgroups: int  # per replica
    simdgroups: int  # per threadgroup

    @property
    def issue_cycles(self) -> float:
        """Every SIMD instruction of the replica at its issue cost."""
        c = self.counters
        counted = (c.loads / 32) * LOAD + (c.transcendentals / 32) * EXP2 + c.shuffles * SHUFFLE
        return counted + c.reductions * REDUCTION + self.arithmetic


@dataclass(frozen=True)
class Estimate:
    seconds: float
    rate: float  # K/V bytes read per second
    bound: str  # what bounds the longest launch: dram, issue, l1, latency or chain
    resident: int  # SIMD groups resident per core in the longest launch


def estimate(launches: list[Work], replicas: int, gpu: Gpu) -> Estimate:
    """The modelled time of `launches` run for `replicas` replicas on `gpu`: each launch's
    longest bound plus its fixed cost (see the module docstring)."""
    seconds, longest, bound, resident = 0.0, 0.0, "", gpu.max_simdgroups
    for work in launches:
        c = work.counters
        threadgroups = work.threadgroups * replicas
        cores = min(gpu.cores, threadgroups)
        per_core = min(
            gpu.max_simdgroups // work.simdgroups,
            int(gpu.registers // (32 * 4 * work.live * work.simdgroups)),
            gpu.threadgroup_memory // max(1, c.threadgroup_memory),
            -(-threadgroups // cores),
        )
        per_core = max(1, per_core)
        simdgroups = per_core * work.simdgroups
        rate = cores * gpu.clock
        in_flight = c.read_bytes / max(1, work.threadgroups * work.simdgroups * work.rounds)
        waves = -(-threadgroups // (cores * per_core))
        bounds = {
            "dram": (work.kv_bytes + c.written_bytes) * replicas / (gpu.bandwidth * gpu.streaming),
            "issue": work.issue_cycles
            * replicas
            / (rate * gpu.schedulers * min(1.0, simdgroups * work.ilp / gpu.full_issue)),
            "l1": c.load_bytes * replicas / (rate * gpu.l1),
            "latency": c.read_bytes * replicas / (cores * simdgroups * in_flight / gpu.latency),
            "chain": waves * (work.rounds * gpu.latency + work.chain_cycles / gpu.clock),
        }
        name = max(bounds, key=lambda k: bounds[k])
        seconds += bounds[name] + gpu.launch
        if bounds[name] > longest:
            longest, bound, resident = bounds[name], name, simdgroups
    return Estimate(seconds, launches[0].kv_bytes * replicas / seconds, bound, resident)


# ---- mlxkv's paged kernel -------------------------------------------------------------------
def paged_work(context: int, group: int, head_dim: int, replicas: int, cores: int) -> list[Work]:
    """The paged kernel's launches for a decode step of `replicas` rows x KV heads, each over
    `context` float16 keys in pages of 16, split as the launcher splits that step on `cores`
    cores; counted in the simulator for one replica and tallied."""
    shape = launch_shape(group, head_dim, 16)
    tiles = group // shape.heads  # threadgroups per replica, unsplit
    partition = paged_count(context, group, head_dim, replicas, cores).partition
    counted = _count_paged(context, group, head_dim, partition)
    parts = -(-context // partition) if partition else 1
    keys = min(context, partition or context)
    tiles_per_simdgroup = -(-keys // shape.keys_per_tile) / shape.splits
    per_tile = paged_tile_cycles(shape.heads_per_simdgroup, shape.keys_per_tile, head_dim, 16, shape.splits)
    per_lane = -(-head_dim // 32)
    threadgroups = tiles * parts
    work = [
        Work(
            counters=counted[0],
            arithmetic=per_tile["arithmetic"] * tiles_per_simdgroup * shape.simdgroups * threadgroups,
            rounds=math.ceil(tiles_per_simdgroup) * _rounds_per_tile(shape.keys_per_tile, per_lane),
            chain_cycles=math.ceil(tiles_per_simdgroup) * per_tile["all"],
            live=paged_live(shape.heads_per_simdgroup, shape.keys_per_tile, head_dim),
            ilp=4,  # a tile's dot products and V updates: one chain per head and key, at least 4
            kv_bytes=kv_bytes(context, head_dim),
            threadgroups=threadgroups,
            simdgroups=shape.simdgroups,
        )
    ]
    for merge in counted[1:]:  # split-K's pass 2: it reads and writes partials, not K/V
        work.append(Work(merge, 0.0, 1, 0.0, 16, 1, merge.read_bytes, tiles, shape.simdgroups))
    return work


def kv_bytes(context: int, head_dim: int, replicas: int = 1) -> int:
    """Float16 K and V bytes of `replicas` rows x KV heads over `context` keys."""
    return kv_bytes_per_token(1, 1, head_dim, mx.float16) * context * replicas


def decode_row(context: int, group: int, head_dim: int) -> tuple[mx.array, mx.array, mx.array, KVBatch]:
    """Queries, K and V pages (of 16, out of order) and the batch of one float16 decode row of
    one KV head over `context` keys: what the model counts a kernel on."""
    rng = np.random.default_rng(0)
    pages = -(-context // 16)
    k_pages, v_pages = (mx.array(rng.standard_normal((pages, 1, 16, head_dim)), mx.float16) for _ in range(2))
    table = rng.permutation(pages).astype(np.int32)[None]
    batch = KVBatch((0,), np.ones(1, np.int32), np.array([context], np.int32), table, 16)
    return mx.array(rng.standard_normal((1, group, head_dim)), mx.float16), k_pages, v_pages, batch


class PagedCount(NamedTuple):
    """What the simulator counts for one `paged_work`: a decode row of one KV head over `context`
    keys, split into partitions of `partition` keys (None: not split)."""

    context: int
    group: int
    head_dim: int
    partition: int | None


def paged_count(context: int, group: int, head_dim: int, replicas: int, cores: int) -> PagedCount:
    """The count `paged_work` of these arguments needs: the partition as the launcher cuts the whole step."""
    tiles = group // launch_shape(group, head_dim, 16).heads  # threadgroups per replica, unsplit
    return PagedCount(context, group, head_dim, partition_keys(replicas * tiles, context, cores))


def uncounted(counts: Iterable[PagedCount]) -> list[PagedCount]:
    """The distinct `counts` not in the simulator's cache yet (`count_cache`): those that take time."""
    return [c for c in dict.fromkeys(counts) if not count_cache.path_of(_describe(c)).exists()]


def _describe(count: PagedCount) -> str:
    """The cache's name for `count`."""
    return "paged decode row: context {}, group {}, head_dim {}, partition {}".format(*count)


@cache
def _count_paged(context: int, group: int, head_dim: int, partition: int | None) -> tuple[Counters, ...]:
    """The simulator's counters for one decode row of one KV head, split into partitions of
    `partition` keys (None: not split); from the cache when counted before."""

    def count() -> list[Counters]:
        q, k_pages, v_pages, batch = decode_row(context, group, head_dim)
        kernels = PagedAttentionKernels(metal_kernel)
        with cost_counters(arrays=False) as launches:
            mx.eval(
                kernels.paged(
                    q, k_pages, v_pages, batch, head_dim**-0.5, split=partition is not None, partition=partition
                )
            )
        return launches

    return count_cache.counted(_describe(PagedCount(context, group, head_dim, partition)), count)


def _rows_at_once(keys_per_tile: int, per_lane: int) -> int:
    """Rows a tile loads before using the first (`AT_ONCE` in paged_attention.h)."""
    fit = next(n for n in (32, 16, 8, 4, 2) if 32 // per_lane >= n or n == 2)
    return min(keys_per_tile, fit)


def _v_with_k(keys_per_tile: int, per_lane: int) -> bool:
    """Whether a tile loads its V rows with its K rows (`V_WITH_K` in paged_attention.h)."""
    return _rows_at_once(keys_per_tile, per_lane) == keys_per_tile and keys_per_tile * per_lane <= 16


def _rounds_per_tile(keys_per_tile: int, per_lane: int) -> int:
    """Load rounds a SIMD group waits through per tile, as the code issues its loads: each group
    of K rows, then each of V rows; one round when V comes with K."""
    groups = -(-keys_per_tile // _rows_at_once(keys_per_tile, per_lane))
    return groups if _v_with_k(keys_per_tile, per_lane) else 2 * groups


def paged_tile_cycles(heads: int, keys: int, head_dim: int, page_size: int, splits: int) -> dict[str, float]:
    """Issue cycles of one SIMD group's tile of `keys` keys for `heads` query heads (float
    pages): `arithmetic`, what the counters do not see, and `all`, with loads, shuffles and
    exp2 added (the tile's own chain). Term by term, as `attend_keys` is written."""
    per_lane = -(-head_dim // 32)
    row = 7 + 2 * (1 + INT64)  # a key's resident row (add, compare, select, min, max, mask), then K and V rows' address
    dots = heads * keys * per_lane  # K: one multiply-add per value and head
    reduce_scatter = 31 * 3  # two selects and an add per shuffle
    softmax = 14 + math.log2(keys)  # mask, maxima, two differences, selects, the running sum
    rescale = heads * per_lane
    values = heads * keys * per_lane  # V: one multiply-add per value and head
    loop = 7 + (6 + 2 * (1 + INT64)) / max(1, page_size // keys // splits)  # the tile's indices; a page's addresses
    arithmetic = FMA * (keys * row + dots + reduce_scatter + softmax + rescale + values + loop)
    events = paged_tile_events(heads, keys, head_dim)
    counted = LOAD * events["loads"] + SHUFFLE * events["shuffles"] + EXP2 * events["exp2"]
    return {"arithmetic": arithmetic, "all": arithmetic + counted}


def paged_tile_events(heads: int, keys: int, head_dim: int) -> dict[str, int]:
    """What one SIMD group's tile issues that the simulator also counts (float16 pages): row
    loads (K and V; a lane's values in vector loads of 4, 2 or, at odd counts, 1 value, as
    `DenseRows` reads them), shuffles (the reduce-scatter's 31, the tile maximum's, one rescale
    factor per head, one weight per head and key) and exp2 (2, one SIMD instruction each)."""
    return {
        "loads": 2 * keys * _loads_per_row(head_dim),
        "shuffles": 31 + int(math.log2(keys)) + heads + heads * keys,
        "exp2": 2,
    }


def _loads_per_row(head_dim: int) -> int:
    """Load instructions a lane issues for its values of one float16 row, as `DenseRows` reads
    them: vector loads of 4 or 2 values, or one by one at odd counts and head dims off 32."""
    per_lane = -(-head_dim // 32)
    chunk = 1 if head_dim % 32 else 4 if per_lane % 4 == 0 else 2 if per_lane % 2 == 0 else 1
    return per_lane // chunk


def paged_live(heads: int, keys: int, head_dim: int, value_bytes: int = 2) -> float:
    """32-bit registers a lane keeps live during a tile's K phase: queries and outputs of its
    heads, the tile's 32 dot products, the rows in flight (K, and V when it comes with K; held
    in their pages' type, `value_bytes` each: two float16 values share a register) and about 16
    scalars (indices, pointers, max and sum). Float pages only: quantized ones add the heads'
    query sums and V biases and each row's scale and bias."""
    per_lane = -(-head_dim // 32)
    rows = _rows_at_once(keys, per_lane) * (2 if _v_with_k(keys, per_lane) else 1)
    return 2 * heads * per_lane + 32 + rows * per_lane * value_bytes / 4 + 16


# ---- the calibration kernel: MLX's vector SDPA structure ---------------------------------------
def vector_sdpa_kernel():
    """`metal/vector_sdpa.metal` in the simulator (pass 1; see the file)."""
    return metal_kernel(
        name="mlxkv_vector_sdpa",
        input_names=["queries", "keys", "values", "scale"],
        output_names=["partial_acc", "partial_ml"],
        source=(METAL_DIR / "vector_sdpa.metal").read_text(),
        header=(METAL_DIR / "paged_attention.h").read_text(),
    )


def vector_sdpa(kernel, queries: mx.array, keys: mx.array, values: mx.array, blocks: int) -> mx.array:
    """Attention of one token's `queries` [heads, D] over `keys`, `values` [kv_heads, N, D] by the
    calibration kernel, its blocks merged in MLX (pass 2)."""
    heads, head_dim = queries.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    acc, ml = kernel(
        inputs=[queries, keys, values, mx.array(head_dim**-0.5, mx.float32)],
        template=[("T", queries.dtype), ("D", head_dim), ("G", group)],
        grid=(32 * group, kv_heads, blocks),
        threadgroup=(32 * group, 1, 1),
        output_shapes=[(heads, blocks, head_dim), (heads, blocks, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    top, total = ml[..., 0], ml[..., 1]
    weight = mx.power(2.0, top - top.max(axis=1, keepdims=True))
    return ((weight[..., None] * acc).sum(axis=1) / (weight * total).sum(axis=1)[:, None]).astype(queries.dtype)


VECTOR_SDPA_BLOCKS = 64  # key blocks per KV head: MLX's pass 1 uses 32 to 128, enough to fill the GPU


def vector_sdpa_work(context: int, group: int, head_dim: int) -> list[Work]:
    """The calibration kernel's pass 1 for one KV head's decode row over `context` float16 keys,
    counted and tallied, and its pass 2 as the bytes it moves."""
    rng = np.random.default_rng(0)
    keys, values = (mx.array(rng.standard_normal((1, context, head_dim)), mx.float16) for _ in range(2))
    queries = mx.array(rng.standard_normal((group, head_dim)), mx.float16)
    blocks = VECTOR_SDPA_BLOCKS
    with cost_counters() as launches:
        mx.eval(vector_sdpa(vector_sdpa_kernel(), queries, keys, values, blocks))
    per_lane = head_dim // 32
    keys_per_simdgroup = -(-context // blocks)
    per_key = vector_sdpa_key_cycles(head_dim)
    (attention,) = launches
    partials = group * blocks * (head_dim + 2) * 4
    merge = _bytes_only("pass 2", read=partials, written=group * head_dim * 2)
    return [
        Work(
            counters=attention,
            arithmetic=per_key["arithmetic"] * keys_per_simdgroup * group * blocks,
            rounds=keys_per_simdgroup,
            chain_cycles=keys_per_simdgroup * per_key["all"],
            live=3 * per_lane + 12,  # query and output in floats, a K and a V row in float16
            ilp=1,  # each key: dot, 32-lane sum, max, exp2, update, in sequence
            kv_bytes=kv_bytes(context, head_dim),
            threadgroups=blocks,
            simdgroups=group,
        ),
        Work(merge, 0.0, 1, 0.0, 16, 1, partials, 1, 1),
    ]


def _bytes_only(name: str, read: int, written: int) -> Counters:
    """Counters for a launch modelled by the bytes it moves alone (one threadgroup of 32 threads)."""
    return Counters(
        name,
        read,
        written,
        loads=0,
        load_bytes=0,
        vector_loads=0,
        vector_load_bytes=0,
        stores=0,
        store_bytes=0,
        reductions=0,
        shuffles=0,
        transcendentals=0,
        barriers=0,
        threadgroups=1,
        threadgroup_memory=0,
        threads=32,
    )


def vector_sdpa_key_cycles(head_dim: int) -> dict[str, float]:
    """Issue cycles of one SIMD group's key in the calibration kernel: `arithmetic` (dot and
    output multiply-adds, softmax, two 64-bit row pointers and the loop) and `all`, with its two
    row loads, its 32-lane sum and two exp2."""
    per_lane = head_dim // 32
    arithmetic = FMA * (3 * per_lane + 4 + 2) + 2 * INT64
    loads = 2 * _loads_per_row(head_dim)
    return {"arithmetic": arithmetic, "all": arithmetic + LOAD * loads + REDUCTION + EXP2 * 2}


# MLX's SDPA on an M5 Pro, float16, batch 1, K/V bytes counted once (ml-explore/mlx issue 4076):
# (q_heads, kv_heads, head_dim) -> GB/s at contexts of 2k, 8k and 32k.
PUBLISHED = {
    (32, 32, 128): (239, 282, 281),
    (32, 8, 128): (234, 263, 264),
    (32, 4, 128): (130, 184, 190),
    (64, 8, 64): (76, 113, 119),
}
PUBLISHED_CONTEXTS = (2048, 8192, 32768)


@dataclass(frozen=True)
class CalibrationPoint:
    """One published figure and the calibration kernel's modelled launches at its geometry."""

    q_heads: int
    kv_heads: int
    head_dim: int
    context: int
    published: float  # GB/s
    work: list[Work]

    def modelled(self, gpu: Gpu) -> Estimate:
        return estimate(self.work, self.kv_heads, gpu)

    def rate(self, gpu: Gpu) -> float:
        """Modelled K/V GB/s on `gpu`."""
        return self.modelled(gpu).rate / 1e9

    def error(self, gpu: Gpu) -> float:
        """Modelled over published, minus one."""
        return self.rate(gpu) / self.published - 1


def calibration_points(on_point=None) -> list[CalibrationPoint]:
    """The calibration kernel counted at every published geometry (`on_point` called after each)."""
    points = []
    for (q_heads, kv_heads, head_dim), rates in PUBLISHED.items():
        for context, published in zip(PUBLISHED_CONTEXTS, rates):
            work = vector_sdpa_work(context, q_heads // kv_heads, head_dim)
            points.append(CalibrationPoint(q_heads, kv_heads, head_dim, context, published, work))
            if on_point:
                on_point(points[-1])
    return points


def fit_latency(points: list[CalibrationPoint], gpu: Gpu = M5_PRO) -> Gpu:
    """`gpu` with the load latency (the model's least known figure) that brings the calibration
    kernel closest to the published speeds: least mean |log(modelled / published)|, 100-1,000 ns."""

    def misfit(latency_ns: int) -> float:  # to 0.1%: of equal fits, the longest latency
        trial = replace(gpu, latency=latency_ns * 1e-9)
        return round(sum(abs(math.log(p.rate(trial) / p.published)) for p in points) / len(points), 3)

    return replace(gpu, latency=min(range(1000, 99, -10), key=misfit) * 1e-9)
