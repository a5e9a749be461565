"""Throughput and latency of mlxkv against mlx-lm's BatchGenerator: one workload, one process.

Both engines run the same model directory, the same prompts and output lengths (greedy,
EOS ignored so lengths are exact) and the same cap on concurrent sequences. mlx-lm runs
first; mlxkv then gets a paged KV pool of `--kv-fraction` times the KV bytes mlx-lm peaked at.
Prints a table and a final line `throughput_ratio=<mlxkv/mlx-lm> kv_memory_ratio=<mlxkv/mlx-lm>`.
With `--long-prompt N` it also measures the inter-token latency of 8 running decodes while
one N-token prompt is prefilled, with and without chunked prefill.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import BatchGenerator

from mlxkv import SamplingParams
from mlxkv.config import EngineConfig
from mlxkv.engine import LLMEngine
from mlxkv.random_model import LLAMA_100M, make_checkpoint

DEFAULT_MODEL = Path.home() / ".cache" / "mlxkv" / "bench-llama-100m"


def blas_in_use() -> str:
    """Which BLAS MLX's matmuls go through in this process."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    maps = Path("/proc/self/maps").read_text()
    for name in ("openblas", "mkl", "blis"):
        if f"lib{name}" in maps:
            return f"{name} (loaded into the process)"
    return "the reference BLAS bundled with mlx[cpu] (slow; see the README for OpenBLAS)"


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]


def make_workload(args, vocab_size: int) -> Workload:
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    prompts = [rng.integers(1, vocab_size, int(k)).tolist()
               for k in rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, n)]
    outputs = rng.integers(args.output_len[0], args.output_len[1] + 1, n).tolist()
    arrivals = np.zeros(n) if args.rate is None else np.cumsum(rng.exponential(1 / args.rate, n))
    return Workload(prompts, outputs, arrivals.tolist())


@dataclass
class Run:
    """Token timestamps per request, and memory peaks, of one engine on the workload."""

    name: str
    token_times: dict[int, list[float]] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0
    peak_kv_bytes: int = 0
    peak_memory: int = 0

    def row(self, workload: Workload) -> dict[str, float]:
        ttft = [self.token_times[i][0] - (self.start + a) for i, a in enumerate(workload.arrivals)]
        itl = np.concatenate([np.diff(t) for t in self.token_times.values()])
        generated = sum(len(t) for t in self.token_times.values())
        return {"tok/s": generated / (self.end - self.start), "TTFT mean s": np.mean(ttft),
                "TTFT p99 s": np.percentile(ttft, 99), "ITL p50 ms": 1e3 * np.percentile(itl, 50),
                "ITL p99 ms": 1e3 * np.percentile(itl, 99), "peak KV MiB": self.peak_kv_bytes / 2**20,
                "peak MLX mem GiB": self.peak_memory / 2**30}


def run_mlx_lm(model, workload: Workload, max_seqs: int) -> Run:
    gen = BatchGenerator(model, completion_batch_size=max_seqs, prefill_batch_size=min(8, max_seqs))
    run = Run("mlx-lm BatchGenerator")
    pending = list(range(len(workload.prompts)))
    uid_to_index: dict[int, int] = {}
    mx.reset_peak_memory()
    run.start = time.perf_counter()
    while pending or uid_to_index:
        arrived = [i for i in pending if run.start + workload.arrivals[i] <= time.perf_counter()]
        if arrived:
            uids = gen.insert([workload.prompts[i] for i in arrived], [workload.output_lens[i] for i in arrived])
            uid_to_index.update(zip(uids, arrived))
            pending = [i for i in pending if i not in arrived]
        if not uid_to_index:
            time.sleep(0.001)
            continue
        _, responses = gen.next()
        now = time.perf_counter()
        for r in responses:
            run.token_times.setdefault(uid_to_index[r.uid], []).append(now)
            if r.finish_reason is not None:
                del uid_to_index[r.uid]
        caches = [c for batch in (gen._prompt_batch, gen._generation_batch) for c in (batch.prompt_cache or [])]
        run.peak_kv_bytes = max(run.peak_kv_bytes, sum(c.nbytes for c in caches))
    run.end = time.perf_counter()
    run.peak_memory = mx.get_peak_memory()
    gen.close()
    return run


def run_mlxkv(model, tokenizer, workload: Workload, config: EngineConfig) -> tuple[Run, LLMEngine]:
    engine = LLMEngine(model, tokenizer, config)
    run = Run("mlxkv paged")
    pending = list(range(len(workload.prompts)))
    mx.reset_peak_memory()
    run.start = time.perf_counter()
    while pending or engine.has_unfinished():
        arrived = [i for i in pending if run.start + workload.arrivals[i] <= time.perf_counter()]
        for i in arrived:
            engine.add_request(workload.prompts[i], SamplingParams(max_tokens=workload.output_lens[i],
                                                                   ignore_eos=True), request_id=str(i))
        pending = [i for i in pending if i not in arrived]
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            run.token_times.setdefault(int(out.request_id), []).append(now)
        if not outputs and not engine.has_unfinished():
            time.sleep(0.001)
    run.end = time.perf_counter()
    run.peak_memory = mx.get_peak_memory()
    run.peak_kv_bytes = engine.cache.storage.nbytes
    return run, engine


def long_prompt_latency(model, tokenizer, length: int, chunk: int | None) -> dict[str, float]:
    """ITL of 8 running decodes while one `length`-token prompt is prefilled."""
    budget = chunk or length + 8
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=9, max_num_batched_tokens=budget,
                                                      max_model_len=length + 64))
    decodes = [engine.add_request(list(range(1, 33)), SamplingParams(max_tokens=length, ignore_eos=True))
               for _ in range(8)]
    while any(not r.output_ids for r in decodes):
        engine.step()
    long = engine.add_request(list(range(1, length + 1)), SamplingParams(max_tokens=1, ignore_eos=True))
    times, start = [], time.perf_counter()
    last = {r.request_id: start for r in decodes}
    while long.finish_reason is None:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id in last:
                times.append(now - last[out.request_id])
                last[out.request_id] = now
    ttft = time.perf_counter() - start
    for r in decodes:
        engine.abort(r.request_id)
    return {"long prompt TTFT s": ttft, "decode ITL p50 ms": 1e3 * np.percentile(times, 50),
            "decode ITL max ms": 1e3 * max(times)}


def print_table(rows: dict[str, dict[str, float]]) -> None:
    columns = list(next(iter(rows.values())))
    print(f"{'':24}" + "".join(f"{c:>18}" for c in columns))
    for name, row in rows.items():
        print(f"{name:24}" + "".join(f"{row[c]:>18.3f}" for c in columns))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help=f"mlx-lm checkpoint directory [default: a random ~100M Llama built in {DEFAULT_MODEL}]")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second [default: all at once]")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="concurrent sequences, both engines")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-fraction", type=float, default=0.5,
                        help="mlxkv's KV pool as a fraction of mlx-lm's peak KV bytes")
    parser.add_argument("--long-prompt", type=int, default=None, metavar="N")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    path = args.model
    if path is None:
        path = DEFAULT_MODEL
        if not (path / "config.json").exists():
            make_checkpoint(path, "llama", "float32", shape=LLAMA_100M, max_position_embeddings=32768)
    print(f"model: {path}\nBLAS: {blas_in_use()}\nMLX {mx.__version__}, device {mx.default_device()}")
    model, tokenizer = mlx_lm_load(str(path))
    workload = make_workload(args, model.args.vocab_size)
    print(f"workload: {args.num_requests} requests, {sum(map(len, workload.prompts))} prompt tokens, "
          f"{sum(workload.output_lens)} output tokens, batch cap {args.max_num_seqs}")

    warm = Workload([[1, 2, 3]] * 2, [4, 4], [0.0, 0.0])
    run_mlx_lm(model, warm, 2)
    reference = run_mlx_lm(model, workload, args.max_num_seqs)
    config = EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          kv_cache_memory=max(1, int(args.kv_fraction * reference.peak_kv_bytes)),
                          max_model_len=args.prompt_len[1] + args.output_len[1])
    run_mlxkv(model, tokenizer, warm, config)
    ours, engine = run_mlxkv(model, tokenizer, workload, config)
    assert all(len(ours.token_times[i]) == n for i, n in enumerate(workload.output_lens))

    rows = {r.name: r.row(workload) for r in (reference, ours)}
    print_table(rows)
    print(f"mlxkv: {engine.scheduler.num_preemptions} preemptions, pool of {engine.cache.pool.capacity} pages")
    if args.long_prompt:
        print(f"\n8 decodes while a {args.long_prompt}-token prompt is prefilled (mlxkv):")
        print_table({"chunked (512 tokens/step)": long_prompt_latency(model, tokenizer, args.long_prompt, 512),
                     "not chunked": long_prompt_latency(model, tokenizer, args.long_prompt, None)})
    ratio = rows["mlxkv paged"]["tok/s"] / rows["mlx-lm BatchGenerator"]["tok/s"]
    print(f"throughput_ratio={ratio:.3f} kv_memory_ratio={ours.peak_kv_bytes / reference.peak_kv_bytes:.3f}")


if __name__ == "__main__":
    main()
