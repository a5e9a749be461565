"""Every code block of README.md and docs/*.md, run verbatim in a fresh process, and what the text says it prints.

The Markdown's conventions: a ```python or ```bash block runs from the repository root, in an
environment holding only what the README's install brings (`pip install -e .`; bash with its bin
folder first on PATH, as after activating it) and must exit 0. `<!-- after: pip install -e
".[extra]" -->` on the line before a block runs it after that install instead, which the page must
say in its text; `<!-- not run: why -->` skips it for that reason. A
```text block after `<!-- prints -->` quotes the output of the nearest runnable block above it:
each quoted line must appear, in order, as a line of that output, where a number with a decimal
point stands for any number and `...` for any text. Blocks that talk to 127.0.0.1:8000 get
`mlxkv serve --port 8000` running, as the README starts it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
from helpers import start_server, stop_server
from installed import environment

from mlxkv import EngineConfig, SamplingParams

pytestmark = pytest.mark.xdist_group("port-8000")  # one worker runs them all: they share the README's port
ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*(not run:.*?|prints|after:.*?)\s*-->$")
AFTER = re.compile(r'^after: (pip install -e "\.\[(\w+(?:,\w+)*)\]")$')
DECIMAL = re.compile(r"\d+\\\.\d+")


@dataclass
class Block:
    page: Path
    line: int
    language: str
    source: str
    skip: str | None = None
    install: str = "pip install -e ."  # what the page says to install before it
    extras: tuple[str, ...] = ()
    prints: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.page.name}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The runnable blocks of `page`, each with the output lines quoted after it."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    marker, i = None, 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            marker = MARKER.match(lines[i].strip()) or (marker if not lines[i].strip() else None)
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        body, language = lines[i + 1 : end], opening.group(1)
        note = marker.group(1) if marker else None
        if language == "text" and note == "prints":
            assert found, f"{page.name}:{i + 1}: quoted output with no runnable block above it"
            found[-1].prints += [line for line in body if line.strip()]
        elif language in ("python", "bash"):
            skip = note[len("not run:") :].strip() if note and note.startswith("not run:") else None
            found.append(Block(page, i + 1, language, "\n".join(body) + "\n", skip))
            if note and (after := AFTER.match(note)):
                found[-1].install, found[-1].extras = after.group(1), tuple(after.group(2).split(","))
            assert not note or not note.startswith("after:") or after, f"{page.name}:{i + 1}: {note!r} names no extras"
        marker, i = None, end + 1
    return found


BLOCKS = [block for page in PAGES for block in blocks(page)]


def pattern(quoted: str) -> re.Pattern[str]:
    """A quoted output line as a pattern: decimals stand for any number, `...` for any text."""
    text = DECIMAL.sub(r"[-+]?\\d+(?:\\.\\d+)?(?:e[-+]?\\d+)?", re.escape(quoted.strip()))
    return re.compile(text.replace(re.escape("..."), ".*"))


def missing_lines(quoted: list[str], output: str) -> list[str]:
    """The quoted lines not found, in order, among `output`'s lines."""
    lines, at, missing = [line.strip() for line in output.splitlines()], 0, []
    for line in quoted:
        wanted = pattern(line)
        hit = next((j for j in range(at, len(lines)) if wanted.fullmatch(lines[j])), None)
        if hit is None:
            missing.append(line)
        else:
            at = hit + 1
    return missing


def run(block: Block, bin_dir: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `block` with the environment of `bin_dir`, in a process group of its own, all of which
    goes when it ends or times out (a block may start a server in the background). Its cache
    folder is a fresh one, so that a server's disk tier reads no pages an earlier run left."""
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(bin_dir.parent)}
    env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mlxkv-docs-cache-")
    python = str(bin_dir / "python")
    command = [python, "-c", block.source] if block.language == "python" else ["bash", "-e", "-c", block.source]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{block.name} did not finish in {timeout} s:\n{out}{err}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The bin folder of an environment holding what a block's install brings (see `installed.py`)."""
    root = tmp_path_factory.mktemp("installs")
    return lambda block: environment(root, block.extras)


@pytest.fixture(scope="module")
def server():
    """`mlxkv serve --port 8000`, started once for the blocks that talk to it."""
    started = []

    def ensure() -> None:
        if not started:
            started.append(start_server(port=8000)[0])

    yield ensure
    for proc in started:
        stop_server(proc)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_block_runs_and_prints_what_the_text_says(block, installed, server):
    if block.skip:
        pytest.skip(f"not run: {block.skip}")
    if block.language == "bash" and "curl " in block.source and not shutil.which("curl"):
        pytest.skip("needs curl, which this machine lacks (Debian: apt-get install curl)")
    if "127.0.0.1:8000" in block.source:
        server()
    assert not block.extras or block.install in block.page.read_text().replace(
        f"<!-- after: {block.install} -->", ""
    ), f"{block.name} runs after `{block.install}`, which its page does not say"
    done = run(block, installed(block))
    assert done.returncode == 0, f"after {block.install}:\n{done.stderr}"
    missing = missing_lines(block.prints, done.stdout + done.stderr)
    assert not missing, f"not printed: {missing}\n--- output:\n{done.stdout}{done.stderr}"


def test_the_conventions_catch_a_wrong_quote():
    assert (
        missing_lines(
            ["Prompt: 3 tokens, 1.5 tokens-per-sec", "KV cache: paged, ... reused"],
            "text\nPrompt: 3 tokens, 211.258 tokens-per-sec\nKV cache: paged, 7/7 pages; 0 reused\n",
        )
        == []
    )
    assert missing_lines(["Prompt: 4 tokens, 1.5 tokens-per-sec"], "Prompt: 3 tokens, 2.5 tokens-per-sec") == [
        "Prompt: 4 tokens, 1.5 tokens-per-sec"
    ]
    assert missing_lines(["b", "a"], "a\nb\n") == ["a"]  # in order


def test_the_readme_quotes_what_its_examples_print():
    assert sum(bool(b.prints) for b in BLOCKS if b.page.name == "README.md") >= 2


def test_the_options_table_lists_every_setting_with_its_flag():
    table = (ROOT / "docs" / "options.md").read_text()
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| `")]
    for record in (EngineConfig, SamplingParams):
        for item in fields(record):
            row = next((r for r in rows if f"`{item.name}`" in r[0]), None)
            assert row is not None, item.name
            flag = (item.metadata["flags"] or (f"--{item.name.replace('_', '-')}",))[0]
            assert item.name == "logprobs" or f"`{flag}" in row[1], (item.name, row)


def test_the_asyncio_example_exits_cleanly_every_time():
    """MLX aborts the process (exit 134) if the engine thread ends without `mx.clear_streams()`."""
    [block] = [b for b in BLOCKS if "AsyncLLM(" in b.source and not b.skip]
    codes = [run(block, Path(sys.executable).parent).returncode for _ in range(5)]
    assert codes == [0] * 5


def test_a_block_runs_with_only_what_its_install_brings(installed):
    """The plain install brings no client and no simulator compiler; each extra brings its own."""
    found = "import importlib.util as u\nprint(*(u.find_spec(n) is not None for n in ('openai', 'ziglang')))\n"
    seen = {}
    for extras in ((), ("clients",), ("test",)):
        probe = Block(ROOT / "README.md", 0, "python", found, extras=extras)
        seen[extras] = run(probe, installed(probe)).stdout.split()
    assert seen == {(): ["False", "False"], ("clients",): ["True", "False"], ("test",): ["True", "True"]}
