"""How much memory a long prompt's prefill takes beyond the weights and the K/V: mlxkv against mlx-lm.

For each prompt length, each engine prefills a prompt of random tokens and draws one token. What
is printed is the engine's peak MLX memory during that request, less what it held before (the
weights; for mlxkv also its KV pool, allocated up front) and less the K/V it holds after (mlx-lm's
cache grows with the prompt): the temporaries of its steps. mlx-lm runs as `mlx_lm.generate` does,
in chunks of its default `prefill_step_size`; mlxkv with its defaults for one sequence. The two
alternate, mlx-lm first, and MLX's memory limits are put back after each mlxkv run, so mlxkv's
budget never throttles mlx-lm.

The default model is a random float32 Llama of 2 layers of width 256 (4 heads, 2 KV heads), built
once in `DEFAULT_MODEL`: small enough that a 64k-token prompt prefills in minutes on a CPU, where
the attention of a long context is what grows. Prints a table and
`transient_growth_1k_to_64k=<mlxkv's temporaries at the longest prompt / at the shortest>
transient_vs_mlx_lm_64k=<mlxkv's / mlx-lm's at the longest>`.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from harness import blas_in_use
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from progress import OPENBLAS, bar, expect

from mlxkv import LLMEngine, SamplingParams
from mlxkv.config import EngineConfig
from mlxkv.models.random_model import make_checkpoint

DEFAULTS_TAKE = 4 * 60  # seconds on progress.MACHINE (docs/benchmarks.md)
DEFAULT_MODEL = Path.home() / ".cache" / "mlxkv" / "bench-llama-memory"
SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=2,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
)
MIB = 2**20


def quiet() -> int:
    """Active MLX memory once everything freed is freed, the peak counter started afresh."""
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    return mx.get_active_memory()


def mlx_lm_run(model, tokenizer, prompt: list[int]) -> tuple[int, float]:
    """mlx-lm's temporaries (bytes) for `prompt`, and its seconds to the first token."""
    cache = make_prompt_cache(model)
    before, started = quiet(), time.perf_counter()
    for _ in stream_generate(model, tokenizer, prompt, max_tokens=1, prompt_cache=cache):
        pass
    seconds = time.perf_counter() - started
    held = sum(layer.nbytes for layer in cache)
    return mx.get_peak_memory() - before - held, seconds


def mlxkv_run(model, tokenizer, prompt: list[int]) -> tuple[int, float]:
    """mlxkv's temporaries for `prompt` (its KV pool is allocated before), and its seconds."""
    limit = mx.get_memory_limit()  # MLX's own, which the engine's budget replaces
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=len(prompt) + 8))
    try:
        before, started = quiet(), time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        return mx.get_peak_memory() - before, time.perf_counter() - started
    finally:
        del engine
        mx.set_memory_limit(limit)
        mx.set_cache_limit(limit)  # MLX's default cache limit is its memory limit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help=f"mlx-lm checkpoint [default: {DEFAULT_MODEL}]")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    args = parser.parse_args(argv)
    if min(args.prompt_tokens) < 1:
        parser.error(f"--prompt-tokens must be positive, got {min(args.prompt_tokens)}")

    expect(DEFAULTS_TAKE, OPENBLAS)
    path = args.model or DEFAULT_MODEL
    if args.model is None and not (path / "config.json").exists():
        make_checkpoint(path, "llama", "float32", shape=SHAPE, max_position_embeddings=max(args.prompt_tokens) + 8)
    print(f"model: {path}\nBLAS: {blas_in_use()}\nMLX {mx.__version__}, device {mx.default_device()}")
    model, tokenizer = mlx_lm_load(str(path))
    rng = np.random.default_rng(0)
    rows = {}
    progress = bar(2 * len(args.prompt_tokens), "prefill", unit="run")
    for length in args.prompt_tokens:
        prompt = rng.integers(0, model.args.vocab_size, length).tolist()
        for name, run in (("mlx-lm", mlx_lm_run), ("mlxkv", mlxkv_run)):
            progress.set_description(f"{length} tokens: {name}")
            rows[length, name] = run(model, tokenizer, prompt)
            progress.update()
    progress.close()
    print(f"\n{'prompt':>8} {'mlx-lm MiB':>11} {'mlxkv MiB':>10} {'mlx-lm s':>9} {'mlxkv s':>8}")
    for length in args.prompt_tokens:
        (theirs, their_s), (ours, our_s) = rows[length, "mlx-lm"], rows[length, "mlxkv"]
        print(f"{length:>8} {theirs / MIB:>11.1f} {ours / MIB:>10.1f} {their_s:>9.1f} {our_s:>8.1f}")
    shortest, longest = min(args.prompt_tokens), max(args.prompt_tokens)
    growth = rows[longest, "mlxkv"][0] / max(rows[shortest, "mlxkv"][0], 1)  # a byte at least: never a 0 divisor
    versus = rows[longest, "mlxkv"][0] / max(rows[longest, "mlx-lm"][0], 1)
    print(f"transient_growth_1k_to_64k={growth:.3f} transient_vs_mlx_lm_64k={versus:.3f}")


if __name__ == "__main__":
    main()
