"""`mlxkv serve` against `mlx_lm.server` over HTTP: one streaming workload at several concurrencies.

Both servers load the same model directory (default: the random ~100M-parameter float32 Llama
of the other benchmarks) and run one after the other on this machine, each with its own
defaults (mlxkv with `--max-num-seqs 16 --max-model-len 2048`: it allocates its KV pool up
front), so neither competes with the other for the CPU.
At each concurrency C, C clients stream `/v1/completions` (greedy, `--output-len` tokens) for
`--requests-per-client` prompts each. Per server and concurrency it prints output tokens/s
(from each stream's usage), time to first token p50/p99, inter-token latency p50/p99, the
server's peak resident memory and how many connections it refused or reset before the first
token (each retried after 50 ms; the time counts), then `serve_throughput_ratio_c16=... serve_throughput_ratio_c1=...`
(mlxkv over mlx-lm; the concurrencies named are the largest and smallest asked for).
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

from mlxkv.models.random_model import TEXT

DEFAULTS_TAKE = 83  # seconds on progress.MACHINE (docs/benchmarks.md)


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


def servers(model: str, port: int, max_model_len: int, max_itl_ms: float | None) -> dict[str, list[str]]:
    """The two commands. mlxkv allocates its KV pool up front, sized for 16 sequences of
    `max_model_len` tokens; mlx-lm grows its caches as it goes."""
    python = sys.executable
    return {
        "mlx_lm.server": [
            python,
            "-m",
            "mlx_lm",
            "server",
            "--model",
            model,
            "--port",
            str(port),
            "--log-level",
            "WARNING",
        ],
        "mlxkv serve": [
            python,
            "-m",
            "mlxkv",
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            "--max-num-seqs",
            "16",
            "--max-model-len",
            str(max_model_len),
            *(["--max-itl-ms", str(max_itl_ms)] if max_itl_ms is not None else []),
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help=MODEL_HELP)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-words", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048, help="mlxkv's context per sequence")
    parser.add_argument("--max-itl-ms", type=float, default=None, help="mlxkv's [default: its serve default]")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    expect(DEFAULTS_TAKE, OPENBLAS)
    load_bench_model(args.model)  # builds the default model if needed, and says what runs it
    model = str(args.model or DEFAULT_MODEL)
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
    rows: dict[tuple[str, int], dict] = {}
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    print(f"server logs: {logs}")
    progress = bar(2 * sum(map(len, workloads.values())) * args.output_len, "", unit="tok")
    for name, command in servers(model, port := free_port(), args.max_model_len, args.max_itl_ms).items():
        progress.set_description(f"{name}: starting")
        proc = launch(command, port, logs / f"{name}.log")
        url = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(load(url, model, ["warm up"] * 2, 2, 4, tqdm(disable=True)))
            for c in args.concurrency:
                progress.set_description(f"{name}: {c} clients")
                rows[name, c] = asyncio.run(load(url, model, workloads[c], c, args.output_len, progress))
            peak = peak_rss_gib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        for c in args.concurrency:
            rows[name, c]["peak RSS GiB"] = peak

    progress.close()
    columns = ["tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms", "peak RSS GiB", "retries"]
    print(f"{'server':16}{'clients':>8}" + "".join(f"{c:>14}" for c in columns))
    for (name, c), row in sorted(rows.items(), key=lambda item: (item[0][1], item[0][0])):
        print(f"{name:16}{c:>8}" + "".join(f"{row[k]:>14.3f}" for k in columns))
    high, low = max(args.concurrency), min(args.concurrency)
    ratio = {c: rows["mlxkv serve", c]["tok/s"] / rows["mlx_lm.server", c]["tok/s"] for c in (high, low)}
    print(f"serve_throughput_ratio_c{high}={ratio[high]:.3f} serve_throughput_ratio_c{low}={ratio[low]:.3f}")


if __name__ == "__main__":
    main()
