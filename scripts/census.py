"""The census of model families: every `model_type` of the installed mlx-lm, built as a tiny random
checkpoint from the family's own `ModelArgs` (`mlxkv.models.tiny_configs`), run greedily by mlx-lm and
by mlxkv in both layouts, batched; each one either runs with mlx-lm's tokens or is refused at load.

    python scripts/census.py            # each family's finding, a line each
    python scripts/census.py --write    # docs/families.md and the README's summary, from the findings
    python scripts/census.py --tensor-parallel   # the families listed with tensor parallel, over 2 processes

`tests/models/test_census.py` runs the same census and checks it against docs/families.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm import load as mlx_lm_load

from mlxkv import LLM, SamplingParams
from mlxkv.cache.storage import GROUP_SIZES
from mlxkv.errors import ModelLoadError
from mlxkv.models.random_model import make_checkpoint
from mlxkv.models.tiny_configs import MODEL_TYPES, UNBUILDABLE, tiny_config

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "families.md"
README = ROOT / "README.md"
PROMPTS = [[int(t) for t in np.random.default_rng(n).integers(1, 300, n)] for n in (3, 9, 17)]
NEW_TOKENS = 6
TIE = 1e-3  # a step where mlx-lm's top two log-probabilities are this close may go either way
RUNS, REFUSED, UNBUILT = "runs", "refused", "not built"


@dataclass(frozen=True)
class Finding:
    """One family's census line: it runs (`detail`: what it gets), is refused (`detail`: why), or no
    tiny checkpoint of it can be built (`detail`: why)."""

    model_type: str
    outcome: str
    detail: str

    def row(self) -> str:
        return f"| `{self.model_type}` | {self.outcome} | {self.detail} |"


def mlx_lm_tokens(path: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    """mlx-lm's greedy tokens for `prompt`, and at each step how far apart its top two log-probabilities are."""
    model, _ = mlx_lm_load(str(path))
    tokens, gaps = [], []
    steps = sys.modules["mlx_lm.generate"].generate_step(
        mx.array(prompt), model, max_tokens=NEW_TOKENS, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    for token, logprobs in steps:
        second, first = mx.sort(logprobs)[-2:].tolist()
        tokens.append(int(token))
        gaps.append(first - second)
    return tokens, gaps


def agrees(got: list[int], expected: list[int], gaps: list[float]) -> bool:
    """`got` is mlx-lm's `expected` up to the first step where they part at a tie (if any)."""
    parted = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), len(expected))
    return parted == len(expected) or gaps[parted] < TIE


def what_it_gets(llm: LLM) -> str:
    """What mlxkv gives a family that runs: pages, windows, states, MLA latents, quantized pages, tensor parallel."""
    cache, model = llm.engine.cache, llm.engine.runner.model
    storages = [cache.storage] + [group.storage for group in cache.windowed.values()]
    head_dims = {dim for storage in storages for dim in storage.head_dims}
    gets = [
        ("pages", any(storage.num_layers for storage in storages)),
        ("windows", bool(cache.windowed)),
        ("states", cache.states is not None),
        ("MLA latents", any(storage.keys_only for storage in storages)),
        ("quantized pages", bool(head_dims) and all(dim % GROUP_SIZES[0] == 0 for dim in head_dims)),
        ("tensor parallel", hasattr(model, "shard") or hasattr(getattr(model, "language_model", None), "shard")),
    ]
    return ", ".join(name for name, has in gets if has)


def refusal(error: ModelLoadError) -> str:
    """A refusal's reason, without the checkpoint's path and the model_type it names first."""
    text = re.sub(r" in '[^']*config\.json'", "", str(error))
    return re.sub(r"^unsupported model_type '[^']*'[:;] (it uses )?", "", text).replace("|", "/")


def examine(model_type: str, directory: Path) -> Finding:
    """`model_type`'s finding, its checkpoint built in `directory`; AssertionError where mlxkv runs
    it but its tokens are not mlx-lm's."""
    if model_type in UNBUILDABLE:
        return Finding(model_type, UNBUILT, UNBUILDABLE[model_type])
    config = tiny_config(model_type)
    path = make_checkpoint(directory, config.pop("model_type"), shape=config)
    expected = [mlx_lm_tokens(path, prompt) for prompt in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    gets = ""
    for layout in ("paged", "contiguous"):
        try:
            llm = LLM(str(path), kv_layout=layout, page_size=4, max_num_seqs=3, max_num_batched_tokens=16)
        except ModelLoadError as exc:
            return Finding(model_type, REFUSED, refusal(exc))
        done = llm.generate(PROMPTS, params)
        for completion, (tokens, gaps) in zip(done, expected):
            got = list(completion.token_ids)
            assert agrees(got, tokens, gaps), f"{model_type} ({layout}): {got} where mlx-lm gives {tokens}"
        gets = gets or what_it_gets(llm)  # the paged layout's: the contiguous one keeps no windows
    return Finding(model_type, RUNS, gets)


def documented() -> dict[str, Finding]:
    """The findings docs/families.md states, by model_type."""
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \| (.*) \|$", TABLE.read_text(), re.M)
    return {name: Finding(name, outcome.strip(), detail.strip()) for name, outcome, detail in rows}


def summary(findings: list[Finding]) -> str:
    """The README's paragraph on the families: how many run, and which are refused at load."""
    runs = [f for f in findings if f.outcome == RUNS]
    built = [f for f in findings if f.outcome != UNBUILT]
    refused = ", ".join(f"`{f.model_type}`" for f in findings if f.outcome == REFUSED)
    text = (
        f"mlxkv runs {len(runs)} of the {len(built)} model types of mlx-lm {mlx_lm.__version__} that build as tiny "
        f"random checkpoints ({len(findings)} in all) with mlx-lm's greedy tokens. It refuses at load, saying "
        f"why ([docs/families.md](docs/families.md) lists each family, what it gets or why not): {refused}."
    )
    return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)


def write(findings: list[Finding]) -> None:
    """docs/families.md and the README's block between its census markers, from `findings`."""
    head = TABLE.read_text().split("| model_type |")[0] if TABLE.exists() else "# Model families\n\n"
    table = ["| model_type | mlxkv | what it gets, or why not |", "|---|---|---|"] + [f.row() for f in findings]
    TABLE.write_text(head + "\n".join(table) + "\n")
    text = README.read_text()
    start, end = "<!-- census -->\n", "<!-- /census -->"
    before, rest = text.split(start)
    README.write_text(before + start + summary(findings) + "\n" + end + rest.split(end)[1])


SPLIT = """
import json, sys
from mlxkv import LLM, SamplingParams
llm = LLM(sys.argv[1], page_size=4, max_num_seqs=3, max_num_batched_tokens=16)  # ranks but 0 end in here
print(json.dumps([o.token_ids for o in llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=6))]))
"""


def splits(model_type: str, directory: Path) -> bool:
    """Whether `model_type` run over two processes by `mlx.launch` (ring backend, 127.0.0.1) gives
    one process's tokens."""
    config = tiny_config(model_type)
    path = make_checkpoint(directory, config.pop("model_type"), shape=config)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = LLM(str(path), page_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    alone = [list(o.token_ids) for o in llm.generate(PROMPTS, params)]
    launcher = str(Path(sys.executable).parent / "mlx.launch")
    command = [launcher, "-n", "2", "--backend", "ring", "--", sys.executable, "-c", SPLIT, str(path)]
    done = subprocess.run([*command, json.dumps(PROMPTS)], capture_output=True, text=True, timeout=300)
    return done.returncode == 0 and json.loads(done.stdout.splitlines()[-1]) == alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite docs/families.md and the README's summary")
    parser.add_argument(
        "--tensor-parallel", action="store_true", help="run the families listed with tensor parallel over 2 processes"
    )
    parser.add_argument("model_types", nargs="*", help="only these (default: every model_type of mlx-lm)")
    args = parser.parse_args()
    if args.tensor_parallel:
        for name, finding in documented().items():
            if "tensor parallel" in finding.detail and name in (args.model_types or MODEL_TYPES):
                with tempfile.TemporaryDirectory() as directory:
                    verdict = "splits with one process's tokens" if splits(name, Path(directory)) else "DIFFERS"
                print(f"| `{name}` | {verdict} |", flush=True)
        return
    findings = []
    for model_type in args.model_types or MODEL_TYPES:
        with tempfile.TemporaryDirectory() as directory:
            try:
                finding = examine(model_type, Path(directory))
            except AssertionError as exc:
                finding = Finding(model_type, "wrong tokens", str(exc))
            except Exception as exc:
                finding = Finding(model_type, "error", f"{type(exc).__name__}: {exc}"[:300])
        print(finding.row(), flush=True)
        findings.append(finding)
    if args.write:
        write(findings)


if __name__ == "__main__":
    main()
