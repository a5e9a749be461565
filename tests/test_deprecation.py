"""The names renamed in 0.2 keep working for one release, each with a DeprecationWarning naming the new one."""

import re
from dataclasses import replace

import pytest
from typer.testing import CliRunner

import mlxkv
from mlxkv import LLM, EngineConfig, KVCacheManager, PageTable
from mlxkv.entrypoints.cli import app


def warns(old, new):
    return pytest.warns(
        DeprecationWarning, match=re.escape(f"{old} is now called {new}; the old name goes in mlxkv 0.3")
    )


def test_old_names_of_the_cache_warn_and_work():
    with warns("mlxkv.BlockTable", "PageTable"):
        assert mlxkv.BlockTable is PageTable
    with warns("the setting max_seqs", "max_num_seqs"), warns("the setting block_size", "page_size"):
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


def test_the_warning_points_at_the_callers_line_even_through_llm(checkpoint):
    """Python shows a DeprecationWarning by default only where it points into `__main__`."""
    with pytest.warns(DeprecationWarning) as warned:
        LLM(str(checkpoint("llama-fp32")), block_size=8, max_num_seqs=1, max_model_len=32)
        EngineConfig(num_blocks=4)
    assert [(w.filename, str(w.message).split(" is now")[0]) for w in warned] == [
        (__file__, "the setting block_size"),
        (__file__, "the setting num_blocks"),
    ]


def test_old_and_new_names_together_are_refused_not_silently_merged():
    with pytest.raises(TypeError, match="EngineConfig got both page_size and its old name block_size; give page_size"):
        replace(EngineConfig(), block_size=8)


def test_old_attribute_and_flag_names(checkpoint):
    config = EngineConfig(page_size=8)
    with warns("EngineConfig.block_size", "page_size"):
        assert config.block_size == 8
    result = CliRunner().invoke(
        app, ["generate", "--model", str(checkpoint("llama-fp32")), "-m", "2", "--block-size", "4"]
    )
    assert result.exit_code == 0, result.output
    assert "warning: --block-size is now --page-size; the old name goes in mlxkv 0.3" in result.stderr
    assert "pages of 4 tokens" in result.stdout


def test_an_unknown_name_is_still_an_error():
    with pytest.raises(AttributeError, match="module 'mlxkv' has no attribute 'BlockTables'"):
        mlxkv.BlockTables  # noqa: B018
