"""Tensor parallel's cost: one process against two under `mlx.launch --backend ring` on this machine.

Both run the same batch (16 greedy requests of `--prompt-len` tokens, `--output-len` tokens each) on
the same model, alternating one and two processes for `--rounds` rounds. Per run it prints output
tokens/s, the mean engine step time and the step plan's bytes per step. On one machine over loopback
the two processes share its cores and memory, so this measures what the protocol costs (two
all-reduces per layer and the step plan), not a speed-up; across Macs each holds half the weights
and KV heads. It prints `tp_tokens_per_s_ratio=<2 processes / 1>` and `plan_bytes_per_step=<mean>`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from harness import DEFAULT_MODEL, MODEL_HELP, load_bench_model
from progress import OPENBLAS

from mlxkv import SamplingParams
from mlxkv.config import EngineConfig
from mlxkv.engine.llm_engine import LLMEngine
from mlxkv.engine.parallel.rank_zero import RankZero
from mlxkv.models.loading import load
from mlxkv.models.sharding import world


def worker(args: argparse.Namespace) -> None:
    """One run: rank 0 prints its figures as JSON; the other ranks follow."""
    group = world()
    config = EngineConfig(max_num_seqs=16, max_model_len=args.prompt_len + args.output_len)
    engine = LLMEngine(*load(args.model, group), config, group=group)
    if engine.rank != 0:
        engine.follow()
        return
    prompts = [[1 + (7 * i + j) % 1000 for j in range(args.prompt_len)] for i in range(16)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    started, steps, plan_bytes = time.perf_counter(), 0, 0
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
        steps += 1
        plan_bytes += engine.rank_zero.channel.sent_bytes if isinstance(engine.rank_zero, RankZero) else 0
    seconds = time.perf_counter() - started
    figures = {
        "tok_s": 16 * args.output_len / seconds,
        "step_ms": 1000 * seconds / steps,
        "plan_bytes": plan_bytes / steps,
    }
    print(json.dumps(figures), flush=True)


def run(args: argparse.Namespace, ranks: int) -> dict:
    command = [sys.executable, __file__, "--worker", "--model", str(args.model)]
    command += ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
    if ranks > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launcher = str(Path(sys.executable).parent / "mlx.launch")
        command = [launcher, "-n", str(ranks), "--backend", "ring", "--starting-port", str(port), "--", *command]
    # Two processes share this machine's cores: one BLAS thread each, or they oversubscribe them.
    env = {**os.environ, **({"OPENBLAS_NUM_THREADS": "1"} if ranks > 1 else {})}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"the {ranks}-process run failed: {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help=MODEL_HELP)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    load_bench_model(args.model)  # builds the default model once, and prints what runs it
    args.model = args.model or DEFAULT_MODEL
    print(f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')} ({'OpenBLAS' if OPENBLAS else 'no OpenBLAS'})")
    print("loopback: both processes on this one machine (the protocol's cost, not a speed-up)")
    print(f"{'processes':>10} {'tok/s':>10} {'step ms':>10} {'plan B/step':>12}")
    results: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for ranks in (1, 2):
            figures = run(args, ranks)
            results[ranks].append(figures)
            print(f"{ranks:>10} {figures['tok_s']:>10.1f} {figures['step_ms']:>10.1f} {figures['plan_bytes']:>12.0f}")
    mean = {r: sum(f["tok_s"] for f in runs) / len(runs) for r, runs in results.items()}
    plan = sum(f["plan_bytes"] for f in results[2]) / len(results[2])
    print(f"tp_tokens_per_s_ratio={mean[2] / mean[1]:.3f} plan_bytes_per_step={plan:.0f}")


if __name__ == "__main__":
    main()
