import mlx.core as mx
import numpy as np

from mlxkv import KVCacheManager
from mlxkv.cache.state_batch import state_batch
from mlxkv.cache.state_pool import StateShape


def step(counts, computed=None):
    """A step of rows with `counts` new tokens each, after `computed` earlier ones."""
    cache = KVCacheManager(
        1, 1, 4, max_num_seqs=8, max_model_len=64, page_size=4, state_shapes=[[StateShape((2,), mx.float32)]]
    )
    ids = cache.claim(len(counts))
    if computed:
        cache.append(ids, computed)
    return cache.append(ids, counts)


def run_groups(batch, packed, padded=True):
    """What a recurrent layer hands back for `packed` (one value per token) when it returns
    each place's input: the groups' outputs, reordered as `RecurrentLayer` does."""
    states = state_batch(batch, padded)
    outputs = []
    for group in states.groups:
        places = packed if group.gather is None else packed[group.gather]
        places = places.reshape(group.rows, group.length).reshape(-1)
        outputs.append(places if group.valid is None else places[group.valid])
    out = mx.concatenate(outputs)
    return (out if states.order is None else out[states.order]).tolist(), states


def test_decode_rows_are_one_batch_of_length_one_with_the_packed_tokens_as_they_are():
    batch = step([1, 1, 1], computed=[5, 2, 7])
    out, states = run_groups(batch, mx.arange(3))
    (group,) = states.groups
    assert (group.rows, group.length, group.gather, group.mask, group.fresh) == (3, 1, None, None, None)
    assert out == [0, 1, 2] and states.order is None


def test_prefill_chunks_are_padded_to_the_longest_and_decodes_kept_apart():
    batch = step([1, 4, 1, 2, 3], computed=[6, 0, 3, 0, 5])  # rows 1 and 3 start fresh
    out, states = run_groups(batch, mx.arange(11))
    single, padded = states.groups
    assert (single.rows, single.length, padded.rows, padded.length) == (2, 1, 3, 4)
    assert single.indices.tolist() == [0, 2] and padded.indices.tolist() == [1, 3, 4]
    assert single.fresh is None and padded.fresh.tolist() == [True, True, False]
    assert np.array(padded.mask).tolist() == [[True] * 4, [True, True, False, False], [True, True, True, False]]
    assert padded.lengths.tolist() == [4, 2, 3]
    assert out == list(range(11))  # every token's output back in its packed place


def test_one_prefill_chunk_alone_is_its_packed_tokens():
    batch = step([9])
    out, states = run_groups(batch, mx.arange(9))
    (group,) = states.groups
    assert (group.rows, group.length, group.gather, group.mask, group.lengths) == (1, 9, None, None, None)
    assert group.fresh.tolist() == [True] and out == list(range(9))


def test_chunks_run_one_by_one_where_padding_would_not_be_exact():
    batch = step([1, 4, 1, 2, 3], computed=[6, 0, 3, 0, 5])
    out, states = run_groups(batch, mx.arange(11), padded=False)
    single, *chunks = states.groups
    assert single.rows == 2 and out == list(range(11))
    assert [(g.rows, g.length, g.mask, g.lengths) for g in chunks] == [
        (1, 4, None, None),
        (1, 2, None, None),
        (1, 3, None, None),
    ]
    assert [g.indices.tolist() for g in chunks] == [[1], [3], [4]]
