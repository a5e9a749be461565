import re

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


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_quantized_pages_hold_more_tokens_in_the_same_memory(layout):
    """float16, head_dim 64, groups of 64: 128 bytes a row; 64 + 4 at 8 bits, 32 + 4 at 4 bits."""
    sizes = {}
    for bits, row in ((None, 128), (8, 68), (4, 36)):
        config = EngineConfig(kv_layout=layout, kv_cache_memory="8MiB", max_num_seqs=64, kv_bits=bits)
        cache = config.build_cache(2, 2, 64, mx.float16, 512)
        assert (cache.kv_bits, cache.storage.bytes_per_token) == (bits, 2 * 2 * 2 * row)
        sizes[bits] = cache.pool.capacity * cache.block_size
    assert sizes[None] == 8 * 2**20 // 1024 // 512 * 512 if layout == "contiguous" else 8 * 2**20 // 1024
    assert (sizes[8] / sizes[None], sizes[4] / sizes[None]) == pytest.approx((128 / 68, 128 / 36), rel=0.07)


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


def test_sub_byte_sizes_are_refused_not_taken_for_the_default():
    with pytest.raises(ValueError, match=r"kv_cache_memory must be a size .* \(at least one byte\), got '0.5'"):
        EngineConfig(kv_cache_memory="0.5")


@pytest.mark.parametrize("sizing, asked", [(dict(kv_cache_memory="200GB"), "kv_cache_memory=200.0 GB asks for 200.0 GB"),
                                           (dict(num_blocks=100_000_000), "num_blocks=100000000 asks for 183500.8 GB")])
def test_a_cache_larger_than_the_memory_left_beside_the_weights_is_refused(sizing, asked, monkeypatch):
    monkeypatch.setattr("mlxkv.config.device_memory", lambda: 16 * 10**9)
    with pytest.raises(ValueError, match=re.escape(f"{asked} of KV cache, but at most 14.8 GB fits "
                                                   "(16.0 GB the device can use, less 1.2 GB of weights)")):
        EngineConfig(**sizing).build_cache(28, 8, 128, mx.bfloat16, 40960, weights_bytes=12 * 10**8)


def test_the_default_budget_is_a_fraction_of_the_memory_left_and_no_more_than_the_sequences_need(monkeypatch):
    monkeypatch.setattr("mlxkv.config.device_memory", lambda: 16 * 10**9)
    per_token = 2 * 28 * 8 * 128 * 2
    cache = EngineConfig(max_num_seqs=16).build_cache(28, 8, 128, mx.bfloat16, 40960, weights_bytes=12 * 10**8)
    assert cache.pool.capacity == int(0.5 * (16 * 10**9 - 12 * 10**8)) // (16 * per_token)
    small = EngineConfig(max_num_seqs=1, max_model_len=30).build_cache(28, 8, 128, mx.bfloat16, 40960)
    assert small.pool.capacity == 2  # 30 tokens in pages of 16
    frugal = EngineConfig(kv_cache_fraction=0.1).build_cache(28, 8, 128, mx.bfloat16, 40960, weights_bytes=0)
    assert frugal.pool.capacity == int(0.1 * 16 * 10**9) // (16 * per_token)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=None), "block_size must be a positive integer, got None"),
    (dict(attention=5), "attention must be 'metal', 'reference' or None, got 5"),
    (dict(kv_cache_fraction=0), r"kv_cache_fraction must be a number in \(0, 1\], got 0"),
    (dict(kv_bits=16), r"kv_bits must be 8, 4 or None \(float pages\), got 16"),
    (dict(kv_bits=4, kv_group_size=256), "kv_group_size must be 32, 64 or 128, got 256"),
    (dict(kv_bits=8.0), r"kv_bits must be 8, 4 or None \(float pages\), got 8.0"),
    (dict(kv_bits=8, kv_group_size=64.0), "kv_group_size must be 32, 64 or 128, got 64.0"),
])
def test_bad_engine_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)
