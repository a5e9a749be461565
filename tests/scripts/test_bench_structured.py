import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import bench_structured


def test_a_small_run_prints_each_mix_and_the_overheads(checkpoint, capsys):
    bench_structured.main(
        ["--model", str(checkpoint("llama-fp32")), "--num-requests", "4", "--prompt-len", "8", "--output-len", "6"]
        + ["--repeats", "1", "--constrained", "0", "2", "4"]
    )
    out = capsys.readouterr().out
    rows = re.findall(r"^ +(\d+) +[\d.]+ +[\d.]+ +([\d.]+)$", out, re.MULTILINE)
    assert [k for k, _ in rows] == ["0", "2", "4"] and rows[0][1] == "1.000"
    assert re.search(r"^structured_overhead_2=[\d.]+ structured_overhead_4=[\d.]+$", out, re.MULTILINE)
