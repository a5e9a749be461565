"""The one stream skeleton under every API: while another request's long prefill runs, a stream on
each of the four APIs receives its keepalive (or its opening events) before its first text, in
process (the interval is a `build_app` argument), so nothing about it depends on the clock."""

import asyncio
import json

import httpx
import pytest

from mlxkv import AsyncLLM, EngineConfig, LLMEngine, load
from mlxkv.entrypoints.server import build_app

LONG = list(range(1, 1501))  # a prompt whose prefill takes far longer than the 1 ms keepalive interval
ASK = [{"role": "user", "content": "The import statement"}]
STREAMS = {  # the API's path, a streaming body, and how its keepalive and its text look
    "openai-completions": ("/v1/completions", {"prompt": "The import statement", "max_tokens": 4}),
    "openai-chat": ("/v1/chat/completions", {"messages": ASK, "max_tokens": 4}),
    "openai-responses": ("/v1/responses", {"input": "The import statement", "max_output_tokens": 4}),
    "anthropic": ("/v1/messages", {"model": "mlxkv-demo", "messages": ASK, "max_tokens": 4}),
    "ollama": (
        "/api/generate",
        {"model": "mlxkv-demo", "prompt": "The import statement", "options": {"num_predict": 4}},
    ),
}


def keepalive(api: str, line: str) -> bool:
    if api == "ollama":
        return json.loads(line) == {**json.loads(line), "response": "", "done": False}
    return line in (": keepalive", "event: ping")


def text(api: str, line: str) -> bool:
    """Whether `line` carries some of the reply's text."""
    if api == "ollama":
        return bool(json.loads(line).get("response"))
    if not line.startswith("data: {"):
        return False
    event = json.loads(line[6:])
    if event.get("type") == "response.output_text.delta":  # the Responses API's
        return bool(event["delta"])
    if event.get("type") == "content_block_delta":  # Anthropic's
        return bool(event["delta"].get("text"))
    choice = (event.get("choices") or [{}])[0]  # OpenAI's chat and completions
    return bool(choice.get("text") or choice.get("delta", {}).get("content"))


@pytest.fixture(scope="module")
def app():
    llm = AsyncLLM(LLMEngine(*load(), EngineConfig(max_num_seqs=1, max_model_len=1600)))
    yield build_app(llm, "mlxkv-demo", keepalive_s=0.001)
    llm.shutdown()


@pytest.mark.parametrize("api", list(STREAMS))
def test_a_stream_waiting_behind_a_long_prefill_gets_its_keepalive_first(app, api):
    path, body = STREAMS[api]

    async def both() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            long = client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 1, "temperature": 0})
            streamed = client.post(path, json={**body, "stream": True, "temperature": 0})
            replies = await asyncio.gather(long, streamed)
            assert [r.status_code for r in replies] == [200, 200]
            return replies[1].text

    lines = [line for line in asyncio.run(both()).splitlines() if line]
    first_text = next(i for i, line in enumerate(lines) if text(api, line))
    assert any(keepalive(api, line) for line in lines[:first_text]), lines[:first_text]
