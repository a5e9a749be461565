"""The random multimodal checkpoints load in mlx-vlm and mlx-lm, and greedy decoding with an image
writes varied tokens, to its `max_tokens`."""

import mlx_lm
import numpy as np
import pytest

from mlxkv.models.random_vision_model import VISION_TYPES, make_vision_checkpoint

mlx_vlm = pytest.importorskip("mlx_vlm")


@pytest.mark.parametrize("model_type", VISION_TYPES)
@pytest.mark.filterwarnings("ignore:At least one mel filter")  # Gemma 4's processor builds its audio features too
def test_a_checkpoint_loads_and_describes_an_image(tmp_path, model_type):
    from PIL import Image

    path = make_vision_checkpoint(tmp_path / model_type, model_type)
    model, processor = mlx_vlm.load(str(path))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8), "RGB")
    prompt = mlx_vlm.apply_chat_template(processor, model.config, "Describe the image.", num_images=1)
    *_, last = mlx_vlm.stream_generate(model, processor, prompt, image=[image], max_tokens=8, temperature=0.0)
    tokens = last.token_ids  # the last response carries them all
    assert (len(tokens), last.finish_reason) == (8, "length")
    assert len(set(tokens)) > 1
    mlx_lm.load(str(path))


def test_an_unknown_model_type_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"llama.*qwen3_vl, qwen3_5, mistral3, gemma4"):
        make_vision_checkpoint(tmp_path, "llama")
