import re
import sys
from pathlib import Path

from helpers import perturbed_copy

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import bench_spec


def test_a_small_run_prints_every_engine_and_the_ratios(checkpoint, tmp_path, capsys):
    target = checkpoint("llama-fp32")
    draft = perturbed_copy(target, tmp_path / "draft", scale=0.1)
    bench_spec.main(
        ["--model", str(target), "--draft-model", str(draft), "--output-len", "12", "--repeats", "1"]
        + ["--batch", "4", "--batch-output-len", "6"]
    )
    out = capsys.readouterr().out
    rows = re.findall(r"^(code edit|free text) +(.+?) +[\d.]+ +[\d.]+ +(yes|no)$", out, re.MULTILINE)
    engines = ["mlxkv", "mlxkv, prompt lookup", "mlxkv, draft model", "mlx-lm, draft model"]
    assert [(w, e) for w, e, _ in rows] == [(w, e) for w in ("code edit", "free text") for e in engines]
    assert all(same == "yes" for _, e, same in rows if e.startswith("mlxkv"))  # speculation changes no token
    assert re.search(r"^mlxkv, draft model: \d+ of \d+ draft tokens accepted \(\d+%\)$", out, re.MULTILINE)
    names = ["lookup", "draft"]
    line = " ".join(
        [f"spec_single_stream_ratio_{n}=[\\d.]+" for n in names]
        + [f"spec_free_text_ratio_{n}=[\\d.]+" for n in names]
        + ["spec_vs_mlx_lm_draft=[\\d.]+", "spec_batch16_ratio=[\\d.]+"]
    )
    assert re.search(f"^{line}$", out, re.MULTILINE)
