import re
import sys
from pathlib import Path

import pytest
from helpers import BASE, GEMMA4, HYBRIDS

from mlxkv.models.random_model import make_checkpoint

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import kv_footprint


def table(out: str) -> dict[str, tuple[str, str, str]]:
    rows = re.findall(r"^(\S.*?) {2,}(\S+) +(\S+) +(\S+)$", out, re.MULTILINE)
    return {name: tuple(values) for name, *values in rows}


def test_gemma4_e2bs_shared_layers_hold_no_pages(capsys):
    """E2B's 35 layers: 3 global (one KV head of 512) and 12 sliding (256, window 512) with pages;
    the 20 KV-shared ones would add 4 global and 16 sliding layers' worth."""
    kv_footprint.main(["--max-num-seqs", "2", "--max-model-len", "1024"])
    out = capsys.readouterr().out
    assert "35 layers: 3 full-attention and 12 sliding-window layers with K/V of their own, 20 KV-shared" in out
    rows = table(out)
    assert rows["layers holding pages"] == ("15", "35", "0.429")
    assert rows["K/V per token outside window pools (KiB)"] == ("6.00", "14.00", "0.429")  # 3 vs 7 x 2 x 512 x 2 B
    assert rows["KV cache allocated (MiB)"][2] == "0.429"
    assert out.endswith("kv_cache_bytes_ratio=0.429\n")


def test_a_hybrids_state_is_told_in_tokens_of_kv(tmp_path, capsys):
    path = make_checkpoint(tmp_path / "q", "qwen3_5", "bfloat16", shape={**BASE, **HYBRIDS["qwen3_5"]})
    kv_footprint.main(["--model", str(path), "--max-model-len", "256"])
    out = capsys.readouterr().out
    assert table(out)["recurrent state per sequence (KiB)"] == ("35.00", "35.00", "1.000")
    assert "one sequence's recurrent state takes as many bytes as 35 tokens of K/V" in out


def test_a_tiny_gemma4_in_the_contiguous_layout(tmp_path, capsys):
    path = make_checkpoint(tmp_path / "g", "gemma4_text", "float32", shape={**BASE, **GEMMA4})
    kv_footprint.main(["--model", str(path / "config.json"), "--kv-layout", "contiguous", "--max-model-len", "64"])
    rows = table(capsys.readouterr().out)
    # float32, 2 KV heads: three sliding layers of 64 and one global of 128, against five and two
    assert rows["K/V per token outside window pools (KiB)"] == ("5.00", "8.00", "0.625")


def test_a_model_path_without_a_config_is_one_clear_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        kv_footprint.main(["--model", str(tmp_path)])
    _, message = capsys.readouterr().err.splitlines()[-1].split(": ", 1)  # after the program, as argv[0] names it
    assert message == (
        f"error: --model: '{tmp_path}/config.json' is neither a checkpoint directory with a config.json "
        "nor a config.json"
    )
