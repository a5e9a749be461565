import re
import sys
from pathlib import Path

import numpy as np
import pytest

from mlxkv import LLM
from mlxkv.models.encoder import Encoder

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
pytest.importorskip("mlx_embeddings", reason="the embeddings extra is not installed")

import bench_embeddings


def test_a_small_run_compares_both_kinds_and_measures_the_chat_gaps(capsys):
    bench_embeddings.main(["--size", "tiny", "--texts", "40", "--rounds", "1", "--streams", "2", "--tokens", "6"])
    out = capsys.readouterr().out
    assert re.search(r"^encoder: mlxkv [\d.]+ texts/s, mlx-embeddings directly [\d.]+ texts/s: [\d.]+x$", out, re.M)
    assert re.search(r"^decoder: mlxkv [\d.]+ texts/s, mlx-lm directly [\d.]+ texts/s: [\d.]+x$", out, re.M)
    assert re.search(r"^chat p99 gap beside decoder: [\d.]+ ms \([\d.]+x alone\)$", out, re.M)
    assert re.search(
        r"^encoder_ratio=[\d.]+ decoder_ratio=[\d.]+ p99_gap_beside_decoder=[\d.]+x p99_gap_beside_encoder=[\d.]+x$",
        out,
        re.M,
    )


def test_the_direct_paths_compute_what_mlxkv_computes(tmp_path):
    encoder, embedder, _ = bench_embeddings.build(tmp_path, "tiny")
    inputs = bench_embeddings.texts(5)
    ours = Encoder.load(encoder)
    expected = ours.embed([ours.tokenize(text) for text in inputs])
    np.testing.assert_allclose(bench_embeddings.direct_encoder(encoder, 2)(inputs), expected, atol=1e-5)
    vectors = LLM(str(embedder), max_model_len=256, num_pages=64).embed(inputs)
    np.testing.assert_allclose(bench_embeddings.direct_decoder(embedder, 2)(inputs), vectors, atol=1e-5)
