import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import bench_memory


def test_a_small_run_prints_both_engines_and_the_ratios(checkpoint, capsys):
    bench_memory.main(["--model", str(checkpoint("llama-fp32")), "--prompt-tokens", "64", "256"])
    out = capsys.readouterr().out
    rows = re.findall(r"^ +(\d+) +-?[\d.]+ +-?[\d.]+ +[\d.]+ +[\d.]+$", out, re.MULTILINE)
    assert [int(tokens) for tokens in rows] == [64, 256]  # prompts this short may allocate next to nothing
    assert re.search(r"^transient_growth_1k_to_64k=-?[\d.]+ transient_vs_mlx_lm_64k=-?[\d.]+$", out, re.MULTILINE)
