import random
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from helpers import ExplodingSampler, drafts_always_pay, mlx_lm_greedy, mutant_kernels, uncompilable_kernels

from mlxkv import LLM, LLMEngine, Pin, RequestTooLong, SamplingParams, UnknownSequenceError, reference_attention
from mlxkv.attention.kernels import PagedAttentionKernels
from mlxkv.config import EngineConfig
from mlxkv.engine.request import NO_SEQUENCE
from mlxkv.models.loading import load

N_REQUESTS = 200


@pytest.fixture(scope="module")
def model(checkpoint):
    return load(checkpoint("llama-fp32"))


@pytest.fixture(scope="module")
def workload(model):
    """200 prompts of random lengths, and the greedy tokens each produces alone."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 320) for _ in range(rng.randint(1, 40))] for _ in range(N_REQUESTS)]
    params = [SamplingParams(max_tokens=rng.randint(1, 12)) for _ in range(N_REQUESTS)]
    alone = LLM(model, max_num_seqs=1)
    expected = [alone.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    return prompts, params, expected


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("speculating", [False, True], ids=["", "prompt-lookup"])
def test_many_requests_under_preemption_and_cancellation(model, workload, layout, speculating):
    prompts, params, expected = workload
    sizing = dict(num_pages=14, page_size=8) if layout == "paged" else dict(kv_cache_memory=6 * 64 * 3072)
    config = EngineConfig(
        kv_layout=layout,
        max_num_seqs=12,
        max_num_batched_tokens=64,
        max_model_len=64,
        prompt_lookup=speculating,
        **sizing,
    )
    engine = LLMEngine(*model, config)
    drafts_always_pay(engine)
    requests = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    cancelled, leaks = set(), []
    done, first = threading.Event(), threading.Event()

    def cancel_at_random():
        """Aborts even-numbered requests at random moments, racing the steps; the odd ones always
        finish, so that what the assertions below need happens however the machine is loaded."""
        rng = random.Random(1)
        while not done.is_set():
            time.sleep(rng.uniform(0, 0.01))
            live = [r for r in requests[::2] if r.finish_reason is None]
            if not live:
                continue
            victim = rng.choice(live)
            seq_id = victim.seq_id
            try:
                engine.abort(victim.request_id)
            except UnknownSequenceError:
                continue
            cancelled.add(victim.request_id)
            first.set()
            if seq_id != NO_SEQUENCE and engine.cache.pool.pages(seq_id):
                leaks.append(victim.request_id)

    canceller = threading.Thread(target=cancel_at_random)
    canceller.start()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 4:  # at least one abort lands while requests run, whoever the scheduler favours
            assert first.wait(timeout=120)
    done.set()
    canceller.join()

    assert leaks == []
    assert 0 < len(cancelled) < N_REQUESTS
    for request, tokens in zip(requests, expected):
        if request.request_id in cancelled:
            assert request.finish_reason == "abort"
        else:
            assert request.output_ids == tokens, request.request_id
    if layout == "paged":
        assert engine.scheduler.num_preemptions > 0
    if speculating:
        assert engine.stats().speculation.accepted > 0
    assert engine.cache.free_pages == engine.cache.pool.capacity
    assert engine.cache.num_sequences == 0


@pytest.fixture(scope="module")
def shared_prefixes(model):
    """60 prompts that start with one of four shared "system prompts" (some prompts repeat
    exactly), and the greedy tokens each produces alone with prefix caching off."""
    rng = random.Random(2)
    systems = [[rng.randrange(1, 320) for _ in range(n)] for n in (8, 19, 33, 40)]
    prompts = [rng.choice(systems) + [rng.randrange(1, 320) for _ in range(rng.randint(0, 12))] for _ in range(60)]
    params = [SamplingParams(max_tokens=rng.randint(1, 12)) for _ in prompts]
    alone = LLM(model, max_num_seqs=1, prefix_caching=False)
    expected = [alone.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    return prompts, params, expected


@pytest.mark.parametrize("layout, caching", [("paged", True), ("paged", False), ("contiguous", True)])
def test_prefix_caching_changes_no_token_under_preemption_and_eviction(model, shared_prefixes, layout, caching):
    prompts, params, expected = shared_prefixes
    sizing = dict(num_pages=14, page_size=8) if layout == "paged" else dict(kv_cache_memory=6 * 64 * 3072)
    engine = LLMEngine(
        *model,
        EngineConfig(
            kv_layout=layout,
            max_num_seqs=12,
            max_num_batched_tokens=64,
            max_model_len=64,
            prefix_caching=caching,
            **sizing,
        ),
    )
    requests, _ = run_all(engine, prompts, params)
    assert [r.output_ids for r in requests] == expected
    stats = engine.stats().prefix_cache
    assert stats.prompt_tokens == sum(map(len, prompts))
    assert stats.cached_tokens == sum(r.num_cached_tokens for r in requests)
    if layout == "paged":
        assert engine.scheduler.num_preemptions > 0
    if layout == "paged" and caching:
        assert stats.hit_rate > 0.3 and engine.cache.pool.num_evictions > 0
    else:
        assert stats.cached_tokens == 0 and engine.cache.pool.num_evictions == 0
    assert (engine.cache.free_pages, engine.cache.num_sequences) == (engine.cache.pool.capacity, 0)


@pytest.mark.parametrize("layout, caching", [("paged", False), ("contiguous", False), ("paged", True)])
def test_quantized_pages_under_preemption(checkpoint, layout, caching):
    """4-bit pages: a preempted request recomputes its prompt's own-K/V span whole, so without
    prefix caching no token changes; with it, hits make prompt tokens attend quantized K/V
    instead (as mlx-lm's prompt-cache reuse does), and pages and pool still balance."""
    model = load(checkpoint("qwen3-fp32-d64"))
    rng = random.Random(4)
    systems = [[rng.randrange(1, 320) for _ in range(n)] for n in (9, 30)]
    prompts = [rng.choice(systems) + [rng.randrange(1, 320) for _ in range(rng.randint(1, 10))] for _ in range(40)]
    params = [SamplingParams(max_tokens=rng.randint(1, 12)) for _ in prompts]
    alone = LLM(model, max_num_seqs=1, kv_bits=4, prefix_caching=False)
    expected = [alone.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    sizing = dict(num_pages=14, page_size=8) if layout == "paged" else dict(kv_cache_memory=6 * 64 * 320)
    engine = LLMEngine(
        *model,
        EngineConfig(
            kv_layout=layout,
            max_num_seqs=12,
            max_num_batched_tokens=64,
            max_model_len=64,
            kv_bits=4,
            prefix_caching=caching,
            **sizing,
        ),
    )
    requests, _ = run_all(engine, prompts, params)
    assert [len(r.output_ids) for r in requests] == [sp.max_tokens for sp in params]
    if caching:
        assert engine.stats().prefix_cache.hit_rate > 0.3
    else:
        assert [r.output_ids for r in requests] == expected
    if layout == "paged":
        assert engine.scheduler.num_preemptions > 0
    assert (engine.cache.free_pages, engine.cache.num_sequences) == (engine.cache.pool.capacity, 0)


def test_the_next_turn_reuses_the_pages_of_the_answer(model):
    """Pages of generated tokens are cached too, the partly filled last one included: a
    follow-up prompt made of the prompt, the answer and a new message computes only the
    tokens the first request did not store (the answer's last token and the new message)."""
    prompt, params = list(range(10, 20)), SamplingParams(max_tokens=12, ignore_eos=True)
    llm = LLM(model, page_size=8, max_num_seqs=1)
    first = llm.generate(prompt, params)[0]
    follow_up = prompt + first.token_ids + [7, 8, 9]
    second = llm.generate(follow_up, params)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 21)  # 10 prompt + 11 stored answer tokens
    alone = LLM(model, page_size=8, max_num_seqs=1, prefix_caching=False).generate(follow_up, params)[0]
    assert second.token_ids == alone.token_ids and alone.num_cached_tokens == 0


def test_requests_with_different_cache_salts_share_nothing(model):
    llm = LLM(model, page_size=8, max_num_seqs=1)
    prompt, params = list(range(10, 30)), SamplingParams(max_tokens=2)
    cached = [
        llm.generate(prompt, params, cache_salt=salt)[0].num_cached_tokens
        for salt in ("alice", "bob", None, "alice", None)
    ]
    assert cached == [0, 0, 0, 19, 19]  # all but the last prompt token, for the same salt
    with pytest.raises(ValueError, match="cache_salt must be None or a non-empty string, got ''"):
        llm.generate(prompt, params, cache_salt="")


def test_bad_requests_are_refused_without_disturbing_the_rest(model):
    engine = LLMEngine(*model, EngineConfig(num_pages=8, page_size=8, max_model_len=64))
    ok = engine.add_request([5, 6, 7], SamplingParams(max_tokens=5), request_id="ok")
    engine.step()
    with pytest.raises(RequestTooLong, match="one request can have at most 64"):
        engine.add_request(list(range(1, 60)), SamplingParams(max_tokens=10), request_id="big")
    with pytest.raises(ValueError, match="request id 'ok' is already in use"):
        engine.add_request([1], SamplingParams(max_tokens=2), request_id="ok")
    with pytest.raises(UnknownSequenceError, match="unknown sequence id 'nope'"):
        engine.abort("nope")
    while engine.has_unfinished():
        engine.step()
    assert len(ok.output_ids) == 5 and ok.finish_reason == "length"
    assert engine.cache.free_pages == 8


def test_metal_kernels_give_the_reference_tokens(checkpoint, model):
    """The engine through the Metal kernels (run by the CPU simulator) and through the
    reference path produce the same greedy tokens as mlx-lm."""
    from mlxkv.attention.lab.simulator import metal_kernel

    prompts = [[5, 6, 7], list(range(10, 29))]
    params = SamplingParams(max_tokens=6)
    kernels = PagedAttentionKernels(metal_kernel)
    engine = LLMEngine(*model, EngineConfig(page_size=8, max_num_seqs=2), kernels=kernels)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    expected = [mlx_lm_greedy(checkpoint("llama-fp32"), p, max_tokens=6) for p in prompts]
    assert [r.output_ids for r in requests] == expected
    assert [c.token_ids for c in LLM(model, attention="reference").generate(prompts, params)] == expected


@pytest.mark.parametrize(
    "factory, why",
    [
        (
            uncompilable_kernels,
            "paged_attention failed to compile or run: [metal::Device] Unable to build metal library",
        ),
        (
            mutant_kernels("static_cast<T>(acc / sum)", "static_cast<T>(-acc / sum)"),
            "paged_attention differs from the reference attention by up to ",
        ),
    ],
    ids=["does-not-compile", "wrong-numbers"],
)
def test_kernels_that_fail_the_start_up_check_leave_the_reference_path(checkpoint, model, caplog, factory, why):
    """A Mac user gets one warning and the reference tokens, never a crash or wrong text."""
    engine = LLMEngine(*model, EngineConfig(page_size=8), kernels=PagedAttentionKernels(factory))
    [record] = caplog.records
    assert record.levelname == "WARNING" and record.name == "mlxkv.attention.backend"
    assert record.getMessage().startswith(
        "mlxkv's Metal kernels fail their start-up check for this model "
        f"(float32, head_dim 16, pages of 8, GQA 2): {why}"
    )
    assert record.getMessage().endswith("; attention runs on the reference path instead")
    assert engine.runner.attention is reference_attention
    request = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6))
    while engine.has_unfinished():
        engine.step()
    assert request.output_ids == mlx_lm_greedy(checkpoint("llama-fp32"), [5, 6, 7], max_tokens=6)


FAILURE_PROMPTS = [[5, 6, 7], list(range(10, 29)), [40, 41], list(range(50, 61))]


@pytest.fixture(scope="module")
def solo(model):
    """Each FAILURE_PROMPTS prompt's tokens alone: greedy, and seeded sampling."""
    alone = LLM(model, max_num_seqs=1)
    greedy = [alone.generate(p, SamplingParams(max_tokens=8))[0].token_ids for p in FAILURE_PROMPTS]
    seeded = [
        alone.generate(p, SamplingParams(max_tokens=8, temperature=0.9, seed=i))[0].token_ids
        for i, p in enumerate(FAILURE_PROMPTS)
    ]
    return greedy, seeded


def run_all(engine, prompts, params):
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return requests, outputs


def test_a_failing_sampler_fails_only_its_own_request(model, solo):
    """A step that fails leaves the engine as if it had not run: the others equal their solo runs
    (the bug was every neighbour recomputed at shifted positions)."""
    engine = LLMEngine(*model, EngineConfig(page_size=4, max_num_seqs=4))
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=i) for i in range(4)]
    requests = [engine.add_request(p, sp) for p, sp in zip(FAILURE_PROMPTS, params)]
    for _ in range(3):
        engine.step()
    broken = requests[1]
    broken.sampler = ExplodingSampler(broken.params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    [failure] = [o for o in outputs if o.finish_reason == "error"]
    assert failure.request_id == broken.request_id and isinstance(failure.error, RuntimeError)
    assert broken.finish_reason == "error" and str(broken.error) == "sampler exploded"
    assert [r.output_ids for r in requests if r is not broken] == [t for i, t in enumerate(solo[1]) if i != 1]
    assert engine.cache.free_pages == engine.cache.pool.capacity


def test_a_forward_pass_failure_fails_its_batch_and_nothing_else(model, solo, monkeypatch):
    engine = LLMEngine(*model, EngineConfig(page_size=4, max_num_seqs=2))
    requests = [engine.add_request(p, SamplingParams(max_tokens=8)) for p in FAILURE_PROMPTS]
    engine.step()
    forward = engine.runner.logits
    calls = iter(range(10**6))

    def fail_on_the_second_call(batch, token_ids):
        if next(calls) == 1:
            raise RuntimeError("[metal] Command buffer execution failed: Internal Error")
        return forward(batch, token_ids)

    monkeypatch.setattr(engine.runner, "logits", fail_on_the_second_call)
    while engine.has_unfinished():
        engine.step()
    assert [r.finish_reason for r in requests] == ["error", "error", "length", "length"]
    assert str(requests[0].error) == "[metal] Command buffer execution failed: Internal Error"
    assert [r.output_ids for r in requests[2:]] == solo[0][2:]
    assert engine.cache.free_pages == engine.cache.pool.capacity


OUT_OF_MEMORY = RuntimeError(
    "[METAL] Command buffer execution failed: "
    "Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"
)


@pytest.mark.parametrize("where", ["forward", "evaluation"])
def test_a_step_out_of_memory_is_undone_and_retried_in_smaller_chunks(model, solo, monkeypatch, where):
    """No request fails or changes: the step is rolled back, the reserve halved, and its requests
    recompute to the tokens they would have drawn."""
    engine = LLMEngine(*model, EngineConfig(page_size=4, max_num_seqs=4))
    requests = [engine.add_request(p, SamplingParams(max_tokens=8)) for p in FAILURE_PROMPTS]
    engine.step()
    reserve, calls = engine.scheduler.sizer.reserve, iter(range(10**6))
    if where == "forward":
        forward = engine.runner.logits

        def failing(batch, token_ids):
            if next(calls) == 1:
                raise OUT_OF_MEMORY
            return forward(batch, token_ids)

        monkeypatch.setattr(engine.runner, "logits", failing)
    else:
        real_eval = mx.eval

        def failing(*args):
            if next(calls) == 1:
                raise OUT_OF_MEMORY
            return real_eval(*args)

        monkeypatch.setattr(mx, "eval", failing)
    while engine.has_unfinished():
        engine.step()
    assert [r.finish_reason for r in requests] == ["length"] * 4
    assert [r.output_ids for r in requests] == solo[0]
    assert engine.scheduler.sizer.reserve == reserve // 2
    assert engine.cache.free_pages == engine.cache.pool.capacity


def test_steps_out_of_memory_again_and_again_fail_their_requests(model, monkeypatch):
    engine = LLMEngine(*model, EngineConfig(page_size=4, max_num_seqs=2))
    requests = [engine.add_request(p, SamplingParams(max_tokens=8)) for p in FAILURE_PROMPTS[:2]]

    def failing(batch, token_ids):
        raise OUT_OF_MEMORY

    monkeypatch.setattr(engine.runner, "logits", failing)
    while engine.has_unfinished():
        engine.step()
    assert [r.finish_reason for r in requests] == ["error", "error"]
    assert requests[0].error is OUT_OF_MEMORY
    assert engine.cache.free_pages == engine.cache.pool.capacity


def test_kv_tensors_that_cannot_be_evaluated_start_afresh(model, solo, monkeypatch):
    """If the failure poisoned the KV pools themselves, every running request recomputes."""
    engine = LLMEngine(*model, EngineConfig(page_size=4, max_num_seqs=2))
    first = engine.add_request(FAILURE_PROMPTS[0], SamplingParams(max_tokens=8))
    engine.step()
    real_eval, failures = mx.eval, iter([True, True])

    def failing_eval(*args):
        if next(failures, False):
            raise RuntimeError("device lost")
        return real_eval(*args)

    monkeypatch.setattr(mx, "eval", failing_eval)
    engine.step()
    assert first.finish_reason == "error"
    requests, _ = run_all(engine, FAILURE_PROMPTS[2:], [SamplingParams(max_tokens=8)] * 2)
    assert [r.output_ids for r in requests] == solo[0][2:]
    assert engine.cache.free_pages == engine.cache.pool.capacity


def test_request_ids_are_strings_and_never_collide(model):
    engine = LLMEngine(*model, EngineConfig(page_size=4))
    given = engine.add_request([1, 2], request_id="0")
    automatic = engine.add_request([1, 2])
    assert given.request_id == "0" and automatic.request_id not in ("0",)
    numbered = engine.add_request([1, 2], request_id=7)
    assert numbered.request_id == "7"
    engine.abort(7)
    assert numbered.finish_reason == "abort"
    with pytest.raises(TypeError, match="request_id must be a string or an integer, got float"):
        engine.add_request([1, 2], request_id=1.5)
    for request_id in ("0", automatic.request_id):
        engine.abort(request_id)
    assert engine.cache.free_pages == engine.cache.pool.capacity


def test_outputs_carry_tokens_usage_and_the_model_s_logprobs(checkpoint, model):
    """A request that asks for logprobs gets, per token, its log-probability under the model
    and the most likely alternatives best first; every output carries the token counts."""
    from mlx_lm import load as mlx_lm_load

    engine = LLMEngine(*model, EngineConfig(page_size=8, max_num_seqs=2))
    prompt = [5, 6, 7, 8]
    asking = engine.add_request(prompt, SamplingParams(max_tokens=3, logprobs=3))
    plain = engine.add_request([9, 10], SamplingParams(max_tokens=2))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    mine = [o for o in outputs if o.request_id == asking.request_id]
    assert [o.token_ids for o in mine] == [(t,) for t in asking.output_ids]
    assert all(o.logprobs == () for o in outputs if o.request_id == plain.request_id)
    first = mine[0].logprobs[0]
    assert first.token == asking.output_ids[0] and len(first.top) == 3
    assert first.top[0] == (first.token, first.logprob)  # greedy: the chosen token is the most likely
    assert [lp for _, lp in first.top] == sorted((lp for _, lp in first.top), reverse=True)
    reference, _ = mlx_lm_load(str(checkpoint("llama-fp32")))
    logits = reference(mx.array(prompt)[None])[0, -1]
    expected = (logits - mx.logsumexp(logits)).tolist()
    assert all(abs(lp - expected[t]) < 1e-4 for t, lp in first.top)
    assert [(o.usage.prompt_tokens, o.usage.completion_tokens, o.usage.cached_tokens) for o in mine] == [
        (4, 1, 0),
        (4, 2, 0),
        (4, 3, 0),
    ]
    assert mine[-1].finished and mine[-1].finish_reason == "length"


def run_mixed(model, pipeline, eos, stop, abort_after):
    """A mixed batch through a small pool (preemptions): greedy and seeded rows, an EOS, a stop
    string, max_tokens, and one request aborted once it has produced `abort_after` tokens."""
    model_, tokenizer = model
    saved = set(tokenizer.eos_token_ids)
    tokenizer.eos_token_ids = saved | {eos}
    try:
        engine = LLMEngine(
            model_,
            tokenizer,
            EngineConfig(page_size=4, num_pages=12, max_num_seqs=5, max_num_batched_tokens=16, pipeline=pipeline),
        )
        params = [
            SamplingParams(max_tokens=12),
            SamplingParams(max_tokens=12, stop=[stop]),
            SamplingParams(max_tokens=7, temperature=0.9, seed=3),
            SamplingParams(max_tokens=12),
            SamplingParams(max_tokens=12, temperature=1.2, top_p=0.9, seed=4),
            SamplingParams(max_tokens=3),
        ]
        requests = [engine.add_request(p, sp) for p, sp in zip(FAILURE_PROMPTS * 2, params)]
        texts = {r.request_id: "" for r in requests}
        while engine.has_unfinished():
            for out in engine.step():
                texts[out.request_id] += out.delta
            victim = requests[3]
            if victim.finish_reason is None and victim.num_outputs >= abort_after:
                engine.abort(victim.request_id)
        assert engine.cache.free_pages == engine.cache.pool.capacity
        return [
            (r.output_ids, r.finish_reason, texts[r.request_id]) for r in requests
        ], engine.scheduler.num_preemptions
    finally:
        tokenizer.eos_token_ids = saved


def test_pipelined_steps_give_exactly_the_unpipelined_outputs(model):
    plain, _ = run_mixed(model, False, eos=-5, stop="\x00", abort_after=99)
    eos, stop = plain[0][0][4], plain[1][2][3:6]  # a token request 0 produces, text request 1 does
    expected, preempted = run_mixed(model, False, eos, stop, abort_after=4)
    assert preempted > 0
    reasons = [reason for _, reason, _ in expected]
    assert reasons[:4] == ["stop", "stop", "length", "abort"] and reasons[5] == "length"
    assert stop not in expected[1][2] and plain[1][2].startswith(expected[1][2])
    assert run_mixed(model, True, eos, stop, abort_after=4)[0] == expected


def test_an_abort_while_a_hybrids_step_is_built_drops_that_request_alone(tmp_path):
    """`step` builds the forward pass without the lock, so a request may be aborted after it was
    scheduled. A hybrid's step then still keeps the recurrent state of the rows that reached
    their snapshot point, skipping the aborted one; the other request finishes as it would alone."""
    from helpers import BASE, HYBRIDS

    from mlxkv.models.random_model import make_checkpoint

    path = make_checkpoint(tmp_path / "qwen3_5", "qwen3_5", shape={**BASE, **HYBRIDS["qwen3_5"]})
    engine = LLMEngine(*load(str(path)), EngineConfig(page_size=16, max_num_seqs=4))
    prompts = {name: [(7 * i + n) % 300 + 1 for i in range(40)] for n, name in enumerate("AB")}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for name, prompt in prompts.items():
        engine.add_request(prompt, params, request_id=name)
    build = engine.runner.logits

    def aborting_forward(batch, token_ids):
        if batch.snapshots and "A" in engine.requests:  # both rows reach their snapshot point
            engine.abort("A")
        return build(batch, token_ids)

    engine.runner.logits = aborting_forward
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"B"} and all(o.error is None for o in outputs)
    assert [t for o in outputs for t in o.token_ids] == mlx_lm_greedy(path, prompts["B"], max_tokens=4)
    assert outputs[-1].finish_reason == "length" and len(engine.cache.snapshots) == 1  # B's state, not A's


def test_a_pinned_prompt_survives_traffic_that_evicts_the_rest_until_its_time_is_up(model):
    """A 41-token prompt pins its 10 full pages in a 40-page pool; requests of 28 pages each then
    cycle through every other page. The prompt sent again finds its pages while pinned, not once
    its pin has lapsed, nor without one; no page is held when all is done."""
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(1, 320, 41)]
    traffic = [[int(t) for t in rng.integers(1, 320, 100)] for _ in range(3)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)

    def cached_after_traffic(pin, wait=0.0):
        engine = LLMEngine(*model, EngineConfig(page_size=4, num_pages=40, max_num_seqs=1, max_model_len=112))
        now = [0.0]
        engine.cache.pins.clock = lambda: now[0]  # pins lapse by this clock, not the machine's
        first = engine.add_request(prompt, params, pin=pin)
        run_all(engine, [], [])
        now[0] += wait
        for other in traffic:
            run_all(engine, [other], [params])
        again, _ = run_all(engine, [prompt], [params])
        while engine.has_unfinished():
            engine.step()
        engine.cache.expire_pins()
        return first.pinned_tokens, again[0].num_cached_tokens, engine

    pinned, cached, engine = cached_after_traffic(Pin(41, ttl_s=60))
    assert (pinned, cached) == (40, 40) and engine.stats().kv.pages_pinned == 10
    assert engine.cache.pool.used_count == 10  # the pin's pages alone
    assert cached_after_traffic(None)[:2] == (None, 0)
    pinned, cached, engine = cached_after_traffic(Pin(41, ttl_s=300), wait=300.5)
    assert (pinned, cached) == (40, 0) and engine.cache.pool.used_count == 0
    with pytest.raises(TypeError, match="pin must be a Pin or None, got int"):
        engine.add_request(prompt, params, pin=40)
    assert not engine.has_unfinished()
