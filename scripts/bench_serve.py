"""`mlxkv serve` against `mlx_lm.server` over HTTP: one streaming workload at several concurrencies.

Both servers load the same model directory (default: the random ~100M-parameter float32 Llama
of the other benchmarks, or one `--layers` deep, which makes each step that many twelfths as
slow, to stand in for a large model on a Mac) and run alternately on this machine, mlx-lm then
mlxkv, `--runs` times (ABAB), so that a burst of load from elsewhere cannot land on one side
only; each run restarts its server, with its own defaults (mlxkv with `--max-num-seqs 16
--max-model-len 2048`, allocating its KV pool up front, and `--mlxkv-flags`).
At each concurrency C, C clients stream `/v1/completions` (greedy, `--output-len` tokens) for
`--requests-per-client` prompts each. Per run, server and concurrency it prints output tokens/s
(from each stream's usage), time to first token p50/p99, inter-token latency p50/p99 and their
ratio, the server's peak resident memory and how many connections it refused or reset before the
first token (each retried after 50 ms; the time counts); then, per concurrency, each run's
throughput ratio (mlxkv over the mlx-lm run before it) and their median, and last
`serve_throughput_ratio_c16=... serve_throughput_ratio_c1=...` (medians; the concurrencies named
are the largest and smallest asked for).
Its HTTP client, httpx, comes with the test extra (`pip install -e ".[test]"`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from harness import DEFAULT_MODEL, MODEL_HELP, load_bench_model
from progress import OPENBLAS, bar, expect
from tqdm import tqdm

from mlxkv.models.random_model import LLAMA_100M, TEXT, make_checkpoint

DEFAULTS_TAKE = 130  # seconds on progress.MACHINE (docs/benchmarks.md)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: list[str], port: int, log: Path) -> subprocess.Popen:
    """Start a server (its output to `log`) and wait until its /health answers."""
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(1200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
        if proc.poll() is not None:
            raise RuntimeError(f"{command[2]} exited: {log.read_text()[-2000:]}")
    raise TimeoutError(f"{command} did not come up")


def peak_rss_gib(pid: int) -> float:
    """The process's peak resident memory (Linux); NaN elsewhere."""
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        return float("nan")
    kib = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmHWM"))
    return kib / 2**20


async def one_stream(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, output_len: int, progress: tqdm
) -> dict:
    """One streaming completion: its token times, the tokens its usage reports, and how many
    times the connection was refused or reset before the first token (then it is retried)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, times, tokens, retries = time.perf_counter(), [], 0, 0
    while True:
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
                reply.raise_for_status()
                async for line in reply.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        times.append(time.perf_counter())
                        progress.update()
            return {"start": start, "times": times, "tokens": tokens, "retries": retries}
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            if times:
                raise
            retries += 1
            await asyncio.sleep(0.05)


async def load(url: str, model: str, prompts: list[str], concurrency: int, output_len: int, progress: tqdm) -> dict:
    """`concurrency` clients share `prompts`, one request at a time each; `progress` counts the
    streamed chunks that carry text."""
    queue = list(prompts)
    results: list[dict] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            results.append(await one_stream(client, url, model, queue.pop(), output_len, progress))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ttft = [r["times"][0] - r["start"] for r in results if r["times"]]
    itl = np.concatenate([np.diff(r["times"]) for r in results if len(r["times"]) > 1] or [np.zeros(0)])
    return {
        "tok/s": sum(r["tokens"] for r in results) / wall,
        "TTFT p50 s": np.percentile(ttft, 50),
        "TTFT p99 s": np.percentile(ttft, 99),
        "ITL p50 ms": 1e3 * np.percentile(itl, 50),
        "ITL p99 ms": 1e3 * np.percentile(itl, 99),
        "retries": float(sum(r["retries"] for r in results)),
    }


def servers(model: str, port: int, max_model_len: int, flags: list[str]) -> dict[str, list[str]]:
    """The two commands. mlxkv allocates its KV pool up front, sized for 16 sequences of
    `max_model_len` tokens; mlx-lm grows its caches as it goes."""
    python = sys.executable
    return {
        "mlx_lm.server": [python, "-m", "mlx_lm", "server", "--model", model, "--port", str(port)]
        + ["--log-level", "WARNING"],
        "mlxkv serve": [python, "-m", "mlxkv", "serve", "--model", model, "--port", str(port), "--max-num-seqs", "16"]
        + ["--max-model-len", str(max_model_len), "--disk-cache", "none", *flags],  # no pages from earlier runs
    }


def bench_model(layers: int | None) -> Path | None:
    """The random ~100M Llama `layers` deep (built once beside the default one); None: the default."""
    if layers is None:
        return None
    path = DEFAULT_MODEL.with_name(f"{DEFAULT_MODEL.name}-{layers}-layers")
    if not (path / "config.json").exists():
        shape = {**LLAMA_100M, "num_hidden_layers": layers}
        make_checkpoint(path, "llama", "float32", shape=shape, max_position_embeddings=32768)
    return path


def run_server(name: str, command: list[str], port: int, log: Path, workloads: dict, output_len: int, progress) -> dict:
    """Start one server, run every concurrency's workload against it, stop it; its rows by concurrency."""
    proc = launch(command, port, log)
    url, model = f"http://127.0.0.1:{port}", command[command.index("--model") + 1]
    rows = {}
    try:
        asyncio.run(load(url, model, ["warm up"] * 2, 2, 4, tqdm(disable=True)))
        for c, prompts in workloads.items():
            progress.set_description(f"{name}: {c} clients")
            rows[c] = asyncio.run(load(url, model, prompts, c, output_len, progress))
        peak = peak_rss_gib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    for row in rows.values():
        row["ITL p99/p50"] = row["ITL p99 ms"] / row["ITL p50 ms"]
        row["peak RSS GiB"] = peak
    return rows


COLUMNS = ["tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms", "ITL p99/p50", "peak RSS GiB", "retries"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help=MODEL_HELP)
    parser.add_argument("--layers", type=int, default=None, help="the default model with this many layers (12)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-words", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048, help="mlxkv's context per sequence")
    parser.add_argument("--mlxkv-flags", default="", help="more flags for mlxkv serve, e.g. '--max-itl-ms 100'")
    parser.add_argument("--runs", type=int, default=2, help="runs of each server, alternating")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    expect(DEFAULTS_TAKE, OPENBLAS)
    path = args.model or bench_model(args.layers)
    load_bench_model(path)  # builds the default model if needed, and says what runs it
    model = str(path or DEFAULT_MODEL)
    rng = np.random.default_rng(args.seed)
    words = TEXT.split()
    workloads = {
        c: [
            " ".join(rng.choice(words, int(rng.integers(*args.prompt_words))))
            for _ in range(c * args.requests_per_client)
        ]
        for c in args.concurrency
    }
    print(f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}")
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    print(f"server logs: {logs}")
    commands = servers(model, port := free_port(), args.max_model_len, args.mlxkv_flags.split())
    progress = bar(args.runs * len(commands) * sum(map(len, workloads.values())) * args.output_len, "", unit="tok")
    rows: dict[tuple[int, str], dict] = {}
    for run in range(1, args.runs + 1):
        for name, command in commands.items():
            log = logs / f"{name}-{run}.log"
            rows[run, name] = run_server(name, command, port, log, workloads, args.output_len, progress)
    progress.close()

    print(f"{'run':>3} {'server':16}{'clients':>8}" + "".join(f"{c:>14}" for c in COLUMNS))
    for c in args.concurrency:
        for (run, name), by_clients in rows.items():
            print(f"{run:>3} {name:16}{c:>8}" + "".join(f"{by_clients[c][k]:>14.3f}" for k in COLUMNS))
    medians = {}
    for c in args.concurrency:
        ratios = [
            rows[run, "mlxkv serve"][c]["tok/s"] / rows[run, "mlx_lm.server"][c]["tok/s"]
            for run in range(1, args.runs + 1)
        ]
        ttft = [
            rows[run, "mlxkv serve"][c]["TTFT p50 s"] / rows[run, "mlx_lm.server"][c]["TTFT p50 s"]
            for run in range(1, args.runs + 1)
        ]
        medians[c] = float(np.median(ratios))
        print(
            f"c{c}: throughput ratio per run {' '.join(f'{r:.3f}' for r in ratios)}, median {medians[c]:.3f}; "
            f"TTFT p50 ratio per run {' '.join(f'{r:.3f}' for r in ttft)}"
        )
    high, low = max(args.concurrency), min(args.concurrency)
    print(f"serve_throughput_ratio_c{high}={medians[high]:.3f} serve_throughput_ratio_c{low}={medians[low]:.3f}")


if __name__ == "__main__":
    main()
