"""Anthropic's Messages API over real HTTP, driven by the official `anthropic` package, on a tiny
random checkpoint whose chat template offers tools."""

import json
import re

import httpx
import jsonschema
import pytest
from helpers import start_server, stop_server

from mlxkv.entrypoints.anthropic.protocol import MessageParam
from mlxkv.models.random_model import TOOLS_CHAT_TEMPLATE, make_checkpoint

anthropic = pytest.importorskip("anthropic", reason="the anthropic package could not be installed")

MODEL = "tiny-tools"  # the checkpoint's folder, which the server names its model by
KEY = "sesame"
HELLO = [{"role": "user", "content": "Hello there"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("anthropic")
    make_checkpoint(folder / MODEL, chat_template=TOOLS_CHAT_TEMPLATE, max_position_embeddings=4096)
    proc, url = start_server("--model", MODEL, "--api-key", KEY, cwd=folder)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY)


def create(client, temperature=0, **kw):
    """A request; the official client no longer sends `temperature`, so it goes as an extra field."""
    args = {"model": MODEL, "max_tokens": 12, "messages": HELLO, "extra_body": {"temperature": temperature}}
    return client.messages.create(**{**args, **kw})


def test_a_reply_whole_and_streamed_is_the_same(client):
    whole = create(client, system="Be brief.")
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    [block] = whole.content
    seen = []
    greedy = {"temperature": 0}
    with client.messages.stream(model=MODEL, max_tokens=12, messages=HELLO, system="Be brief.", extra_body=greedy) as s:
        for event in s:
            seen.append(event.type)
        streamed = s.get_final_message()
    assert seen[0] == "message_start" and seen[-1] == "message_stop" and "content_block_delta" in seen
    assert [b.model_dump() for b in streamed.content] == [block.model_dump()]
    assert streamed.stop_reason == whole.stop_reason and streamed.usage.output_tokens == 12


def test_a_stop_sequence_ends_the_text_before_it_and_is_named(client):
    text = create(client).content[0].text
    stop = next(c for c in text[2:] if c.strip())  # a character the greedy reply writes
    reply = create(client, stop_sequences=[stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == text[: text.index(stop)]


def test_a_tool_use_round_trip_with_tool_choice_any(client):
    """`any` makes the reply a call whose input validates against the tool's schema; the call and
    its result go back through the chat template for the next turn."""
    first = create(
        client,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=300,
        temperature=0.8,
    )
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    second = create(client, messages=turns, tools=[WEATHER], max_tokens=4)
    counted = client.messages.count_tokens(model=MODEL, messages=turns, tools=[WEATHER]).input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == counted


def test_streamed_tool_use_comes_as_input_json_deltas(client):
    args = dict(
        model=MODEL,
        max_tokens=300,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    )
    with client.messages.stream(**args) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        message = stream.get_final_message()
    assert deltas == ["input_json_delta"] and message.stop_reason == "tool_use"
    jsonschema.validate(message.content[0].input, WEATHER["input_schema"])


def test_a_second_identical_request_reads_its_prompt_from_the_cache(client):
    messages = [{"role": "user", "content": "The import statement " * 20}]
    first, second = (create(client, messages=messages, max_tokens=2) for _ in range(2))
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    assert client.messages.count_tokens(model=MODEL, messages=messages).input_tokens == total


def test_the_key_comes_as_x_api_key_or_bearer_and_errors_have_anthropics_shape(server, client):
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=server, api_key="wrong").messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "authentication_error"
    bearer = httpx.post(
        f"{server}/v1/messages/count_tokens",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "messages": HELLO},
    )
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    missing = httpx.post(f"{server}/v1/messages", headers={"x-api-key": KEY}, json={"model": MODEL, "messages": HELLO})
    assert missing.status_code == 400
    assert missing.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-opus-4", max_tokens=2, messages=HELLO)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as unnamed:
        create(client, tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    assert "tool_choice names 'nope'" in unnamed.value.body["error"]["message"]


def test_tool_choice_none_shows_no_tools(client):
    with_tools = client.messages.count_tokens(model=MODEL, messages=HELLO, tools=[WEATHER]).input_tokens
    without = client.messages.count_tokens(
        model=MODEL, messages=HELLO, tools=[WEATHER], tool_choice={"type": "none"}
    ).input_tokens
    assert without == client.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens < with_tools
    assert json.loads(create(client, tools=[WEATHER], tool_choice={"type": "none"}).model_dump_json())["content"]


def test_output_config_holds_the_reply_to_a_json_schema(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    reply = create(client, max_tokens=60, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads(reply.content[0].text), schema)


def test_cache_control_pins_the_prompt_up_to_the_marked_block_and_says_what_it_wrote(server, client):
    """The system prompt is marked: the first request writes its pages to the cache (and pins
    them), the next one, with another question, reads them."""
    system = [{"type": "text", "text": "You answer questions on Python. " * 10, "cache_control": {"type": "ephemeral"}}]
    first = create(client, system=system, messages=[{"role": "user", "content": "First?"}], max_tokens=2)
    written = first.usage.cache_creation_input_tokens
    assert written > 100  # past the template's first page, which other tests' prompts share
    second = create(client, system=system, messages=[{"role": "user", "content": "Second?"}], max_tokens=2)
    assert second.usage.cache_read_input_tokens >= written and second.usage.cache_creation_input_tokens == 0
    metrics = httpx.get(f"{server}/metrics", headers={"x-api-key": KEY}).text
    assert int(float(re.search(r"^mlxkv_kv_pages_pinned\{model=\"[^\"]+\"\} (\S+)$", metrics, re.M).group(1))) > 0
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(
            client,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "soon"}}],
                }
            ],
        )
    assert refused.value.body["error"]["message"] == "cache_control.ttl must be like '5m' or '1h', got 'soon'"


def test_a_history_with_an_image_in_a_tool_result_and_thinking_blocks(client):
    """What Claude Code sends after reading a screenshot: the image is refused naming it (a text
    model); without it, the thinking blocks passed back are taken (left out by a template that
    renders no reasoning) and the reply is a normal one."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    thought = [
        {"type": "thinking", "thinking": "The user wants a screenshot.", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
    ]
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo", "days": 1}}

    def history(result):
        return [
            *HELLO,
            {"role": "assistant", "content": [*thought, call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]},
        ]

    shown = [{"type": "text", "text": "Sunny."}]
    with pytest.raises(anthropic.BadRequestError, match=f"image content is not supported by {MODEL}"):
        create(client, tools=[WEATHER], messages=history([*shown, image]))
    reply = create(client, tools=[WEATHER], messages=history(shown))
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 12
    without = history(shown)
    without[1]["content"] = [call]
    counted = [
        client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=m).input_tokens
        for m in (history(shown), without)
    ]
    assert counted[0] == counted[1]


def test_thinking_passed_back_is_the_reasoning_templates_render_where_trusted():
    thought = {"type": "thinking", "thinking": "Two steps.", "signature": "c2ln"}
    message = MessageParam(role="assistant", content=[thought, {"type": "text", "text": "Done."}])
    assert message.as_template_inputs(lambda block: True) == [
        {"role": "assistant", "content": "Done.", "reasoning_content": "Two steps."}
    ]
    assert message.as_template_inputs(lambda block: False) == [{"role": "assistant", "content": "Done."}]
