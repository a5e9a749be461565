import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import compare_layouts  # noqa: E402


@pytest.fixture(scope="module")
def result(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    compare_layouts.main(["--model", str(checkpoint("qwen2-fp32")), "--num-requests", "10", "--prompt-len", "20",
                          "--output-len", "12", "--max-num-seqs", "4", "--out", str(out)])
    return out, json.loads((out / "samples.json").read_text())


def test_bytes_holding_tokens_equal_tokens_in_flight_times_bytes_per_token(result):
    _, runs = result
    assert set(runs) == {"mlxkv paged (block 8)", "mlxkv paged (block 16)", "mlxkv paged (block 32)",
                         "mlxkv paged (block 64)", "mlxkv contiguous", "mlx-lm BatchGenerator"}
    for name, run in runs.items():
        exact = [s for s in run["samples"] if s["exact"]]
        assert len(exact) > 10, name
        for s in exact:
            assert s["holding"] == sum(s["lengths"]) * run["bytes_per_token"], (name, s)
            assert s["holding"] <= s["allocated"]


def test_paged_allocates_exactly_the_pages_its_sequences_need(result):
    _, runs = result
    for block in (8, 16, 32, 64):
        run = runs[f"mlxkv paged (block {block})"]
        for s in run["samples"]:
            pages = sum(-(-n // block) for n in s["lengths"])
            assert s["allocated"] == pages * block * run["bytes_per_token"]


def test_report_is_written(result):
    out, _ = result
    table = (out / "layout-comparison.md").read_text()
    assert table.count("\n| mlxkv paged (block ") == 4 and "| mlx-lm BatchGenerator |" in table
