"""What an idle tensor-parallel server costs, and whether its ranks outlive their launcher (Linux:
it reads /proc).

`mlxkv serve` with the demo model runs as two processes under `mlx.launch -n 2 --backend ring`
on this machine, answers one request (so that every rank has run steps), then idles for
`--seconds` (default 30) with no request in flight. Per rank, and for the launcher, it prints the
CPU time the process used over that window as a percentage of one core. Then it kills the launcher
alone (SIGKILL, as a crash or `kill -9` would) and waits up to `--exit-timeout` seconds for both
ranks to end. Last it prints `idle_cpu_percent_rank0=<...> idle_cpu_percent_rank1=<...>
idle_cpu_percent_launcher=<...> ranks_gone_after_s=<...>` (`never` if a rank outlived the timeout;
the script then kills it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(port: int) -> subprocess.Popen[bytes]:
    """`mlxkv serve` on `port` as two ranks, the launcher in a session of its own (to stop them all)."""
    launcher = str(Path(sys.executable).parent / "mlx.launch")
    ring = ["-n", "2", "--backend", "ring", "--starting-port", str(free_port())]
    serve = [sys.executable, "-m", "mlxkv", "serve", "--port", str(port), "--disk-cache", "none"]
    return subprocess.Popen(
        [launcher, *ring, "--", *serve], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def wait_healthy(url: str, launcher: subprocess.Popen[bytes]) -> None:
    while True:
        if launcher.poll() is not None:
            raise RuntimeError(f"the server ended with code {launcher.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def ranks(launcher: int) -> dict[int, int]:
    """The process id of each rank `launcher` started, by rank."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(stat_fields(int(pid))[1]) != launcher:  # field 4 of stat: the parent's id
                continue
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next(v.split(b"=", 1)[1] for v in environ if v.startswith(b"MLX_RANK="))
        found[int(rank)] = int(pid)
    return dict(sorted(found.items()))


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (which may hold spaces): state first."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User and system CPU time process `pid` has used, all its threads together."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime and stime, fields 14 and 15


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, ended but not reaped by its new parent, does not)."""
    try:
        return stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def idle_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Each named process's CPU use over `seconds`, as a percentage of one core."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    return {name: 100 * (cpu_seconds(pid) - before[name]) / elapsed for name, pid in pids.items()}


def gone_after(launcher: subprocess.Popen[bytes], pids: dict[int, int], timeout: float) -> float | None:
    """Seconds from killing `launcher` until every rank in `pids` has ended (None: not within `timeout`)."""
    launcher.kill()
    launcher.wait()
    started = time.monotonic()
    while any(alive(pid) for pid in pids.values()):
        if time.monotonic() - started > timeout:
            return None
        time.sleep(0.05)
    return time.monotonic() - started


def measure(seconds: float, exit_timeout: float) -> tuple[dict[str, float], float | None]:
    """Each rank's (and the launcher's) idle CPU use, then how long the ranks outlive their killed launcher."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launcher = launch(port)
    pids: dict[int, int] = {}
    try:
        wait_healthy(url, launcher)
        body = {"model": "mlxkv-demo", "prompt": "hello", "max_tokens": 4}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        pids = ranks(launcher.pid)
        named = {**{f"rank{rank}": pid for rank, pid in pids.items()}, "launcher": launcher.pid}
        return idle_cpu(named, seconds), gone_after(launcher, pids, exit_timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the session: whatever outlived the launcher
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to measure the idle server")
    parser.add_argument("--exit-timeout", type=float, default=60.0, help="how long to wait for the ranks to end")
    args = parser.parse_args(argv)
    percents, gone = measure(args.seconds, args.exit_timeout)
    for name, percent in percents.items():
        print(f"{name}: {percent:.2f}% of a core over {args.seconds:g} s idle")
    print(f"both ranks gone {f'{gone:.1f} s' if gone is not None else 'never'} after the launcher was killed")
    figures = [f"idle_cpu_percent_{name}={percent:.2f}" for name, percent in percents.items()]
    print(" ".join([*figures, f"ranks_gone_after_s={f'{gone:.1f}' if gone is not None else 'never'}"]))


if __name__ == "__main__":
    main()
