"""Families run through their own mlx-lm attention module over the pages: keys and values of
different widths (DeepSeek V2) share zero-padded pages, Llama 4's chunked layers attend their
chunk, PLaMo's tiled KV heads are attended through a query order and StableLM's float32 cast as
cached, through the reference path and the simulated Metal kernels, with mlx-lm's tokens."""

import numpy as np
import pytest
from helpers import mlx_lm_greedy

from mlxkv import LLMEngine, SamplingParams
from mlxkv.attention.kernels import PagedAttentionKernels
from mlxkv.attention.lab.simulator import metal_kernel
from mlxkv.config import EngineConfig
from mlxkv.models.loading import load
from mlxkv.models.random_model import make_checkpoint
from mlxkv.models.structure import decoder_layers
from mlxkv.models.tiny_configs import tiny_config

PROMPTS = [[int(t) for t in np.random.default_rng(n).integers(1, 300, n)] for n in (5, 19)]


def checkpoint(tmp_path, model_type):
    config = tiny_config(model_type)
    return make_checkpoint(tmp_path / model_type, config.pop("model_type"), shape=config)


def run(path, kernels):
    model, tokenizer = load(str(path))
    config = EngineConfig(page_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    engine = LLMEngine(model, tokenizer, config, kernels=PagedAttentionKernels(metal_kernel) if kernels else None)
    requests = [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    return engine, [r.output_ids for r in requests]


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "simulated-kernels"])
@pytest.mark.parametrize("model_type", ["deepseek_v2", "llama4", "plamo", "stablelm"])
def test_tokens_equal_mlx_lms_batched_across_chunks(tmp_path, model_type, kernels):
    path = checkpoint(tmp_path, model_type)
    _, tokens = run(path, kernels)
    assert tokens == [mlx_lm_greedy(path, p, max_tokens=6) for p in PROMPTS]


def test_keys_and_values_of_different_widths_share_pages_as_wide_as_the_keys(tmp_path):
    config = tiny_config("deepseek_v2")
    keys = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    assert config["v_head_dim"] < keys
    engine, _ = run(checkpoint(tmp_path, "deepseek_v2"), kernels=False)
    storage = engine.cache.storage
    heads = config["num_attention_heads"]  # DeepSeek V2 caches every head's keys and values
    assert storage.head_dims == (keys,) * config["num_hidden_layers"]
    assert storage.bytes_per_token == config["num_hidden_layers"] * heads * 2 * keys * 4


def test_tiled_kv_heads_are_attended_in_the_pages_groups(tmp_path):
    engine, _ = run(checkpoint(tmp_path, "plamo"), kernels=False)
    attention = decoder_layers(engine.runner.model)[0].self_attn
    assert attention.adapter.query_order.tolist() == [0, 2, 1, 3]  # 4 query heads over 2 tiled KV heads
