"""Encoder embedding models through mlx-embeddings: the vectors equal the library's own, pooled as
the checkpoint's files say, in batches of any mix of lengths."""

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.models.encoder import Encoder, is_encoder
from mlxkv.models.random_model import make_encoder

mlx_embeddings = pytest.importorskip("mlx_embeddings", reason="the embeddings extra is not installed")
TEXTS = ["a", "paged attention on a Mac", "one more text, longer than the others by some way", "MLX"]


def library(folder, texts):
    """The library's model run on `texts`: its last hidden states, its own vectors, and the attention mask."""
    model, tokenizer = mlx_embeddings.load(str(folder))
    batch = tokenizer._tokenizer(texts, padding=True, return_tensors="np")
    out = model(mx.array(batch["input_ids"]), attention_mask=mx.array(batch["attention_mask"]))
    return np.array(out.last_hidden_state), np.array(out.text_embeds), batch["attention_mask"]


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_mean_pooled_vectors_equal_the_librarys(tmp_path, model_type):
    folder = make_encoder(tmp_path / model_type, model_type)
    encoder = Encoder.load(folder)
    _, expected, _ = library(folder, TEXTS)
    vectors = encoder.embed([encoder.tokenize(text) for text in TEXTS])
    np.testing.assert_allclose(vectors, expected, atol=1e-5)


def test_cls_pooling_takes_the_first_token_unnormalised(tmp_path):
    folder = make_encoder(tmp_path / "cls", flag="pooling_mode_cls_token", normalize=False)
    encoder = Encoder.load(folder)
    hidden, _, _ = library(folder, TEXTS)
    np.testing.assert_allclose(encoder.embed([encoder.tokenize(t) for t in TEXTS]), hidden[:, 0], atol=1e-5)


def test_batches_split_by_length_give_each_inputs_own_vector(tmp_path, monkeypatch):
    folder = make_encoder(tmp_path / "bert")
    encoder = Encoder.load(folder)
    inputs = [encoder.tokenize(text) for text in TEXTS]
    alone = [encoder.embed([ids])[0] for ids in inputs]
    monkeypatch.setattr("mlxkv.models.encoder.BATCH_TOKENS", 20)  # a batch or two of short ones, the long alone
    np.testing.assert_allclose(encoder.embed(inputs), alone, atol=1e-5)
    assert encoder.tokenize("a") == [2, 69, 3]  # [CLS] a [SEP], as sentence-transformers tokenizes
    assert (encoder.max_length, encoder.vocab_size, encoder.pad_id) == (514, 320, 0)


def test_refusals(tmp_path):
    folder = make_encoder(tmp_path / "bert")
    (folder / "modules.json").unlink()
    with pytest.raises(ValueError, match=r"modules\.json' is missing: an encoder's pooling comes from its"):
        Encoder.load(folder)
    assert is_encoder("bert") and is_encoder("xlm-roberta") and is_encoder("modernbert")
    assert not is_encoder("qwen3") and not is_encoder(None)
