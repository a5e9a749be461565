"""Multi-head latent attention in pages: DeepSeek V3, Kimi K2.5 and GLM-4.7-Flash give mlx-lm's
greedy tokens alone, batched through preemption, with 8-bit latent pages, after a prefix-cache
hit and through the simulated Metal kernels, keeping one latent row per token and layer."""

import sys

import mlx.core as mx
import numpy as np
import pytest
from helpers import mlx_lm_greedy
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import KVCache

from mlxkv import LLM, LLMEngine, SamplingParams
from mlxkv.attention.kernels import PagedAttentionKernels
from mlxkv.attention.lab.simulator import metal_kernel
from mlxkv.config import EngineConfig
from mlxkv.models.loading import load
from mlxkv.models.random_model import make_checkpoint
from mlxkv.models.tiny_configs import tiny_config

NAMES = ["deepseek_v3", "kimi_k25", "glm4_moe_lite"]
PROMPTS = [[int(t) for t in np.random.default_rng(40 + n).integers(1, 320, n)] for n in (5, 33, 1, 12, 26, 2, 19, 40)]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            config = tiny_config(name)
            model_type = config.pop("model_type")
            built[name] = make_checkpoint(tmp_path_factory.mktemp(name), model_type, shape=config)
        return built[name]

    return get


@pytest.fixture(scope="module")
def expected(checkpoint):
    found = {}

    def get(name):
        if name not in found:
            found[name] = [mlx_lm_greedy(checkpoint(name), p, max_tokens=12) for p in PROMPTS]
        return found[name]

    return get


class EightBitRows(KVCache):
    """mlx-lm's cache holding what 8-bit latent pages hold (groups of 32): the prompt's first chunk
    attends its own rows as computed, every later token the stored, round-tripped ones (mlx-lm's
    own quantized cache cannot run DeepSeek's attention, whose RoPE keys it multiplies directly)."""

    def update_and_fetch(self, keys, values):
        first = self.offset == 0
        stored = [mx.dequantize(*mx.quantize(x, group_size=32, bits=8), group_size=32, bits=8) for x in (keys, values)]
        fetched = super().update_and_fetch(*stored)
        return (keys, values) if first else fetched


def mlx_lm_greedy_over_8_bit_rows(path, prompt, max_tokens=12):
    model, _ = mlx_lm_load(str(path))
    cache = [EightBitRows() for _ in model.layers]
    steps = sys.modules["mlx_lm.generate"].generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1), prompt_cache=cache
    )
    return [int(token) for token, _ in steps]


def tokens(done):
    return [list(c.token_ids) for c in done]


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("name", NAMES)
def test_batched_through_preemption_and_alone_tokens_equal_mlx_lms(checkpoint, expected, name, layout):
    pages = dict(num_pages=24) if layout == "paged" else dict(max_model_len=64)
    llm = LLM(str(checkpoint(name)), kv_layout=layout, page_size=4, max_num_seqs=8, max_num_batched_tokens=32, **pages)
    want = [e[:12] for e in expected(name)]
    assert tokens(llm.generate(PROMPTS, GREEDY)) == want
    assert llm.stats().preemptions > 0 or layout == "contiguous"
    assert [tokens(llm.generate(p, GREEDY))[0] for p in PROMPTS[:3]] == want[:3]
    assert llm.stats().kv.pages_used == 0


@pytest.mark.parametrize("name", NAMES)
def test_one_latent_row_per_token_and_layer(checkpoint, name):
    """A layer's pages hold the latent and the RoPE key (64 + 32 float32 values) once, as keys only."""
    llm = LLM(str(checkpoint(name)), page_size=4, max_num_seqs=2, max_model_len=64)
    storage, layers = llm.engine.cache.storage, llm.engine.runner.model.args
    num_layers = getattr(layers, "num_hidden_layers", None) or layers.text_config["num_hidden_layers"]
    assert storage.kv_heads == (1,) * num_layers and storage.head_dims == (96,) * num_layers
    assert storage.bytes_per_token == num_layers * 96 * 4 and storage.values == [None] * num_layers


def test_8_bit_latent_pages_and_a_prefix_cache_hit_keep_the_tokens(checkpoint, expected):
    name = "deepseek_v3"
    llm = LLM(str(checkpoint(name)), page_size=4, max_num_seqs=4, kv_bits=8, kv_group_size=32)
    want = [mlx_lm_greedy_over_8_bit_rows(checkpoint(name), p) for p in PROMPTS]
    assert tokens(llm.generate(PROMPTS, GREEDY)) == want and want != [e[:12] for e in expected(name)]
    assert llm.engine.cache.storage.bytes_per_token == 2 * (96 + 2 * 3 * 4)  # 8-bit values, a scale and bias per 32
    warm = LLM(str(checkpoint(name)), page_size=4, max_num_seqs=4)
    first = warm.generate(PROMPTS[7], GREEDY)[0]
    again = warm.generate(PROMPTS[7] + [3, 4], GREEDY)[0]
    assert first.token_ids == expected(name)[7][:12] and again.num_cached_tokens == 40
    assert list(again.token_ids) == mlx_lm_greedy(checkpoint(name), PROMPTS[7] + [3, 4], max_tokens=12)


def test_latent_attention_through_the_simulated_kernels(checkpoint, expected):
    """Four query heads over one latent row of 96 values a token: the kernels read it as key and value."""
    model, tokenizer = load(str(checkpoint("deepseek_v3")))
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(page_size=4, max_num_seqs=2, max_num_batched_tokens=16),
        kernels=PagedAttentionKernels(metal_kernel),
    )
    assert isinstance(engine.runner.attention, PagedAttentionKernels)
    requests = [engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in (PROMPTS[3], PROMPTS[1])]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in requests] == [expected("deepseek_v3")[i][:4] for i in (3, 1)]
    mx.clear_cache()
