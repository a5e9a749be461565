import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import bench_decode


def test_a_small_run_prints_every_ratio_and_the_host_time_table(checkpoint, tmp_path, capsys):
    model = str(checkpoint("llama-fp32"))
    small = ["--tokens", "6", "--runs", "1", "--sequences", "2", "4", "--steps", "2"]
    bench_decode.main(["--model", model, "--tiny", model, *small])
    out = capsys.readouterr().out
    assert out.startswith("With its defaults this takes about ")
    for name in ("demo", "llama-100m"):
        assert re.search(rf"^single_stream_ratio\[{name}\]=[\d.]+$", out, re.M)
        assert re.search(rf"^step_ratio\[{name}\]=[\d.]+$", out, re.M)
    assert re.findall(r"^ +(\d+) +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M) == ["2", "4"]
