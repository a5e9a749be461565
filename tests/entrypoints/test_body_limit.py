"""The request body limit: a body over it is refused with a 413 in the shape of the API it was sent
to, whether its length was declared or it came in chunks; a body within it reaches the API whole."""

import asyncio
import json

import httpx
import pytest

from mlxkv import AsyncLLM, EngineConfig, LLMEngine, load
from mlxkv.entrypoints.server import build_app, request_bytes_for

CHAT = json.dumps({"messages": [{"role": "user", "content": "The import statement"}], "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM(LLMEngine(*load(), EngineConfig(max_num_seqs=2, max_model_len=256)))
    yield llm
    llm.shutdown()


def post(app, path: str, body: bytes, chunked: bool) -> httpx.Response:
    async def chunks():
        for at in range(0, len(body), 7):
            yield body[at : at + 7]

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            headers = {"content-type": "application/json"}
            return await client.post(path, content=chunks() if chunked else body, headers=headers)

    return asyncio.run(send())


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_a_body_over_the_limit_is_a_413_in_the_api_s_shape(llm, chunked):
    app = build_app(llm, "mlxkv-demo", max_request_bytes=len(CHAT) - 1)
    expected = {
        "/v1/chat/completions": lambda body: body["error"]["code"] == "request_too_large",
        "/v1/messages": lambda body: body["error"]["type"] == "request_too_large",
        "/api/chat": lambda body: "larger than this server takes" in body["error"],
    }
    for path, shaped in expected.items():
        reply = post(app, path, CHAT, chunked)
        assert reply.status_code == 413 and shaped(reply.json()), reply.text


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_a_body_within_the_limit_reaches_the_api_whole(llm, chunked):
    reply = post(build_app(llm, "mlxkv-demo", max_request_bytes=len(CHAT)), "/v1/chat/completions", CHAT, chunked)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_the_default_limit_holds_the_longest_prompt_the_context_takes_with_room_to_spare():
    assert request_bytes_for(32_768) == 4 * 2**20 + 32 * 32_768
