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

`--model` runs anywhere: first it calibrates `mlxkv.attention.lab.cost_model` against MLX's
published SDPA speeds (a kernel with MLX's structure, counted in the simulator and modelled on
an M5 Pro, beside the published figure and mlxkv's kernel at the same geometry); then it counts
the kernels for decode batches (device bytes, vector loads, SIMD reductions and shuffles,
transcendentals, barriers, threadgroup memory, private arrays left in memory), per K/V byte and
per key, beside the kernels of commit `--baseline`, with the calibrated model's registers,
residency, bound and share of bandwidth. Those are models; the GB/s table, run on a Mac, is the
measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from progress import FLOAT16, bar, expect, say

from mlxkv import reference_attention
from mlxkv.attention.kernels import PagedAttentionKernels
from mlxkv.attention.lab import speed
from mlxkv.attention.lab.cost_model import (
    ASSUMED_LATENCY,
    M5_PRO,
    PUBLISHED,
    PUBLISHED_CONTEXTS,
    Gpu,
    calibration_points,
    decode_row,
    estimate,
    fit_latency,
    kv_bytes,
    paged_work,
)
from mlxkv.attention.lab.speed import Geometry

REPO = Path(__file__).resolve().parents[1]
BASELINE = "a7e596a"  # the kernels before issue 29 (loads in flight, registers, split from the GPU's cores)
PREFILL_CHUNKS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
# seconds the defaults take on progress.MACHINE (docs/benchmarks.md)
MODEL_TAKES = 399  # --model, its kernels already compiled
REFERENCE_TAKES = 1440  # --reference
SIMULATOR = "kernels compiled by an earlier run; the first run compiles them with clang, minutes more"


def geometry(args) -> Geometry:
    return Geometry(
        args.q_heads,
        args.kv_heads,
        args.head_dim,
        getattr(mx, args.dtype),
        args.page_size,
        args.kv_bits,
        args.kv_group_size,
    )


def prefill(args) -> None:
    """Seconds per chunk of L tokens at one context: the paged kernel per token against SDPA."""
    if not mx.metal.is_available():
        print("--prefill times the Metal kernel against SDPA, which needs a Mac (no Metal on this machine)")
        return
    progress = bar(len(PREFILL_CHUNKS), "prefill chunks", unit="chunk")
    kernels, context = PagedAttentionKernels(), args.contexts[0]
    print(
        f"prefill chunks at context {context}, {args.q_heads}/{args.kv_heads} heads, head_dim {args.head_dim}, "
        f"{args.dtype}"
    )
    print(f"{'chunk':>6} {'paged ms':>9} {'SDPA ms':>8} {'paged/SDPA':>11}")
    for length in PREFILL_CHUNKS:
        progress.set_description(f"prefill chunks of {length}")
        paged, sdpa = speed.prefill(kernels, geometry(args), length, context, args.repeats)
        progress.update()
        say(f"{length:>6} {paged * 1e3:>9.3f} {sdpa * 1e3:>8.3f} {paged / sdpa:>11.2f}")
    progress.close()


# ---- the cost model ------------------------------------------------------------------------
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
        print(f"(git cannot show commit {rev} here: no baseline rows)")
        return None
    name = "mlxkv.attention.baseline_kernels"
    spec = importlib.util.spec_from_file_location(name, tmp / "mlxkv" / "attention" / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "mlxkv.attention"
    sys.modules[name] = module  # its dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:  # it imports names this tree has since renamed
        print(f"(commit {rev}'s kernel launcher does not load beside this tree: {exc}; no baseline rows)")
        return None
    return module


def baseline_counters(old, context: int, group: int, head_dim: int, replicas: int, cores: int) -> list:
    """Commit `--baseline`'s launches for one decode row of one KV head, split as its launcher
    (a fixed partition of `old.PARTITION` keys) would split a step of `replicas` of them."""
    from mlxkv.attention.lab.simulator import cost_counters, metal_kernel

    tiles = group // old.launch_shape(group, head_dim, 16).heads
    split = replicas * tiles < old.THREADGROUPS_PER_CORE * cores and context > old.PARTITION
    q, k_pages, v_pages, batch = decode_row(context, group, head_dim)
    with cost_counters() as launches:
        mx.eval(old.PagedAttentionKernels(metal_kernel, cores=cores)(q, k_pages, v_pages, batch, split=split))
    return launches


COUNTER_COLUMNS = (
    f"{'batch':>5} {'ctx':>6} {'G':>2} {'D':>4} {'kernel':>8} {'split':>5} {'thr':>4} {'tg mem':>6} {'dev/KV':>6} "
    f"{'vec%':>4} {'B/load':>6} {'red/key':>7} {'shf/key':>7} {'exp/key':>7} {'bar/tg':>6} {'spill':>5} "
    f"{'live':>4} {'SGs':>3} {'bound':>7} {'GB/s':>5} {'of BW':>5}"
)


def counter_row(case: tuple, name: str, launches: list, work: list | None, gpu: Gpu) -> str:
    """One row of the counter table: the simulator's counts per K/V byte and per key, and for
    this tree's kernels the model's registers, residency, bound and rate."""
    batch, context, group, head_dim, kv_heads = case
    kv = kv_bytes(context, head_dim)  # one KV head's
    main = launches[0]

    def total(field: str) -> int:
        return sum(getattr(c, field) for c in launches)

    row = (
        f"{batch:>5} {context:>6} {group:>2} {head_dim:>4} {name:>8} {'yes' if len(launches) > 1 else 'no':>5} "
        f"{main.threads:>4} {main.threadgroup_memory:>6} {(total('read_bytes') + total('written_bytes')) / kv:>6.3f} "
        f"{100 * total('vector_load_bytes') / max(1, total('load_bytes')):>4.0f} "
        f"{total('load_bytes') / max(1, total('loads')):>6.1f} {total('reductions') / context:>7.2f} "
        f"{total('shuffles') / context:>7.2f} {total('transcendentals') / context:>7.1f} "
        f"{total('barriers') / max(1, main.threadgroups):>6.2f} {sum(len(c.dynamic_arrays) for c in launches):>5}"
    )
    if work is None:
        return row + f" {'-':>4} {'-':>3} {'-':>7} {'-':>5} {'-':>5}"
    est = estimate(work, batch * kv_heads, gpu)
    modelled = f"{est.resident:>3} {est.bound:>7} {est.rate / 1e9:>5.0f} {est.rate / gpu.bandwidth:>5.0%}"
    return row + f" {work[0].live:>4.0f} {modelled}"


def calibrate() -> Gpu:
    """Count the calibration kernel at MLX's published points, fit the load latency, print both."""
    progress = bar(len(PUBLISHED) * len(PUBLISHED_CONTEXTS), "counting the calibration kernel", unit="point")
    points = calibration_points(lambda _point: progress.update())
    progress.close()
    gpu = fit_latency(points)
    assumed = replace(gpu, latency=ASSUMED_LATENCY)
    print(f"Calibration on {gpu.name}: the model of a kernel with MLX's vector SDPA structure (one query head per")
    print(
        "SIMD group, each re-reading K/V; metal/vector_sdpa.metal) against MLX's published SDPA speeds (float16, "
        f"batch 1,\nml-explore/mlx issue 4076). Load latency fitted to these points: {gpu.latency * 1e9:.0f} ns "
        f"(cost_model.M5_PRO has {M5_PRO.latency * 1e9:.0f} ns; assumed before: {ASSUMED_LATENCY * 1e9:.0f} ns)."
    )
    print(
        f"{'q/kv heads':>10} {'D':>4} {'ctx':>6} {'published':>9} {'of BW':>5} {'modelled':>8} {'error':>6} "
        f"{'bound':>7} {'at ' + format(ASSUMED_LATENCY * 1e9, '.0f') + ' ns':>9} {'mlxkv':>6} {'of BW':>5} "
        f"{'bound':>7}"
    )
    for p in points:
        est = p.modelled(gpu)
        work = paged_work(p.context, p.q_heads // p.kv_heads, p.head_dim, p.kv_heads, gpu.cores)
        ours = estimate(work, p.kv_heads, gpu)
        ours_rate = ours.rate / 1e9
        say(
            f"{f'{p.q_heads}/{p.kv_heads}':>10} {p.head_dim:>4} {p.context:>6} {p.published:>9.0f} "
            f"{p.published * 1e9 / gpu.bandwidth:>5.0%} {p.rate(gpu):>8.0f} {p.error(gpu):>+6.0%} {est.bound:>7} "
            f"{p.error(assumed):>+9.0%} {ours_rate:>6.0f} {ours_rate * 1e9 / gpu.bandwidth:>5.0%} {ours.bound:>7}"
        )
    errors = [p.error(gpu) for p in points]
    print(
        f"Model error on the published points: {min(errors):+.0%} to {max(errors):+.0%}, mean "
        f"{sum(map(abs, errors)) / len(errors):.0%} (at the assumed latency: "
        f"{min(p.error(assumed) for p in points):+.0%} to {max(p.error(assumed) for p in points):+.0%})."
    )
    return gpu


def model(args) -> None:
    """The calibration table, then the counter table for decode batches, this tree's kernels
    (with the calibrated model's estimate) beside `--baseline`'s (counts only)."""
    expect(MODEL_TAKES, SIMULATOR)
    old = baseline_kernels(args.baseline)
    gpu = calibrate()
    kv_heads = args.kv_heads
    print(f"\nAssumed: {gpu.describe()}.")
    print(
        f"Counted in the CPU simulator, float16 K/V, {kv_heads} KV heads, pages of 16. Per key = per key of one KV "
        "head (its G query heads); device bytes count once per threadgroup; spill = private arrays left in memory; "
        "live = 32-bit values a lane holds; SGs = SIMD groups resident a core. To be confirmed on a Mac: "
        "python scripts/bench_kernels.py"
    )
    print(COUNTER_COLUMNS)
    cases = list(itertools.product(args.model_head_dims, args.model_groups, args.model_contexts, args.model_batches))
    progress = bar(len(cases), "", unit="row")
    for head_dim, group, context, batch in cases:
        progress.set_description(f"simulating head_dim {head_dim}, G {group}, context {context}, batch {batch}")
        case = (batch, context, group, head_dim, kv_heads)
        work = paged_work(context, group, head_dim, batch * kv_heads, gpu.cores)
        lines = [counter_row(case, "new", [w.counters for w in work], work, gpu)]
        if old is not None:
            launches = baseline_counters(old, context, group, head_dim, batch * kv_heads, gpu.cores)
            lines.append(counter_row(case, args.baseline[:8], launches, None, gpu))
        progress.update()
        for line in lines:
            say(line)
    progress.close()


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
    shape, budget = geometry(args), speed.memory()
    cases = [(b, c) for b in args.batches for c in args.contexts]
    left_out = {(b, c): why for b, c in cases if (why := speed.too_big(shape, b, c, budget))}
    for (b, c), why in left_out.items():
        print(f"(left out: batch {b} x context {c}, {why})")
    cases = [pair for pair in cases if pair not in left_out]
    print(f"{'batch':>6} {'context':>8} {'paged GB/s':>11} {'base GB/s':>10} {'paged/base time':>16}")
    progress = bar(len(cases), "", unit="case")
    for batch, context in cases:
        progress.set_description(f"batch {batch}, context {context}")
        kv_bytes = shape.kv_bytes(batch, context)
        paged, sdpa = speed.decode(attention, shape, batch, context, args.repeats)
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
