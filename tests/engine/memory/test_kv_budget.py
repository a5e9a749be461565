import re

import mlx.core as mx
import pytest

from mlxkv import KVLayout
from mlxkv.config import EngineConfig
from mlxkv.engine.memory.kv_budget import build_kv_cache, size_kv_cache
from mlxkv.engine.model_kv import ModelKV

ROOM = 16 * 10**9  # bytes the memory budget leaves the KV cache, unless a test says otherwise


def built(config, shape, room=ROOM):
    return build_kv_cache(config, shape, size_kv_cache(config, shape, room))


def test_paged_cache_is_sized_by_memory():
    cache = built(EngineConfig(kv_cache_memory="1MiB", page_size=16), ModelKV(2, 2, 64, mx.float16, 512))
    assert cache.pool.capacity == 2**20 // (16 * 2 * 2 * 2 * 64 * 2)
    assert cache.max_model_len == 512


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_quantized_pages_hold_more_tokens_in_the_same_memory(layout):
    """float16, head_dim 64, groups of 64: 128 bytes a row; 64 + 4 at 8 bits, 32 + 4 at 4 bits."""
    sizes = {}
    for bits, row in ((None, 128), (8, 68), (4, 36)):
        config = EngineConfig(kv_layout=layout, kv_cache_memory="8MiB", max_num_seqs=64, kv_bits=bits)
        cache = built(config, ModelKV(2, 2, 64, mx.float16, 512))
        assert (cache.kv_bits, cache.storage.bytes_per_token) == (bits, 2 * 2 * 2 * row)
        sizes[bits] = cache.pool.capacity * cache.page_size
    assert sizes[None] == 8 * 2**20 // 1024 // 512 * 512 if layout == "contiguous" else 8 * 2**20 // 1024
    assert (sizes[8] / sizes[None], sizes[4] / sizes[None]) == pytest.approx((128 / 68, 128 / 36), rel=0.07)


def test_contiguous_cache_buys_whole_pages_up_to_the_sequence_cap():
    config = EngineConfig(kv_layout="contiguous", kv_cache_memory=10 * 2**20, max_num_seqs=4)
    cache = built(config, ModelKV(2, 2, 64, mx.float16, 2048))
    assert (cache.layout, cache.pool.capacity, cache.page_size) == (KVLayout.CONTIGUOUS, 4, 2048)


def test_a_contiguous_page_larger_than_the_budget_names_the_fix():
    with pytest.raises(ValueError, match="raise kv_cache_memory or lower max_model_len"):
        built(EngineConfig(kv_layout="contiguous", kv_cache_memory="1MB"), ModelKV(2, 2, 64, mx.float16, 4096))


@pytest.mark.parametrize(
    "sizing, asked",
    [
        (dict(kv_cache_memory="200GB"), "kv_cache_memory=200.0 GB asks for 200.0 GB"),
        (dict(num_pages=100_000_000), "num_pages=100000000 asks for 183500.8 GB"),
    ],
)
def test_a_cache_larger_than_the_room_the_budget_leaves_is_refused(sizing, asked):
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{asked} of KV cache, but at most 14.8 GB fits in the memory budget (memory_limit) "
            "beside the weights and a step's temporaries"
        ),
    ):
        built(EngineConfig(**sizing), ModelKV(28, 8, 128, mx.bfloat16, 40960), room=148 * 10**8)


def test_the_default_budget_is_a_fraction_of_the_room_and_no_more_than_the_sequences_need():
    per_token = 2 * 28 * 8 * 128 * 2
    sizing = size_kv_cache(EngineConfig(max_num_seqs=16), ModelKV(28, 8, 128, mx.bfloat16, 40960), 148 * 10**8)
    assert sizing.num_pages == int(0.5 * 148 * 10**8) // (16 * per_token)
    assert sizing.bytes == sizing.num_pages * 16 * per_token
    small = built(EngineConfig(max_num_seqs=1, max_model_len=30), ModelKV(28, 8, 128, mx.bfloat16, 40960))
    assert small.pool.capacity == 2  # 30 tokens in pages of 16
    frugal = size_kv_cache(EngineConfig(kv_cache_fraction=0.1), ModelKV(28, 8, 128, mx.bfloat16, 40960), ROOM)
    assert frugal.num_pages == int(0.1 * 16 * 10**9) // (16 * per_token)


@pytest.mark.parametrize(("prefix_states", "kept"), [(None, 4), (1, 1), (0, 0)])
def test_a_hybrids_running_and_kept_states_come_out_of_the_budget_before_the_pages(prefix_states, kept):
    """A state of 64 KiB per sequence; pages of 16 tokens at 4 KiB a token (2 layers, 2 heads of 64
    dims, float16). Running states for `max_num_seqs`, kept ones for `prefix_states` (default: as
    many), and the rest buys pages; keeping none turns the prefix cache off."""
    from mlxkv.cache.state_pool import StateShape

    shape = ModelKV(2, 2, 64, mx.float16, 512, state_shapes=[[StateShape((16, 16, 64), mx.float32)]])
    config = EngineConfig(kv_cache_memory="2MiB", max_num_seqs=4, prefix_states=prefix_states)
    cache = built(config, shape)
    assert cache.pool.capacity == (2**21 - (4 + kept) * 2**16) // (16 * 1024)
    assert cache.prefix_caching == bool(kept) and (cache.snapshots.capacity if kept else 0) == kept


def test_prefix_states_must_be_a_non_negative_integer():
    with pytest.raises(ValueError, match=r"prefix_states must be an integer >= 0 or None, got -1"):
        EngineConfig(prefix_states=-1)


def test_layers_of_different_head_shapes_are_sized_each_by_its_own():
    """Gemma-4-like: two window-8 layers of 2 x 64 beside one full layer of 1 x 128 (float16);
    the window layers' pool is taken first, the full layer's bytes per token buy the pages."""
    shape = ModelKV(3, [2, 2, 1], [64, 64, 128], mx.float16, 512, layer_windows=[8, 8, None])
    config = EngineConfig(kv_cache_memory="1MiB", page_size=16, max_num_seqs=2, max_num_batched_tokens=32)
    cache = built(config, shape)
    window_bytes = cache.windowed[8].pool.capacity * 16 * 2 * (2 * 2 * 64 * 2)
    assert cache.storage.bytes_per_token == 2 * 128 * 2
    assert cache.pool.capacity == (2**20 - window_bytes) // (16 * 2 * 128 * 2)
