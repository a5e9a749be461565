import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load as mlx_lm_load
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import perplexity

from mlxkv.models.loading import DEMO_MODEL


def test_float_pages_score_as_mlx_lm_and_quantized_ones_drift_by_bits():
    model, tokenizer = mlx_lm_load(str(DEMO_MODEL))
    windows = perplexity.windows_of(tokenizer, perplexity.held_out_text(), 100, 300)
    assert [len(w) for w in windows] == [100, 100, 100]
    scores = perplexity.score(model, windows, list(perplexity.FORMATS), 64, 16, 32, tqdm(disable=True))
    nll = 0.0
    for w in windows:
        logits = model(mx.array(w)[None])[0, :-1].astype(mx.float32)
        nll += (mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, mx.array(w[1:])[:, None], -1)[:, 0]).sum()
    assert scores[None].count == scores[8].count == 297
    assert math.isclose(scores[None].nll, nll.item(), rel_tol=1e-3)
    assert (scores[None].kl, scores[None].agree) == (0.0, 297)
    assert 0 < scores[8].kl < scores[4].kl and scores[8].agree > scores[4].agree


def test_the_report(capsys):
    perplexity.main(["--max-tokens", "200", "--window", "100", "--chunk", "50"])
    up_front, out = capsys.readouterr().out.split("\n", 1)
    assert up_front == (
        "With its defaults this takes about 2 minutes on a 2-core x86-64 Linux CPU "
        "(MLX's CPU build, float16 matmuls, so the BLAS plays no part)."
    )
    assert "held-out text: 200 tokens in 2 windows of up to 100 (docstrings of 16 standard-library modules)" in out
    assert out.count("float16 ") == 2 and out.count("4-bit, groups of 64") == 2
    ratios = dict(item.split("=") for item in out.strip().splitlines()[-1].split())
    assert set(ratios) == {f"ppl_ratio_{b}bit_{t}" for b in (8, 4) for t in ("held_out", "training")}
    assert all(np.isfinite(float(v)) for v in ratios.values())
