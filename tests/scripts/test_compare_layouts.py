import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import compare_layouts


@pytest.fixture(scope="module")
def result(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    compare_layouts.main(
        [
            "--model",
            str(checkpoint("llama-fp32-d64")),
            "--num-requests",
            "10",
            "--prompt-len",
            "20",
            "--output-len",
            "12",
            "--max-num-seqs",
            "4",
            "--out",
            str(out),
        ]
    )
    return out, json.loads((out / "samples.json").read_text())


def test_bytes_holding_tokens_equal_tokens_in_flight_times_bytes_per_token(result):
    _, runs = result
    assert set(runs) == {
        "mlxkv paged (pages of 8)",
        "mlxkv paged (pages of 16)",
        "mlxkv paged (pages of 32)",
        "mlxkv paged (pages of 64)",
        "mlxkv paged 8-bit (pages of 16)",
        "mlxkv paged 4-bit (pages of 16)",
        "mlxkv contiguous",
        "mlx-lm BatchGenerator",
    }
    for name, run in runs.items():
        known = [s for s in run["samples"] if s["lengths_known"]]
        assert len(known) > 10, name
        for s in known:
            assert s["holding"] == sum(s["lengths"]) * run["bytes_per_token"], (name, s)
            assert s["holding"] <= s["allocated"]


def test_paged_allocates_exactly_the_pages_its_sequences_need(result):
    _, runs = result
    for size in (8, 16, 32, 64):
        run = runs[f"mlxkv paged (pages of {size})"]
        for s in run["samples"]:
            pages = sum(-(-n // size) for n in s["lengths"])
            assert s["allocated"] == pages * size * run["bytes_per_token"]


def test_quantized_pages_hold_the_same_tokens_in_fewer_bytes(result):
    """float32 K/V, head_dim 64, groups of 64: 256 bytes a row, 64 + 8 at 8 bits, 32 + 8 at 4 bits."""
    _, runs = result
    per_token = {bits: runs[f"mlxkv paged{bits} (pages of 16)"]["bytes_per_token"] for bits in ("", " 8-bit", " 4-bit")}
    assert per_token == {"": 2 * 2 * 2 * 256, " 8-bit": 2 * 2 * 2 * 72, " 4-bit": 2 * 2 * 2 * 40}


def test_report_is_written(result):
    out, _ = result
    table = (out / "layout-comparison.md").read_text()
    assert table.count("\n| mlxkv paged (pages of ") == 4 and "| mlx-lm BatchGenerator |" in table
    assert (
        "| mlxkv paged 8-bit (pages of 16) | 576.00 |" in table
        and "| mlxkv paged 4-bit (pages of 16) | 320.00 |" in table
    )


def test_rows_the_model_cannot_run_are_skipped_with_one_line_each(checkpoint, tmp_path, capsys):
    """head_dim 16 fits no KV group size: the quantized rows are skipped, every other row is reported."""
    small = ["--num-requests", "4", "--prompt-len", "8", "--output-len", "4", "--max-num-seqs", "2"]
    compare_layouts.main(["--model", str(checkpoint("llama-fp32")), "--out", str(tmp_path), *small])
    out = capsys.readouterr().out
    assert out.startswith("With its defaults this takes about 17 minutes")
    skipped = [line for line in out.splitlines() if line.startswith("skipped: ")]
    assert len(skipped) == 2
    for bits, line in zip((8, 4), skipped):
        assert re.fullmatch(rf"skipped: mlxkv paged {bits}-bit \(pages of 16\): the model's head_dim=16 .*", line)
        assert "cannot be quantized" in line
    assert set(json.loads((tmp_path / "samples.json").read_text())) == {
        "mlxkv paged (pages of 8)",
        "mlxkv paged (pages of 16)",
        "mlxkv paged (pages of 32)",
        "mlxkv paged (pages of 64)",
        "mlxkv contiguous",
        "mlx-lm BatchGenerator",
    }
    table = (tmp_path / "layout-comparison.md").read_text()
    assert table.count("\n| mlxkv paged (pages of ") == 4 and "-bit" not in table
    assert re.search(
        r"^paged_waste=[\d.]+% contiguous_waste=[\d.]+% mlx_lm_waste=[\d.]+% "
        r"concurrency_gain_vs_mlx_lm=[\d.]+x concurrency_gain_vs_contiguous=[\d.]+x$",
        out,
        re.MULTILINE,
    )
