"""Tool calls and structured output over real HTTP, with the official `openai` client and LangChain,
on a tiny random checkpoint whose chat template offers tools (calls as JSON between <tool_call>
markers): even a random model, constrained, calls tools with arguments valid under their schema."""

import asyncio
import json
from collections import Counter

import httpx
import jsonschema
import mlx.core as mx
import openai
import pytest
from helpers import start_server, stop_server

from mlxkv import LLM, SamplingParams
from mlxkv.entrypoints.prompts import prompt_ids
from mlxkv.models import load
from mlxkv.models.random_model import TOOLS_CHAT_TEMPLATE, make_checkpoint

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for the next days.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "additionalProperties": False,
}
ANSWER["required"] = ["answer", "score"]
MODEL = "tiny-tools"  # the checkpoint's folder, which the server names its model by


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tiny-tools"
    return make_checkpoint(path, chat_template=TOOLS_CHAT_TEMPLATE, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(checkpoint):
    proc, url = start_server("--model", MODEL, "--max-num-seqs", "16", cwd=checkpoint.parent)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def schema_of(name):
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def call(client, stream=False, **kw):
    """A chat request to the one model the server runs (the client's `model`)."""
    args = dict(model=MODEL, messages=ASK, max_tokens=300, temperature=0.8, seed=1)
    return client.chat.completions.create(**{**args, **kw}, stream=stream)


def test_forced_calls_are_valid_for_16_concurrent_requests_beside_free_ones(server):
    """Eight requests must call a tool, eight are free, all at once: every forced reply is one
    call of an offered tool whose arguments validate against its schema."""
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused")

    async def run():
        forced = [
            call(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=i) for i in range(8)
        ]
        free = [call(client, max_tokens=40, seed=i) for i in range(8)]
        return await asyncio.gather(*forced, *free)

    replies = asyncio.run(run())
    for reply in replies[:8]:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (made,) = choice.message.tool_calls
        assert made.type == "function" and made.id.startswith("call_")
        jsonschema.validate(json.loads(made.function.arguments), schema_of(made.function.name))
    assert all(r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None for r in replies[8:])


def test_a_named_tool_is_the_one_called(client):
    reply = call(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=4)
    for made in reply.choices[0].message.tool_calls:
        assert made.function.name == "get_time"
        assert json.loads(made.function.arguments)["zone"] in ("UTC", "CET")


def test_streamed_calls_equal_the_whole_reply_for_the_same_seed(client):
    """Parallel calls allowed: the model calls until it stops or runs out of tokens; streamed, the
    calls come as OpenAI's deltas (id and name, then arguments) and add up to the same reply."""
    for seed in (2, 3):
        whole = call(client, tools=TOOLS, tool_choice="required", seed=seed, max_tokens=150).choices[0]
        content, calls, reason = "", {}, None
        for chunk in call(client, True, tools=TOOLS, tool_choice="required", seed=seed, max_tokens=150):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"id": part.id, "name": part.function.name, "arguments": ""})
                entry["arguments"] += part.function.arguments
            reason = chunk.choices[0].finish_reason or reason
        made = [(c.id, c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [m[1:] for m in made]
        assert content == (whole.message.content or "") and reason == whole.finish_reason
        assert all(c["id"].startswith("call_") for c in calls.values())


def test_response_format_holds_on_both_endpoints_streamed_or_not(client):
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    reply = call(client, response_format=schema)
    jsonschema.validate(json.loads(reply.choices[0].message.content), ANSWER)
    streamed = "".join(c.choices[0].delta.content or "" for c in call(client, True, response_format=schema))
    assert streamed == reply.choices[0].message.content
    anything = call(client, response_format={"type": "json_object"}, max_tokens=400, seed=5)
    assert anything.choices[0].finish_reason == "length" or isinstance(
        json.loads(anything.choices[0].message.content), dict
    )
    text = client.completions.create(
        model=MODEL, prompt="Say", max_tokens=200, seed=1, extra_body={"response_format": schema}
    )
    jsonschema.validate(json.loads(text.choices[0].text), ANSWER)


@pytest.mark.parametrize(
    "field, value, check",
    [
        ("regex", "[0-9]{2}-[a-z]{3}", lambda t: len(t) == 6 and t[2] == "-"),
        ("choice", ["left", "right"], lambda t: t in ("left", "right")),
        ("grammar", 'start: "go " DIR\nDIR: "up" | "down"', lambda t: t in ("go up", "go down")),
        ("json", ANSWER, lambda t: jsonschema.validate(json.loads(t), ANSWER) is None),
    ],
)
def test_structured_outputs_as_vllm_names_them(client, field, value, check):
    reply = client.completions.create(
        model=MODEL, prompt="Say", max_tokens=100, seed=2, extra_body={"structured_outputs": {field: value}}
    )
    assert reply.choices[0].finish_reason == "stop" and check(reply.choices[0].text)


@pytest.mark.parametrize(
    "extra, param, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}},
            "response_format",
            'response_format: json_schema cannot be used: Unimplemented keys: ["if"]',
        ),
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs", "structured_outputs: regex cannot be used"),
        ({"json_schema": {"type": "object", "if": {}}}, "json_schema", "json_schema cannot be used: Unimplemented"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "tool_choice names 'nope', which is not among the tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]}
            | {"tool_choice": "required"},
            "tool_choice",
            "tool_choice: grammar cannot be used",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs tools"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            None,
            "constraints: give at most one; got json_schema (response_format), regex (structured_outputs)",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(client, extra, param, message):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=extra)
    error = refused.value.body
    assert error["message"].startswith(message) and (param is None or error["param"] == param)


def test_a_tool_answer_goes_back_through_the_template(client, checkpoint):
    """An assistant's call and the tool's answer are rendered by the model's own template, the
    call's arguments as an object (as mlx-lm renders them)."""
    made = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    turns = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [made]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    reply = call(client, messages=turns, tools=TOOLS, max_tokens=4)
    as_template = turns[:1] + [
        {"role": "assistant", "content": "", "tool_calls": [{**made, "function": {**made["function"]}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    as_template[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo"}
    tokenizer = load(str(checkpoint))[1]
    assert reply.usage.prompt_tokens == len(prompt_ids(tokenizer, as_template, tools=TOOLS))
    assert "sunny, 21 C" in tokenizer.decode(prompt_ids(tokenizer, as_template, tools=TOOLS))


def test_tool_choice_none_shows_no_tools_and_parses_no_calls(client, checkpoint):
    reply = call(client, tools=TOOLS, tool_choice="none", max_tokens=4)
    tokenizer = load(str(checkpoint))[1]
    assert reply.usage.prompt_tokens == len(prompt_ids(tokenizer, ASK))
    assert reply.choices[0].message.tool_calls is None


def test_langchain_binds_tools_and_gets_structured_output(server):
    pytest.importorskip("langchain_openai", reason="langchain-openai could not be installed")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class WeatherArgs(BaseModel):
        city: str = Field(max_length=10)
        days: int = Field(ge=1, le=7)

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str, days: int) -> str:
        """The weather in a city for the next days."""
        return "sunny"

    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=120)

    chat = ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model=MODEL, max_tokens=300, seed=3)
    bound = chat.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False, strict=True)
    message = bound.invoke("Paris?")  # strict: no properties beyond the schema's, which a random model never ends
    (made,) = message.tool_calls
    assert made["name"] == "get_weather" and WeatherArgs(**made["args"])
    person = chat.with_structured_output(Person).invoke("Who is there?")
    assert isinstance(person, Person)


def test_tools_need_a_model_whose_template_has_tool_calls():
    proc, url = start_server("--max-num-seqs", "1")  # the demo model: no chat template at all
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused").chat.completions.create(
                model="mlxkv-demo", messages=ASK, tools=TOOLS, max_tokens=4
            )
        assert refused.value.body["param"] == "tools"
        assert refused.value.body["message"].startswith("this model's chat template has no tool calls")
    finally:
        stop_server(proc)


def test_an_extra_cache_control_field_pins_a_chat_prompt(client, server):
    import httpx

    def pinned():
        metrics = httpx.get(f"{server}/metrics").text
        return float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("mlxkv_kv_pages_pinned")))

    before = pinned()
    long = [{"role": "user", "content": "Pin this question, which is long enough to fill pages. " * 4}]
    call(client, messages=long, max_tokens=2, extra_body={"cache_control": {"type": "ephemeral", "ttl": "1m"}})
    assert pinned() > before


SEEDS = 32


def responses_tool(tool):
    return {"type": "function", "name": tool["function"]["name"], "parameters": tool["function"]["parameters"]}


def anthropic_tool(tool):
    return {"name": tool["function"]["name"], "input_schema": tool["function"]["parameters"]}


@pytest.mark.parametrize("named", [False, True], ids=["any-tool", "named-tool"])
def test_forced_calls_are_valid_for_32_draws_at_temperature_1_on_every_api(server, checkpoint, named):
    """The checkpoint's `<tool_call>` markers are single added tokens, as in Qwen's tokenizers: forced by
    `tool_choice` (OpenAI's 'required' or a named function, the Responses API's alike, Anthropic's
    'any' or a named tool), each of 32 draws at temperature 1 on each API is one valid call."""
    anthropic = pytest.importorskip("anthropic", reason="the anthropic package could not be installed")
    tokenizer = load(str(checkpoint))[1]
    assert [len(tokenizer.encode(m, add_special_tokens=False)) for m in ("<tool_call>", "</tool_call>")] == [1, 1]
    wanted = "get_time" if named else None

    async def openai_chat(chat, _, seed):
        choice = {"type": "function", "function": {"name": wanted}} if named else "required"
        reply = await call(chat, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=1, seed=seed)
        made = reply.choices[0].message.tool_calls or []
        return reply.choices[0].finish_reason, [(c.function.name, c.function.arguments) for c in made]

    async def openai_responses(chat, _, seed):
        choice = {"type": "function", "name": wanted} if named else "required"
        tools = [responses_tool(t) for t in TOOLS]
        reply = await chat.responses.create(
            model=MODEL,
            input=ASK[0]["content"],
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=1,
            max_output_tokens=300,
        )
        calls = [(item.name, item.arguments) for item in reply.output if item.type == "function_call"]
        return reply.status, calls

    async def anthropic_messages(_, messages, seed):
        choice = {"type": "tool", "name": wanted} if named else {"type": "any"}
        reply = await messages.messages.create(
            model=MODEL,
            max_tokens=300,
            messages=ASK,
            tools=[anthropic_tool(t) for t in TOOLS],
            tool_choice={**choice, "disable_parallel_tool_use": True},
            extra_body={"temperature": 1},
        )
        return reply.stop_reason, [(b.name, json.dumps(b.input)) for b in reply.content if b.type == "tool_use"]

    async def run():
        apis = (openai_chat, openai_responses, anthropic_messages)
        async with (
            openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused") as chat,
            anthropic.AsyncAnthropic(base_url=server, api_key="unused") as messages,
        ):
            return await asyncio.gather(*(api(chat, messages, seed) for api in apis for seed in range(SEEDS)))

    results = asyncio.run(run())
    ends = {"tool_calls", "completed", "tool_use"}
    for end, calls in results:
        assert end in ends and len(calls) == 1, (end, calls)
        name, arguments = calls[0]
        assert wanted in (None, name)
        jsonschema.validate(json.loads(arguments), schema_of(name))
    assert len(results) == 3 * SEEDS and len({call for _, [call] in results}) > 1  # the draws differ


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    """A server of a random tools model that opens calls often: its `<tool_call>` token's output
    row is that of the token it writes most after the tools prompt, so at temperature 1 it calls
    a few times a reply, each call, unheld, as random as the rest of its text."""
    path = make_checkpoint(
        tmp_path_factory.mktemp("eager") / MODEL, chat_template=TOOLS_CHAT_TEMPLATE, max_position_embeddings=4096
    )
    tokenizer = load(str(path))[1]
    prompt = prompt_ids(tokenizer, ASK, tools=TOOLS)
    drawn = LLM(model=str(path)).generate(
        [prompt] * 4, [SamplingParams(max_tokens=100, temperature=1, seed=s) for s in range(4)]
    )
    common = Counter(t for output in drawn for t in output.token_ids).most_common(1)[0][0]
    weights = mx.load(str(path / "model.safetensors"))
    weights["lm_head.weight"][tokenizer.convert_tokens_to_ids("<tool_call>")] = weights["lm_head.weight"][common]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    proc, url = start_server("--model", MODEL, "--max-num-seqs", "32", cwd=path.parent)
    yield url
    stop_server(proc)


def test_under_auto_every_call_a_random_model_opens_validates_on_every_api(eager):
    """`tool_choice` 'auto' (Ollama's only way): the model writes freely, and each call it opens is
    held to its tool's schema from the `<tool_call>` token on, so 32 draws at temperature 1 on each
    API make many calls, every one valid."""
    anthropic = pytest.importorskip("anthropic", reason="the anthropic package could not be installed")
    most = 120

    async def openai_chat(seed):
        reply = await chat.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=most, temperature=1, seed=seed
        )
        return [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls or []]

    async def openai_responses(seed):
        tools = [responses_tool(t) for t in TOOLS]
        reply = await chat.responses.create(model=MODEL, input=ASK, tools=tools, max_output_tokens=most, temperature=1)
        return [(item.name, item.arguments) for item in reply.output if item.type == "function_call"]

    async def anthropic_messages(seed):
        reply = await messages.messages.create(
            model=MODEL,
            max_tokens=most,
            messages=ASK,
            tools=[anthropic_tool(t) for t in TOOLS],
            extra_body={"temperature": 1},
        )
        return [(b.name, json.dumps(b.input)) for b in reply.content if b.type == "tool_use"]

    async def ollama_chat(seed):  # as JSON: the ollama package drops the schemas' bounds (maxLength, minimum)
        options = {"temperature": 1, "seed": seed, "num_predict": most}
        body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "options": options, "stream": False}
        reply = (await local.post(f"{eager}/api/chat", json=body, timeout=120)).json()
        return [
            (c["function"]["name"], json.dumps(c["function"]["arguments"]))
            for c in reply["message"].get("tool_calls", [])
        ]

    async def run():
        apis = (openai_chat, openai_responses, anthropic_messages, ollama_chat)
        return await asyncio.gather(*(api(seed) for api in apis for seed in range(SEEDS)))

    chat = openai.AsyncOpenAI(base_url=f"{eager}/v1", api_key="unused")
    messages = anthropic.AsyncAnthropic(base_url=eager, api_key="unused")
    local = httpx.AsyncClient()
    results = asyncio.run(run())
    per_api = [sum(len(calls) for calls in results[i * SEEDS : (i + 1) * SEEDS]) for i in range(4)]
    assert min(per_api) >= SEEDS // 2, per_api  # about one call a reply
    for name, arguments in (call for calls in results for call in calls):
        jsonschema.validate(json.loads(arguments), schema_of(name))


def test_a_tool_schema_llguidance_refuses_is_a_400_under_auto_too(client):
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}},
        },
    }
    with pytest.raises(openai.BadRequestError) as refused:
        call(client, tools=[bad])
    assert refused.value.body["param"] == "tools" and "grammar cannot be used" in refused.value.body["message"]
