import gc
import re

import mlx.core as mx
import numpy as np
import pytest

from mlxkv import LLMEngine, SamplingParams
from mlxkv.config import EngineConfig
from mlxkv.engine.memory.memory_budget import memory_limit, split_memory
from mlxkv.engine.memory.step_memory import StepMemory
from mlxkv.engine.model_kv import ModelKV
from mlxkv.models.loading import load
from mlxkv.models.random_model import TINY, make_checkpoint

GB = 10**9
LLAMA_8B = ModelKV(32, 8, 128, mx.bfloat16, 131072, weights_bytes=16 * GB)
STEP = StepMemory(per_token=100_000, per_sample=500_000, heads=None, attention=lambda heads, q, c: 1_000 * q)


@pytest.fixture
def device(monkeypatch):
    monkeypatch.setattr("mlxkv.engine.memory.memory_budget.device_memory", lambda: 48 * GB)


@pytest.mark.parametrize(
    "given, limit",
    [(None, 48 * GB), (0.5, 24 * GB), ("0.25", 12 * GB), ("20GB", 20 * GB), (10**9, GB), ("1", 1)],
)
def test_the_limit_is_the_device_a_share_of_it_or_a_size(given, limit):
    assert memory_limit(EngineConfig(memory_limit=given), 48 * GB) == limit


@pytest.mark.parametrize(
    "given, message",
    [
        (1.5, "memory_limit must be a share in (0, 1] or a size such as 16GB, got 1.5"),
        ("lots", "memory_limit must be a size such as 2GB or 512MiB (at least one byte), got 'lots'"),
        (0, "memory_limit must be a size such as 2GB or 512MiB (at least one byte), got 0"),
    ],
)
def test_a_bad_limit_is_refused_by_name(given, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(memory_limit=given)


def test_a_limit_above_what_the_device_can_use_is_refused():
    with pytest.raises(ValueError, match=r"memory_limit=64.00 GB is more than the 48.00 GB this device can use"):
        memory_limit(EngineConfig(memory_limit="64GB"), 48 * GB)


def test_the_parts_are_weights_the_worst_step_twice_and_kv_from_the_rest(device):
    config = EngineConfig(max_num_seqs=16, max_model_len=4096, memory_limit="40GB")
    budget, sizing = split_memory(config, LLAMA_8B, STEP)
    worst = 512 * 100_000 + 16 * 500_000 + 1_000 * 512  # 15 decodes and a 497-token chunk: 512 queries
    assert (budget.limit, budget.weights, budget.reserve, budget.cache) == (40 * GB, 16 * GB, worst, worst)
    per_token = 2 * 32 * 8 * 128 * 2
    assert budget.kv == sizing.num_pages * 16 * per_token == 16 * 4096 * per_token  # all 16 sequences fit
    assert budget.planned <= budget.limit


def test_a_tight_budget_cuts_the_reserve_before_the_kv_cache(device):
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32768, max_model_len=32768, num_pages=100)
    kv = 100 * 16 * 2 * 32 * 8 * 128 * 2
    budget, _ = split_memory(replace_limit(config, 16 * GB + kv + 2 * 10**9), LLAMA_8B, STEP)
    assert budget.reserve == budget.cache == 10**9 < 32768 * 100_000
    assert budget.planned == budget.limit


def test_a_budget_without_room_for_the_smallest_step_names_the_fix(device):
    config = EngineConfig(max_num_seqs=4, num_pages=100, memory_limit=16 * GB + 100 * 16 * 131072 + 10)
    with pytest.raises(ValueError, match=r"the smallest step needs .*: raise memory_limit"):
        split_memory(config, LLAMA_8B, STEP)


def test_weights_larger_than_the_budget_are_refused(device):
    with pytest.raises(ValueError, match=r"the weights take 16.00 GB, more than the memory budget of 8.00 GB"):
        split_memory(EngineConfig(memory_limit="8GB"), LLAMA_8B, STEP)


def replace_limit(config, limit):
    from dataclasses import replace

    return replace(config, memory_limit=limit)


def greedy(engine, prompts, max_tokens=4):
    requests = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [list(r.output_ids) for r in requests]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A model of two layers of one head: a 32k-token prefill takes seconds on a CPU."""
    shape = dict(TINY, num_attention_heads=1, num_key_value_heads=1)
    return load(make_checkpoint(tmp_path_factory.mktemp("one-head"), shape=shape))


def test_a_32k_prompt_under_a_budget_a_single_chunk_would_exceed_gives_the_same_tokens(small):
    model, tokenizer = small
    prompt = np.random.default_rng(0).integers(0, 320, 32768).tolist()
    sizes = dict(max_num_seqs=1, max_model_len=32768 + 8, num_pages=2049)

    free = LLMEngine(model, tokenizer, EngineConfig(**sizes, max_num_batched_tokens=4096))  # no memory limit
    expected = greedy(free, [prompt])
    naive = free.scheduler.sizer.memory.row(32768, 32768)  # a single chunk's temporaries
    held = free.memory.weights + free.memory.kv
    del free
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    limit = held + naive // 64
    tight = LLMEngine(model, tokenizer, EngineConfig(**sizes, max_num_batched_tokens=32768, memory_limit=limit))
    assert tight.memory.reserve <= naive // 128
    mx.reset_peak_memory()
    assert greedy(tight, [prompt]) == expected
    assert mx.get_peak_memory() - before + tight.memory.weights <= tight.memory.limit
    assert tight.cache.pool.free_count == tight.cache.pool.capacity


def test_a_draft_model_s_weights_and_pages_are_in_the_budget(checkpoint):
    model, tokenizer = load(checkpoint("llama-fp32"))
    alone = LLMEngine(model, tokenizer, EngineConfig(num_pages=64, page_size=8)).memory
    drafting = LLMEngine(
        model, tokenizer, EngineConfig(num_pages=64, page_size=8, draft_model=str(checkpoint("llama-fp32")))
    ).memory
    assert drafting.draft_weights == alone.weights  # the model drafting for itself
    assert drafting.kv == 2 * alone.kv  # as many pages again, of the same shape
    assert drafting.planned <= drafting.limit
