import asyncio
import threading

import pytest

from mlxkv import LLM, SamplingParams
from mlxkv.config import EngineConfig
from mlxkv.engine import LLMEngine
from mlxkv.engine.async_llm import AsyncLLM
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
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity
    assert not llm.engine.has_unfinished()


def test_abort_from_another_thread_ends_the_stream(setup):
    llm, _ = setup

    async def main():
        seen = []
        async for delta in llm.generate(PROMPTS[1], SamplingParams(max_tokens=400), request_id="long"):
            seen.append(delta)
            if len(seen) == 2:
                threading.Thread(target=llm.abort, args=("long",)).start()
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
