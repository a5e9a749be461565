import re
import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import bench_kernels

from mlxkv.attention.lab import cost_model, speed

SMALL = ["--model-batches", "1", "8", "--model-contexts", "512", "--model-groups", "4", "--model-head-dims", "64"]


@pytest.mark.skipif(mx.metal.is_available(), reason="on a Mac the default times the Metal kernels")
def test_with_no_mode_off_a_mac_it_counts_the_kernels_and_says_so(capsys, monkeypatch):
    """Calibrated on two of the published points (all twelve: tests/attention/test_cost_model.py)."""
    for module in (cost_model, bench_kernels):
        monkeypatch.setattr(module, "PUBLISHED", {(32, 32, 128): (239,), (64, 8, 64): (76,)})
        monkeypatch.setattr(module, "PUBLISHED_CONTEXTS", (2048,))
    bench_kernels.main([*SMALL, "--baseline", "no-such-commit"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "No Metal on this machine, so no kernel to time: counting the kernels in the CPU simulator instead "
        "(--model; --reference times the pure-MLX reference path)."
    )
    assert lines[1].startswith("With its defaults this takes about 7 minutes on a 2-core x86-64 Linux CPU")
    assert lines[2] == "(git cannot show commit no-such-commit here: no baseline rows)"
    assert lines[3].startswith("Calibration on M5 Pro (20-core GPU): the model of a kernel with MLX's vector SDPA")
    calibration = [line.split()[:4] for line in lines[7:9]]
    assert calibration == [["32/32", "128", "2048", "239"], ["64/8", "64", "2048", "76"]]
    assert re.fullmatch(r"Model error on the published points: -\d+% to -\d+%, mean \d+% \(.*\)\.", lines[9])
    assert lines[11].startswith("Assumed: M5 Pro (20-core GPU): 307 GB/s")
    rows = [line.split() for line in lines[14:]]
    assert [row[:5] for row in rows] == [["1", "512", "4", "64", "new"], ["8", "512", "4", "64", "new"]]
    assert [row[15] for row in rows] == ["0", "0"]  # no private array left in memory


def test_reference_times_the_reference_path_per_case(capsys):
    small = ["--batches", "2", "--contexts", "64", "128", "--repeats", "1", "--q-heads", "4", "--kv-heads", "2"]
    bench_kernels.main(["--reference", *small])
    out = capsys.readouterr().out
    if not mx.metal.is_available():
        assert out.startswith("With its defaults this takes about ")
        assert "paged: the pure-MLX reference path (no Metal on this machine)" in out
    assert re.findall(r"^ +2 +(\d+) +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M) == ["64", "128"]


def test_reference_leaves_out_what_would_not_fit_and_says_which(capsys):
    bench_kernels.main(["--reference", "--batches", "64", "--contexts", "32768", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("(left out:")] in (
        ["(left out: batch 64 x context 32768, a gathered K of 2**31 elements, on which MLX 0.32's SDPA crashes)"],
        [f"(left out: batch 64 x context 32768, 8.0 GiB of K/V, over a third of {speed.memory() / 2**30:.0f} GiB)"],
    )
    assert lines[-1].split() == ["batch", "context", "paged", "GB/s", "base", "GB/s", "paged/base", "time"]
