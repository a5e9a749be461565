import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import bench_disk_cache


def test_a_small_run_prints_each_parts_ratio(capsys, checkpoint):
    bench_disk_cache.main(
        [
            "--model", str(checkpoint("llama-fp32")), "--lengths", "100", "--sessions", "3",
            "--session-min", "40", "--session-max", "80", "--cycles", "2", "--clients", "2",
            "--tokens", "6", "--runs", "1", "--pressure-model", str(checkpoint("llama-fp32")),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert re.search(
        r"^100 tokens: cold [\d.]+ s, restored [\d.]+ s, mlx-lm cold [\d.]+ s, mlx-lm file [\d.]+ s$", out, re.M
    )
    assert re.search(r"^restart_ttft_ratio_100=[\d.]+$", out, re.M) and re.search(
        r"^vs_mlx_lm_file_100=[\d.]+$", out, re.M
    )
    computed = re.search(r"prompt tokens computed (\d+) without the disk tier, (\d+) with$", out, re.M)
    assert int(computed.group(2)) < int(computed.group(1))
    assert re.search(r"^pressure_computed_ratio=[\d.]+$", out, re.M)
    assert re.search(r"^writer_itl_p99_ratio=[\d.]+$", out, re.M)
