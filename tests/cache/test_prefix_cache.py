"""Prefix caching through the manager's API, after the assertions of vLLM's
tests/v1/core/test_prefix_caching.py (written anew against mlxkv)."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlxkv import KVCacheExhausted, KVCacheManager
from mlxkv.cache.prefix_cache import PrefixCacheStats, check_salt, page_key, root_key

BS = 4


def make(num_pages=16, **kw):
    return KVCacheManager(
        1, 1, 4, max_num_seqs=8, max_model_len=64, page_size=BS, num_pages=num_pages, dtype=mx.float32, **kw
    )


def admit(cache, tokens, salt=None, compute=None, marks=()):
    """Open a sequence for `tokens` as the scheduler does: reuse its cached prefix, step the
    rest (or the first `compute` tokens of it), publish what it filled. Returns (id, hits)."""
    (seq,) = cache.claim(1)
    hits = cache.reuse_prefix(seq, tokens, salt, marks)
    count = len(tokens) - hits if compute is None else compute
    cache.append([seq], [count])
    cache.publish([seq], [tokens], [hits + count])
    return seq, hits


def keys_of(tokens, salt=None):
    keys, parent = [], root_key(salt)
    for start in range(0, len(tokens) // BS * BS, BS):
        parent = page_key(parent, tokens[start : start + BS])
        keys.append(parent)
    return keys


def test_keys_chain_each_page_to_everything_before_it():
    a = keys_of(list(range(12)))
    b = keys_of(list(range(8)) + [99, 9, 10, 11])
    c = keys_of([99] + list(range(1, 12)))
    assert len(a[0]) == 32 and len(set(a)) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c))  # page 0 differs, so every later key does
    assert keys_of(list(range(12)), salt="tenant") != a
    assert page_key(root_key(None), [1, 2, 3, 4]) != page_key(root_key(None), [1, 2, 3, 5])
    assert page_key(root_key(None), [256]) != page_key(root_key(None), [1, 0])  # token ids, not bytes


def test_marks_split_equal_tokens_from_the_page_they_start_in():
    """Two images of a size have equal placeholder ids: their digests, marked at the first
    placeholder, keep their pages apart from there on, and an equal image shares them all."""
    cache = make()
    prompt = [1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9, 7, 8, 10, 11, 12]  # placeholders 9 at 6..11
    cat, dog = ((6, b"cat" * 8),), ((6, b"dog" * 8),)
    admit(cache, prompt, marks=cat)
    _, hits = admit(cache, prompt, marks=dog)
    assert hits == 4  # page 0 only: page 1 holds the first placeholder
    _, hits = admit(cache, prompt, marks=cat)
    assert hits == 16  # every full page: the same image again
    _, hits = admit(cache, prompt)
    assert hits == 4  # no image at all
    short, _ = admit(cache, prompt[:7], marks=cat)  # its last page holds 5, 6 and the first placeholder
    cache.release(short)
    _, hits = admit(cache, prompt[:7] + [0], marks=cat)
    assert hits == 7  # the released tail page's prefixes are keyed with their marks too
    _, hits = admit(cache, prompt[:7] + [0], marks=dog)
    assert hits == 4


def test_a_second_request_shares_the_three_page_prefix_and_allocates_one_page():
    cache = make()
    prompt = list(range(14))  # 3 full pages and 2 tokens
    a, hits = admit(cache, prompt)
    assert hits == 0 and len(cache.pool.pages(a)) == 4
    free = cache.free_pages
    b, hits = admit(cache, list(range(12)) + [50, 51, 52])
    assert hits == 12
    shared, own = cache.pool.pages(b)[:3], cache.pool.pages(b)[3:]
    assert shared == cache.pool.pages(a)[:3]
    assert [cache.pool.ref_count(p) for p in shared] == [2, 2, 2]
    assert len(own) == 1 and own[0] not in cache.pool.pages(a)
    assert cache.free_pages == free - 1
    assert cache.usage().tokens == 14 + 3  # shared pages count once


def test_the_last_token_is_always_computed_and_written_to_a_page_of_its_own():
    cache = make()
    admit(cache, list(range(12)))
    (b,) = cache.claim(1)
    assert cache.reuse_prefix(b, list(range(12)), None) == 8  # not 12: the last token's logits are needed
    batch = cache.append([b], [4])
    own = cache.pool.pages(b)[2]
    assert cache.pool.ref_count(own) == 1
    assert set(batch.slot_mapping.tolist()) <= set(range(own * BS, own * BS + BS))


def test_appending_within_a_page_allocates_nothing_and_a_full_page_is_published():
    cache = make()
    (seq,) = cache.claim(1)
    tokens = list(range(6))
    cache.append([seq], [6])
    cache.publish([seq], [tokens], [6])
    assert [cache.pool.key(p) for p in cache.pool.pages(seq)] == [keys_of(tokens)[0], None]
    free = cache.free_pages
    for n in (7, 8):
        tokens.append(n)
        cache.append([seq], [1])
        cache.publish([seq], [tokens], [len(tokens)])
    assert cache.free_pages == free
    assert cache.pool.key(cache.pool.pages(seq)[1]) == keys_of(tokens)[1]
    tokens.append(9)
    cache.append([seq], [1])
    assert cache.free_pages == free - 1


def test_pages_are_published_only_as_far_as_computed():
    cache = make()
    (seq,) = cache.claim(1)
    tokens = list(range(10))
    cache.append([seq], [10])
    cache.publish([seq], [tokens], [5])  # the rest of the step is still being computed
    assert [cache.pool.key(p) is not None for p in cache.pool.pages(seq)] == [True, False, False]
    with pytest.raises(ValueError, match=r"num_computed=11 is outside 5\.\.10"):
        cache.publish([seq], [tokens], [11])
    with pytest.raises(ValueError, match=r"num_computed=4 is outside 5\.\.10"):  # computed tokens never go back
        cache.publish([seq], [tokens], [4])


def test_freed_pages_stay_cached_and_a_hit_revives_them():
    cache = make()
    a, _ = admit(cache, list(range(9)))
    pages = cache.pool.pages(a)
    cache.release(a)
    assert (cache.free_pages, cache.pool.cached_free_count) == (16, 3)  # 2 full pages and the partial one
    b, hits = admit(cache, list(range(8)) + [70])
    assert hits == 8 and cache.pool.pages(b)[:2] == pages[:2]
    assert (cache.pool.cached_free_count, cache.usage().pages_cached) == (1, 1)


def test_a_partly_filled_last_page_goes_to_the_sequence_that_continues_it():
    cache = make()
    a, _ = admit(cache, list(range(6)))
    tail = cache.pool.pages(a)[1]
    cache.release(a)
    assert cache.pool.cached_free_count == 2
    b, hits = admit(cache, list(range(6)) + [40, 41, 42], compute=0)
    assert hits == 6 and cache.pool.pages(b)[1] == tail
    assert (cache.pool.ref_count(tail), cache.pool.key(tail)) == (1, None)  # b's own, to write into
    batch = cache.append([b], [3])
    assert batch.slot_mapping.tolist() == [tail * BS + 2, tail * BS + 3, batch.slot_mapping[2]]
    _, hits = admit(cache, list(range(6)) + [50])
    assert hits == 4  # the partial page is b's now; c recomputes its two tokens


def test_a_partial_page_goes_to_the_first_sequence_that_starts_like_it():
    cache = make()
    a, _ = admit(cache, list(range(7)))
    cache.release(a)
    assert admit(cache, list(range(7)))[1] == 6  # the same prompt again: everything but its last token
    b, _ = admit(cache, list(range(7)))
    cache.release(b)
    assert admit(cache, list(range(6)) + [60, 61])[1] == 6  # it shares the page's first two tokens
    assert admit(cache, list(range(6)) + [70])[1] == 4  # the page is taken: only the full one is left


def test_release_caches_the_computed_tokens_of_the_list_last_published():
    cache = make()
    tokens = list(range(6))
    a, _ = admit(cache, tokens)  # pages [0..3] and [4, 5]: the second one partly filled
    tokens += [70, 71]  # the sequence's list grows after the publish, which kept it (no copy)
    cache.release(a)
    assert admit(cache, tokens + [9])[1] == 6  # the partial page holds 4, 5 as published, not 70, 71


def test_eviction_takes_empty_pages_first_then_least_recently_used_cached_ones():
    cache = make(num_pages=6)
    old, _ = admit(cache, list(range(8)))  # 2 pages
    new, _ = admit(cache, list(range(100, 108)))  # 2 pages
    old_pages, new_pages = cache.pool.pages(old), cache.pool.pages(new)
    cache.release(old)
    cache.release(new)
    (c,) = cache.claim(1)
    first = cache.append([c], [2 * BS])  # takes the 2 pages that never held anything
    assert set(cache.pool.pages(c)).isdisjoint(old_pages + new_pages)
    assert cache.pool.num_evictions == 0 and first.num_tokens == 8
    cache.append([c], [BS])
    cache.append([c], [BS])
    evicted = cache.pool.pages(c)[2:]
    assert sorted(evicted) == sorted(old_pages)  # least recently used first
    assert evicted == old_pages[::-1]  # and of one sequence, its last page first
    assert cache.pool.num_evictions == 2
    assert all(cache.pool.key(p) is not None for p in new_pages)


def test_a_reused_page_loses_its_old_key():
    cache = make(num_pages=2)
    a, _ = admit(cache, list(range(8)))
    old_key = cache.pool.key(cache.pool.pages(a)[0])
    cache.release(a)
    b, hits = admit(cache, list(range(50, 58)))
    assert hits == 0
    assert cache.pool.lookup(old_key) is None
    assert old_key not in {cache.pool.key(p) for p in cache.pool.pages(b)}
    cache.release(b)
    _, hits = admit(cache, list(range(8)))
    assert hits == 0


def test_pages_a_request_hit_are_not_evicted_by_its_own_allocation():
    cache = make(num_pages=4)
    a, _ = admit(cache, list(range(12)))  # 3 pages, all published
    pages = cache.pool.pages(a)
    cache.release(a)
    assert cache.pool.cached_free_count == 3
    b, hits = admit(cache, list(range(8)) + [60, 61, 62, 63, 64], compute=5)  # hits 2, needs 2 pages
    assert hits == 8
    assert cache.pool.pages(b)[:2] == pages[:2]
    assert [cache.pool.key(p) for p in pages[:2]] == keys_of(list(range(8)))
    assert cache.pool.num_evictions == 1  # the third cached page, which b did not hit
    assert cache.free_pages == 0


def test_no_hits_with_caching_disabled_or_in_the_contiguous_layout():
    for cache in (
        make(prefix_caching=False),
        KVCacheManager(1, 1, 4, max_num_seqs=4, max_model_len=64, layout="contiguous", dtype=mx.float32),
    ):
        admit(cache, list(range(12)))
        _, hits = admit(cache, list(range(12)))
        assert hits == 0 and not cache.prefix_caching
        assert cache.pool.cached_free_count == 0


def test_different_salts_share_nothing_and_equal_salts_share():
    cache = make()
    admit(cache, list(range(12)), salt="alice")
    assert admit(cache, list(range(12)), salt="bob")[1] == 0
    assert admit(cache, list(range(12)))[1] == 0
    assert admit(cache, list(range(12)), salt="alice")[1] == 8


def test_a_page_computed_twice_is_cached_once():
    cache = make()
    (a, b) = cache.claim(2)
    tokens = list(range(8))
    cache.append([a, b], [8, 8])
    cache.publish([a], [tokens], [8])
    cache.publish([b], [tokens], [8])
    assert [cache.pool.lookup(k) for k in keys_of(tokens)] == cache.pool.pages(a)
    assert all(cache.pool.key(p) is None for p in cache.pool.pages(b))
    cache.release(b)
    assert cache.pool.cached_free_count == 0


def test_reset_forgets_every_cached_page():
    cache = make()
    a, _ = admit(cache, list(range(12)))
    cache.release(a)
    cache.reset()
    assert cache.pool.cached_free_count == 0 and cache.free_pages == 16
    assert admit(cache, list(range(12)))[1] == 0


def test_a_prefix_is_reused_only_by_a_new_sequence():
    cache = make()
    seq, _ = admit(cache, list(range(6)))
    with pytest.raises(ValueError, match="already holds pages"):
        cache.reuse_prefix(seq, list(range(6)))


def test_salts_must_be_non_empty_strings_and_stats_count_hits():
    assert check_salt(None) is None and check_salt("x") == "x"
    for bad in ("", 3, b"x"):
        with pytest.raises(ValueError, match="cache_salt must be None or a non-empty string"):
            check_salt(bad)
    stats = PrefixCacheStats()
    assert stats.hit_rate == 0.0
    stats.record(10, 8)
    stats.record(30, 0)
    assert (stats.prompt_tokens, stats.cached_tokens, stats.hit_rate) == (40, 8, 0.2)


def content_values(tokens):
    """What a model would store for each position: a function of the whole prefix up to it."""
    values, v = [], 0
    for t in tokens:
        v = (v * 31 + t) % 1_000_003
        values.append(float(v))
    return values


class PrefixMachine(RuleBasedStateMachine):
    """Random sequences over a two-token alphabet (so prefixes collide often) admitted,
    extended and released on a small pool: every sequence must read back exactly what it
    would have computed alone, whichever pages it shares or revives."""

    def __init__(self):
        super().__init__()
        self.cache = KVCacheManager(
            1, 1, 1, max_num_seqs=4, max_model_len=16, page_size=2, num_pages=10, dtype=mx.float32
        )
        self.pool = self.cache.pool
        self.tokens: dict[int, list[int]] = {}

    def _write(self, seq_id, tokens, count):
        batch = self.cache.append([seq_id], [count])
        new = mx.array(content_values(tokens)[len(tokens) - count :], dtype=mx.float32).reshape(-1, 1, 1)
        self.cache.write(0, batch, new, -new)
        mx.eval(self.cache.storage.tensors)
        self.cache.publish([seq_id], [tokens], [len(tokens)])

    @rule(tokens=st.lists(st.integers(1, 2), min_size=1, max_size=9), salt=st.sampled_from([None, "s"]))
    def admit(self, tokens, salt):
        if self.cache.num_sequences == self.cache.max_num_seqs:
            return
        (seq_id,) = self.cache.claim(1)
        hits = self.cache.reuse_prefix(seq_id, tokens, salt)
        assert hits < len(tokens)
        try:
            self._write(seq_id, tokens, len(tokens) - hits)
        except KVCacheExhausted:
            self.cache.release(seq_id)
            return
        self.tokens[seq_id] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.lists(st.integers(1, 2), min_size=1, max_size=3))
    def extend(self, data, more):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[seq_id] + more
        if len(tokens) > 16:
            return
        try:
            self._write(seq_id, tokens, len(more))
        except KVCacheExhausted:
            return
        self.tokens[seq_id] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.release(seq_id)
        del self.tokens[seq_id]

    @invariant()
    def every_sequence_reads_what_it_would_compute_alone(self):
        for seq_id, tokens in self.tokens.items():
            k, _ = self.cache.as_tensor(seq_id, 0)
            assert np.array(k)[:, 0, 0].tolist() == content_values(tokens)

    @invariant()
    def pool_and_keys_are_consistent(self):
        holders: dict[int, int] = {}
        for owner in self.pool.owners():
            for page in self.pool.pages(owner):
                holders[page] = holders.get(page, 0) + 1
        assert all(self.pool.ref_count(p) == n for p, n in holders.items())
        assert self.pool.free_count + len(holders) == self.pool.capacity
        assert self.pool.extra_refs == sum(n - 1 for n in holders.values())
        for page in range(self.pool.capacity):
            key = self.pool.key(page)
            if key is not None:
                assert self.pool.lookup(key) == page
        cached_free = [p for p in range(self.pool.capacity) if p not in holders and self.pool.key(p) is not None]
        assert len(cached_free) == self.pool.cached_free_count
        slots = {self.pool.pages(s)[i // 2] * 2 + i % 2 for s, t in self.tokens.items() for i in range(len(t))}
        assert self.cache.usage().tokens == len(slots)

    def teardown(self):
        for seq_id in list(self.tokens):
            self.cache.release(seq_id)
        assert self.pool.free_count == self.pool.capacity


TestPrefixCache = PrefixMachine.TestCase
TestPrefixCache.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
