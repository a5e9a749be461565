from pathlib import Path

import pytest

from mlxkv.models.random_model import make_checkpoint

SPECS = {
    "llama-fp32": dict(model_type="llama", dtype="float32"),
    "llama-fp16": dict(model_type="llama", dtype="float16"),
    "qwen2-bf16": dict(model_type="qwen2", dtype="bfloat16"),
    "qwen2-fp32": dict(model_type="qwen2", dtype="float32"),
    "qwen3-fp16": dict(model_type="qwen3", dtype="float16"),
    "qwen3-bf16": dict(model_type="qwen3", dtype="bfloat16"),
    "llama-4bit": dict(model_type="llama", dtype="float16", bits=4, tied=True),
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """`checkpoint(name)`: the directory of one of the SPECS models, built once per session."""
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = make_checkpoint(tmp_path_factory.mktemp(name), **SPECS[name])
        return built[name]

    return get
