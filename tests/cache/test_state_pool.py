import mlx.core as mx
import numpy as np
import pytest

from mlxkv import KVCacheManager
from mlxkv.cache.state_pool import StatePool, StateShape

CONV, STATE = StateShape((3, 8), mx.float16), StateShape((2, 4, 4), mx.float32)


def manager(layout="paged", **kw):
    return KVCacheManager(
        2, 2, 4, max_num_seqs=3, max_model_len=32, page_size=4, layout=layout, state_shapes=[[CONV, STATE]], **kw
    )


def test_an_entry_holds_its_state_until_written_and_reads_zeros_when_fresh():
    pool = StatePool(4, [[CONV, STATE], [CONV]])
    rows = mx.array([2, 0])
    pool.write(0, rows, [mx.ones((2, 3, 8)), mx.full((2, 2, 4, 4), 5.0)])
    conv, state = pool.read(0, mx.array([0, 1, 2]), None)
    assert conv.dtype == mx.float16 and state.dtype == mx.float32  # the pool's dtypes, whatever was written
    assert conv.sum(axis=(1, 2)).tolist() == [24, 0, 24] and state.sum(axis=(1, 2, 3)).tolist() == [160, 0, 160]
    conv, state = pool.read(0, rows, mx.array([True, False]))  # row 2 starts a new sequence
    assert conv.sum(axis=(1, 2)).tolist() == [0, 24] and state.sum(axis=(1, 2, 3)).tolist() == [0, 160]
    assert pool.read(1, rows, None)[0].sum().item() == 0  # another layer's entries are its own


def test_bytes_per_sequence_count_every_array_of_every_layer():
    pool = StatePool(4, [[CONV, STATE], [CONV]])
    assert pool.bytes_per_sequence == 2 * (3 * 8 * 2) + 2 * 4 * 4 * 4
    assert pool.nbytes == 4 * pool.bytes_per_sequence and len(pool.tensors) == 3


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_a_sequence_takes_its_row_as_its_state_index_and_gives_it_back(layout):
    cache = manager(layout)
    first, second = cache.claim(2)
    batch = cache.append([second, first], [3, 1])
    assert batch.state_indices.tolist() == [1, 0] and batch.fresh.tolist() == [True, True]
    assert cache.append([first], [2]).fresh.tolist() == [False]
    usage = cache.usage()
    assert (usage.states_used, usage.states_total) == (2, 3)
    assert usage.state_bytes == 3 * 8 * 2 + 2 * 4 * 4 * 4
    assert "recurrent state 2/3 sequences of 0.00 MiB" in str(usage)
    cache.release(first)
    (third,) = cache.claim(1)
    assert cache.append([third], [1]).state_indices.tolist() == [0]  # the released row, and so its state index
    assert cache.usage().states_used == 2


def test_a_hybrid_shares_prefixes_with_float_pages_only():
    assert manager().prefix_caching and manager().snapshot_point(9) == 8 and manager().snapshot_point(8) == 4
    quantized = KVCacheManager(
        2, 2, 32, max_num_seqs=3, max_model_len=32, page_size=4, kv_bits=8, kv_group_size=32, state_shapes=[[CONV]]
    )
    assert not quantized.prefix_caching and quantized.snapshot_point(9) == 0  # its first chunk must stay whole


def test_a_kept_state_lets_a_later_sequence_start_where_it_was_taken():
    cache, tokens = manager(), list(range(10, 21))  # 11 tokens: kept after 8, the last full page before the last
    (first,) = cache.claim(1)
    cache.append([first], [8])
    cache.states.write(0, mx.array([0]), [mx.full((1, 3, 8), 2.0), mx.full((1, 2, 4, 4), 3.0)])
    cache.capture([first])
    cache.states.write(0, mx.array([0]), [mx.zeros((1, 3, 8)), mx.zeros((1, 2, 4, 4))])  # the next step moves on
    cache.publish([first], [tokens], [8])
    cache.release(first)
    second, third = cache.claim(2)
    assert cache.reuse_prefix(second, tokens + [7, 7]) == 8  # its pages reach 12 tokens, its kept state 8
    conv, state = cache.states.read(0, mx.array(cache.fetch([second]).state_indices), None)
    assert conv.sum().item() == 2 * 24 and state.sum().item() == 3 * 32  # the state as captured
    assert cache.reuse_prefix(third, [10, 11, 12, 13, 99, 98]) == 0  # its one shared page has no kept state
    assert cache.num_tokens(third) == 0 and cache.pages_in_use == 2
    assert "recurrent state 2/3 sequences of 0.00 MiB, 1 kept for prefix hits" in str(cache.usage())


def test_state_is_evaluated_and_reset_with_the_pages():
    cache = manager()
    states = cache.states
    assert states is not None and all(any(t is a for t in cache.tensors) for a in states.tensors)
    states.write(0, mx.array([1]), [mx.ones((1, 3, 8)), mx.ones((1, 2, 4, 4))])
    cache.reset()
    assert np.all(np.array(states.read(0, mx.array([1]), None)[1]) == 0)
