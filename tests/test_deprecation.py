"""The names renamed in 0.2 keep working for one release, each with a DeprecationWarning naming the new one."""

import re

import pytest

import mlxkv
from mlxkv import KVCacheManager, PageTable


def warns(old, new):
    return pytest.warns(
        DeprecationWarning, match=re.escape(f"{old} is now called {new}; the old name goes in mlxkv 0.3")
    )


def test_old_names_of_the_cache_warn_and_work():
    with warns("mlxkv.BlockTable", "PageTable"):
        assert mlxkv.BlockTable is PageTable
    with warns("KVCacheManager(max_seqs=...)", "max_num_seqs"), warns("KVCacheManager(block_size=...)", "page_size"):
        cache = KVCacheManager(1, 2, 64, max_seqs=2, max_model_len=64, block_size=8)
    (seq,) = cache.claim(1)
    with warns("KVCacheManager.step", "append"):
        batch = cache.step([seq], [3])
    with warns("KVBatch.block_tables", "page_tables"):
        assert batch.block_tables is batch.page_tables
    with warns("KVCacheManager.blocks_in_use", "pages_in_use"):
        assert cache.blocks_in_use == 1
    with warns("KVCacheManager.block_size", "page_size"):
        assert cache.block_size == 8


def test_an_unknown_name_is_still_an_error():
    with pytest.raises(AttributeError, match="module 'mlxkv' has no attribute 'BlockTables'"):
        mlxkv.BlockTables  # noqa: B018
