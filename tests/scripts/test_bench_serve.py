import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import bench_serve


def test_a_small_run_drives_both_servers_and_prints_the_summary(checkpoint, capsys):
    bench_serve.main(
        [
            "--model",
            str(checkpoint("llama-fp32")),
            "--concurrency",
            "1",
            "3",
            "--requests-per-client",
            "1",
            "--output-len",
            "4",
            "--prompt-words",
            "2",
            "6",
            "--max-model-len",
            "128",
            "--runs",
            "2",
            "--mlxkv-flags",
            "--max-itl-ms 50",
        ]
    )
    out = capsys.readouterr().out
    assert out.startswith("With its defaults this takes about ")
    rows = re.findall(r"^ +(\d) (mlx_lm\.server|mlxkv serve) +(\d+) +([\d.]+) ", out, re.MULTILINE)
    assert sorted((run, name, clients) for run, name, clients, _ in rows) == [
        (run, name, clients) for run in "12" for name in ("mlx_lm.server", "mlxkv serve") for clients in ("1", "3")
    ]
    assert all(float(rate) > 0 for *_, rate in rows)
    for clients in (3, 1):
        assert re.search(rf"^c{clients}: throughput ratio per run [\d.]+ [\d.]+, median [\d.]+; ", out, re.MULTILINE)
    assert re.search(r"^serve_throughput_ratio_c3=[\d.]+ serve_throughput_ratio_c1=[\d.]+$", out, re.MULTILINE)
