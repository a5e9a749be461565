"""Quantized pages: the format `mx.quantize` produces, written once per token, read back exactly."""

import mlx.core as mx
import numpy as np
import pytest

from mlxkv import KVCacheManager
from mlxkv.cache.storage import KVStorage, QuantizedPages, kv_bytes_per_token


def rows(tokens, heads=2, dim=64, seed=0, dtype=mx.float32):
    return mx.array(np.random.default_rng(seed).standard_normal((tokens, heads, dim)), dtype)


def quantized_cache(bits, group_size=64, layout="paged", **kw):
    args = dict(max_num_seqs=3, max_model_len=64, page_size=16, dtype=mx.float32, layout=layout)
    return KVCacheManager(2, 2, 64, kv_bits=bits, kv_group_size=group_size, **{**args, **kw})


@pytest.mark.parametrize("bits, group_size", [(8, 32), (8, 64), (4, 64), (4, 128)])
def test_dequantize_equals_mlx_bit_for_bit(bits, group_size):
    x = rows(5, dim=128)
    words, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    pages = QuantizedPages(words[None], scales[None], biases[None], bits, group_size)
    assert pages.shape == (1, 5, 2, 128)
    expected = mx.dequantize(words, scales, biases, group_size=group_size, bits=bits)
    assert mx.array_equal(pages.dequantize()[0], expected).item()


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("bits", [8, 4])
def test_each_token_is_stored_as_mx_quantize_makes_it_whatever_the_chunking(layout, bits):
    """Tokens written in chunks of 1, 7 and 12 hold the words, scales and biases `mx.quantize`
    gives for the whole sequence at once, and read back as its dequantized values."""
    cache = quantized_cache(bits, layout=layout)
    (seq,) = cache.claim(1)
    keys, values = rows(20), rows(20, seed=1)
    done = 0
    for count in (1, 7, 12):
        batch = cache.append([seq], [count])
        cache.write(1, batch, keys[done : done + count], values[done : done + count])
        done += count
    mx.eval(cache.storage.tensors)
    stored, _ = cache.as_tensor(seq, 1)
    roundtrip = mx.dequantize(*mx.quantize(keys, group_size=64, bits=bits), group_size=64, bits=bits)
    assert mx.array_equal(stored, roundtrip).item()
    _, v_pages = cache.kv(1)
    page = cache.fetch([seq]).page_tables[0, 0]
    expected = mx.quantize(values[:16], group_size=64, bits=bits)
    for part, want in zip(v_pages.parts, expected):
        assert mx.array_equal(part[int(page), :, :16].swapaxes(0, 1), want).item()


def test_bytes_per_token_count_packed_values_scales_and_biases():
    # Llama-3-8B: 32 layers, 8 KV heads, head_dim 128, float16.
    dense = kv_bytes_per_token(32, 8, 128, mx.float16)
    assert dense == 131072
    assert kv_bytes_per_token(32, 8, 128, mx.float16, 8, 64) == 2 * 32 * 8 * (128 + 2 * 2 * 2) == 69632
    assert kv_bytes_per_token(32, 8, 128, mx.float16, 4, 64) == 2 * 32 * 8 * (64 + 2 * 2 * 2) == 36864
    assert kv_bytes_per_token(32, 8, 128, mx.float16, 4, 32) == 2 * 32 * 8 * (64 + 2 * 4 * 2) == 40960
    for bits in (8, 4):
        storage = KVStorage(3, 10, 2, 16, 64, mx.float16, bits, 32)
        assert storage.nbytes == 10 * 16 * storage.bytes_per_token


def test_usage_names_the_bits():
    cache = quantized_cache(4)
    (seq,) = cache.claim(1)
    cache.append([seq], [3])
    usage = cache.usage()
    assert usage.kv_bits == 4 and usage.bytes_holding_tokens == 3 * cache.storage.bytes_per_token
    assert str(usage).startswith("paged, 4-bit, 1/12 pages of 16 tokens in use")


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(kv_bits=3), "kv_bits must be 8, 4 or None, got 3"),
        (dict(kv_bits=True), "kv_bits must be 8, 4 or None, got True"),
        (dict(kv_bits=8, kv_group_size=16), "kv_group_size must be 32, 64 or 128, got 16"),
        (dict(kv_bits=8, kv_group_size=128), "kv_group_size=128 must divide the model's head_dim=64; use 32 or 64"),
    ],
)
def test_bad_quantization_settings_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        KVCacheManager(1, 2, 64, max_num_seqs=1, max_model_len=16, **kw)


def test_a_head_dim_no_group_size_divides_cannot_be_quantized():
    with pytest.raises(
        ValueError,
        match="the model's head_dim=80 is not a multiple of 32, the smallest kv_group_size, "
        "so its KV cannot be quantized; use kv_bits=None",
    ):
        KVCacheManager(1, 2, 80, max_num_seqs=1, max_model_len=16, kv_bits=4, kv_group_size=32)
