import asyncio
import threading
import time

import pytest
from helpers import ExplodingSampler

from mlxkv import LLM, RequestFailed, SamplingParams
from mlxkv.config import EngineConfig
from mlxkv.engine import LLMEngine
from mlxkv.engine.async_llm import AsyncLLM
from mlxkv.engine.sampling.sampler import TokenSampler
from mlxkv.models.loading import load

PROMPTS = [[5, 6, 7], list(range(10, 40)), list(range(50, 61))]


@pytest.fixture()
def setup(checkpoint):
    model = load(checkpoint("qwen3-bf16"))
    expected = [c.text for c in LLM(model).generate(PROMPTS, SamplingParams(max_tokens=16))]
    llm = AsyncLLM(LLMEngine(*model, EngineConfig(max_num_seqs=4)))
    yield llm, expected
    llm.shutdown()


def test_concurrent_streams_get_their_own_text(setup):
    llm, expected = setup

    async def collect(prompt):
        return "".join([delta async for delta in llm.generate(prompt, SamplingParams(max_tokens=16))])

    async def main():
        return await asyncio.gather(*(collect(p) for p in PROMPTS))

    assert asyncio.run(main()) == expected
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity


def test_leaving_a_stream_early_frees_its_pages(setup):
    llm, _ = setup

    async def main():
        stream = llm.generate(PROMPTS[1], SamplingParams(max_tokens=200))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(main())
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity  # at once
    deadline = time.monotonic() + 30  # the step in flight when it left is read by the engine thread, then idle
    while llm.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not llm.engine.has_unfinished()


def test_abort_from_another_thread_ends_the_stream(setup):
    llm, _ = setup

    async def main():
        seen = []
        async for delta in llm.generate(PROMPTS[1], SamplingParams(max_tokens=400), request_id="long"):
            seen.append(delta)
            if len(seen) == 2:  # aborted from another thread, waited for: the stream must end
                aborter = threading.Thread(target=llm.abort, args=("long",))
                aborter.start()
                aborter.join()
        return seen

    assert len(asyncio.run(main())) < 400
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity


def test_duplicate_and_oversized_requests_are_refused(setup):
    llm, _ = setup

    async def main():
        with pytest.raises(ValueError, match="prompt is empty"):
            async for _ in llm.generate([]):
                pass
        return "".join([d async for d in llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))])

    assert asyncio.run(main())


async def collect(llm, prompt, params=SamplingParams(max_tokens=16)):
    return "".join([delta async for delta in llm.generate(prompt, params)])


def test_a_consumer_whose_event_loop_closed_does_not_stop_the_engine(setup):
    llm, expected = setup
    loop = asyncio.new_event_loop()
    orphan = llm.generate(PROMPTS[1], SamplingParams(max_tokens=300))
    loop.run_until_complete(orphan.__anext__())
    loop.close()  # the consumer vanishes mid-stream; its outputs can no longer be delivered
    assert asyncio.run(collect(llm, PROMPTS[0])) == expected[0]
    deadline = time.monotonic() + 30
    while llm.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity


def test_a_failed_request_fails_in_its_own_consumer_while_others_finish(setup, monkeypatch):
    llm, expected = setup
    original = TokenSampler.key
    monkeypatch.setattr(
        TokenSampler,
        "key",
        lambda self, index: ExplodingSampler.key(self, index) if self.params.seed == 13 else original(self, index),
    )

    async def main():
        bad = collect(llm, PROMPTS[2], SamplingParams(max_tokens=16, temperature=1.0, seed=13))
        return await asyncio.gather(collect(llm, PROMPTS[0]), bad, collect(llm, PROMPTS[1]), return_exceptions=True)

    first, failure, second = asyncio.run(main())
    assert [first, second] == [expected[0], expected[1]]
    assert isinstance(failure, RequestFailed) and "sampler exploded" in str(failure)
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity


def test_aborts_racing_a_failing_step_leave_the_engine_serving(setup, monkeypatch):
    llm, expected = setup
    forward, calls = llm.engine.runner.logits, iter(range(10**6))

    def slow_then_failing(batch, token_ids):
        time.sleep(0.05)
        if next(calls) % 3 == 1:
            raise RuntimeError("forward failed")
        return forward(batch, token_ids)

    monkeypatch.setattr(llm.engine.runner, "logits", slow_then_failing)

    async def main():
        tasks = [asyncio.ensure_future(collect(llm, p, SamplingParams(max_tokens=40))) for p in PROMPTS * 3]
        await asyncio.sleep(0.12)
        for task in tasks[::2]:
            task.cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, (str, RequestFailed, asyncio.CancelledError)) for r in results)
    monkeypatch.setattr(llm.engine.runner, "logits", forward)
    assert asyncio.run(collect(llm, PROMPTS[0])) == expected[0]
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity


class IdleEngine:
    """An engine with no request until its third rest, then one step's worth, recording what the
    engine thread asks of it; its fourth rest waits for no nap (as alone: only a request or
    `shutdown` ends the wait)."""

    def __init__(self):
        self.calls, self.work, self.rested_again = [], 0, threading.Event()

    def has_unfinished(self):
        return self.work > 0

    def rest(self):
        self.calls.append("rest")
        self.work += len(self.calls) == 3
        if len(self.calls) < 4:
            return 0.0  # a nap that has ended: the thread rests again at once unless a request came
        self.rested_again.set()
        return None

    def step(self):
        self.calls.append("step")
        self.work -= 1
        return []


def test_an_idle_engine_thread_rests_between_waits_and_steps_only_for_a_request():
    """Rank 0 of a tensor-parallel group sends its followers a nap at each rest (`RankZero.rest`),
    never a plan while idle; alone, `rest` asks for no nap and the wait lasts until a request."""
    engine = IdleEngine()
    llm = AsyncLLM(engine)
    assert engine.rested_again.wait(timeout=60)
    llm.shutdown()  # ends the last wait, which had no timeout
    assert engine.calls == ["rest", "rest", "rest", "step", "rest"]
