"""What paging buys: KV memory, waste and concurrency of mlxkv paged, mlxkv contiguous and mlx-lm.

One chat-like workload runs through mlxkv's paged layout (at several page sizes, and with
8-bit and 4-bit pages), mlxkv's contiguous layout (one max-length page per sequence) and
mlx-lm's BatchGenerator, all measured the same way after every step: KV bytes allocated to
sequences and KV bytes holding tokens. A row the model cannot run (quantized pages need a group
size that divides its head_dim) is skipped, with one printed line saying why. It writes
`layout-comparison.md`, `samples.json` and PNG charts (with the `plot` extra) into `--out`,
and prints a final summary line.

Concurrency within `--kv-budget` is the number of this workload's sequences that fit in the
budget at the KV bytes each one held, time-weighted, in that layout.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np
from harness import (
    Run,
    Workload,
    blas_in_use,
    model_kv_bytes_per_token,
    run_mlx_lm,
    run_mlxkv,
    runnable,
)
from mlx_lm import load as mlx_lm_load
from progress import FLOAT16, bar, expect

from mlxkv.cache.storage import dtype_name
from mlxkv.config import EngineConfig, parse_memory
from mlxkv.engine.memory.kv_budget import context_length
from mlxkv.engine.model_kv import kv_shape
from mlxkv.models.loading import DEMO_MODEL, model_context

PAGE_SIZES = (8, 16, 32, 64)
KV_BITS = (8, 4)
DEFAULTS_TAKE = 1006  # seconds on progress.MACHINE (docs/benchmarks.md)


def make_workload(args, vocab_size: int, max_len: int) -> Workload:
    """Prompt and output lengths: long-tailed (log-normal), uniform or fixed; all arrive at once."""
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    if args.lengths == "longtail":
        prompt = rng.lognormal(np.log(args.prompt_len), 0.9, n)
        output = rng.lognormal(np.log(args.output_len), 0.8, n)
    elif args.lengths == "uniform":
        prompt = rng.uniform(1, 2 * args.prompt_len, n)
        output = rng.uniform(1, 2 * args.output_len, n)
    else:
        prompt, output = np.full(n, args.prompt_len), np.full(n, args.output_len)
    prompt = np.clip(prompt.astype(int), 1, max_len // 2)
    output = np.clip(output.astype(int), 1, max_len - prompt)
    prompts = [rng.integers(1, vocab_size, int(k)).tolist() for k in prompt]
    return Workload(prompts, output.tolist(), [0.0] * n)


def page_floor(run: Run, page_size: int) -> float:
    """The waste no paged cache can avoid, time-weighted: the unfilled part of each live
    sequence's last page, from the requests' own lengths (not from the cache)."""
    unfilled = run.weighted(lambda s: sum(-(-n // page_size) * page_size - n for n in s.lengths))
    return unfilled / max(unfilled + run.weighted("tokens"), 1e-9)


def summarise(run: Run, workload: Workload, budget: int) -> dict[str, float]:
    per_sequence = run.weighted("allocated") / max(run.weighted("sequences"), 1e-9)
    return {
        "KV bytes/token": run.bytes_per_token,
        "KV allocated MiB (peak)": run.peak_allocated / 2**20,
        "KV allocated MiB (mean)": run.weighted("allocated") / 2**20,
        "KV holding tokens MiB (mean)": run.weighted("holding") / 2**20,
        "waste %": 100 * run.waste(),
        "sequences in budget": budget / max(per_sequence, 1),
        **{k: v for k, v in run.latency(workload).items() if k in ("tok/s", "TTFT mean s")},
    }


def write_markdown(out: Path, rows: dict[str, dict[str, float]], header: str) -> None:
    columns = list(next(iter(rows.values())))
    lines = [header, "", "| run | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + " |" for name, row in rows.items()]
    (out / "layout-comparison.md").write_text("\n".join(lines) + "\n")


def plot(out: Path, runs: dict[str, Run], rows: dict[str, dict[str, float]]) -> list[str]:
    """PNG charts with matplotlib, when the `plot` extra is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in ("mlxkv paged (pages of 16)", "mlxkv contiguous", "mlx-lm BatchGenerator"):
        run = runs[name]
        t = [s.time - run.start for s in run.samples]
        (line,) = ax.plot(t, [s.allocated / 2**20 for s in run.samples], label=f"{name}: allocated")
        ax.plot(
            t,
            [s.holding / 2**20 for s in run.samples],
            ls="--",
            color=line.get_color(),
            label=f"{name}: holding tokens",
        )
    ax.set(xlabel="seconds", ylabel="KV MiB", title="KV memory over time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "memory-over-time.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([str(b) for b in PAGE_SIZES], [rows[f"mlxkv paged (pages of {b})"]["waste %"] for b in PAGE_SIZES])
    ax.set(xlabel="page size (tokens)", ylabel="waste % (time-weighted)", title="Paged KV waste per page size")
    fig.tight_layout()
    fig.savefig(out / "waste-per-page-size.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    names = ["mlxkv paged (pages of 16)", "mlxkv contiguous", "mlx-lm BatchGenerator"]
    ax.bar(["paged", "contiguous", "mlx-lm"], [rows[n]["sequences in budget"] for n in names])
    ax.set(ylabel="sequences", title="Concurrent sequences within the KV budget")
    fig.tight_layout()
    fig.savefig(out / "concurrency.png", dpi=120)
    return ["memory-over-time.png", "waste-per-page-size.png", "concurrency.png"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL, help="mlx-lm checkpoint [default: the demo model]")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--lengths", choices=("longtail", "uniform", "fixed"), default="longtail")
    parser.add_argument("--prompt-len", type=int, default=160, help="median (longtail), mean (uniform) or value")
    parser.add_argument("--output-len", type=int, default=120, help="median (longtail), mean (uniform) or value")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="most tokens per sequence, the contiguous layout's page [default: the model's context]",
    )
    parser.add_argument("--max-num-seqs", type=int, default=32, help="concurrent sequences, every run")
    parser.add_argument("--kv-budget", default="256MiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("layout-comparison"))
    args = parser.parse_args(argv)

    budget = parse_memory(args.kv_budget)
    expect(DEFAULTS_TAKE, FLOAT16)
    model, tokenizer = mlx_lm_load(str(args.model))
    max_len = context_length(args.max_model_len, model_context(model))
    workload = make_workload(args, model.args.vocab_size, max_len)
    bytes_per_token = model_kv_bytes_per_token(model)
    args.out.mkdir(parents=True, exist_ok=True)

    common = dict(max_num_seqs=args.max_num_seqs, max_model_len=max_len)
    paged = {
        f"mlxkv paged (pages of {size})": EngineConfig(kv_layout="paged", page_size=size, **common)
        for size in PAGE_SIZES
    }
    paged |= {
        f"mlxkv paged {bits}-bit (pages of 16)": EngineConfig(kv_layout="paged", page_size=16, kv_bits=bits, **common)
        for bits in KV_BITS
    }
    plans: dict[str, EngineConfig | None] = {name: c for name, c in paged.items() if runnable(model, c, name)}
    plans |= {"mlxkv contiguous": EngineConfig(kv_layout="contiguous", **common), "mlx-lm BatchGenerator": None}
    runs: dict[str, Run] = {}
    progress = bar(len(plans) * sum(workload.output_lens), "", unit="tok")
    for i, (name, config) in enumerate(plans.items()):
        progress.set_description(f"run {i + 1}/{len(plans)}: {name}")
        if config is None:
            runs[name] = run_mlx_lm(model, workload, args.max_num_seqs, bytes_per_token, progress)
        else:
            runs[name] = run_mlxkv(model, tokenizer, workload, config, name, progress)[0]
    progress.close()

    rows = {name: summarise(run, workload, budget) for name, run in runs.items()}
    floor = 100 * page_floor(runs["mlxkv paged (pages of 16)"], 16)
    header = (
        f"{workload.size} requests ({args.lengths} lengths, {sum(map(len, workload.prompts))} prompt and "
        f"{sum(workload.output_lens)} output tokens), model {args.model.name}, batch cap {args.max_num_seqs}, "
        f"contiguous page {max_len} tokens, KV budget {budget / 2**20:.0f} MiB; {platform.machine()} "
        f"{platform.system()}, MLX {mx.__version__} on {mx.default_device()}, BLAS: {blas_in_use()}; "
        f"{time.strftime('%Y-%m-%d')}. Paged waste floor at pages of 16: {floor:.2f} %."
    )
    write_markdown(args.out, rows, header)
    (args.out / "samples.json").write_text(
        json.dumps(
            {
                name: {"bytes_per_token": r.bytes_per_token, "samples": [asdict(s) for s in r.samples]}
                for name, r in runs.items()
            }
        )
    )
    charts = plot(args.out, runs, rows)
    print((args.out / "layout-comparison.md").read_text())
    print("charts: " + (", ".join(charts) if charts else "none (pip install -e '.[bench]' for PNG charts)"))
    paged, contiguous, mlx_lm = (
        rows[n] for n in ("mlxkv paged (pages of 16)", "mlxkv contiguous", "mlx-lm BatchGenerator")
    )
    print(f"paged_floor={floor:.2f}%")
    dtype = dtype_name(kv_shape(model)[3])
    quantized = [
        f"kv{b}bit_sequences_vs_{dtype}="
        f"{rows[f'mlxkv paged {b}-bit (pages of 16)']['sequences in budget'] / paged['sequences in budget']:.2f}x"
        for b in KV_BITS
        if f"mlxkv paged {b}-bit (pages of 16)" in rows
    ]
    print(
        f"paged_waste={paged['waste %']:.2f}% contiguous_waste={contiguous['waste %']:.2f}% "
        f"mlx_lm_waste={mlx_lm['waste %']:.2f}% "
        f"concurrency_gain_vs_mlx_lm={paged['sequences in budget'] / mlx_lm['sequences in budget']:.2f}x "
        f"concurrency_gain_vs_contiguous={paged['sequences in budget'] / contiguous['sequences in budget']:.2f}x",
        *quantized,
    )


if __name__ == "__main__":
    main()
