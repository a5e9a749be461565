import pytest

from mlxkv import KVCacheExhausted, PagePool


def test_alloc_gives_distinct_pages_and_counts_them():
    pool = PagePool(8, 16)
    a = pool.alloc("a", 3)
    b = pool.alloc("b", 2)
    assert len(set(a + b)) == 5
    assert (pool.free_count, pool.used_count, pool.capacity, pool.page_size) == (3, 5, 8, 16)
    assert pool.pages("a") == a
    assert pool.alloc("a", 1) != []
    assert len(pool.pages("a")) == 4


def test_alloc_is_all_or_nothing_and_says_what_was_asked():
    pool = PagePool(4, 16)
    pool.alloc("a", 3)
    with pytest.raises(KVCacheExhausted, match="asked for 2 pages, 1 free") as info:
        pool.alloc("b", 2)
    assert (info.value.requested, info.value.free) == (2, 1)
    assert pool.free_count == 1
    assert pool.pages("b") == []
    assert pool.owners() == ["a"]


def test_free_returns_every_page_and_reuses_least_recently_freed_first():
    pool = PagePool(4, 2)
    a = pool.alloc("a", 2)
    pool.alloc("b", 2)
    assert pool.free("a") == 2
    assert pool.free("a") == 0
    assert sorted(pool.alloc("c", 2)) == a
    assert pool.free("b") == 2 and pool.free("c") == 2
    assert pool.free_count == 4


def test_shared_page_survives_until_its_last_holder_frees_it():
    pool = PagePool(4, 16)
    pages = pool.alloc("a", 2)
    pool.share("b", pages[:1])
    assert pool.ref_count(pages[0]) == 2
    assert pool.free("a") == 2
    assert pool.free_count == 3
    assert pool.ref_count(pages[0]) == 1
    assert pool.free("b") == 1
    assert pool.free_count == 4


def test_share_refuses_a_free_page_without_changing_anything():
    pool = PagePool(4, 16)
    pages = pool.alloc("a", 1)
    with pytest.raises(ValueError, match="page 3 is neither an allocated nor a cached page"):
        pool.share("b", [pages[0], 3])
    assert pool.ref_count(pages[0]) == 1
    assert pool.pages("b") == []


@pytest.mark.parametrize(
    "kwargs", [dict(num_pages=0, page_size=16), dict(num_pages=4, page_size=-1), dict(num_pages=2.5, page_size=16)]
)
def test_bad_sizes_are_rejected_by_name(kwargs):
    name = next(k for k, v in kwargs.items() if not (isinstance(v, int) and v > 0))
    with pytest.raises(ValueError, match=name):
        PagePool(**kwargs)


def test_negative_count_is_rejected():
    with pytest.raises(ValueError, match="count must be a non-negative integer"):
        PagePool(4, 16).alloc("a", -1)
