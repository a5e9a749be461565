import re
import threading

import mlx.core as mx
import numpy as np
import pytest
from helpers import scramble_free_pages
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlxkv import (
    KVCacheExhausted,
    KVCacheManager,
    KVLayout,
    MlxkvError,
    SequenceTooLong,
    UnknownSequenceError,
)
from mlxkv.attention.reference import gather_kv
from mlxkv.cache.disk import DiskSpec


def make(layout="paged", **kw):
    args = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        max_num_seqs=4,
        max_model_len=32,
        page_size=4,
        num_pages=10,
        dtype=mx.float32,
    )
    args.update(kw)
    return KVCacheManager(layout=layout, **args)


def kv(tokens, heads=2, dim=4, dtype=mx.float32, start=0.0):
    return (mx.arange(tokens * heads * dim, dtype=mx.float32) + start).reshape(tokens, heads, dim).astype(dtype)


def snapshot(cache, ids):
    return cache.pool.free_count, [cache.pool.pages(i) for i in ids], [cache.num_tokens(i) for i in ids]


def test_lifecycle_writes_through_the_slot_mapping():
    cache = make()
    a, b = cache.claim(2)
    batch = cache.append([a, b], [5, 3])
    assert batch.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    cache.write(0, batch, kv(8), kv(8, start=100))
    fetched = cache.fetch([b, a])
    assert fetched.context_lens.tolist() == [3, 5]
    assert fetched.page_tables.tolist() == [[2, 0], [0, 1]]
    assert fetched.page_tables.dtype == np.int32
    keys = gather_kv(cache.kv(0)[0], fetched.page_tables, 5)
    assert np.array_equal(np.array(keys[1, :, :5]), np.array(kv(5)).transpose(1, 0, 2))
    assert cache.release(a) == 2
    assert cache.release(b) == 1
    assert cache.pool.free_count == 10


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_rewinding_past_rejected_drafts_frees_the_pages_they_alone_took(layout):
    cache = make(layout)
    (a,) = cache.claim(1)
    cache.append([a], [7])  # 7 tokens computed: pages 0 and 1, the second holding 3
    cache.publish([a], [list(range(7))], [7])
    cache.append([a], [6])  # the last token and 5 drafts: up to token 12, into pages 2 and 3
    assert cache.num_tokens(a) == 13
    cache.rewind(a, 9)  # the last token and one draft accepted: the page of tokens 12 goes back
    assert cache.num_tokens(a) == 9
    if layout == "paged":
        assert cache.pool.pages(a) == [0, 1, 2] and cache.free_pages == 7
        assert cache.append([a], [1]).slot_mapping.tolist() == [9]  # the next token where a rejected one was
        with pytest.raises(ValueError, match="cannot rewind sequence 0 to 6 of its 10 tokens"):
            cache.rewind(a, 6)  # before tokens the prefix cache holds
    else:
        assert cache.free_pages == 3
    cache.release(a)
    assert cache.free_pages == cache.pool.capacity


def test_a_released_sequences_row_of_the_block_tables_starts_empty_for_the_next():
    cache = make(max_num_seqs=2)
    a, b = cache.claim(2)
    cache.append([a, b], [9, 9])
    cache.release(a)
    (c,) = cache.claim(1)
    batch = cache.append([c, b], [1, 1])
    assert batch.page_tables.tolist() == [[6, 0, 0, 0], [3, 4, 5, 0]]
    assert batch.slot_mapping.tolist() == [24, 21]


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_as_tensor_returns_each_sequences_kv_in_order(layout):
    """Sequences written in interleaved chunks over pages taken out of order read back whole."""
    cache = make(layout, num_pages=16, max_model_len=24)
    if layout == "paged":
        scramble_free_pages(cache, np.random.default_rng(0))
    ids = cache.claim(3)
    written = {s: ([], []) for s in ids}
    rng = np.random.default_rng(1)
    for counts in ([5, 1, 9], [3, 0, 2], [1, 7, 4], [6, 2, 1]):
        batch = cache.append(ids, counts)
        for layer in range(2):
            keys, values = (mx.array(rng.standard_normal((sum(counts), 2, 4)), mx.float32) for _ in range(2))
            cache.write(layer, batch, keys, values)
            if layer == 1:
                for s, k, v in zip(
                    ids,
                    np.split(np.array(keys), np.cumsum(counts)[:-1]),
                    np.split(np.array(values), np.cumsum(counts)[:-1]),
                ):
                    written[s][0].append(k)
                    written[s][1].append(v)
    for s in ids:
        keys, values = cache.as_tensor(s, 1)
        assert keys.shape == values.shape == (cache.num_tokens(s), 2, 4)
        assert np.array_equal(np.array(keys), np.concatenate(written[s][0]))
        assert np.array_equal(np.array(values), np.concatenate(written[s][1]))


def test_as_tensor_is_a_copy():
    cache = make()
    (a,) = cache.claim(1)
    cache.write(0, cache.append([a], [3]), kv(3), kv(3, start=100))
    keys, values = cache.as_tensor(a, 0)
    mx.eval(keys, values)
    cache.write(0, cache.append([a], [2]), kv(2, start=-50), kv(2, start=-50))
    mx.eval(cache.storage.tensors)
    assert np.array_equal(np.array(keys), np.array(kv(3)))
    assert np.array_equal(np.array(values), np.array(kv(3, start=100)))


def test_as_tensor_of_an_empty_sequence_and_bad_arguments():
    cache = make("contiguous")
    (a,) = cache.claim(1)
    keys, values = cache.as_tensor(a, 0)
    assert keys.shape == values.shape == (0, 2, 4)
    with pytest.raises(UnknownSequenceError):
        cache.as_tensor(a + 1, 0)
    with pytest.raises(IndexError, match=r"layer 2 is outside 0\.\.1"):
        cache.as_tensor(a, 2)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_blocks_in_use_counts_pages_holding_tokens(layout):
    cache = make(layout)
    a, b = cache.claim(2)
    assert cache.pages_in_use == 0
    cache.append([a, b], [5, 1])
    assert cache.pages_in_use == (3 if layout == "paged" else 2)
    cache.release(a)
    assert cache.pages_in_use == 1


def test_block_tables_are_padded_to_a_power_of_two_width():
    cache = make(num_pages=20, max_model_len=40)
    (a,) = cache.claim(1)
    widths = [cache.append([a], [4]).page_tables.shape[1] for _ in range(10)]
    assert widths == [1, 2, 4, 4, 8, 8, 8, 8, 10, 10]


def test_contiguous_layout_gives_each_sequence_one_fixed_page():
    cache = make("contiguous")
    assert (cache.layout, cache.page_size, cache.pool.capacity) == (KVLayout.CONTIGUOUS, 32, 4)
    a, b = cache.claim(2)
    batch = cache.append([a, b], [2, 1])
    assert batch.page_tables[:, 0].tolist() == [0, 1]
    assert batch.slot_mapping.tolist() == [0, 1, 32]
    assert cache.kv(1)[0].shape == (4, 2, 32, 4)


def test_contiguous_sequence_longer_than_its_slot_names_the_limit():
    cache = make("contiguous")
    (a,) = cache.claim(1)
    cache.append([a], [30])
    with pytest.raises(SequenceTooLong, match="would hold 33 tokens, more than max_model_len=32"):
        cache.append([a], [3])
    assert cache.num_tokens(a) == 30


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_claim_beyond_capacity_changes_nothing(layout):
    cache = make(layout)
    cache.claim(3)
    with pytest.raises(KVCacheExhausted, match="asked for 2 sequences, 1 free"):
        cache.claim(2)
    assert cache.num_sequences == 3
    assert cache.claim(1) == [3]


def test_step_beyond_the_pool_changes_nothing():
    cache = make()
    a, b = cache.claim(2)
    cache.append([a], [30])
    before = snapshot(cache, [a, b])
    with pytest.raises(KVCacheExhausted, match="asked for 3 pages, 2 free"):
        cache.append([a, b], [1, 9])
    assert snapshot(cache, [a, b]) == before


@pytest.mark.parametrize("call", ["append", "fetch", "release", "num_tokens"])
def test_unknown_and_released_ids_are_named(call):
    cache = make()
    (a,) = cache.claim(1)
    cache.release(a)
    for bad in (a, 99):
        args = {"append": ([bad], [1]), "fetch": ([bad],), "release": (bad,), "num_tokens": (bad,)}[call]
        with pytest.raises(UnknownSequenceError, match=f"unknown sequence id {bad}"):
            getattr(cache, call)(*args)


@pytest.mark.parametrize(
    "keys, message",
    [
        (kv(3, heads=1), r"keys must have shape \(tokens=3, num_kv_heads=2, head_dim=4\), got \(3, 1, 4\)"),
        (kv(3, dim=8), r"keys must have shape .* got \(3, 2, 8\)"),
        (kv(2), r"keys must have shape \(tokens=3, .* got \(2, 2, 4\)"),
        (kv(3, dtype=mx.float16), "keys must have the cache dtype float32, got mlx.core.float16"),
    ],
)
def test_write_rejects_keys_of_the_wrong_shape_or_dtype(keys, message):
    cache = make()
    (a,) = cache.claim(1)
    batch = cache.append([a], [3])
    with pytest.raises(ValueError, match=message):
        cache.write(0, batch, keys, kv(3))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="head_dim must be a positive integer"):
        make(head_dim=0)
    with pytest.raises(ValueError, match="dtype must be one of float16, bfloat16, float32"):
        make(dtype=mx.int8)
    cache = make()
    (a,) = cache.claim(1)
    with pytest.raises(ValueError, match="got 1 seq_ids but 2 num_new_tokens"):
        cache.append([a], [1, 2])
    with pytest.raises(ValueError, match="seq_ids must be distinct"):
        cache.append([a, a], [1, 2])
    for bad in ("x", 1.5, True, -1, [1]):
        with pytest.raises(ValueError, match=r"num_new_tokens must be non-negative integers, got \["):
            cache.append([a], [bad])
    assert cache.num_tokens(a) == 0
    with pytest.raises(IndexError, match=r"layer 2 is outside 0\.\.1"):
        cache.write(2, cache.append([a], [1]), kv(1), kv(1))


@pytest.mark.parametrize(
    "dtype, kv_bits", [(mx.float16, None), (mx.bfloat16, None), (mx.float32, None), (mx.float16, 8), (mx.bfloat16, 4)]
)
def test_appending_a_thousand_tokens_does_not_copy_the_pool(dtype, kv_bits):
    cache = make(
        num_layers=2,
        num_kv_heads=8,
        head_dim=128,
        max_num_seqs=1,
        max_model_len=1024,
        page_size=16,
        num_pages=512,
        dtype=dtype,
        kv_bits=kv_bits,
    )
    pool_bytes = cache.storage.nbytes
    (a,) = cache.claim(1)
    new = kv(1, heads=8, dim=128, dtype=dtype)
    mx.eval(new)
    mx.reset_peak_memory()
    baseline = mx.get_active_memory()
    active = []
    for _ in range(1000):
        batch = cache.append([a], [1])
        for layer in range(2):
            cache.write(layer, batch, new, new)
        mx.eval(cache.storage.tensors)
        active.append(mx.get_active_memory())
    assert max(active) - min(active) < 64 * 1024
    assert mx.get_peak_memory() - baseline < pool_bytes // 100
    assert cache.num_tokens(a) == 1000


def run_threads(target, count):
    errors = []

    def guarded(index):
        try:
            target(index)
        except Exception as exc:  # collected and asserted by the caller
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_bookkeeping_is_safe_from_many_threads():
    cache = make(num_pages=64, max_num_seqs=8)
    held = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(200):
            (s,) = cache.claim(1)
            for _ in range(3):
                cache.append([s], [int(rng.integers(1, 5))])
            pages = cache.pool.pages(s)
            held.append((len(pages), len(set(pages))))
            assert cache.release(s) == len(pages)

    assert run_threads(worker, 4) == []
    assert all(n == distinct for n, distinct in held) and len(held) == 800
    assert (cache.pool.free_count, cache.num_sequences) == (64, 0)


def test_write_from_a_second_thread_is_refused_clearly_until_the_first_evaluates():
    cache = make()
    (a,) = cache.claim(1)
    cache.write(0, cache.append([a], [1]), kv(1), kv(1))
    batch = cache.append([a], [1])
    errors = run_threads(lambda _: cache.write(0, batch, kv(1), kv(1)), 1)
    assert len(errors) == 1 and "thread other than the one that owns the KV tensors" in str(errors[0])
    cache.evaluate(wait=False)  # a pipelined step's evaluation, started: the next step may run anywhere

    def write_and_evaluate(_):
        cache.write(0, batch, kv(1, start=100.0), kv(1, start=200.0))
        cache.evaluate()
        mx.clear_streams()

    assert run_threads(write_and_evaluate, 1) == []
    keys, values = cache.as_tensor(a, 0)
    assert mx.array_equal(keys, mx.concatenate([kv(1), kv(1, start=100.0)])).item()
    assert mx.array_equal(values[1:], kv(1, start=200.0)).item()


class CacheMachine(RuleBasedStateMachine):
    """Random claim/append/release on the manager and raw alloc/share/free on its pool."""

    layout = "paged"

    def __init__(self):
        super().__init__()
        self.cache = make(
            self.layout,
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            max_num_seqs=5,
            max_model_len=24,
            page_size=4,
            num_pages=12,
        )
        self.pool = self.cache.pool
        self.tokens: dict[int, list[float]] = {}
        self.extra: dict[str, list[int]] = {}
        self.counter = 0.0
        self.names = iter(f"x{i}" for i in range(10**6))

    def _state(self):
        return (
            self.pool.free_count,
            {r: self.pool.pages(r) for r in self.pool.owners()},
            dict((s, self.cache.num_tokens(s)) for s in self.tokens),
        )

    @rule(n=st.integers(0, 3))
    def claim(self, n):
        before = self._state()
        try:
            ids = self.cache.claim(n)
        except KVCacheExhausted:
            assert self._state() == before
            return
        self.tokens.update({i: [] for i in ids})

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def step(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, unique=True))
        counts = data.draw(st.lists(st.integers(0, 9), min_size=len(ids), max_size=len(ids)))
        before = self._state()
        try:
            batch = self.cache.append(ids, counts)
        except (KVCacheExhausted, SequenceTooLong):
            assert self._state() == before
            return
        values = [self.counter + i for i in range(sum(counts))]
        self.counter += sum(counts)
        new = mx.array(values, dtype=mx.float32).reshape(-1, 1, 1)
        self.cache.write(0, batch, new, -new)
        for seq_id, chunk in zip(ids, np.split(np.array(values), np.cumsum(counts)[:-1])):
            self.tokens[seq_id].extend(chunk.tolist())

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        held = len(self.pool.pages(seq_id))
        free_before = self.pool.free_count
        shared = sum(self.pool.ref_count(p) > 1 for p in self.pool.pages(seq_id))
        assert self.cache.release(seq_id) == held
        assert self.pool.free_count == free_before + held - shared
        del self.tokens[seq_id]

    @rule(count=st.integers(0, 4))
    def alloc_outside(self, count):
        name = next(self.names)
        before = self._state()
        try:
            self.extra[name] = self.pool.alloc(name, count)
        except KVCacheExhausted:
            assert self._state() == before

    @precondition(lambda self: any(self.pool.pages(s) for s in self.tokens))
    @rule(data=st.data())
    def share_full_page(self, data):
        seq_id = data.draw(st.sampled_from([s for s in sorted(self.tokens) if self.pool.pages(s)]))
        page = self.pool.pages(seq_id)[0]
        name = next(self.names)
        self.pool.share(name, [page])
        self.extra[name] = [page]

    @precondition(lambda self: self.extra)
    @rule(data=st.data())
    def free_outside(self, data):
        name = data.draw(st.sampled_from(sorted(self.extra)))
        assert self.pool.free(name) == len(self.extra.pop(name))

    @invariant()
    def pool_is_consistent(self):
        holders: dict[int, int] = {}
        for owner in self.pool.owners():
            for page in self.pool.pages(owner):
                holders[page] = holders.get(page, 0) + 1
        assert all(self.pool.ref_count(p) == n for p, n in holders.items())
        assert self.pool.used_count == len(holders)
        assert self.pool.free_count + self.pool.used_count == self.pool.capacity
        live_pages = [p for s in self.tokens for p in self.pool.pages(s)]
        assert len(live_pages) == len(set(live_pages))

    @invariant()
    def every_sequence_reads_back_what_it_wrote(self):
        if not self.tokens:
            return
        ids = sorted(self.tokens)
        batch = self.cache.fetch(ids)
        length = max(1, int(batch.context_lens.max()))
        keys = np.array(gather_kv(self.cache.kv(0)[0], batch.page_tables, length))
        for row, seq_id in enumerate(ids):
            assert keys[row, 0, : len(self.tokens[seq_id]), 0].tolist() == self.tokens[seq_id]
            k, v = self.cache.as_tensor(seq_id, 0)
            assert np.array(k)[:, 0, 0].tolist() == self.tokens[seq_id]
            assert np.array(v)[:, 0, 0].tolist() == [-t for t in self.tokens[seq_id]]

    @invariant()
    def blocks_in_use_are_the_pages_holding_tokens(self):
        held = {p for s, t in self.tokens.items() for p in self.pool.pages(s)[: -(-len(t) // self.cache.page_size)]}
        assert self.cache.pages_in_use == len(held)

    def teardown(self):
        for seq_id in list(self.tokens):
            self.cache.release(seq_id)
        for name in list(self.extra):
            self.pool.free(name)
        assert self.pool.free_count == self.pool.capacity


class ContiguousCacheMachine(CacheMachine):
    layout = "contiguous"


TestPagedCache = CacheMachine.TestCase
TestPagedCache.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestContiguousCache = ContiguousCacheMachine.TestCase
TestContiguousCache.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_skip_drops_each_rows_leading_new_tokens():
    cache = make(num_pages=10)
    a, b, c = cache.claim(3)
    cache.append([a], [2])
    batch = cache.append([a, b, c], [3, 4, 1])
    rest = batch.skip(np.array([1, 4, 0]))
    assert rest.query_lens.tolist() == [2, 0, 1]
    assert rest.context_lens.tolist() == batch.context_lens.tolist() == [5, 4, 1]
    assert rest.positions.tolist() == [3, 4, 0]
    assert rest.slot_mapping.tolist() == [batch.slot_mapping[i] for i in (1, 2, 7)]


def test_blocks_follow_their_tokens_into_derived_batches():
    cache = make(num_pages=10)
    a, b, c = cache.claim(3)
    cache.append([a], [2])
    blocks = np.zeros((8, 2), np.int32)
    blocks[1:3] = 3, 5  # row a's tokens at positions 3 and 4
    batch = cache.append([a, b, c], [3, 4, 1]).with_blocks(blocks)
    assert batch.skip(np.array([1, 4, 0])).blocks.tolist() == [[3, 5], [3, 5], [0, 0]]
    assert batch.skip(np.array([3, 0, 0])).blocks is None  # none of its tokens is in a block
    assert batch.select(np.array([2, 0])).blocks.tolist() == [[0, 0], [0, 0], [3, 5], [3, 5]]
    assert batch.select(np.array([1])).blocks is None


def test_sliding_window_layers_hold_pages_of_their_own():
    """Layer 0 sees the last 6 tokens, layer 1 all of them: layer 0's pages slide, the step's
    batch for each layer points at its own pages, and usage counts both."""
    cache = make(num_pages=16, max_num_seqs=2, layer_windows=[6, None], window_pages={6: 8})
    (a,) = cache.claim(1)
    for count in (5, 3, 1, 4):
        batch = cache.append([a], [count])
        for layer in (0, 1):
            cache.write(layer, batch, kv(count, start=10.0 * layer), kv(count))
    assert cache.num_tokens(a) == 13 and cache.pool.pages(a) == cache.fetch([a]).page_tables[0, :4].tolist()
    local = batch.for_window(6)
    assert local is not batch and local.query_lens.tolist() == [4]
    group = cache.windowed[6]
    assert group.layers == [0] and group.tables[a].dropped == 1  # tokens 0-3 left the window of token 9
    assert group.pool.pages(a) == local.page_tables[0, 1:4].tolist()
    assert cache.kv(0)[0].shape[0] == 8 and cache.kv(1)[0].shape[0] == 16
    usage = cache.usage()
    assert (usage.pages_used, usage.windowed[0][0], usage.windowed[0][1].pages_used) == (4, 6, 3)
    assert "window-6 layers 3/8" in str(usage)
    with pytest.raises(MlxkvError, match="layer 0 keeps only the pages of its last 6 tokens"):
        cache.as_tensor(a, 0)
    cache.release(a)
    assert group.pool.free_count == 8 and cache.free_pages == 16


def test_a_step_that_one_window_group_cannot_hold_changes_no_group():
    cache = make(
        num_layers=3,
        num_pages=16,
        max_num_seqs=1,
        layer_windows=[4, 8, None],
        max_model_len=64,
        window_pages={4: 8, 8: 3},
    )
    (a,) = cache.claim(1)
    cache.append([a], [8])
    with pytest.raises(KVCacheExhausted):
        cache.append([a], [12])
    tables = [cache.windowed[4].tables[a], cache.windowed[8].tables[a], cache._table(a)]
    assert [t.num_tokens for t in tables] == [8, 8, 8]
    assert cache.append([a], [1]).for_window(8).context_lens.tolist() == [9]


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_each_layer_may_have_its_own_kv_heads_and_head_dim(layout):
    """Gemma 4's global layers have wider heads, and may have fewer KV heads, than its sliding
    ones: each layer's pages take its own shape, in the window group's pages or the shared ones,
    and give back what was written."""
    cache = make(
        layout,
        num_layers=3,
        num_kv_heads=[2, 1, 2],
        head_dim=[4, 8, 4],
        layer_windows=[6, None, 6],
        window_pages={6: 8},
    )
    (a,) = cache.claim(1)
    batch = cache.append([a], [5])
    shapes = {0: (2, 4), 1: (1, 8), 2: (2, 4)}
    for layer, (heads, dim) in shapes.items():
        cache.write(layer, batch, kv(5, heads, dim, start=layer), kv(5, heads, dim))
        assert cache.kv(layer)[0].shape[1:] == (heads, cache.page_size, dim)
    assert mx.array_equal(cache.as_tensor(a, 1)[0], kv(5, 1, 8, start=1)).item()
    per_token = 2 * 4 * (1 * 8 + (2 * 4 + 2 * 4) * (layout == "contiguous"))
    assert cache.storage.bytes_per_token == per_token
    with pytest.raises(ValueError, match=r"keys must have shape \(tokens=5, num_kv_heads=1, head_dim=8\)"):
        cache.write(1, batch, kv(5), kv(5))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(num_kv_heads=[2, 2, 2]), "num_kv_heads has 3 entries for 2 layers"),
        (dict(head_dim=[4, 0]), "head_dim must be a positive integer, got 0"),
        (dict(head_dim=4.0), "head_dim must be a positive integer, got 4.0"),
        (dict(head_dim=[64, 96], kv_bits=8), "kv_group_size=64 must divide the model's head_dim=96; use 32"),
    ],
)
def test_per_layer_shapes_are_checked(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make(**kw)


def windowed_prefix(cache, tokens, steps=(5, 4, 4)):
    """A sequence that computed `tokens` in steps of `steps` tokens (publishing each, as the engine
    does), then was released."""
    (seq,) = cache.claim(1)
    done, keys = 0, kv(len(tokens))
    for count in steps:
        batch = cache.append([seq], [count])
        for layer in (0, 1):
            cache.write(layer, batch, keys[done : done + count] + 100.0 * layer, kv(count))
        cache.evaluate()
        done += count
        cache.publish([seq], [tokens], [done])
    cache.release(seq)


def test_a_window_group_reuses_a_prefix_only_while_it_holds_the_pages_its_window_reaches():
    """Layer 0 sees the last 6 tokens: 12 cached tokens continue from page 1 on in its group (token
    12 sees tokens 7-12), shared with the sequence that left them; once another sequence has
    taken those pages the full-attention pages alone cannot start a prefix, and nothing is reused."""
    cache = make(num_pages=16, max_num_seqs=2, layer_windows=[6, None], window_pages={6: 4})
    tokens = list(range(1, 15))
    windowed_prefix(cache, tokens)
    group = cache.windowed[6]
    (b,) = cache.claim(1)
    assert cache.reuse_prefix(b, tokens) == 12 and cache.prefix_caching
    table = group.tables[b]
    assert (table.dropped, table.num_tokens, len(group.pool.pages(b)), table.pages[0]) == (1, 12, 2, 0)
    assert mx.array_equal(group.storage.read(0, table.pages[1:3], 8)[0], kv(14)[4:12]).item()
    batch = cache.append([b], [2])
    assert batch.for_window(6).context_lens.tolist() == [14] and batch.context_lens.tolist() == [14]
    cache.release(b)
    (c,) = cache.claim(1)
    cache.append([c], [13])  # all four of the window group's pages
    cache.release(c)
    (d,) = cache.claim(1)
    assert cache.reuse_prefix(d, tokens) == 0 and cache._table(d).num_pages == 0


def test_a_window_groups_pages_come_back_from_disk_where_its_pool_lost_them(tmp_path):
    """With the disk tier, each window group's pages are filed too, under keys of its own: the
    pool still holds the full-attention pages, the window group's come back from disk, equal."""
    cache = make(
        num_pages=16, max_num_seqs=2, layer_windows=[6, None], window_pages={6: 4}, disk=DiskSpec(tmp_path, 10**9, "m")
    )
    tokens = list(range(1, 15))
    windowed_prefix(cache, tokens)
    assert cache.disk.flush(10)
    group = cache.windowed[6]
    (c,) = cache.claim(1)
    cache.append([c], [13])
    cache.release(c)
    (d,) = cache.claim(1)
    assert cache.reuse_prefix(d, tokens) == 12
    assert cache.disk.stats.pages_restored == 2  # the window group's pages 1 and 2; the others were in the pool
    cache.evaluate()
    assert mx.array_equal(group.storage.read(0, group.tables[d].pages[1:3], 8)[0], kv(14)[4:12]).item()
