import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import bench_isolation


def test_a_small_run_measures_the_stream_and_health_beside_a_huge_prompt(capsys):
    bench_isolation.main(["--megabytes", "0.5", "--runs", "1"])
    out = capsys.readouterr().out
    assert re.search(
        r"^run 1: huge request [\d.]+ s, stream's longest gap [\d.]+ s, slowest /health [\d.]+ s$", out, re.M
    )
    assert re.search(r"^max_stream_gap_s=[\d.]+ max_health_s=[\d.]+$", out, re.M)
