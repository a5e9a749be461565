"""A thinking model's reasoning apart from its answer over HTTP, with each API's official client."""

import pytest
from helpers import start_server, stop_server

from mlxkv.models.random_model import make_checkpoint

openai = pytest.importorskip("openai", reason="the openai package could not be installed")

# Qwen3.5's way: the template opens the reply's thinking itself, unless told not to.
OPENING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}"
)
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("think") / "thinker", chat_template=OPENING_TEMPLATE)
    proc, url = start_server("--model", str(path), "--max-model-len", "256")
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none"), str(path)
    stop_server(proc)


def test_openai_chat_keeps_the_reasoning_apart_streamed_and_whole(client):
    api, model = client
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
