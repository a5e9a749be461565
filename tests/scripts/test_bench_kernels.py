import re
import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import bench_kernels

SMALL = ["--model-batches", "1", "8", "--model-contexts", "512", "--model-groups", "4", "--model-head-dims", "64"]


@pytest.mark.skipif(mx.metal.is_available(), reason="on a Mac the default times the Metal kernels")
def test_with_no_mode_off_a_mac_it_counts_the_kernels_and_says_so(capsys):
    bench_kernels.main([*SMALL, "--baseline", "no-such-commit"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "No Metal on this machine, so no kernel to time: counting the kernels in the CPU simulator instead "
        "(--model; --reference times the pure-MLX reference path)."
    )
    assert lines[1].startswith("With its defaults this takes about 2 minutes on a 2-core x86-64 Linux CPU")
    assert lines[2] == "(git cannot show commit no-such-commit here: no baseline columns)"
    assert lines[3].startswith("Modeled in the CPU simulator, float16 K/V, 8 KV heads")
    rows = [line.split()[:5] for line in lines[5:]]
    assert rows == [["1", "512", "4", "64", "new"], ["8", "512", "4", "64", "new"]]


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
    assert (
        "(left out: over 8 GiB of K/V, or a gathered K of 2**31 elements, on which MLX 0.32's SDPA crashes on "
        "the CPU: batch 64 x context 32768)"
    ) in lines
    assert lines[-1].split() == ["batch", "context", "paged", "GB/s", "base", "GB/s", "paged/base", "time"]
