"""Pinned prefixes: kept from eviction while pinned, bounded, lapsing oldest first, at their time,
or when a request needs the pages; never a page leaked."""

import pytest

from mlxkv import KVCacheManager, Pin


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def cache_with_clock(**kw):
    args = dict(max_num_seqs=4, max_model_len=48, page_size=4, num_pages=12, dtype="float32")
    cache = KVCacheManager(1, 1, 4, **{**args, **kw})
    clock = Clock()
    cache.pins.clock = clock
    return cache, clock


def computed(cache, tokens):
    """A sequence that computed `tokens` and published its pages."""
    (seq,) = cache.claim(1)
    cache.append([seq], [len(tokens)])
    cache.publish([seq], [tokens], [len(tokens)])
    return seq


def reused(cache, tokens):
    (seq,) = cache.claim(1)
    hit = cache.reuse_prefix(seq, tokens)
    cache.release(seq)
    return hit


PROMPT = list(range(100, 113))  # 13 tokens: 3 full pages


def test_pinned_pages_survive_a_pool_full_of_other_sequences_and_lapse_at_their_time():
    cache, clock = cache_with_clock()
    seq = computed(cache, PROMPT)
    assert cache.pin(seq, 13, ttl_s=60) == 12
    cache.release(seq)
    assert (cache.usage().pages_pinned, cache.pool.used_count, cache.usage().tokens) == (3, 3, 12)
    other = computed(cache, list(range(300, 336)))  # 9 pages: every other free page, cached ones evicted
    cache.release(other)
    assert reused(cache, PROMPT) == 12
    clock.now = 61
    cache.expire_pins()
    assert cache.pool.used_count == 0 and cache.usage().pages_pinned == 0  # back among the cached pages
    cache.release(computed(cache, list(range(400, 448))))  # 12 pages: the old prefix is evicted now
    assert reused(cache, PROMPT) == 0 and cache.pool.free_count == cache.pool.capacity


def test_pinning_a_prefix_again_renews_it_without_counting_its_pages_twice():
    cache, clock = cache_with_clock()
    first = computed(cache, PROMPT)
    cache.pin(first, 13, ttl_s=10)
    clock.now = 5
    again = computed(cache, PROMPT[:12] + [7])
    assert cache.pin(again, 13, ttl_s=10) == 12
    assert cache.pins.num_pages == 3
    clock.now = 12  # past the first pin's time, within the renewed one
    cache.expire_pins()
    assert cache.pins.num_pages == 3
    clock.now = 16
    cache.expire_pins()
    assert cache.pins.num_pages == 0


def test_pins_stay_under_their_share_of_the_pool_the_oldest_lapsing():
    cache, _ = cache_with_clock(pinned_fraction=0.5)  # 6 of 12 pages
    a, b = computed(cache, PROMPT), computed(cache, list(range(200, 213)))
    assert cache.pin(a, 12, 60) == 12 and cache.pin(b, 12, 60) == 12
    cache.release(a)
    cache.release(b)
    c = computed(cache, list(range(500, 509)))
    assert cache.pin(c, 8, 60) == 8  # a's 3 pages lapse for c's 2
    assert cache.pins.num_pages == 5 and reused(cache, list(range(200, 213))) == 12


def test_a_request_that_needs_pinned_pages_gets_them_and_nothing_leaks():
    cache, _ = cache_with_clock()
    seq = computed(cache, PROMPT)
    cache.pin(seq, 13, 60)
    cache.release(seq)
    (big,) = cache.claim(1)
    cache.make_room(12)
    cache.append([big], [48])  # the whole pool
    assert cache.pins.num_pages == 0
    cache.release(big)
    assert cache.pool.free_count == cache.pool.capacity


def test_nothing_is_pinned_without_prefix_caching_or_full_pages():
    plain = KVCacheManager(1, 1, 4, max_num_seqs=2, max_model_len=16, page_size=4, prefix_caching=False)
    (seq,) = plain.claim(1)
    plain.append([seq], [8])
    assert plain.pins is None and plain.pin(seq, 8, 60) == 0
    cache, _ = cache_with_clock()
    assert cache.pin(computed(cache, [1, 2, 3]), 3, 60) == 0


@pytest.mark.parametrize(
    "kw, message", [(dict(tokens=0), "tokens must be a positive integer"), (dict(tokens=4, ttl_s=0), "ttl_s")]
)
def test_a_pin_is_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        Pin(**kw)
