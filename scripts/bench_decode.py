"""Single-stream decode against mlx-lm, and the engine's host time per step, in one process.

Part one: greedy decode of one chat, `mlx_lm.stream_generate` against mlxkv's `LLM.stream`, on
the shipped demo model and on a random ~100M-parameter float32 Llama (both engines load the same
weights once). The two alternate, run after run, and the medians of their generation tokens per
second (after the first token) give `single_stream_ratio=<mlxkv/mlx-lm>` per model.

Then, per model, the two engines' decode steps interleaved one by one (unpipelined: each
step built, then evaluated), which pairs them within milliseconds of each other on a noisy
machine and splits each step into evaluation and host work.

Part two: host milliseconds per engine step (the step's wall time but the time blocked in MLX's
evaluation) at 16, 64, 256 and 1,024 running decodes on a tiny model. Measured with unpipelined
steps: on a CPU the device's threads share the cores with the host, which would blur the split.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
from harness import DEFAULT_MODEL, blas_in_use, load_bench_model
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from progress import OPENBLAS, bar, expect, say
from tqdm import tqdm

from mlxkv import LLM, SamplingParams
from mlxkv.config import EngineConfig
from mlxkv.engine import LLMEngine
from mlxkv.models import load
from mlxkv.models.random_model import make_checkpoint

DEFAULTS_TAKE = 73  # seconds on progress.MACHINE (docs/benchmarks.md)

PROMPT = "Write a short note on paged attention and why it saves memory."


def mlx_lm_tps(model, tokenizer, prompt: list[int], tokens: int, progress: tqdm) -> float:
    for response in stream_generate(model, tokenizer, prompt, max_tokens=tokens, sampler=make_sampler(0.0)):
        progress.update()
        generated, tps = response.generation_tokens, response.generation_tps
    assert generated == tokens, generated
    return tps


def mlxkv_tps(llm: LLM, prompt: list[int], tokens: int, progress: tqdm) -> float:
    stream = llm.stream(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    request, counted = stream.request, 0
    for _ in stream:
        progress.update(len(request.output_ids) - counted)
        counted = len(request.output_ids)
    assert len(request.output_ids) == tokens, len(request.output_ids)
    return (len(request.output_ids) - 1) / (request.finish_time - request.first_token_time)


def single_stream(name: str, model, tokenizer, args, progress: tqdm) -> float:
    """Median generation tok/s of each engine, alternating; prints and returns mlxkv/mlx-lm."""
    llm = LLM((model, tokenizer), max_num_seqs=1)
    prompt = tokenizer.encode(PROMPT)
    mlx_lm_tps(model, tokenizer, prompt, 8, tqdm(disable=True))
    mlxkv_tps(llm, prompt, 8, tqdm(disable=True))
    theirs, ours = [], []
    for run in range(args.runs):
        progress.set_description(f"{name}: single stream, run {run + 1}/{args.runs}")
        theirs.append(mlx_lm_tps(model, tokenizer, prompt, args.tokens, progress))
        ours.append(mlxkv_tps(llm, prompt, args.tokens, progress))
    ratio = statistics.median(ours) / statistics.median(theirs)
    say(
        f"{name}: mlx-lm {statistics.median(theirs):.1f} tok/s, mlxkv {statistics.median(ours):.1f} tok/s "
        f"(runs: {', '.join(f'{t:.0f}/{o:.0f}' for t, o in zip(theirs, ours))})"
    )
    say(f"single_stream_ratio[{name}]={ratio:.3f}")
    return ratio


def mlx_lm_steps(model, prompt: list[int]):
    """mlx-lm's decode loop, one step per `next`: (step seconds, of them waiting for evaluation)."""
    cache = make_prompt_cache(model)
    token = mx.argmax(model(mx.array(prompt)[None], cache=cache)[:, -1], axis=-1)
    while True:
        start = time.perf_counter()
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1], axis=-1)
        built = time.perf_counter()
        mx.eval(token)
        done = time.perf_counter()
        yield done - start, done - built


def mlxkv_steps(model, tokenizer, prompt: list[int], steps: int):
    """mlxkv's unpipelined engine, one step per `next`, as `mlx_lm_steps`."""
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=1, pipeline=False))
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    engine.step()
    while True:
        start = time.perf_counter()
        engine.step()
        yield time.perf_counter() - start, engine.last_step_wait


def interleaved_steps(name: str, model, tokenizer, steps: int, progress: tqdm) -> None:
    """Median step, evaluation and host ms of each engine, stepping them alternately."""
    prompt = tokenizer.encode(PROMPT)
    engines = {"mlx-lm": mlx_lm_steps(model, prompt), "mlxkv": mlxkv_steps(model, tokenizer, prompt, steps)}
    times = {engine: [] for engine in engines}
    for steps_of in engines.values():  # warm up
        next(steps_of)
    progress.set_description(f"{name}: interleaved steps")
    for _ in range(steps):
        for engine, steps_of in engines.items():
            times[engine].append(next(steps_of))
        progress.update(2)
    medians = {
        engine: [1e3 * statistics.median(x) for x in ([s for s, _ in t], [w for _, w in t], [s - w for s, w in t])]
        for engine, t in times.items()
    }
    say(
        f"{name}, {steps} interleaved steps (ms: step / evaluation / host): "
        + ", ".join(f"{engine} {m[0]:.2f} / {m[1]:.2f} / {m[2]:.2f}" for engine, m in medians.items())
    )
    say(f"step_ratio[{name}]={medians['mlx-lm'][0] / medians['mlxkv'][0]:.3f}")


def host_per_step(model, tokenizer, sequences: int, steps: int) -> tuple[float, float]:
    """(host ms, step ms) per decode step, median over `steps`, with `sequences` running."""
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(
            max_num_seqs=sequences,
            max_num_batched_tokens=4 * sequences,
            max_model_len=256,
            num_pages=sequences * 8 + 64,
            pipeline=False,
        ),
    )
    for i in range(sequences):
        engine.add_request([1 + i % 50, 2, 3, 4], SamplingParams(max_tokens=200, ignore_eos=True))
    while any(r.num_computed < len(r.prompt_ids) for r in engine.requests.values()):
        engine.step()
    hosts, totals = [], []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - start)
        hosts.append(totals[-1] - engine.last_step_wait)
    return 1e3 * statistics.median(hosts), 1e3 * statistics.median(totals)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None, help=f"the ~100M model [default: {DEFAULT_MODEL}]")
    parser.add_argument("--sequences", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", type=Path, default=Path.home() / ".cache" / "mlxkv" / "bench-tiny")
    args = parser.parse_args(argv)

    expect(DEFAULTS_TAKE, OPENBLAS)
    print(f"BLAS: {blas_in_use()}; MLX {mx.__version__}, device {mx.default_device()}")
    progress = bar(2 * 2 * (args.runs + 1) * args.tokens, "", unit="tok")
    for name, loader in (("demo", lambda: load(None)), ("llama-100m", lambda: load_bench_model(args.model))):
        progress.set_description(f"{name}: loading")
        model, tokenizer = loader()  # one model in memory at a time
        single_stream(name, model, tokenizer, args, progress)
        interleaved_steps(name, model, tokenizer, args.tokens, progress)
    progress.close()
    if not (args.tiny / "config.json").exists():
        make_checkpoint(args.tiny, "llama", "float32")
    tiny, tokenizer = load(args.tiny)
    print(f"\nhost time per decode step, tiny model ({args.steps} steps, median)")
    print(f"{'running':>8} {'host ms':>8} {'step ms':>8} {'host us/seq':>12}")
    progress = bar(len(args.sequences), "host time per step", unit="batch")
    for sequences in args.sequences:
        progress.set_description(f"host time per step, {sequences} running")
        host, total = host_per_step(tiny, tokenizer, sequences, args.steps)
        progress.update()
        say(f"{sequences:>8} {host:>8.2f} {total:>8.2f} {1e3 * host / sequences:>12.1f}")


if __name__ == "__main__":
    main()
