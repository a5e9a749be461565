"""What the prefix cache's disk tier buys. One process, every engine side by side.

(a) Restart: a prompt of each of `--lengths` tokens is computed once by an engine with the disk
tier, then resent to a new engine over the same folder (what a server restart leaves: an empty
pool, the files): time to first token cold and restored, and mlx-lm's with its prompt cache file
(the cache of the prompt but its last token saved with `save_prompt_cache`, as `mlx_lm.cache_prompt`
does, then loaded and fed the last token, as `mlx_lm.generate --prompt-cache-file` does; the load
counted). The engines take turns, the restored tokens are checked against the cold run's.
(b) Pressure: `--sessions` agent sessions with prompts of `--session-min` to `--session-max`
tokens, resent one after another for `--cycles` cycles to an engine whose pool holds about a
third of them: prompt tokens computed with and without the disk tier. What is computed does not
depend on the model's size, so this part runs a tiny random Llama (`--pressure-model` for another).
(c) The writer: `--clients` requests decoding while new prompts arrive, so pages are filed all
the while: their inter-token p99 with the disk tier and without, runs alternating.

Prints the tables and the lines `restart_ttft_ratio_<length>=<restored / cold>`,
`vs_mlx_lm_file_<length>=<restored / mlx-lm's>`, `pressure_computed_ratio=<with / without>` and
`writer_itl_p99_ratio=<with / without>`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from harness import DEFAULT_MODEL, MODEL_HELP, load_bench_model
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from progress import OPENBLAS, bar, expect
from tqdm import tqdm

from mlxkv import LLMEngine, SamplingParams
from mlxkv.config import EngineConfig
from mlxkv.models.random_model import make_checkpoint
from mlxkv.models.tiny_configs import tiny_config

DEFAULTS_TAKE = 430  # seconds on progress.MACHINE (docs/benchmarks.md)
FIRST = SamplingParams(max_tokens=1, temperature=0.0)


def say(line: str) -> None:
    print(line, flush=True)


def engine_over(model, tokenizer, folder: str | None, **settings) -> LLMEngine:
    return LLMEngine(model, tokenizer, EngineConfig(disk_cache=folder, **settings))


def first_token(engine: LLMEngine, prompt: list[int]) -> tuple[float, int, int]:
    """Seconds to `prompt`'s first token, the token, and the prompt tokens it found cached."""
    request = engine.add_request(prompt, FIRST)
    while engine.has_unfinished():
        engine.step()
    return request.first_token_time - request.arrival_time, request.output_ids[0], request.num_cached_tokens


def mlx_lm_file(model, prompt: list[int], file: Path) -> tuple[float, float, int]:
    """mlx-lm: seconds to the first token cold, then from its prompt cache file (loading it counted), and that token."""
    start, cache = time.perf_counter(), make_prompt_cache(model)
    for chunk in range(0, len(prompt) - 1, 2048):  # mlx-lm's prefill step
        model(mx.array(prompt[chunk : min(chunk + 2048, len(prompt) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    token, _ = next(generate_step(mx.array(prompt[-1:]), model, prompt_cache=cache, max_tokens=1))
    cold = time.perf_counter() - start
    for c in cache:  # the file holds the prompt but its last token, as cache_prompt leaves it
        c.trim(1)
    save_prompt_cache(str(file), cache)
    start = time.perf_counter()
    loaded = load_prompt_cache(str(file))
    token, _ = next(generate_step(mx.array(prompt[-1:]), model, prompt_cache=loaded, max_tokens=1))
    return cold, time.perf_counter() - start, int(token)


def restart(model, tokenizer, args, progress: tqdm) -> None:
    rng = np.random.default_rng(0)
    for length in args.lengths:
        prompt = rng.integers(10, args.vocab, length).tolist()
        settings = dict(max_num_seqs=1, max_model_len=length + 8)
        times: dict[str, list[float]] = {"cold": [], "restored": [], "mlx-lm cold": [], "mlx-lm file": []}
        for repeat in range(args.repeats):
            folder = tempfile.mkdtemp()
            progress.set_description(f"{length} tokens, run {repeat + 1}: mlxkv cold")
            cold = engine_over(model, tokenizer, folder, **settings)
            seconds, token, _ = first_token(cold, prompt)
            times["cold"].append(seconds)
            cold.cache.disk.flush()
            del cold
            progress.set_description(f"{length} tokens, run {repeat + 1}: mlx-lm")
            lm_cold, lm_file, lm_token = mlx_lm_file(model, prompt, Path(folder) / "prompt.safetensors")
            times["mlx-lm cold"].append(lm_cold)
            times["mlx-lm file"].append(lm_file)
            progress.set_description(f"{length} tokens, run {repeat + 1}: mlxkv restored")
            seconds, again, cached = first_token(engine_over(model, tokenizer, folder, **settings), prompt)
            times["restored"].append(seconds)
            assert again == token == lm_token and cached == (length - 1) // 16 * 16, (again, token, lm_token, cached)
            progress.update()
        median = {name: statistics.median(values) for name, values in times.items()}
        say(f"{length} tokens: " + ", ".join(f"{name} {value:.2f} s" for name, value in median.items()))
        say(f"restart_ttft_ratio_{length}={median['restored'] / median['cold']:.4f}")
        say(f"vs_mlx_lm_file_{length}={median['restored'] / median['mlx-lm file']:.3f}")


def tiny_llama() -> Path:
    """A random 2-layer Llama 64 wide (built once beside the bench model)."""
    path = DEFAULT_MODEL.parent / "bench-llama-tiny"
    if not (path / "config.json").exists():
        config = {k: v for k, v in tiny_config("llama").items() if k not in ("layer_types", "sliding_window")}
        make_checkpoint(path, config.pop("model_type"), "float32", shape=config, max_position_embeddings=32768)
    return path


def pressure(model, tokenizer, args, progress: tqdm) -> None:
    model, tokenizer = load_bench_model(args.pressure_model or tiny_llama())
    rng = np.random.default_rng(1)
    sessions = [
        rng.integers(10, tokenizer.vocab_size, rng.integers(args.session_min, args.session_max + 1)).tolist()
        for _ in range(args.sessions)
    ]
    pages = max(sum(len(s) for s in sessions) // 3, args.session_max + 32) // 16  # a third of the working set
    computed = {}
    for name, folder in (("without", None), ("with", tempfile.mkdtemp())):
        engine = engine_over(
            model, tokenizer, folder, max_num_seqs=1, num_pages=pages, max_model_len=args.session_max + 8
        )
        total = 0
        for cycle in range(args.cycles):
            for prompt in sessions:
                progress.set_description(f"pressure, {name} the disk tier, cycle {cycle + 1}")
                total += len(prompt) - first_token(engine, prompt)[2]
                if folder is not None:
                    engine.cache.disk.flush()  # what the writer does between an agent's turns
                progress.update()
        computed[name] = total
    say(
        f"{args.sessions} sessions of {args.session_min}-{args.session_max} tokens, {args.cycles} cycles, a pool of "
        f"a third of them: prompt tokens computed {computed['without']} without the disk tier, {computed['with']} with"
    )
    say(f"pressure_computed_ratio={computed['with'] / computed['without']:.4f}")


def decoding(engine: LLMEngine, args, seed: int, progress: tqdm) -> float:
    """Inter-token p99 (ms) of `--clients` requests decoding while a prompt arrives every 4 steps."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    clients = [engine.add_request(rng.integers(10, args.vocab, 64).tolist(), params) for _ in range(args.clients)]
    stamps: list[list[float]] = [[] for _ in clients]
    step = 0
    while any(r.finish_reason is None for r in clients):
        if step % 4 == 0:
            arriving = rng.integers(10, args.vocab, 256).tolist()
            engine.add_request(arriving, SamplingParams(max_tokens=2, ignore_eos=True))
        engine.step()
        now, step = time.perf_counter(), step + 1
        for request, times in zip(clients, stamps):
            times.extend([now] * (request.num_outputs - len(times)))
        progress.update()
    while engine.has_unfinished():
        engine.step()
    return float(np.percentile(np.concatenate([np.diff(t[1:]) for t in stamps]), 99)) * 1000


def writer(model, tokenizer, args, progress: tqdm) -> None:
    settings = dict(max_num_seqs=args.clients + 4, max_model_len=1024)
    engines = {
        "without": engine_over(model, tokenizer, None, **settings),
        "with": engine_over(model, tokenizer, tempfile.mkdtemp(), **settings),
    }
    p99: dict[str, list[float]] = {name: [] for name in engines}
    for run in range(args.runs):
        for name, engine in engines.items():
            progress.set_description(f"{args.clients} clients decoding, {name} the disk tier, run {run + 1}")
            p99[name].append(decoding(engine, args, run, progress))
    written = engines["with"].cache.disk.stats.bytes_written
    say(
        f"{args.clients} clients decoding beside arriving prompts: inter-token p99 "
        + ", ".join(f"{name} the disk tier {statistics.median(v):.1f} ms" for name, v in p99.items())
        + f" ({written / 2**20:.1f} MiB written)"
    )
    say(f"writer_itl_p99_ratio={statistics.median(p99['with']) / statistics.median(p99['without']):.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help=MODEL_HELP)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192], help="prompt lengths for (a)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of (a) per length")
    parser.add_argument("--pressure-model", type=Path, default=None, help="the model of (b) [default: a tiny Llama]")
    parser.add_argument("--sessions", type=int, default=20, help="agent sessions in (b)")
    parser.add_argument("--session-min", type=int, default=4096, help="shortest session prompt in (b)")
    parser.add_argument("--session-max", type=int, default=16384, help="longest session prompt in (b)")
    parser.add_argument("--cycles", type=int, default=2, help="times each session is resent in (b)")
    parser.add_argument("--clients", type=int, default=16, help="requests decoding in (c)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each client generates in (c)")
    parser.add_argument("--runs", type=int, default=3, help="runs of (c) per engine, alternating")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    args = parser.parse_args(argv)
    expect(DEFAULTS_TAKE, OPENBLAS)
    model, tokenizer = load_bench_model(args.model)
    args.vocab = tokenizer.vocab_size  # random prompts' ids below it
    steps = {
        "restart": len(args.lengths) * args.repeats,
        "pressure": 2 * args.sessions * args.cycles,
        "writer": 2 * args.runs * args.tokens,
    }
    with bar(sum(steps[part] for part in args.parts), "loading") as progress:
        for part in args.parts:
            PARTS[part](model, tokenizer, args, progress)


PARTS = {"restart": restart, "pressure": pressure, "writer": writer}


if __name__ == "__main__":
    main()
