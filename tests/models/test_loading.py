import json
import shutil

import pytest
from helpers import mlx_lm_greedy

from mlxkv import LLM, ModelLoadError, SamplingParams
from mlxkv.models.loading import load


def edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_rope_settings_only_in_rope_parameters_are_honoured(checkpoint, tmp_path, model_type):
    """transformers 5 writes rope_theta and rope_scaling under rope_parameters; mlx-lm's llama
    and qwen2 read only the old fields and would run default RoPE."""
    name = "llama-fp32" if model_type == "llama" else "qwen2-fp32"
    legacy, modern = tmp_path / "legacy", tmp_path / "modern"
    shutil.copytree(checkpoint(name), legacy)
    scaling = {"rope_type": "linear", "factor": 4.0}
    edit_config(legacy, lambda c: c.update(rope_theta=50.0, rope_scaling=scaling))
    shutil.copytree(legacy, modern)
    edit_config(
        modern,
        lambda c: [
            c.pop("rope_theta"),
            c.pop("rope_scaling"),
            c.update(rope_parameters={"rope_theta": 50.0, **scaling}),
        ],
    )
    prompt = list(range(10, 60))
    expected = mlx_lm_greedy(legacy, prompt, max_tokens=12)
    assert expected != mlx_lm_greedy(checkpoint(name), prompt, max_tokens=12)  # the settings matter
    assert LLM(str(modern)).generate(prompt, SamplingParams(max_tokens=12))[0].token_ids == expected


@pytest.mark.parametrize(
    "content, message",
    [
        (b"[1, 2]", "must hold a JSON object, got a list"),
        (b'{"model_type": "llama\xff"}', r"is not UTF-8 text \(invalid start byte at byte 21\)"),
        (b"{", "is not valid JSON"),
    ],
)
def test_a_malformed_config_is_named(checkpoint, tmp_path, content, message):
    path = tmp_path / "bad"
    shutil.copytree(checkpoint("llama-fp32"), path)
    (path / "config.json").write_bytes(content)
    with pytest.raises(ModelLoadError, match=f"config.json' {message}"):
        load(path)
