"""A multimodal checkpoint's vision half: loaded through mlx-vlm when it is installed (its
language weights the text model's), a line at load when it is not; images told apart by digest,
encoded once."""

import json
import logging
import sys

import numpy as np
import pytest

from mlxkv import load
from mlxkv.models.random_vision_model import make_vision_checkpoint
from mlxkv.models.vision import attached

pytest.importorskip("mlx_vlm")
pytestmark = pytest.mark.filterwarnings("ignore:At least one mel filter")  # Gemma 4's audio processor


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    return make_vision_checkpoint(tmp_path_factory.mktemp("qwen3-vl"), "qwen3_vl")


def picture(seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8))


def test_the_vision_half_shares_the_text_model_s_embeddings_and_keeps_encoded_images(qwen3_vl):
    model, _ = load(qwen3_vl)
    vision = attached(model)
    assert vision is not None and vision.image_token == "<|image_pad|>" and vision.deepstack_layers == 1
    assert vision.model.language_model.model.embed_tokens is model.language_model.model.embed_tokens
    from mlx.utils import tree_flatten

    text = {id(w) for _, w in tree_flatten(model.parameters())}
    assert vision.weight_bytes > 0 and not any(id(w) in text for w in vision.weights())  # the tower's alone
    cat, again, dog = vision.process(picture(1)), vision.process(picture(1)), vision.process(picture(2))
    assert cat.digest == again.digest != dog.digest and cat.ids == dog.ids  # same size: same placeholders
    (first,) = vision.features([cat])
    assert vision.features([again]) == [first]  # encoded once
    assert first.rows.shape == (cat.placeholders.size, 64)


def test_without_mlx_vlm_a_multimodal_checkpoint_runs_on_text_and_says_so(qwen3_vl, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "mlx_vlm", None)  # as if not installed: importing it fails
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        model, _ = load(qwen3_vl)
    assert attached(model) is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f'{qwen3_vl.name} is a multimodal checkpoint: it runs on text only; images need pip install "mlxkv[vision]"'
    ]


def test_a_language_model_that_attends_an_image_both_ways_says_so(qwen3_vl, tmp_path):
    """Gemma 4's config (`use_bidirectional_attention: "vision"`, as its released checkpoints) makes
    each run of an image's placeholders attend itself both ways; Qwen3-VL's is causal."""
    gemma4 = make_vision_checkpoint(tmp_path / "gemma4", "gemma4")
    assert json.loads((gemma4 / "config.json").read_text())["text_config"]["use_bidirectional_attention"] == "vision"
    assert attached(load(gemma4)[0]).both_ways and not attached(load(qwen3_vl)[0]).both_ways
