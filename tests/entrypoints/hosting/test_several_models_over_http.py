"""Several models behind one `mlxkv serve`, over real HTTP with each API's official client: requests
name their model on every API and get what the model gives served alone; a model not listed is a
404 in the API's shape and loads nothing; idle models go when their keep-alive runs out."""

import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from helpers import start_server, stop_server

from mlxkv import LLM, SamplingParams
from mlxkv.entrypoints.prompts import prompt_ids
from mlxkv.models.random_model import TOOLS_CHAT_TEMPLATE, make_checkpoint

MODELS = ("chat-a", "chat-b", "chat-c")
HI = [{"role": "user", "content": "Hello there"}]
SMALL = ("--max-model-len", "256", "--num-pages", "64", "--max-num-seqs", "4")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder of three tiny chat checkpoints, which `--model folder` lists under their names."""
    folder = tmp_path_factory.mktemp("several")
    for seed, name in enumerate(MODELS):
        make_checkpoint(folder / name, seed=seed, chat_template=TOOLS_CHAT_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def solo(folder):
    """Each model's greedy reply to HI, served alone in process."""
    replies = {}
    for name in MODELS:
        llm = LLM(str(folder / name), max_model_len=256, num_pages=64)
        params = SamplingParams(max_tokens=8, temperature=0.0)
        replies[name] = llm.generate([prompt_ids(llm.tokenizer, HI)], params, continuation=False)[0].text
    assert len(set(replies.values())) == 3  # three models, three replies
    return replies


@pytest.fixture(scope="module")
def server(folder):
    proc, url = start_server("--model", str(folder), *SMALL)
    yield url
    stop_server(proc)


def ask(url: str, api: str, model: str) -> str:
    """`model`'s greedy reply to HI through `api`'s official client."""
    if api == "openai":
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        return (
            client.chat.completions.create(model=model, messages=HI, max_tokens=8, temperature=0)
            .choices[0]
            .message.content
        )
    if api == "responses":
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        return client.responses.create(model=model, input="Hello there", max_output_tokens=8, temperature=0).output_text
    if api == "anthropic":
        reply = anthropic.Anthropic(base_url=url, api_key="unused").messages.create(
            model=model,
            messages=HI,
            max_tokens=8,
            extra_body={"temperature": 0},  # the client sends none itself
        )
        return reply.content[0].text if reply.content else ""
    ollama = pytest.importorskip("ollama", reason="the ollama package could not be installed")
    return (
        ollama.Client(host=url)
        .chat(model=model, messages=HI, options={"temperature": 0, "num_predict": 8})
        .message.content
    )


def loaded(url: str) -> list[str]:
    return sorted(m["name"] for m in httpx.get(f"{url}/api/ps").json()["models"])


def test_interleaved_requests_on_every_api_get_each_models_solo_reply(server, solo):
    asked = [(api, model) for api in ("openai", "responses", "anthropic", "ollama") for model in MODELS]
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda pair: ask(server, *pair), asked))
    assert replies == [solo[model] for _, model in asked]
    assert [m.id for m in openai.OpenAI(base_url=f"{server}/v1", api_key="unused").models.list().data] == list(MODELS)
    assert [m["name"] for m in httpx.get(f"{server}/api/tags").json()["models"]] == list(MODELS)
    assert loaded(server) == list(MODELS)
    metrics = httpx.get(f"{server}/metrics").text
    for model in MODELS:
        assert f'mlxkv_kv_pages_total{{model="{model}"}} 64.0' in metrics
        assert f'mlxkv_generation_tokens_total{{model="{model}"}}' in metrics


def test_a_model_not_listed_is_a_404_in_each_apis_shape_and_loads_nothing(server):
    before = loaded(server)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    with pytest.raises(openai.NotFoundError, match="model 'llama3' does not exist here; this server serves 'chat-a'"):
        client.chat.completions.create(model="llama3", messages=HI, max_tokens=2)
    with pytest.raises(anthropic.NotFoundError) as unknown:
        anthropic.Anthropic(base_url=server, api_key="unused").messages.create(
            model="llama3", messages=HI, max_tokens=2
        )
    assert unknown.value.body["error"]["type"] == "not_found_error"
    ollama = httpx.post(f"{server}/api/chat", json={"model": "llama3", "messages": HI})
    assert ollama.status_code == 404 and ollama.json()["error"].startswith("model 'llama3' does not exist here")
    assert loaded(server) == before


def test_an_idle_model_goes_when_its_keep_alive_runs_out_and_a_request_loads_it_again(folder, solo):
    proc, url = start_server(
        "--model", str(folder / "chat-a"), "--model", str(folder / "chat-b"), *SMALL, "--keep-alive", "1s"
    )
    try:
        b = str(folder / "chat-b")
        assert ask(url, "openai", b) == solo["chat-b"]
        for _ in range(300):  # the keep-alive is a second; the reaper looks every second
            if not loaded(url):
                break
            time.sleep(0.1)
        assert loaded(url) == []
        assert ask(url, "ollama", b) == solo["chat-b"]
        assert loaded(url) == [b]
    finally:
        stop_server(proc)
