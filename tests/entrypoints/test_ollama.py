"""Ollama's API over real HTTP: its documented requests as plain JSON, and the `ollama` package."""

import json
from datetime import datetime, timezone

import httpx
import jsonschema
import pytest
from helpers import start_server, stop_server

from mlxkv.entrypoints.ollama.protocol import OLLAMA_VERSION
from mlxkv.entrypoints.prompts import prompt_ids
from mlxkv.models import load
from mlxkv.models.random_model import TOOLS_CHAT_TEMPLATE, make_checkpoint

MODEL = "tiny-tools"
HI = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "num_predict": 8}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
    }
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ollama") / MODEL, chat_template=TOOLS_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(checkpoint):
    proc, url = start_server("--model", MODEL, cwd=checkpoint.parent)
    yield url
    stop_server(proc)


def lines(response):
    return [json.loads(line) for line in response.text.splitlines()]


def test_chat_streams_json_lines_by_default_and_they_add_up_to_the_whole_reply(server):
    streamed = httpx.post(f"{server}/api/chat", json={"model": MODEL, "messages": HI, "options": GREEDY})
    assert streamed.headers["content-type"] == "application/x-ndjson"
    parts = lines(streamed)
    assert all(not p["done"] for p in parts[:-1]) and parts[-1]["done"] and parts[-1]["done_reason"] == "length"
    assert parts[-1]["eval_count"] == 8 and parts[-1]["prompt_eval_count"] > 0
    whole = httpx.post(
        f"{server}/api/chat", json={"model": MODEL + ":latest", "messages": HI, "options": GREEDY, "stream": False}
    ).json()
    assert whole["message"] == {"role": "assistant", "content": "".join(p["message"]["content"] for p in parts)}
    assert whole["model"] == MODEL and whole["created_at"].endswith("Z") and whole["total_duration"] > 0


def test_generate_honours_format_json_and_a_schema(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    for fmt, check in (("json", lambda v: isinstance(v, dict)), (schema, lambda v: jsonschema.validate(v, schema))):
        body = {"model": MODEL, "prompt": "Say", "format": fmt, "stream": False, "options": {"seed": 1}}
        reply = httpx.post(f"{server}/api/generate", json=body | {"options": {"seed": 1, "num_predict": 80}}).json()
        assert reply["done_reason"] == "stop"
        check(json.loads(reply["response"]))


def test_a_tool_answer_goes_back_through_the_template(server, checkpoint):
    turns = HI + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "12:00", "tool_name": "get_time"},
    ]
    body = {"model": MODEL, "messages": turns, "tools": TOOLS, "stream": False, "options": {"num_predict": 1}}
    reply = httpx.post(f"{server}/api/chat", json=body).json()
    expected = HI + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1_0", "type": "function", "function": {"name": "get_time", "arguments": {}}}],
        },
        {"role": "tool", "content": "12:00", "name": "get_time"},
    ]
    assert reply["prompt_eval_count"] == len(prompt_ids(load(str(checkpoint))[1], expected, tools=TOOLS))


def test_tags_show_and_version_describe_the_one_model(server):
    [listed] = httpx.get(f"{server}/api/tags").json()["models"]
    assert listed["name"] == listed["model"] == MODEL and listed["details"]["family"] == "llama"
    assert listed["size"] > 0 and len(listed["digest"]) == 64
    shown = httpx.post(f"{server}/api/show", json={"model": MODEL}).json()
    assert shown["capabilities"] == ["completion", "tools"] and "<tool_call>" in shown["template"]
    assert shown["model_info"]["general.architecture"] == "llama"
    assert httpx.get(f"{server}/api/version").json() == {"version": OLLAMA_VERSION}


def test_errors_have_ollamas_shape(server):
    unknown = httpx.post(f"{server}/api/chat", json={"model": "llama3", "messages": HI})
    assert unknown.status_code == 404 and unknown.json() == {
        "error": f"model 'llama3' does not exist here; this server serves '{MODEL}'"
    }
    bad = httpx.post(f"{server}/api/generate", json={"model": MODEL, "prompt": "x", "options": {"temperature": -1}})
    assert bad.status_code == 400 and bad.json() == {"error": "temperature must be a number >= 0, got -1.0"}


def test_the_ollama_package(server):
    ollama = pytest.importorskip("ollama", reason="the ollama package could not be installed")
    client = ollama.Client(host=server)
    assert [m.model for m in client.list().models] == [MODEL]
    reply = client.chat(model=MODEL, messages=HI, options=GREEDY)
    parts = list(client.generate(model=MODEL, prompt="Hello there", stream=True, options=GREEDY))
    assert reply.message.role == "assistant" and reply.done_reason == "length" and reply.eval_count == 8
    assert parts[-1].done and sum(1 for p in parts if p.response) <= 8


def test_load_unload_and_warm_up_answer_at_once_as_ollama_does(server):
    """Open WebUI's unload (`prompt: ""`, `keep_alive: 0`), a client's warm-up (a model and nothing
    else) and a chat of no messages generate nothing: they answer `done` with Ollama's reason."""
    ollama = pytest.importorskip("ollama", reason="the ollama package could not be installed")
    client = ollama.Client(host=server)
    unloaded = client.generate(model=MODEL, prompt="", keep_alive=0)
    warmed = client.generate(model=MODEL)
    loaded = client.chat(model=MODEL, messages=[], keep_alive="5m")
    streamed = list(client.generate(model=MODEL, keep_alive=-1, stream=True))
    assert (unloaded.done_reason, unloaded.response, unloaded.eval_count) == ("unload", "", None)
    assert (warmed.done_reason, loaded.done_reason, loaded.message.content) == ("load", "load", "")
    assert [(part.done, part.done_reason) for part in streamed] == [(True, "load")]


def test_load_unload_and_ps_follow_keep_alive(server):
    """`keep_alive` 0 unloads (`/api/ps` is empty), a warm-up loads again, -1 keeps the model for
    good (Ollama's far-off expiry), a duration until then."""
    ollama = pytest.importorskip("ollama", reason="the ollama package could not be installed")
    client = ollama.Client(host=server)
    client.generate(model=MODEL, prompt="", keep_alive=0)
    gone = client.ps().models
    client.generate(model=MODEL, keep_alive=-1)
    [running] = client.ps().models
    assert gone == [] and (running.name, running.model, running.context_length) == (MODEL, MODEL, 512)
    assert running.size == running.size_vram > 0 and running.expires_at.year == 2318
    assert len(running.digest) == 64 and running.details.family == "llama"
    client.generate(model=MODEL, keep_alive="10h")
    [running] = client.ps().models
    assert 9 < (running.expires_at - datetime.now(timezone.utc)).total_seconds() / 3600 <= 10


def test_keep_alive_must_be_seconds_or_a_duration(server):
    bad = httpx.post(f"{server}/api/generate", json={"model": MODEL, "keep_alive": "soon"})
    assert bad.status_code == 400 and "keep_alive must be seconds or a duration such as '5m'" in bad.json()["error"]
