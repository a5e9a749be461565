import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import train_demo_model


def test_a_short_training_run_saves_a_loadable_model_and_reports_its_loss(tmp_path, capsys):
    train_demo_model.main(["--steps", "2", "--batch", "2", "--seq-len", "16", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.startswith(
        "With its defaults this takes about 26 minutes on a 2-core x86-64 Linux CPU "
        "(MLX's CPU build, OpenBLAS preloaded)."
    )
    assert re.search(r"^step 1: loss [\d.]+ \(\d+s\)$", out, re.M)
    assert json.loads((tmp_path / "training.json").read_text())["steps"] == 2
    assert {p.name for p in tmp_path.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
