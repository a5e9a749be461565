"""The README's Python examples, run verbatim in fresh interpreters, as a user would paste them."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import start_server, stop_server

README = Path(__file__).parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def run(source: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300)


@pytest.fixture
def served(source):
    """The `mlxkv serve` an example talks to (the README's command, on its port 8000)."""
    if "127.0.0.1:8000" not in source:
        yield
        return
    proc, _ = start_server(port=8000)
    yield
    stop_server(proc)


@pytest.mark.parametrize("source", EXAMPLES, ids=[f"example-{i}" for i in range(len(EXAMPLES))])
def test_example_runs_and_exits_cleanly(source, served):
    done = run(source)
    assert done.returncode == 0, done.stderr


def test_the_asyncio_example_exits_cleanly_every_time():
    """MLX aborts the process (exit 134) if the engine thread ends without `mx.clear_streams()`."""
    [source] = [s for s in EXAMPLES if "AsyncLLM" in s]
    codes = [run(source).returncode for _ in range(10)]
    assert codes == [0] * 10
