"""The serving core under all four APIs: prompts are built off the event loop, so that one client's
huge prompt stalls no other; a conversation that gives nothing to reply to, and content a text model
cannot read, are refused with a 400 in each API's shape, streamed or not, by each official client."""

import asyncio
import threading

import anthropic
import httpx
import ollama
import openai
import pytest
from helpers import start_server, stop_server

from mlxkv import AsyncLLM, EngineConfig, LLMEngine, load
from mlxkv.entrypoints import core
from mlxkv.entrypoints.server import build_app

SYSTEM = {"role": "system", "content": "Be brief."}
EMPTY = {"role": "user", "content": ""}
IMAGE = "iVBORw0KGgo="  # the first bytes of a PNG: enough to be refused as an image


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--max-model-len", "256")  # the demo model: no chat template
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(f"{server}/v1/models").json()["data"][0]["id"]


def openai_chat(url, model, messages, stream):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=4, stream=stream)
    return list(reply) if stream else reply


def openai_responses(url, model, messages, stream):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    reply = client.responses.create(model=model, input=messages, max_output_tokens=4, stream=stream)
    return list(reply) if stream else reply


def anthropic_messages(url, model, messages, stream):
    client = anthropic.Anthropic(base_url=url, api_key="unused")
    system = "".join(m["content"] for m in messages if m["role"] == "system")
    turns = [m for m in messages if m["role"] != "system"] or [EMPTY]
    reply = client.messages.create(
        model=model, system=system or anthropic.NOT_GIVEN, messages=turns, max_tokens=4, stream=stream
    )
    return list(reply) if stream else reply


def ollama_chat(url, model, messages, stream):
    reply = ollama.Client(host=url).chat(model=model, messages=messages, stream=stream)
    return list(reply) if stream else reply


REFUSED = {  # how each official client raises a 400
    openai_chat: openai.BadRequestError,
    openai_responses: openai.BadRequestError,
    anthropic_messages: anthropic.BadRequestError,
    ollama_chat: ollama.ResponseError,
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("messages", [[EMPTY], [SYSTEM]], ids=["empty", "system-only"])
@pytest.mark.parametrize("api", list(REFUSED), ids=lambda api: api.__name__)
def test_a_conversation_with_nothing_to_reply_to_is_a_400(server, model, api, messages, stream):
    with pytest.raises(REFUSED[api]) as refused:
        api(server, model, messages, stream)
    assert refused.value.status_code == 400
    assert "is empty: there is nothing to reply to" in str(refused.value)


def test_an_empty_completion_prompt_is_a_400(server, model):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="prompt is empty"):
            client.completions.create(model=model, prompt="", max_tokens=4, stream=stream)


IMAGES = {  # each API's image content, in a user message
    openai_chat: [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMAGE}"}}],
    openai_responses: [{"type": "input_image", "image_url": f"data:image/png;base64,{IMAGE}"}],
    anthropic_messages: [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": IMAGE}}],
}
NAMED = {openai_chat: "image_url", openai_responses: "input_image", anthropic_messages: "image"}


@pytest.mark.parametrize("api", list(IMAGES), ids=lambda api: api.__name__)
def test_an_image_is_a_400_naming_it_and_the_model(server, model, api):
    with pytest.raises(REFUSED[api]) as refused:
        api(server, model, [{"role": "user", "content": [*IMAGES[api], {"type": "text", "text": "hi"}]}], False)
    assert refused.value.status_code == 400
    assert f"image content is not supported by {model} ({NAMED[api]} in " in str(refused.value)


def test_ollama_images_are_a_400_naming_them_and_the_model(server, model):
    client = ollama.Client(host=server)
    with pytest.raises(ollama.ResponseError, match=f"image content is not supported by {model}"):
        client.chat(model=model, messages=[{"role": "user", "content": "hi", "images": [IMAGE]}])
    with pytest.raises(ollama.ResponseError, match=f"image content is not supported by {model}"):
        client.generate(model=model, prompt="hi", images=[IMAGE])


@pytest.fixture(scope="module")
def app():
    llm = AsyncLLM(LLMEngine(*load(), EngineConfig(max_num_seqs=2, max_model_len=256)))
    yield build_app(llm, "mlxkv-demo")
    llm.shutdown()


def test_a_huge_prompt_being_built_stalls_no_other_client(app, monkeypatch):
    """While a 2 MB prompt is held inside prompt building (the test holds it there), another
    client's stream runs to its end and /health answers: the event loop is free. Nothing is timed:
    a blocked loop would finish neither before the hold ends."""
    entered, release, left = threading.Event(), threading.Event(), threading.Event()
    build = core.prompt_ids

    def held(tokenizer, messages, **kw):
        if len(messages[-1]["content"]) > 10**6:
            entered.set()
            release.wait(120)
            left.set()
        return build(tokenizer, messages, **kw)

    monkeypatch.setattr(core, "prompt_ids", held)

    async def clients() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=300) as client:
            huge = {"messages": [{"role": "user", "content": "word " * 400_000}], "max_tokens": 4}
            big = asyncio.create_task(client.post("/v1/chat/completions", json=huge))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            body = {"messages": [{"role": "user", "content": "The import statement"}], "max_tokens": 8}
            streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
            health = await client.get("/health")
            assert not left.is_set()  # both answered while the huge prompt was still held
            release.set()
            return streamed, health, await big

    streamed, health, big = asyncio.run(clients())
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert health.json()["status"] == "ok"
    assert big.status_code == 400 and "this server holds at most 256" in big.json()["error"]["message"]
