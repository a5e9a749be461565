"""Paged attention against `mx.fast.scaled_dot_product_attention` on the same K/V, for decode.

For each batch size and context length the K/V are written into a paged pool (pages handed
out in shuffled order) and also laid out contiguously per sequence; both attentions run on
them and the script prints the K/V bytes read per second and the paged/SDPA time ratio.
With `--kv-bits` both hold quantized K/V and the baseline is mlx-lm's own quantized attention
(`mx.quantized_matmul` over the packed K/V, as its `QuantizedKVCache` runs).
On a Mac this times the Metal kernels; elsewhere, where there is no Metal, it counts them in
the simulator as `--model` does and says so (`--reference` times the pure-MLX reference path
there instead). `--prefill` (a Mac) times prefill chunks of growing length on
the paged kernel against MLX's SDPA over the gathered pages, the choice `PREFILL_FROM` makes.

`--model` runs anywhere: the kernels run in the project's CPU simulator, which counts what a
launch does (device bytes, vector loads, SIMD reductions and shuffles, transcendentals,
barriers, threadgroup memory), printed per K/V byte and per key for decode batches beside the
kernels of commit `--baseline`, with a roofline estimate of the share of an M2 Max's memory
bandwidth each would reach. Those are models; the GB/s table above, run on a Mac, is the
measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from progress import FLOAT16, bar, expect, say

from mlxkv import KVBatch, reference_attention
from mlxkv.attention.kernels import PagedAttentionKernels, launch_shape, partition_keys
from mlxkv.attention.prefill import chunk_attention
from mlxkv.cache.storage import QuantizedPages, kv_bytes_per_token

REPO = Path(__file__).resolve().parents[1]
BASELINE = "b728b4a"  # the kernels before the tiled, reduce-scatter decode (issue 16)
PREFILL_CHUNKS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
# seconds the defaults take on progress.MACHINE (docs/benchmarks.md)
MODEL_TAKES = 107  # --model, its kernels already compiled
REFERENCE_TAKES = 1440  # --reference
SIMULATOR = "kernels compiled by an earlier run; the first run compiles them with clang, minutes more"


def timed(fn, repeats: int) -> float:
    mx.eval(fn())
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn())
    return (time.perf_counter() - start) / repeats


def case(attention, batch: int, context: int, args) -> tuple[float, float]:
    """(paged seconds, SDPA seconds) for one decode step of `batch` sequences of `context` tokens."""
    rng = np.random.default_rng(0)
    bs, kv_heads, q_heads, d = args.page_size, args.kv_heads, args.q_heads, args.head_dim
    dtype = getattr(mx, args.dtype)
    pages_per_seq = -(-context // bs)
    pages = rng.permutation(batch * pages_per_seq).astype(np.int32).reshape(batch, pages_per_seq)
    k_pages = mx.random.normal((batch * pages_per_seq, kv_heads, bs, d)).astype(dtype)
    v_pages = mx.random.normal((batch * pages_per_seq, kv_heads, bs, d)).astype(dtype)
    ones = np.ones(batch, np.int32)
    meta = KVBatch(tuple(range(batch)), ones, np.full(batch, context, np.int32), pages, bs)
    q = mx.random.normal((batch, q_heads, d)).astype(dtype)
    order = mx.array(pages.reshape(-1))
    k = k_pages[order].reshape(batch, pages_per_seq, kv_heads, bs, d).transpose(0, 2, 1, 3, 4)
    k = k.reshape(batch, kv_heads, pages_per_seq * bs, d)[:, :, :context]
    v = v_pages[order].reshape(batch, pages_per_seq, kv_heads, bs, d).transpose(0, 2, 1, 3, 4)
    v = v.reshape(batch, kv_heads, pages_per_seq * bs, d)[:, :, :context]
    scale = d**-0.5
    if args.kv_bits:
        quantized = dict(group_size=args.kv_group_size, bits=args.kv_bits)
        k_pages, v_pages = (
            QuantizedPages.quantize(array, args.kv_bits, args.kv_group_size) for array in (k_pages, v_pages)
        )
        k, v = mx.quantize(k, **quantized), mx.quantize(v, **quantized)

        def baseline():
            return quantized_scaled_dot_product_attention(q[:, :, None], k, v, scale, None, **quantized)
    else:

        def baseline():
            return mx.fast.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale)

    mx.eval(q, k, v, [getattr(pages, "parts", pages) for pages in (k_pages, v_pages)])
    paged = timed(lambda: attention(q, k_pages, v_pages, meta, scale), args.repeats)
    return paged, timed(baseline, args.repeats)


def prefill(args) -> None:
    """Seconds per chunk of L tokens at one context: the paged kernel per token against SDPA."""
    if not mx.metal.is_available():
        print("--prefill times the Metal kernel against SDPA, which needs a Mac (no Metal on this machine)")
        return
    progress = bar(len(PREFILL_CHUNKS), "prefill chunks", unit="chunk")
    kernels, dtype = PagedAttentionKernels(), getattr(mx, args.dtype)
    context, bs, d = args.contexts[0], args.page_size, args.head_dim
    pages = -(-context // bs)
    k_pages, v_pages = (mx.random.normal((pages, args.kv_heads, bs, d)).astype(dtype) for _ in range(2))
    table = np.random.default_rng(0).permutation(pages).astype(np.int32)
    print(f"prefill chunks at context {context}, {args.q_heads}/{args.kv_heads} heads, head_dim {d}, {args.dtype}")
    print(f"{'chunk':>6} {'paged ms':>9} {'SDPA ms':>8} {'paged/SDPA':>11}")
    for length in PREFILL_CHUNKS:
        progress.set_description(f"prefill chunks of {length}")
        q = mx.random.normal((length, args.q_heads, d)).astype(dtype)
        batch = KVBatch((0,), np.array([length], np.int32), np.array([context], np.int32), table[None], bs)
        mx.eval(q, k_pages, v_pages)
        paged = timed(partial(kernels.paged, q, k_pages, v_pages, batch, d**-0.5), args.repeats)
        sdpa = timed(partial(chunk_attention, q, k_pages, v_pages, table, context, d**-0.5), args.repeats)
        progress.update()
        say(f"{length:>6} {paged * 1e3:>9.3f} {sdpa * 1e3:>8.3f} {paged / sdpa:>11.2f}")
    progress.close()


# ---- the cost model ------------------------------------------------------------------------
@dataclass(frozen=True)
class Gpu:
    """An M2 Max (38 cores), as the roofline below assumes it."""

    name: str = "M2 Max"
    bandwidth: float = 400e9  # bytes/s of unified memory
    cores: int = 38
    lanes: int = 128  # ALU lanes per core issuing one instruction a cycle (4 SIMD groups)
    clock: float = 1.398e9
    launch: float = 4e-6  # s of fixed dispatch and tail per kernel launch (assumed)
    latency: float = 700e-9  # s from a device load's issue to its data (assumed)
    tg_memory: int = 64 * 1024  # threadgroup memory a core holds for its resident threadgroups (assumed)
    simdgroups: int = 32  # SIMD groups resident on a core (assumed)
    transcendental: int = 4  # issue cycles of an exp2/tanh (quarter-rate special-function unit)
    reduction: int = 5  # shuffles a 32-lane reduction takes (log2 32 steps)


def baseline_kernels(rev: str):
    """The kernels module as commit `rev` had it (its launcher and its `metal/` sources), loaded
    beside this tree's package; None, saying why, when git cannot show it or it no longer loads."""
    tmp = Path(tempfile.mkdtemp(prefix="mlxkv-baseline-"))
    try:
        names = subprocess.run(
            ["git", "-C", str(REPO), "ls-tree", "--name-only", rev, "metal/"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        (tmp / "mlxkv" / "attention").mkdir(parents=True)
        (tmp / "mlxkv" / "metal").mkdir()
        for name in [n for n in names if n.endswith((".h", ".metal"))] + ["mlxkv/attention/kernels.py"]:
            text = subprocess.run(
                ["git", "-C", str(REPO), "show", f"{rev}:{name}"], check=True, capture_output=True, text=True
            ).stdout
            (tmp / ("mlxkv/metal/" + Path(name).name if name.startswith("metal/") else name)).write_text(text)
    except (OSError, subprocess.CalledProcessError):
        print(f"(git cannot show commit {rev} here: no baseline columns)")
        return None
    name = "mlxkv.attention.baseline_kernels"
    spec = importlib.util.spec_from_file_location(name, tmp / "mlxkv" / "attention" / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "mlxkv.attention"
    sys.modules[name] = module  # its dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:  # it imports names this tree has since renamed
        print(f"(commit {rev}'s kernel launcher does not load beside this tree: {exc}; no baseline columns)")
        return None
    return module


def count(kernels, context: int, group: int, head_dim: int, split: bool, page_size: int = 16) -> list:
    """The counted launches of one decode row of one KV head (a threadgroup's work is the same
    for every sequence and KV head, so per K/V byte this is the whole batch's)."""
    from mlxkv.attention.simulator import cost_counters

    rng = np.random.default_rng(0)
    pages = -(-context // page_size)
    k_pages, v_pages = (mx.array(rng.standard_normal((pages, 1, page_size, head_dim)), mx.float16) for _ in range(2))
    batch = KVBatch(
        (0,),
        np.ones(1, np.int32),
        np.array([context], np.int32),
        rng.permutation(pages).astype(np.int32)[None],
        page_size,
    )
    q = mx.array(rng.standard_normal((1, group, head_dim)), mx.float16)
    with cost_counters() as launches:
        mx.eval(kernels(q, k_pages, v_pages, batch, head_dim**-0.5, split=split))
    return launches


def estimate(launches: list, replicas: int, in_flight: int, group: int, head_dim: int, context: int, gpu: Gpu) -> float:
    """Seconds the launches would take on `gpu` for `replicas` (sequences x KV heads) copies of
    the counted work, each launch bound by the slowest of: device bytes at full bandwidth;
    device bytes at what its resident SIMD groups keep in flight (`in_flight` bytes each for
    the attention launch, Little's law over the load latency; residency limited by threadgroup
    memory and SIMD groups per core); the ALUs (FMAs, loads, transcendentals, shuffles); on the
    cores its threadgroups occupy. Plus a fixed cost per launch."""
    seconds = 0.0
    for i, c in enumerate(launches):
        issued = (2 * group * head_dim * context if i == 0 else 0) + c.loads + gpu.transcendental * c.transcendentals
        issued += 32 * (c.shuffles + gpu.reduction * c.reductions)
        threadgroups, simdgroups = c.threadgroups * replicas, c.threads // 32
        cores = min(gpu.cores, threadgroups)
        resident = min(
            gpu.tg_memory // max(1, c.threadgroup_memory), gpu.simdgroups // simdgroups, -(-threadgroups // gpu.cores)
        )
        bandwidth = gpu.bandwidth if i else min(gpu.bandwidth, cores * resident * simdgroups * in_flight / gpu.latency)
        seconds += (
            max(
                (c.read_bytes + c.written_bytes) * replicas / bandwidth,
                issued * replicas / (cores * gpu.lanes * gpu.clock),
            )
            + gpu.launch
        )
    return seconds


@dataclass(frozen=True)
class Contender:
    """A kernel set to count, and what its launcher decides for a decode step: query heads per
    threadgroup `(group, head_dim)`, split-K `(threadgroups, context)`, and K/V bytes a SIMD
    group has in flight `(group, head_dim)` for the roofline."""

    name: str
    kernels: object
    heads: Callable[[int, int], int]
    splits: Callable[[int, int], bool]
    in_flight: Callable[[int, int], int]


def contenders(gpu: Gpu, rev: str) -> list[Contender]:
    """This tree's kernels (a tile's K rows in flight), and commit `rev`'s when git can show them
    (one K and one V row in flight)."""
    from mlxkv.attention.simulator import metal_kernel

    found = [
        Contender(
            "new",
            PagedAttentionKernels(metal_kernel, cores=gpu.cores),
            lambda g, d: launch_shape(g, d, 16).heads,
            lambda t, c: partition_keys(t, c, gpu.cores) is not None,
            lambda g, d: 2 * d * launch_shape(g, d, 16).keys_per_tile,
        )
    ]
    old = baseline_kernels(rev)
    if old is None:
        return found
    return found + [
        Contender(
            rev,
            old.PagedAttentionKernels(metal_kernel),
            lambda g, d: old.launch_shape(g, d)[1],
            lambda t, c: t < old.SPLIT_BELOW and c >= old.SPLIT_FROM,
            lambda g, d: 2 * d * 2,
        )
    ]


def model(args) -> None:
    """The counter table for decode batches, this tree's kernels beside `--baseline`'s."""
    expect(MODEL_TAKES, SIMULATOR)
    gpu, kv_heads = Gpu(), args.kv_heads
    rivals = contenders(gpu, args.baseline)
    print(
        f"Modeled in the CPU simulator, float16 K/V, {kv_heads} KV heads, pages of 16; roofline for an {gpu.name}: "
        f"{gpu.bandwidth / 1e9:.0f} GB/s, {gpu.cores} cores x {gpu.lanes} lanes at {gpu.clock / 1e9:.2f} GHz, "
        f"{gpu.launch * 1e6:.0f} us a launch, {gpu.latency * 1e9:.0f} ns load latency, {gpu.tg_memory // 1024} KiB "
        f"threadgroup memory and {gpu.simdgroups} SIMD groups resident a core, exp2/tanh {gpu.transcendental} issue "
        f"cycles, a 32-lane reduction {gpu.reduction} shuffles, a shuffle a SIMD instruction; in flight per SIMD "
        "group: a tile's K rows (new) or one K and one V row (baseline). Per key = per key of one KV head (its G "
        "query heads); device bytes count once per threadgroup. To be confirmed on a Mac: "
        "python scripts/bench_kernels.py"
    )
    print(
        f"{'batch':>5} {'ctx':>6} {'G':>2} {'D':>4} {'kernel':>8} {'split':>5} {'thr':>5} {'tg mem':>7} "
        f"{'dev/KV':>7} {'vec%':>5} {'B/load':>6} {'red/key':>8} {'shf/key':>8} {'exp/key':>8} {'bar/tg':>6} "
        f"{'est GB/s':>8} {'of BW':>6}"
    )
    counted: dict = {}
    rows = list(
        itertools.product(args.model_head_dims, args.model_groups, args.model_contexts, args.model_batches, rivals)
    )
    progress = bar(len(rows), "", unit="row")
    for head_dim, group, context, batch, rival in rows:
        progress.set_description(f"simulating {rival.name} kernels, head_dim {head_dim}, G {group}, context {context}")
        split = rival.splits(batch * kv_heads * group // rival.heads(group, head_dim), context)
        key = (rival.name, context, group, head_dim, split)
        if key not in counted:
            counted[key] = count(rival.kernels, context, group, head_dim, split)
        progress.update()
        say(
            _row(
                batch,
                context,
                group,
                head_dim,
                rival.name,
                split,
                counted[key],
                kv_heads,
                rival.in_flight(group, head_dim),
                gpu,
            )
        )
    progress.close()


def _row(batch, context, group, head_dim, name, split, launches, kv_heads, in_flight, gpu) -> str:
    kv = 2 * context * head_dim * 2  # K and V of one KV head, float16
    total = {
        f: sum(getattr(c, f) for c in launches)
        for f in (
            "read_bytes",
            "written_bytes",
            "loads",
            "load_bytes",
            "vector_load_bytes",
            "reductions",
            "shuffles",
            "transcendentals",
            "barriers",
        )
    }
    main = launches[0]
    rate = kv * batch * kv_heads / estimate(launches, batch * kv_heads, in_flight, group, head_dim, context, gpu)
    return (
        f"{batch:>5} {context:>6} {group:>2} {head_dim:>4} {name:>8} {'yes' if split else 'no':>5} "
        f"{main.threads:>5} {main.threadgroup_memory:>7} "
        f"{(total['read_bytes'] + total['written_bytes']) / kv:>7.3f} "
        f"{100 * total['vector_load_bytes'] / max(1, total['load_bytes']):>5.0f} "
        f"{total['load_bytes'] / max(1, total['loads']):>6.1f} {total['reductions'] / context:>8.2f} "
        f"{total['shuffles'] / context:>8.2f} {total['transcendentals'] / context:>8.1f} "
        f"{total['barriers'] / max(1, main.threadgroups):>6.2f} {rate / 1e9:>8.0f} {rate / gpu.bandwidth:>6.0%}"
    )


def timings(args, attention, what: str) -> None:
    """K/V bytes read per second by `attention` and by the baseline, per batch and context."""
    print(
        f"paged: {what}; device {mx.default_device()}, MLX {mx.__version__}, {args.dtype}, "
        f"{args.q_heads}/{args.kv_heads} heads, head_dim {args.head_dim}, pages of {args.page_size}, "
        + (
            f"{args.kv_bits}-bit K/V in groups of {args.kv_group_size} (baseline: mlx-lm's quantized attention)"
            if args.kv_bits
            else "float K/V (baseline: MLX's SDPA)"
        )
    )
    per_token = kv_bytes_per_token(
        1, args.kv_heads, args.head_dim, getattr(mx, args.dtype), args.kv_bits, args.kv_group_size
    )
    cases = [(b, c) for b in args.batches for c in args.contexts]
    too_big = [
        (b, c) for b, c in cases if b * c * per_token > 8 * 2**30 or b * c * args.kv_heads * args.head_dim >= 2**31
    ]
    if too_big:
        print(
            "(left out: over 8 GiB of K/V, or a gathered K of 2**31 elements, on which MLX 0.32's SDPA "
            "crashes on the CPU: " + ", ".join(f"batch {b} x context {c}" for b, c in too_big) + ")"
        )
    cases = [pair for pair in cases if pair not in too_big]
    print(f"{'batch':>6} {'context':>8} {'paged GB/s':>11} {'base GB/s':>10} {'paged/base time':>16}")
    progress = bar(len(cases), "", unit="case")
    for batch, context in cases:
        progress.set_description(f"batch {batch}, context {context}")
        kv_bytes = batch * context * per_token
        paged, sdpa = case(attention, batch, context, args)
        progress.update()
        say(
            f"{batch:>6} {context:>8} {kv_bytes / paged / 1e9:>11.2f} {kv_bytes / sdpa / 1e9:>10.2f} "
            f"{paged / sdpa:>16.2f}"
        )
    progress.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--kv-bits", type=int, choices=[8, 4], default=None, help="quantized K/V [default: floats]")
    parser.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--prefill", action="store_true", help="time prefill chunks: paged kernel vs SDPA (a Mac)")
    parser.add_argument(
        "--model", action="store_true", help="count the kernels in the simulator [default where there is no Metal]"
    )
    parser.add_argument(
        "--reference", action="store_true", help="where there is no Metal, time the pure-MLX reference path instead"
    )
    parser.add_argument("--baseline", default=BASELINE, help="commit whose kernels --model counts beside these")
    parser.add_argument("--model-batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--model-contexts", type=int, nargs="+", default=[512, 4096, 32768])
    parser.add_argument("--model-groups", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--model-head-dims", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args(argv)
    if args.model:
        return model(args)
    if args.prefill:
        return prefill(args)
    if mx.metal.is_available():
        return timings(args, PagedAttentionKernels(), "Metal paged-attention kernels")
    if args.reference:
        expect(REFERENCE_TAKES, FLOAT16)
        return timings(args, reference_attention, "the pure-MLX reference path (no Metal on this machine)")
    print(
        "No Metal on this machine, so no kernel to time: counting the kernels in the CPU simulator instead "
        "(--model; --reference times the pure-MLX reference path)."
    )
    model(args)


if __name__ == "__main__":
    main()
