import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import bench_throughput

SMALL = ["--num-requests", "4", "--prompt-len", "4", "12", "--output-len", "2", "6", "--max-num-seqs", "2"]


@pytest.mark.parametrize(
    ("model", "skipped"), [("llama-fp32", (8, 4)), ("llama-fp32-d64", ())], ids=["head_dim-16", "head_dim-64"]
)
def test_quantized_runs_the_model_cannot_run_are_skipped_with_one_line_each(checkpoint, capsys, model, skipped):
    """head_dim 16 fits no KV group size, so its quantized runs are skipped; head_dim 64 runs them all."""
    bench_throughput.main(["--model", str(checkpoint(model)), *SMALL])
    out = capsys.readouterr().out
    assert out.startswith("With its defaults this takes about ")
    lines = [line for line in out.splitlines() if line.startswith("skipped: ")]
    assert len(lines) == len(skipped)
    for bits, line in zip(skipped, lines):
        assert re.fullmatch(rf"skipped: mlxkv {bits}-bit equal KV, cap 4: the model's head_dim=16 .*", line)
        assert "cannot be quantized" in line
    ran = {bits for bits in (8, 4) if bits not in skipped}
    assert {int(b) for b in re.findall(r"^mlxkv (\d)-bit equal KV, cap 4 +[\d.]+ ", out, re.MULTILINE)} == ran
    assert re.search(r"^mlxkv equal KV, cap 4 +[\d.]+ ", out, re.MULTILINE)
    assert re.search(
        r"^throughput_ratio=[\d.]+ kv_memory_ratio=[\d.]+ throughput_ratio_0\.5x_kv=[\d.]+"
        + "".join(rf" throughput_ratio_{bits}bit=[\d.]+" for bits in (8, 4) if bits in ran)
        + "$",
        out,
        re.MULTILINE,
    )
