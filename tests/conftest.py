from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv.models.random_model import make_checkpoint

HEAD_DIM_64 = dict(
    hidden_size=256,
    num_hidden_layers=2,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
)  # head_dim 64: every KV group size divides it
SPECS = {
    "llama-fp32": dict(model_type="llama", dtype="float32"),
    "llama-fp16": dict(model_type="llama", dtype="float16"),
    "qwen2-bf16": dict(model_type="qwen2", dtype="bfloat16"),
    "qwen2-fp32": dict(model_type="qwen2", dtype="float32"),
    "qwen3-fp16": dict(model_type="qwen3", dtype="float16"),
    "qwen3-bf16": dict(model_type="qwen3", dtype="bfloat16"),
    "llama-4bit": dict(model_type="llama", dtype="float16", bits=4, tied=True),
    "llama-fp32-d64": dict(model_type="llama", dtype="float32", shape=HEAD_DIM_64),
    "qwen3-fp32-d64": dict(model_type="qwen3", dtype="float32", shape=HEAD_DIM_64),
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


@pytest.fixture(autouse=True)
def mlx_memory_limits():
    """MLX's memory and cache limits as they were before the test: an engine sets them to its budget."""
    limit = mx.get_memory_limit()
    yield
    mx.set_memory_limit(limit)
    mx.set_cache_limit(limit)
