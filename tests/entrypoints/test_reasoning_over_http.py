"""A thinking model's reasoning apart from its answer over HTTP, with each API's official client."""

import re
from pathlib import Path

import httpx
import pytest
from helpers import start_server, stop_server

from mlxkv.models.random_model import HARMONY_CHAT_TEMPLATE, HARMONY_MARKERS, make_checkpoint

openai = pytest.importorskip("openai", reason="the openai package could not be installed")
ollama = pytest.importorskip("ollama", reason="the ollama package could not be installed")

# Qwen3.5's way: the template opens the reply's thinking itself, unless told not to, and renders
# the reasoning of replies passed back.
OPENING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}"
)
HELLO = [{"role": "user", "content": "Hello"}]
TEMPLATES = {
    "qwen3.5": {"chat_template": OPENING_TEMPLATE},
    "harmony": {  # gpt-oss's channels: the analysis is the reasoning, the final channel the answer
        "chat_template": HARMONY_CHAT_TEMPLATE,
        "markers": HARMONY_MARKERS,
        "tokenizer_config": {"eos_token": "<|return|>"},
    },
}


@pytest.fixture(scope="module", params=list(TEMPLATES))
def client(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("think") / "thinker", **TEMPLATES[request.param])
    proc, url = start_server("--model", str(path), "--max-model-len", "256")
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none"), str(path), url
    stop_server(proc)


def thinks_always(model: str) -> bool:
    """Whether the model's template thinks whatever the request says (gpt-oss's)."""
    return "<|channel|>" in (Path(model) / "tokenizer_config.json").read_text()


def test_openai_chat_keeps_the_reasoning_apart_streamed_and_whole(client):
    api, model, _ = client
    whole = api.chat.completions.create(model=model, messages=HELLO, max_tokens=12, temperature=0)
    [choice] = whole.choices
    assert (choice.message.content, choice.finish_reason) == ("", "length")  # cut inside its thinking
    assert choice.message.reasoning_content == choice.message.reasoning != ""
    assert "<think>" not in choice.message.reasoning and whole.usage.completion_tokens_details.reasoning_tokens == 12
    chunks = list(
        api.chat.completions.create(
            model=model,
            messages=HELLO,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == choice.message.reasoning
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == choice.message.reasoning
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 12
    counted = httpx.get(f"{client[2]}/metrics").text  # this module's first test: its two replies
    assert (
        float(re.search(r"^mlxkv_reasoning_tokens_total\{model=\"[^\"]+\"\} (\S+)$", counted, re.MULTILINE).group(1))
        == 24
    )


def test_thinking_turned_off_gives_no_reasoning_on_each_api(client):
    anthropic = pytest.importorskip("anthropic", reason="the anthropic package could not be installed")
    api, model, url = client
    if thinks_always(model):
        pytest.skip("gpt-oss's template cannot turn thinking off")

    def chat(**extra):
        reply = api.chat.completions.create(model=model, messages=HELLO, max_tokens=8, temperature=0, **extra)
        return reply.choices[0].message

    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        message = chat(extra_body=extra)
        assert message.content and getattr(message, "reasoning", None) is None
    assert getattr(chat(extra_body={"reasoning_effort": "high"}), "reasoning", None)
    ask = ollama.Client(host=url)
    off = ask.chat(model=model, messages=HELLO, think=False, options={"num_predict": 8, "temperature": 0})
    on = ask.chat(model=model, messages=HELLO, think=True, options={"num_predict": 8, "temperature": 0})
    assert off.message.content and not off.message.thinking
    assert (on.message.content, on.message.thinking) == ("", chat().reasoning)
    disabled = anthropic.Anthropic(base_url=url, api_key="none").messages.create(
        model=model, max_tokens=8, messages=HELLO, thinking={"type": "disabled"}, extra_body={"temperature": 0}
    )
    assert [b.type for b in disabled.content] == ["text"] and disabled.content[0].text
    none = api.responses.create(
        model=model, input="Hello", max_output_tokens=8, temperature=0, reasoning={"effort": "none"}
    )
    assert [item.type for item in none.output] == ["message"] and none.output_text
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    off_too = api.responses.create(model=model, input="Hello", max_output_tokens=8, temperature=0, extra_body=kwargs)
    assert [item.type for item in off_too.output] == ["message"]


def test_ollama_streams_the_thinking_apart(client):
    _, model, url = client
    ask = ollama.Client(host=url)
    whole = ask.chat(model=model, messages=HELLO, options={"num_predict": 12, "temperature": 0})
    parts = list(ask.chat(model=model, messages=HELLO, options={"num_predict": 12, "temperature": 0}, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking != ""
    assert "".join(p.message.content for p in parts) == whole.message.content == ""
    generated = ask.generate(model=model, prompt="Hello", options={"num_predict": 12, "temperature": 0})
    assert (generated.response, generated.thinking) == ("", whole.message.thinking)


def test_template_kwargs_the_server_sets_itself_are_refused(client):
    _, model, url = client
    body = {"model": model, "messages": HELLO, "chat_template_kwargs": {"tools": [], "enable_thinking": True}}
    refused = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"
    assert "may not set tools" in refused.json()["error"]["message"]
    body = {"model": model, "input": "Hello", "chat_template_kwargs": {"tokenize": True}}
    refused = httpx.post(f"{url}/v1/responses", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


def test_anthropic_thinking_blocks_streamed_whole_and_only_this_server_s_go_back_into_the_prompt(client):
    anthropic = pytest.importorskip("anthropic", reason="the anthropic package could not be installed")
    _, model, url = client
    api = anthropic.Anthropic(base_url=url, api_key="none")
    args = {"model": model, "max_tokens": 12, "messages": HELLO, "extra_body": {"temperature": 0}}
    whole = api.messages.create(**args)
    thinking, text = whole.content
    assert (thinking.type, text.type, text.text, whole.stop_reason) == ("thinking", "text", "", "max_tokens")
    assert thinking.thinking and thinking.signature
    with api.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]

    def prompt_tokens(*blocks):
        """A tool loop's prompt (templates render the reasoning after the last user message only)."""
        call = {"type": "tool_use", "id": "t1", "name": "now", "input": {}}
        history = [
            *HELLO,
            {"role": "assistant", "content": [*blocks, {"type": "text", "text": "Hi"}, call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "noon"}]},
        ]
        return api.messages.count_tokens(model=model, messages=history).input_tokens

    ours, unchanged = thinking.model_dump(), prompt_tokens()
    assert prompt_tokens(ours) > unchanged  # its reasoning goes back into the prompt
    assert prompt_tokens(ours | {"thinking": ours["thinking"] + " (edited)"}) == unchanged  # left out
    assert prompt_tokens(ours | {"signature": "c2ln"}) == unchanged  # another server's


def test_a_budget_of_16_closes_the_thinking_and_an_answer_follows_on_each_api(client):
    anthropic = pytest.importorskip("anthropic", reason="the anthropic package could not be installed")
    api, model, url = client
    chat = api.chat.completions.create(
        model=model, messages=HELLO, max_tokens=40, temperature=0, extra_body={"thinking_token_budget": 16}
    )
    assert chat.usage.completion_tokens_details.reasoning_tokens == 16 and chat.choices[0].message.content
    message = anthropic.Anthropic(base_url=url, api_key="none").messages.create(
        model=model,
        max_tokens=40,
        messages=HELLO,
        thinking={"type": "enabled", "budget_tokens": 16},
        extra_body={"temperature": 0},
    )
    thinking, text = message.content
    assert thinking.thinking == chat.choices[0].message.reasoning and text.text == chat.choices[0].message.content
    reply = ollama.Client(host=url).chat(
        model=model, messages=HELLO, options={"num_predict": 40, "temperature": 0, "thinking_token_budget": 16}
    )
    assert (reply.message.thinking, reply.message.content) == (thinking.thinking, text.text)
    response = api.responses.create(
        model=model, input="Hello", max_output_tokens=40, temperature=0, extra_body={"thinking_token_budget": 16}
    )
    reasoning, message_item = response.output
    assert (reasoning.type, message_item.type) == ("reasoning", "message")
    assert (reasoning.summary[0].text, response.output_text) == (thinking.thinking, text.text)
    assert response.usage.output_tokens_details.reasoning_tokens == 16
    markers = ("<think>", "</think>", "<|channel|>analysis<|message|>", "<|end|><|start|>", "<|channel|>final")
    for tag in markers:  # neither reasoning nor answer
        assert tag not in text.text and tag not in thinking.thinking


def test_responses_reasoning_items_streamed_and_whole_and_passed_back(client):
    api, model, _ = client
    whole = api.responses.create(model=model, input="Hello", max_output_tokens=12, temperature=0)
    [reasoning] = whole.output  # cut inside its thinking: no message at all
    assert (reasoning.type, whole.output_text, whole.status) == ("reasoning", "", "incomplete")
    text = reasoning.summary[0].text
    assert text and reasoning.content[0].text == text and whole.usage.output_tokens_details.reasoning_tokens == 12
    events = list(api.responses.create(model=model, input="Hello", max_output_tokens=12, temperature=0, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
    assert "".join(deltas) == text
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning"] and final.output[0].summary[0].text == text
    call = {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"}
    loop = [call, {"type": "function_call_output", "call_id": "c1", "output": "noon"}]  # one task's tool loop

    def input_tokens(*items):
        reply = api.responses.create(model=model, input=[*items, *loop], max_output_tokens=4, temperature=0)
        return reply.usage.input_tokens

    unpassed = input_tokens({"role": "user", "content": "Hello"})
    passed = input_tokens({"role": "user", "content": "Hello"}, reasoning.model_dump(exclude_none=True))
    assert passed > unpassed  # the reasoning went back into the prompt


def test_a_next_turn_that_sends_the_reasoning_back_reuses_every_token_of_the_turn_before(tmp_path):
    """A template that renders past reasoning as the model wrote it (Qwen3's does, for the turns of
    an agent's current task): the reply's reasoning and answer are spliced back as their own ids."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}<think>\n{{ m.reasoning_content or '' }}</think>{% endif %}"
        "{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    path = make_checkpoint(tmp_path / "thinker", chat_template=template)
    proc, url = start_server("--model", str(path), "--max-model-len", "512")
    try:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        messages, turns = list(HELLO), []
        for question in ("And then?", "Why?", "Sure?"):
            reply = api.chat.completions.create(
                model=str(path),
                messages=messages,
                max_tokens=40,
                temperature=0.7,
                extra_body={"thinking_token_budget": 10},
            )
            message, usage = reply.choices[0].message, reply.usage
            turns.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens))
            assert message.reasoning_content and reply.choices[0].finish_reason == "length"
            back = {"role": "assistant", "content": message.content, "reasoning_content": message.reasoning_content}
            messages += [back, {"role": "user", "content": question}]
    finally:
        stop_server(proc)
    assert [cached for _, cached, _ in turns] == [0] + [p + c - 1 for p, _, c in turns[:-1]]


def test_a_server_wide_budget_bounds_the_requests_that_set_none(tmp_path):
    path = make_checkpoint(tmp_path / "thinker", chat_template=OPENING_TEMPLATE)
    proc, url = start_server("--model", str(path), "--max-model-len", "256", "--thinking-token-budget", "16")
    try:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none")

        def reasoned(**extra):
            reply = api.chat.completions.create(
                model=str(path), messages=HELLO, max_tokens=40, temperature=0, extra_body=extra
            )
            return reply.usage.completion_tokens_details.reasoning_tokens

        assert (reasoned(), reasoned(thinking_token_budget=8), reasoned(reasoning_effort="high")) == (16, 8, 40)
    finally:
        stop_server(proc)
