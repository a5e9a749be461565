"""A model without attention layers (Mamba's, Mamba 2's, RWKV-7's) runs through the state pool alone: its
cache holds no K/V pages, batched prefill chunks and decodes give mlx-lm's greedy tokens, and a
shared prefix starts from a kept state."""

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

from mlxkv import LLM, SamplingParams
from mlxkv.cache.state_pool import StateShape
from mlxkv.config import EngineConfig
from mlxkv.engine.memory.kv_budget import size_kv_cache
from mlxkv.engine.model_kv import ModelKV
from mlxkv.models.random_model import make_checkpoint
from mlxkv.models.tiny_configs import tiny_config

PROMPTS = [np.random.default_rng(n).integers(1, 300, n).tolist() for n in (3, 9, 17)]
NEW_TOKENS = 5


def mlx_lm_greedy(path, prompt):
    """mlx-lm's own greedy tokens for `prompt`, EOS or not."""
    model, _ = mlx_lm_load(str(path))
    steps = sys.modules["mlx_lm.generate"].generate_step(
        mx.array(prompt), model, max_tokens=NEW_TOKENS, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    return [int(token) for token, _ in steps]


@pytest.fixture(scope="module", params=["mamba", "mamba2", "rwkv7"])
def checkpoint(request, tmp_path_factory):
    config = tiny_config(request.param)
    return make_checkpoint(tmp_path_factory.mktemp(request.param), config.pop("model_type"), shape=config)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_batched_prompts_give_mlx_lms_tokens_with_no_pages(checkpoint, layout):
    llm = LLM(str(checkpoint), kv_layout=layout, page_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    assert (llm.engine.cache.storage.num_layers, llm.engine.cache.storage.nbytes) == (0, 0)
    assert llm.engine.cache.states is not None and llm.engine.cache.nbytes == llm.engine.cache.states.nbytes
    done = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [c.token_ids for c in done] == [mlx_lm_greedy(checkpoint, p) for p in PROMPTS]


def test_a_shared_prefix_starts_from_its_kept_state(checkpoint):
    llm = LLM(str(checkpoint), page_size=4, max_num_seqs=2)
    longer = PROMPTS[2] + [7, 8, 9]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([PROMPTS[2]], params)
    (again,) = llm.generate([longer], params)
    assert again.num_cached_tokens == 16  # the prompt's last full page before its last token
    assert again.token_ids == mlx_lm_greedy(checkpoint, longer)


def test_states_that_outgrow_the_budget_are_refused():
    shape = ModelKV(0, (), (), mx.float16, 512, state_shapes=[[StateShape((1024, 1024), mx.float32)]])
    with pytest.raises(ValueError, match=r"recurrent state of max_num_seqs=8 sequences .* lower max_num_seqs"):
        size_kv_cache(EngineConfig(max_num_seqs=8), shape, 10 * 2**20)
