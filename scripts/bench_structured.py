"""What structured output costs a batch: decode tokens per second of 16 requests with 0, 4 and 16
of them held to a JSON schema, side by side in one process.

Each run starts 16 requests at once (the same prompts, sampled at temperature 0.7 with fixed
seeds, `--output-len` tokens each) and times their decode: from the step where every request
has its first token to the last token. The constrained rows follow a JSON schema for an
unbounded list of records (an array of at least 10,000 objects, so `max_tokens` ends them, as
EOS ends the free ones' never), which makes llguidance fill a mask of the whole vocabulary for
every constrained row at every step. The three mixes run in turn, `--repeats` times, and the
medians give `structured_overhead_4` and `structured_overhead_16`: a constrained batch's decode
time per token over the unconstrained one's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
from harness import MODEL_HELP, load_bench_model
from progress import OPENBLAS, bar, expect
from tqdm import tqdm

from mlxkv import LLMEngine, SamplingParams
from mlxkv.config import EngineConfig

DEFAULTS_TAKE = 90  # seconds on progress.MACHINE (docs/benchmarks.md)
RECORDS = {
    "type": "array",
    "minItems": 10000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
}


def decode_tps(engine: LLMEngine, prompts: list[list[int]], constrained: int, tokens: int, progress: tqdm) -> float:
    """Decode tokens per second of one batch whose first `constrained` requests follow `RECORDS`."""
    params = [
        SamplingParams(
            max_tokens=tokens,
            temperature=0.7,
            seed=i,
            ignore_eos=i >= constrained,
            json_schema=RECORDS if i < constrained else None,
        )
        for i in range(len(prompts))
    ]
    requests = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    started = None
    while engine.has_unfinished():
        engine.step()
        if started is None and all(r.first_token_time is not None for r in requests):
            started = time.perf_counter()
            first = sum(len(r.output_ids) for r in requests)
        progress.update()
    assert started is not None and all(len(r.output_ids) == tokens for r in requests), "a request ended early"
    return (sum(len(r.output_ids) for r in requests) - first) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help=MODEL_HELP)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--constrained", type=int, nargs="+", default=[0, 4, 16])
    args = parser.parse_args(argv)

    expect(DEFAULTS_TAKE, OPENBLAS)
    model, tokenizer = load_bench_model(args.model)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=args.num_requests))
    vocab = model.args.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(args.prompt_len)] for i in range(args.num_requests)]
    engine.structured.compile(SamplingParams(json_schema=RECORDS))  # llguidance's tokenizer, built once up front
    progress = bar(len(args.constrained) * args.repeats * (args.output_len + 2), "", unit="step")
    runs: dict[int, list[float]] = {k: [] for k in args.constrained}
    for repeat in range(args.repeats):
        turn = repeat % len(args.constrained)  # each mix goes first in turn
        for k in args.constrained[turn:] + args.constrained[:turn]:
            progress.set_description(f"repeat {repeat + 1}/{args.repeats}: {k} constrained")
            runs[k].append(decode_tps(engine, prompts, k, args.output_len, progress))
            mx.clear_cache()
    progress.close()
    print(f"\n{args.num_requests} requests, {args.prompt_len} prompt tokens, {args.output_len} output tokens each")
    print(f"{'constrained':>11} {'decode tok/s (median)':>22} {'runs':>24} {'time per token vs 0':>20}")
    base = statistics.median(runs[args.constrained[0]])
    for k, values in runs.items():
        median = statistics.median(values)
        print(f"{k:>11} {median:>22.1f} {' '.join(f'{v:.1f}' for v in values):>24} {base / median:>20.3f}")
    print(" ".join(f"structured_overhead_{k}={base / statistics.median(runs[k]):.3f}" for k in args.constrained[1:]))


if __name__ == "__main__":
    main()
