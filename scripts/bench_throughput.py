"""Throughput and latency of mlxkv against mlx-lm's BatchGenerator: one workload, one process.

Both engines run the same model directory, the same prompts and output lengths (greedy,
EOS ignored so lengths are exact). mlx-lm runs first, with `--max-num-seqs` sequences at once.
mlxkv then runs twice with float pages:
- with a pool of `--kv-fraction` of the KV bytes mlx-lm peaked at and the same sequence cap
  (does it do the same work in less memory?);
- with a pool of exactly mlx-lm's peak KV bytes and the sequence cap raised to every request,
  so that the budget, not the cap, limits it (what does the same memory buy?).
It repeats the second run with each of `--kv-bits` (8-bit and 4-bit pages: more tokens in the
same bytes), skipping (with one printed line) those the model cannot run: quantized pages
need a group size that divides its head_dim. "peak KV" is the KV each engine actually held at
its peak (mlxkv: the pages allocated to sequences, not the pool).
Prints a table and a final line `throughput_ratio=<mlxkv/mlx-lm at equal KV bytes>
kv_memory_ratio=<mlxkv's peak KV at the smaller pool / mlx-lm's>` followed by
`throughput_ratio_<bits>bit=...` per quantized run not skipped.
With `--long-prompt N` it also measures the inter-token latency of 8 running decodes while
one N-token prompt is prefilled, with and without chunked prefill.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from harness import (
    MODEL_HELP,
    Workload,
    load_bench_model,
    model_kv_bytes_per_token,
    run_mlx_lm,
    run_mlxkv,
    runnable,
)
from progress import OPENBLAS, bar, expect
from tqdm import tqdm

from mlxkv import SamplingParams
from mlxkv.config import EngineConfig
from mlxkv.engine import LLMEngine

DEFAULTS_TAKE = 1376  # seconds on progress.MACHINE (docs/benchmarks.md)


def make_workload(args, vocab_size: int) -> Workload:
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    prompts = [
        rng.integers(1, vocab_size, int(k)).tolist()
        for k in rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, n)
    ]
    outputs = rng.integers(args.output_len[0], args.output_len[1] + 1, n).tolist()
    arrivals = np.zeros(n) if args.rate is None else np.cumsum(rng.exponential(1 / args.rate, n))
    return Workload(prompts, outputs, arrivals.tolist())


def long_prompt_latency(model, tokenizer, length: int, chunk: int | None, progress: tqdm) -> dict[str, float]:
    """ITL of 8 running decodes while one `length`-token prompt is prefilled (`progress` counts its tokens)."""
    budget = chunk or length + 8
    engine = LLMEngine(
        model, tokenizer, EngineConfig(max_num_seqs=9, max_num_batched_tokens=budget, max_model_len=length + 64)
    )
    decodes = [
        engine.add_request(list(range(1, 33)), SamplingParams(max_tokens=length, ignore_eos=True)) for _ in range(8)
    ]
    while any(not r.output_ids for r in decodes):
        engine.step()
    long = engine.add_request(list(range(1, length + 1)), SamplingParams(max_tokens=1, ignore_eos=True))
    times, start, computed = [], time.perf_counter(), 0
    last = {r.request_id: start for r in decodes}
    while long.finish_reason is None:
        outputs = engine.step()
        now = time.perf_counter()
        progress.update(long.num_computed - computed)
        computed = long.num_computed
        for out in outputs:
            if out.request_id in last:
                times.append(now - last[out.request_id])
                last[out.request_id] = now
    ttft = time.perf_counter() - start
    for r in decodes:
        engine.abort(r.request_id)
    return {
        "long prompt TTFT s": ttft,
        "decode ITL p50 ms": 1e3 * np.percentile(times, 50),
        "decode ITL max ms": 1e3 * max(times),
    }


def print_table(rows: dict[str, dict[str, float]]) -> None:
    columns = list(next(iter(rows.values())))
    print(f"{'':36}" + "".join(f"{c:>18}" for c in columns))
    for name, row in rows.items():
        print(f"{name:36}" + "".join(f"{row[c]:>18.3f}" for c in columns))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help=MODEL_HELP)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second [default: all at once]")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="concurrent sequences, both engines")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--kv-fraction", type=float, default=0.5, help="mlxkv's KV pool as a fraction of mlx-lm's peak KV bytes"
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        nargs="*",
        choices=[8, 4],
        default=[8, 4],
        help="also run with quantized pages of these bits in the same KV memory",
    )
    parser.add_argument("--long-prompt", type=int, default=None, metavar="N")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    expect(DEFAULTS_TAKE, OPENBLAS)
    model, tokenizer = load_bench_model(args.model)
    workload = make_workload(args, model.args.vocab_size)
    print(
        f"workload: {args.num_requests} requests, {sum(map(len, workload.prompts))} prompt tokens, "
        f"{sum(workload.output_lens)} output tokens, batch cap {args.max_num_seqs}"
    )

    warm = Workload([[1, 2, 3]] * 2, [4, 4], [0.0, 0.0])
    bytes_per_token = model_kv_bytes_per_token(model)
    run_mlx_lm(model, warm, 2, bytes_per_token)
    equal_kv = f"equal KV, cap {args.num_requests}"
    bits = [b for b in args.kv_bits if runnable(model, EngineConfig(kv_bits=b), f"mlxkv {b}-bit {equal_kv}")]
    total = 3 + len(bits)
    progress = bar(total * sum(workload.output_lens), f"run 1/{total}: mlx-lm BatchGenerator", unit="tok")
    reference = run_mlx_lm(model, workload, args.max_num_seqs, bytes_per_token, progress)
    small = EngineConfig(
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=max(1, int(args.kv_fraction * reference.peak_allocated)),
        max_model_len=args.prompt_len[1] + args.output_len[1],
        prefix_states=0,  # the prompts share nothing, and mlx-lm keeps no state for later prompts
    )
    equal = replace(small, kv_cache_memory=reference.peak_allocated, max_num_seqs=args.num_requests)
    plans = [(f"mlxkv {args.kv_fraction:g}x KV, cap {args.max_num_seqs}", small)]
    plans += [(f"mlxkv{f' {b}-bit' if b else ''} {equal_kv}", replace(equal, kv_bits=b)) for b in [None, *bits]]
    runs, engines = [reference], {}
    for number, (name, config) in enumerate(plans, start=2):
        progress.set_description(f"run {number}/{total}: {name}")
        run_mlxkv(model, tokenizer, warm, config, "warm-up")
        run, engines[name] = run_mlxkv(model, tokenizer, workload, config, name, progress)
        assert all(len(run.token_times[i]) == n for i, n in enumerate(workload.output_lens))
        runs.append(run)
    progress.close()

    rows = {
        r.name: r.latency(workload)
        | {
            "KV bytes/token": r.bytes_per_token,
            "peak KV MiB": r.peak_allocated / 2**20,
            "peak MLX mem GiB": r.peak_memory / 2**30,
        }
        for r in runs
    }
    print_table(rows)
    for name, engine in engines.items():
        run = runs[list(engines).index(name) + 1]
        most = max(s.sequences for s in run.samples)
        print(
            f"{name}: pool {run.pool_bytes / 2**20:.1f} MiB, peak use {run.peak_allocated / run.pool_bytes:.0%} "
            f"of it, at most {most} sequences at once, {engine.scheduler.num_preemptions} preemptions"
        )
    if args.long_prompt:
        progress = bar(2 * args.long_prompt, "long prompt, chunked then not", unit="tok")
        latency = {
            "chunked (512 tokens/step)": long_prompt_latency(model, tokenizer, args.long_prompt, 512, progress),
            "not chunked": long_prompt_latency(model, tokenizer, args.long_prompt, None, progress),
        }
        progress.close()
        print(f"\n8 decodes while a {args.long_prompt}-token prompt is prefilled (mlxkv):")
        print_table(latency)
    base = rows["mlx-lm BatchGenerator"]["tok/s"]
    ratios = {name: rows[name]["tok/s"] / base for name, _ in plans}
    quantized = [f"throughput_ratio_{config.kv_bits}bit={ratios[name]:.3f}" for name, config in plans[2:]]
    print(
        " ".join(
            [
                f"throughput_ratio={ratios[plans[1][0]]:.3f}",
                f"kv_memory_ratio={runs[1].peak_allocated / reference.peak_allocated:.3f}",
                f"throughput_ratio_{args.kv_fraction:g}x_kv={ratios[plans[0][0]]:.3f}",
                *quantized,
            ]
        )
    )


if __name__ == "__main__":
    main()
