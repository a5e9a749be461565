"""What one client's huge prompt does to the others on `mlxkv serve`: a stream's gaps and `/health`.

Starts `mlxkv serve` (the demo model, `--max-model-len 2048`) and, `--runs` times: a client streams
a chat reply (greedy, 1,024 tokens) while, once the stream has begun, another posts a `--megabytes`
MB prompt (answered 400: longer than the context) and a third asks `/health` every 50 ms. Per run
it prints how long the huge request took, the stream's longest gap between chunks while it ran,
and the slowest `/health` answer then; last `max_stream_gap_s=... max_health_s=...` over all runs.
Its HTTP client, httpx, comes with the test extra (`pip install -e ".[test]"`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

import httpx
from bench_serve import free_port, launch
from harness import blas_in_use

CHAT = {"messages": [{"role": "user", "content": "The import statement"}], "max_tokens": 1024, "temperature": 0}


async def stream(client: httpx.AsyncClient, chunks: list[float], started: asyncio.Event) -> None:
    """A streamed chat reply, the time each chunk came at."""
    async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                chunks.append(time.perf_counter())
                started.set()


async def health(client: httpx.AsyncClient, answers: list[tuple[float, float]], done: asyncio.Event) -> None:
    """`/health` every 50 ms until `done`: when each was asked and how long it took."""
    while not done.is_set():
        asked = time.perf_counter()
        await client.get("/health")
        answers.append((asked, time.perf_counter() - asked))
        await asyncio.sleep(0.05)


async def one_run(url: str, megabytes: float) -> tuple[float, float, float]:
    """(the huge request's seconds, the stream's longest gap then, the slowest /health then)."""
    huge = {"messages": [{"role": "user", "content": "word " * int(megabytes * 2**20 / 5)}], "max_tokens": 4}
    chunks: list[float] = []
    answers: list[tuple[float, float]] = []
    started, done = asyncio.Event(), asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        streaming = asyncio.create_task(stream(client, chunks, started))
        await started.wait()
        polling = asyncio.create_task(health(client, answers, done))
        sent = time.perf_counter()
        reply = await client.post("/v1/chat/completions", json=huge)
        answered = time.perf_counter()
        done.set()
        await asyncio.gather(streaming, polling)
    assert reply.status_code == 400, reply.text
    gaps = [b - a for a, b in pairwise(chunks) if b >= sent and a <= answered]
    if not gaps or chunks[-1] < answered:
        raise RuntimeError("the stream ended before the huge request was answered: a longer reply is needed")
    return answered - sent, max(gaps), max(took for asked, took in answers if sent <= asked <= answered)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=2.0, help="size of the huge prompt [default: 2]")
    parser.add_argument("--runs", type=int, default=3, help="how many times [default: 3]")
    args = parser.parse_args(argv)
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "serve.log"
    command = [sys.executable, "-m", "mlxkv", "serve", "--port", str(port), "--max-model-len", "2048"]
    command += ["--disk-cache", "none"]  # no pages from earlier runs
    server = launch(command, port, log)
    print(f"BLAS: {blas_in_use()}; a {args.megabytes} MB prompt beside a streamed reply")
    try:
        results = [asyncio.run(one_run(f"http://127.0.0.1:{port}", args.megabytes)) for _ in range(args.runs)]
    finally:
        server.terminate()
        server.wait(30)
    for run, (took, gap, slowest) in enumerate(results, 1):
        print(
            f"run {run}: huge request {took:.2f} s, stream's longest gap {gap:.3f} s, slowest /health {slowest:.3f} s"
        )
    print(f"max_stream_gap_s={max(r[1] for r in results):.3f} max_health_s={max(r[2] for r in results):.3f}")


if __name__ == "__main__":
    main()
