import numpy as np
import pytest

from mlxkv import KVCacheExhausted, PagePool, PageTable, SequenceTooLong


def test_slots_follow_the_pages_in_logical_order():
    pool = PagePool(8, 4)
    pool.alloc("other", 1)
    table = PageTable(pool, "s", max_tokens=32)
    assert table.append(6).tolist() == [4, 5, 6, 7, 8, 9]
    assert table.pages == [1, 2]
    assert table.slot(5) == 9
    assert (table.position_base, table.max_context, table.num_tokens) == (4, 8, 6)


def test_grows_a_page_only_when_the_last_one_is_full():
    pool = PagePool(8, 4)
    table = PageTable(pool, "s", max_tokens=32)
    table.append(4)
    assert pool.used_count == 1
    table.append(1)
    assert pool.used_count == 2
    assert table.slots(0, 5).tolist() == [0, 1, 2, 3, 4]


def test_failed_growth_changes_nothing():
    pool = PagePool(2, 4)
    table = PageTable(pool, "s", max_tokens=32)
    table.append(3)
    with pytest.raises(KVCacheExhausted):
        table.append(6)
    assert (table.num_tokens, table.pages, pool.free_count) == (3, [0], 1)


def test_length_limit_names_the_limit():
    table = PageTable(PagePool(8, 4), "s", max_tokens=10)
    with pytest.raises(SequenceTooLong, match="max_model_len=10"):
        table.append(11)
    assert table.num_tokens == 0


def test_slot_outside_the_sequence_is_an_index_error():
    table = PageTable(PagePool(8, 4), "s", max_tokens=10)
    table.append(2)
    with pytest.raises(IndexError, match=r"position 2 is outside 0\.\.1"):
        table.slot(2)


def test_page_for_token_follows_the_table_and_is_none_past_the_end():
    pool = PagePool(8, 4)
    pool.alloc("other", 1)
    table = PageTable(pool, "s", max_tokens=32)
    assert table.page_for_token(0) is None
    table.append(6)
    assert [table.page_for_token(t) for t in range(8)] == [1, 1, 1, 1, 2, 2, None, None]
    assert table.page_for_token(1000) is None
    with pytest.raises(ValueError, match="token must be a non-negative integer, got -1"):
        table.page_for_token(-1)


def test_blocks_in_use_counts_pages_holding_tokens():
    table = PageTable(PagePool(8, 4), "s", max_tokens=32)
    table.reserve_pages(5)
    assert (table.pages_in_use, len(table.pages)) == (0, 2)
    table.append(5)
    assert table.pages_in_use == 2
    table.append(3)
    assert table.pages_in_use == 2
    table.append(1)
    assert table.pages_in_use == 3


def test_release_returns_the_pages():
    pool = PagePool(8, 4)
    table = PageTable(pool, "s", max_tokens=32)
    table.append(9)
    assert table.release() == 3
    assert pool.free_count == 8
    assert (table.pages, table.num_tokens, table.position_base) == ([], 0, 0)
    assert isinstance(table.slots(0, 0), np.ndarray)


def test_slide_gives_back_the_pages_before_a_token_and_keeps_the_indices():
    pool = PagePool(8, 4)
    table = PageTable(pool, "s", 64)
    table.append(14)  # pages for tokens 0-3, 4-7, 8-11, 12-13
    live = table.pages[2:]
    assert table.slide(-3) == 0 and table.slide(7) == 1  # token 7 is still needed: page 1 stays
    assert table.slide(9) == 1 and table.slide(9) == 0
    assert table.pages == [0, 0] + live and table.dropped == 2
    assert pool.free_count == 6 and pool.pages("s") == live
    assert table.slots(12, 14).tolist() == [live[1] * 4, live[1] * 4 + 1]
    assert table.release() == 2 and pool.free_count == 8


def test_truncated_pages_go_back_deepest_first_so_a_prefix_keeps_its_start_longest():
    """A hybrid keeps reused pages only as far as a kept recurrent state reaches: the pages it
    gives back leave the cache deepest first, as a released sequence's do."""
    pool = PagePool(4, 4)
    tokens = list(range(100, 116))  # four full pages
    first = PageTable(pool, "first", max_tokens=32)
    first.append(16)
    first.publish(tokens, 16)
    first.release()
    second = PageTable(pool, "second", max_tokens=32)
    assert second.reuse_prefix(tokens + [7]) == 16
    second.truncate(1)
    assert second.num_tokens == second.num_computed == 4 and second.pages == [0]
    PageTable(pool, "third", max_tokens=32).append(4)  # takes one page: the cache must give one up
    third = PageTable(pool, "fourth", max_tokens=32)
    assert third.reuse_prefix(tokens + [7]) == 12  # pages 0-2 still found; page 3, the deepest, went first
