import mlx.core as mx

from mlxkv import KVCacheManager, SamplingParams
from mlxkv.engine.images import PromptImages
from mlxkv.engine.memory.chunk_sizing import LEAST_CHUNK, ChunkSizer
from mlxkv.engine.memory.step_memory import StepMemory
from mlxkv.engine.memory.step_time import StepTime
from mlxkv.engine.request import Request, Status
from mlxkv.engine.scheduler import HOLD_STEPS, Scheduler


def make(num_pages=32, page_size=4, max_num_seqs=8, budget=16, layout="paged", prefix_caching=True, kv_bits=None):
    cache = KVCacheManager(
        1,
        1,
        32,
        max_num_seqs=max_num_seqs,
        max_model_len=64,
        layout=layout,
        page_size=page_size,
        num_pages=num_pages,
        dtype=mx.float32,
        prefix_caching=prefix_caching,
        kv_bits=kv_bits,
        kv_group_size=32,
    )
    return Scheduler(cache, max_num_seqs, budget)


def request(name, prompt_len, max_tokens=8, first=0, salt=None):
    """A request whose prompt is `first, first + 1, ...` (distinct `first`s share no prefix)."""
    return Request(name, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens), cache_salt=salt)


def run_step(scheduler):
    """Play the engine: advance what was scheduled and 'sample' token 1 where a row samples."""
    batch = scheduler.schedule()
    scheduler.commit(batch)
    for r, samples in zip(batch.requests, batch.samples):
        if samples:
            r.append_output(1)
    return [(r.request_id, n) for r, n in zip(batch.requests, batch.counts)]


def test_decodes_first_then_prefill_chunks_split_to_the_budget():
    s = make(budget=8)
    for r in (request("a", 3), request("b", 3)):
        s.add(r)
    assert run_step(s) == [("a", 3), ("b", 3)]
    s.add(request("c", 10))
    assert run_step(s) == [("a", 1), ("b", 1), ("c", 6)]
    assert run_step(s) == [("a", 1), ("b", 1), ("c", 4)]
    assert run_step(s) == [("a", 1), ("b", 1), ("c", 1)]


def test_entry_cap_keeps_the_rest_waiting():
    s = make(max_num_seqs=2)
    for name in "abc":
        s.add(request(name, 2))
    assert run_step(s) == [("a", 2), ("b", 2)]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_admission_waits_for_free_pages_in_arrival_order():
    s = make(num_pages=4, page_size=4, budget=32)
    s.add(request("a", 12))
    s.add(request("b", 8))
    s.add(request("c", 2))
    assert run_step(s) == [("a", 12)]
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_newest_running_request_is_preempted_by_recompute_and_resumes_from_its_cached_pages():
    s = make(num_pages=3, page_size=4)
    a, b = request("a", 4), request("b", 4, first=100)
    s.add(a)
    s.add(b)
    assert run_step(s) == [("a", 4), ("b", 4)]
    assert run_step(s) == [("a", 1)]
    assert (b.status, b.num_computed, b.output_ids, s.num_preemptions) == (Status.WAITING, 0, [1], 1)
    assert s.waiting[0] is b
    s.finish(a, "stop")
    assert run_step(s) == [("b", 1)]  # its full prompt page waited in the cache; only the sampled token runs
    assert (b.num_computed, b.num_cached_tokens, s.cache.free_pages) == (5, 0, 1)


def test_preempted_request_recomputes_everything_without_prefix_caching():
    s = make(num_pages=3, page_size=4, prefix_caching=False)
    a, b = request("a", 4), request("b", 4, first=100)
    s.add(a)
    s.add(b)
    run_step(s)
    assert run_step(s) == [("a", 1)]
    s.finish(a, "stop")
    assert run_step(s) == [("b", 5)]


def test_finish_frees_pages_wherever_the_request_is():
    s = make()
    a, b = request("a", 5), request("b", 5)
    s.add(a)
    run_step(s)
    s.add(b)
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert s.cache.free_pages == s.cache.pool.capacity
    assert not s.has_work()
    assert (a.finish_reason, b.status) == ("abort", Status.FINISHED)


def test_contiguous_layout_admits_one_sequence_per_slot():
    s = make(layout="contiguous", max_num_seqs=2)
    for name in "abc":
        s.add(request(name, 2))
    assert run_step(s) == [("a", 2), ("b", 2)]
    assert (s.cache.free_pages, [r.request_id for r in s.waiting]) == (0, ["c"])


def test_quantized_pages_compute_a_new_prompts_own_kv_span_in_one_step():
    """With quantized pages a new prompt's first chunk holds the prompt but its last token
    (at most the budget less a decode token per other sequence: 16 - 3 here) from its own
    unquantized K/V; a prompt whose span does not fit this step's budget waits, not split."""
    s = make(budget=16, max_num_seqs=4, kv_bits=8)
    s.add(request("a", 5))
    batch = s.schedule()
    assert (batch.counts, batch.own_kv) == ([5], [4])
    s.commit(batch)
    batch.requests[0].append_output(1)
    s.add(request("b", 14, first=100))
    s.add(request("c", 3, first=200))
    batch = s.schedule()
    assert ([r.request_id for r in batch.requests], batch.counts, batch.own_kv) == (["a", "b"], [1, 14], [0, 13])
    s.commit(batch)
    for r in batch.requests:
        r.append_output(1)
    s.add(request("d", 40, first=300))
    batch = s.schedule()
    assert ([r.request_id for r in batch.requests], batch.counts) == (["a", "b", "c"], [1, 1, 3])
    assert batch.own_kv == [0, 0, 2]
    assert [r.request_id for r in s.waiting] == ["d"]  # its 13-token span needs 13 of the 11 left
    s.commit(batch)
    for r in batch.requests:
        r.append_output(1)
    s.finish(batch.requests[2], "length")
    batch = s.schedule()
    assert ([r.request_id for r in batch.requests], batch.counts) == (["a", "b", "d"], [1, 1, 14])
    assert batch.own_kv == [0, 0, 13]


def test_float_pages_and_prefix_hits_have_no_own_kv_span():
    s = make(budget=16)
    s.add(request("a", 5))
    assert s.schedule().own_kv == [0]
    q = make(budget=16, kv_bits=4, page_size=4)
    q.add(request("a", 9))
    run_step(q)
    q.finish(q.running[0], "length")
    q.add(request("b", 9))
    batch = q.schedule()
    assert (batch.requests[0].num_computed, batch.own_kv) == (8, [0])


def sized(sizer, budget=64):
    scheduler = make(num_pages=64, budget=budget)
    scheduler.sizer = sizer
    return scheduler


def fitted(fixed, per_token, per_pair=0.0):
    """A step-time fit of exactly these costs."""
    step_time = StepTime()
    for tokens, attended in [(1, 10), (8, 100), (2, 5), (32, 900), (4, 40), (16, 300)]:
        step_time.record(tokens, attended, fixed + per_token * tokens + per_pair * attended)
    return step_time


def decoding(scheduler, names="acd"):
    """`scheduler` with a request decoding for each of `names`."""
    for i, name in enumerate(names):
        scheduler.add(request(name, 3, max_tokens=20, first=100 + 10 * i))
    assert run_step(scheduler) == [(name, 3) for name in names]  # nobody decodes yet: whole prompts
    return scheduler


def test_while_others_decode_a_chunk_is_cut_to_the_latency_target():
    s = decoding(sized(ChunkSizer(step_time=fitted(0.010, 0.001), max_itl_s=0.0405)))
    s.add(request("b", 60))
    assert run_step(s) == [("a", 1), ("c", 1), ("d", 1), ("b", 27)]  # 10 ms + 30 tokens of 1 ms: 40 ms
    assert run_step(s) == [("a", 1), ("c", 1), ("d", 1), ("b", 27)]


def test_a_chunk_never_falls_below_the_least_chunk():
    s = decoding(sized(ChunkSizer(step_time=fitted(0.050, 0.001), max_itl_s=0.040)))  # decodes alone miss it
    s.add(request("b", 60))
    s.add(request("e", 60, first=200))
    assert run_step(s) == [("a", 1), ("c", 1), ("d", 1), ("b", LEAST_CHUNK)]  # one chunk progresses


def test_a_relative_target_cuts_a_chunk_to_its_share_of_the_decode_step():
    """Decoding alone, b's row counted in, takes 20.5 + 4 x 1 ms: at a factor of 2 a step may take 49 ms,
    25 of them for b's prompt beside the three decode rows."""
    s = decoding(sized(ChunkSizer(step_time=fitted(0.0205, 0.001), max_itl_factor=2.0)))
    s.add(request("b", 60))
    assert run_step(s) == [("a", 1), ("c", 1), ("d", 1), ("b", 25)]


def test_a_decode_step_slower_than_the_target_still_leaves_prefill_its_share():
    """50.5 + 4 ms of decoding misses a 40 ms target by itself; at a factor of 2 the step still takes
    55 ms of prefill (not the 16-token minimum), and the absolute target is kept where it is longer."""
    slow = fitted(0.0505, 0.001)
    s = decoding(sized(ChunkSizer(step_time=slow, max_itl_s=0.040, max_itl_factor=2.0), budget=80))
    s.add(request("b", 60))
    assert run_step(s) == [("a", 1), ("c", 1), ("d", 1), ("b", 55)]  # 2 x 54.5 ms = 53.5 + 55.5
    s = decoding(sized(ChunkSizer(step_time=slow, max_itl_s=0.120, max_itl_factor=2.0), budget=80))
    s.add(request("b", 60))
    assert run_step(s) == [("a", 1), ("c", 1), ("d", 1), ("b", 60)]  # within 120 ms: 53.5 + 60


def test_the_decode_step_counts_the_prompts_that_will_decode_beside_it():
    """Two waiting prompts will decode beside the three rows: the share is of a five-row step."""
    s = decoding(sized(ChunkSizer(step_time=fitted(0.0205, 0.001), max_itl_factor=2.0)))
    s.add(request("b", 60))
    s.add(request("e", 60, first=300))
    assert run_step(s) == [("a", 1), ("c", 1), ("d", 1), ("b", 27)]  # 2 x 25.5 ms = 23.5 + 27.5


def test_prompts_arriving_together_start_decoding_together():
    """Under a target, with nothing decoding and more prompt left than a step holds, each prompt stops
    short of its last token; the last tokens run in one step, so every prompt decodes from the next on
    and no chunk was cut for the first ones' sake."""
    s = sized(ChunkSizer(step_time=fitted(0.010, 0.001), max_itl_factor=2.0), budget=16)
    for i, name in enumerate("abcd"):
        s.add(request(name, 6, first=100 * i))
    assert run_step(s) == [("a", 5), ("b", 5), ("c", 5), ("d", 1)]  # 21 prompt tokens left: hold
    assert run_step(s) == [("a", 1), ("b", 1), ("c", 1), ("d", 5)]  # 5 left: none held
    assert run_step(s) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]


def test_a_prompt_waits_for_the_others_at_most_hold_steps():
    s = sized(ChunkSizer(step_time=fitted(0.020, 0.001), max_itl_factor=2.0), budget=4)
    s.add(request("a", 4))
    s.add(request("b", 60, first=100))
    steps = [run_step(s) for _ in range(HOLD_STEPS + 1)]
    assert steps == [[("a", 3), ("b", 1)]] + [[("b", 4)]] * (HOLD_STEPS - 1) + [[("a", 1), ("b", 3)]]
    assert run_step(s) == [("a", 1), ("b", 3)]  # a decodes: b's chunks are cut to the target now


def test_without_a_target_nothing_is_held():
    s = make(budget=16)
    for i, name in enumerate("abcd"):
        s.add(request(name, 6, first=100 * i))
    assert run_step(s) == [("a", 6), ("b", 6), ("c", 4)]


def test_chunks_are_cut_to_the_memory_reserve_more_as_the_context_grows():
    memory = StepMemory(per_token=10, per_sample=0, heads=None, attention=lambda heads, q, c: q * c)
    s = sized(ChunkSizer(memory=memory, reserve=1000))
    s.add(request("a", 60))
    counts = [run_step(s)[0][1] for _ in range(4)]
    assert counts == [27, 18, 14, 1]  # the most n with 10 * n + n * (computed + n) <= 1000


def with_blocks(r, *blocks):
    """`r` as a prompt whose images' tokens at each `(first, end)` attend each other both ways (Gemma 4)."""
    r.images = PromptImages((), blocks=blocks)
    return r


def test_a_chunk_never_ends_inside_a_block_nor_at_its_last_token():
    s = make(budget=8)
    s.add(with_blocks(request("a", 24), (5, 12), (15, 21)))
    assert run_step(s) == [("a", 5)]  # 8 would end inside (5, 12): cut back to its start
    assert run_step(s) == [("a", 8)]  # to 13, past the block's last token
    assert run_step(s) == [("a", 2)]  # 8 would end at (15, 21)'s last token: cut back to 15
    assert run_step(s) == [("a", 8)]
    assert run_step(s) == [("a", 1)]


def test_a_block_where_a_chunk_starts_waits_for_a_step_that_holds_it_and_one_token_more():
    s = make(budget=8)
    s.add(request("a", 2))
    run_step(s)
    s.add(with_blocks(request("b", 12, first=100), (0, 7)))
    assert run_step(s) == [("a", 1)]  # b's block and a token more need 8 of the 7 left
    s.finish(s.running[0], "length")
    assert run_step(s) == [("b", 8)]
