"""Ctrl-C on `mlxkv serve` while clients stream: the first SIGINT aborts every running request, so
each stream ends properly (finish reason "abort", then `[DONE]`), and the server exits without a
traceback; a second SIGINT ends it at once, also without one."""

import json
import signal
import threading

import httpx
import pytest
from helpers import start_server


def streams(url: str, count: int, started: threading.Barrier) -> tuple[list[threading.Thread], list[list[str]]]:
    """`count` long completion streams; each list gets its stream's data lines."""
    lines: list[list[str]] = [[] for _ in range(count)]

    def stream(index: int) -> None:
        body = {"prompt": "The import statement", "max_tokens": 3000, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: "):
                        if not lines[index]:
                            started.wait()
                        lines[index].append(line[6:])
        except httpx.TransportError:  # a second Ctrl-C ends the server at once: the stream is cut
            lines[index].append("cut")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads, lines


@pytest.mark.parametrize("signals", [1, 2], ids=["once", "twice"])
def test_ctrl_c_during_four_streams_ends_them_and_exits_quietly(signals):
    proc, url = start_server("--max-model-len", "4096")
    started = threading.Barrier(5)
    threads, lines = streams(url, 4, started)
    started.wait(timeout=120)  # every stream has its first chunk
    for _ in range(signals):
        proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    for thread in threads:
        thread.join(timeout=60)
    assert proc.returncode in (0, 130) and "Traceback" not in stderr, stderr
    if signals == 1:
        for data in lines:
            assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "abort"
        assert "4 running requests aborted" in stderr
    else:
        assert "interrupted again; exiting now" in stderr or "running requests aborted" in stderr
