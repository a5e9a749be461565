import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

pytest.importorskip("mlx_vlm")
import bench_images


def test_a_small_run_prints_both_parts_ratios(capsys):
    bench_images.main(
        [
            "--tiny",
            "--streams",
            "2",
            "--tokens",
            "6",
            "--requests",
            "2",
            "--runs",
            "1",
            "--every",
            "2",
            "--image-size",
            "32",
        ]
    )
    out = capsys.readouterr().out
    for kind in bench_images.ARRIVALS:
        assert re.search(rf"^2 text streams, {kind} arriving: [\d.]+ tok/s \(p99 \d+ ms\)$", out, re.M)
    assert re.search(r"^text_tps_ratio=[\d.]+ text_itl_p99_ratio=[\d.]+$", out, re.M)
    assert re.search(r"^2 image requests of 6 tokens: mlx-vlm generate [\d.]+ tok/s, mlxkv [\d.]+ tok/s$", out, re.M)
    assert re.search(r"^vs_mlx_vlm_ratio=[\d.]+$", out, re.M)
