import mlx.core as mx
import pytest

from mlxkv import KVLayout
from mlxkv.config import EngineConfig, parse_memory


@pytest.mark.parametrize("text, expected", [("2GB", 2 * 10**9), ("512MiB", 512 * 2**20), ("1.5 gb", 1_500_000_000),
                                            ("4096", 4096), (1024, 1024)])
def test_memory_sizes(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1GB", "0", "2TB"])
def test_bad_memory_sizes_are_named(text):
    with pytest.raises(ValueError, match="kv_cache_memory must be a size such as 2GB"):
        parse_memory(text)


def test_paged_cache_is_sized_by_memory():
    cache = EngineConfig(kv_cache_memory="1MiB", block_size=16).build_cache(2, 2, 64, mx.float16, 512)
    assert cache.pool.capacity == 2**20 // (16 * 2 * 2 * 2 * 64 * 2)
    assert cache.max_seq_len == 512


def test_contiguous_cache_buys_whole_slots_up_to_the_sequence_cap():
    config = EngineConfig(kv_layout="contiguous", kv_cache_memory=10 * 2**20, max_num_seqs=4)
    cache = config.build_cache(2, 2, 64, mx.float16, 2048)
    assert (cache.layout, cache.pool.capacity, cache.block_size) == (KVLayout.CONTIGUOUS, 4, 2048)


def test_contiguous_slot_larger_than_the_budget_names_the_fix():
    with pytest.raises(ValueError, match="raise kv_cache_memory or lower max_model_len"):
        EngineConfig(kv_layout="contiguous", kv_cache_memory="1MB").build_cache(2, 2, 64, mx.float16, 4096)


def test_num_blocks_is_only_for_the_paged_layout():
    with pytest.raises(ValueError, match="num_blocks applies to the paged layout"):
        EngineConfig(kv_layout="contiguous", num_blocks=10)
