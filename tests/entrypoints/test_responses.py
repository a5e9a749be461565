"""OpenAI's Responses API over real HTTP, driven by the official `openai` package's
`client.responses.create`, on a tiny random checkpoint whose chat template offers tools."""

import json

import jsonschema
import openai
import pytest
from helpers import start_server, stop_server

from mlxkv.models import load
from mlxkv.models.random_model import TOOLS_CHAT_TEMPLATE, make_checkpoint

MODEL = "tiny-tools"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("responses") / MODEL
    return make_checkpoint(path, chat_template=TOOLS_CHAT_TEMPLATE, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def client(checkpoint):
    proc, url = start_server("--model", MODEL, cwd=checkpoint.parent)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    stop_server(proc)


def create(client, **kw):
    return client.responses.create(**{"model": MODEL, "input": "Hello", "max_output_tokens": 8, "temperature": 0, **kw})


def test_a_response_whole_and_streamed_is_the_same(client):
    whole = create(client, instructions="Be brief.")
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert whole.usage.output_tokens == 8 and whole.usage.total_tokens == whole.usage.input_tokens + 8
    events = list(create(client, instructions="Be brief.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text


def test_previous_response_id_continues_the_kept_conversation(client, checkpoint):
    first = create(client)
    second = create(client, input="And then?", previous_response_id=first.id, max_output_tokens=2)
    # The kept reply goes back as the tokens it was generated as: the whole first turn is reused
    # (but the reply's 8th token, sampled and never run), and only the new message is computed.
    assert first.usage.output_tokens == 8
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + 8 - 1
    tokenizer = load(str(checkpoint))[1]
    rendered = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "REPLY"},
            {"role": "user", "content": "And then?"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    tail = tokenizer.encode(rendered[rendered.index("REPLY") + len("REPLY") :], add_special_tokens=False)
    assert second.usage.input_tokens == first.usage.input_tokens + 8 + len(tail)
    unkept = create(client, store=False)
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, input="More?", previous_response_id=unkept.id)
    assert refused.value.body["param"] == "previous_response_id"


def test_a_function_call_round_trip(client):
    called = create(
        client,
        input="Weather?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0.8,
    )
    assert called.status == "completed"
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    assert called.tool_choice == "required"
    after = create(client, input=answer, previous_response_id=called.id, tools=[WEATHER], max_output_tokens=3)
    assert after.status == "incomplete" and after.usage.input_tokens_details.cached_tokens > 0


def test_a_named_tool_choice_is_echoed_as_given(client):
    named = {"type": "function", "name": "get_weather"}
    reply = create(client, input="Weather?", tools=[WEATHER], tool_choice=named, max_output_tokens=200)
    assert reply.tool_choice.model_dump() == named and reply.output[0].name == "get_weather"


def test_text_format_holds_the_output_to_a_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    reply = create(
        client, text={"format": {"type": "json_schema", "name": "n", "schema": schema}}, max_output_tokens=60
    )
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), schema)


def test_unsupported_input_items_are_400s(client):
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, input=[{"type": "image_generation_call", "id": "x"}])
    assert "input items of type 'image_generation_call' are not supported" in refused.value.body["message"]


def test_sampling_fields_as_chat_bodies_give_them_but_constraints_through_text_format(client):
    seeded = [create(client, temperature=1.0, extra_body={"seed": 7, "top_k": 5}).output_text for _ in range(2)]
    assert seeded[0] == seeded[1]
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, extra_body={"regex": "[a-z]+"})
    error = refused.value.body
    assert error["param"] == "regex" and "constrains its output through text.format" in error["message"]


def test_a_kept_response_can_be_fetched_and_deleted(client):
    made = create(client)
    fetched = client.responses.retrieve(made.id)
    assert fetched.model_dump() == made.model_dump()
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError, match=f"response '{made.id}' is not kept here"):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)
    unkept = create(client, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_logprobs_come_with_each_delta_and_the_done_text(client):
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = create(client, **asked)
    events = list(create(client, stream=True, **asked))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    scores = [s for d in deltas for s in d.logprobs]
    assert [s.model_dump() for s in done.logprobs[: len(scores)]] == [s.model_dump() for s in scores]
    assert len(done.logprobs) == whole.usage.output_tokens == 8
    assert all(len(s.top_logprobs) == 2 and s.logprob <= 0 for s in scores)
    assert [s.model_dump() for s in whole.output[0].content[0].logprobs] == [s.model_dump() for s in done.logprobs]
    plain = list(create(client, stream=True))
    assert all(e.logprobs == [] for e in plain if e.type == "response.output_text.delta")


def test_usage_counts_cached_and_written_tokens(client):
    first, again = create(client, input="Count the tokens"), create(client, input="Count the tokens")
    assert (
        first.usage.input_tokens_details.cache_write_tokens == again.usage.input_tokens_details.cache_write_tokens == 0
    )
    assert again.usage.input_tokens_details.cached_tokens > first.usage.input_tokens_details.cached_tokens
