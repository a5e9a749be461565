"""Images over HTTP, through each API's official client: OpenAI's `image_url` parts, the Responses
API's `input_image`, Anthropic's `image` blocks (in a user turn and inside a `tool_result`, as Claude
Code sends a screenshot), Ollama's `images`; streamed replies equal whole ones, and the answer is
the one the engine gives the same prompt. Unreadable images and refused URLs are 400s."""

import base64
import http.server
import io
import threading
import warnings

import anthropic
import numpy as np
import ollama
import openai
import pytest
from helpers import start_server, stop_server

from mlxkv import LLM, ImagePrompt, SamplingParams
from mlxkv.models.random_vision_model import make_vision_checkpoint

pytest.importorskip("mlx_vlm")
pytestmark = pytest.mark.xdist_group("images-over-http")
QUESTION = "What is in the picture?"
TOKENS = 6


def png(seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


IMAGE = png(1)
B64 = base64.b64encode(IMAGE).decode()
DATA_URL = f"data:image/png;base64,{B64}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_vision_checkpoint(tmp_path_factory.mktemp("qwen3-vl"), "qwen3_vl")


@pytest.fixture(scope="module")
def server(checkpoint):
    proc, url = start_server("--model", str(checkpoint), "--max-model-len", "512", "--served-model-name", "m")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def expected(checkpoint):
    """The engine's own greedy reply to the user turn [image, question], as the chat template writes it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(str(checkpoint))
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    (done,) = llm.generate(
        ImagePrompt(text, [IMAGE]), SamplingParams(max_tokens=TOKENS, temperature=0.0), continuation=False
    )
    return done.text


def test_openai_image_url_parts_whole_and_streamed(server, expected):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": DATA_URL}}, {"type": "text", "text": QUESTION}],
        }
    ]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=TOKENS, temperature=0)
    chunks = client.chat.completions.create(model="m", messages=messages, max_tokens=TOKENS, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed == expected
    assert whole.usage.prompt_tokens > 12  # the image's placeholders are prompt tokens


def test_responses_input_image(server, expected):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    content = [{"type": "input_image", "image_url": DATA_URL}, {"type": "input_text", "text": QUESTION}]
    items = [{"role": "user", "content": content}]
    whole = client.responses.create(model="m", input=items, max_output_tokens=TOKENS, temperature=0)
    events = client.responses.create(model="m", input=items, max_output_tokens=TOKENS, temperature=0, stream=True)
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert whole.output_text == streamed == expected


def test_anthropic_image_blocks_and_a_screenshot_in_a_tool_result(server, expected):
    client = anthropic.Anthropic(base_url=server, api_key="unused")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}]
    whole = client.messages.create(model="m", messages=messages, max_tokens=TOKENS, extra_body={"temperature": 0})
    with client.messages.stream(
        model="m", messages=messages, max_tokens=TOKENS, extra_body={"temperature": 0}
    ) as stream:
        streamed = "".join(stream.text_stream)
    assert whole.content[0].text == streamed == expected
    history = [
        {"role": "user", "content": "Look at my screen."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}]},
    ]
    reply = client.messages.create(model="m", messages=history, max_tokens=TOKENS, extra_body={"temperature": 0})
    assert reply.usage.input_tokens > 12 and reply.content


def test_ollama_images_in_chat_and_generate(server, expected):
    client = ollama.Client(host=server)
    message = {"role": "user", "content": QUESTION, "images": [IMAGE]}
    whole = client.chat(model="m", messages=[message], options={"temperature": 0, "num_predict": TOKENS})
    parts = client.chat(model="m", messages=[message], options={"temperature": 0, "num_predict": TOKENS}, stream=True)
    assert whole.message.content == "".join(p.message.content for p in parts) == expected
    generated = client.generate(
        model="m", prompt=QUESTION, images=[IMAGE], options={"temperature": 0, "num_predict": TOKENS}
    )
    assert generated.response == expected


def test_an_image_from_an_http_url_is_fetched(server, expected):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(IMAGE)

        def log_message(self, *args):
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    try:
        client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
        url = f"http://127.0.0.1:{host.server_address[1]}/cat.png"
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": content}], max_tokens=TOKENS, temperature=0
        )
        assert reply.choices[0].message.content == expected
    finally:
        host.shutdown()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,!!!", "image_url: the image data is not base64"),
        (f"data:image/png;base64,{base64.b64encode(b'not an image').decode()}", "could not read an image"),
        ("ftp://example.com/cat.png", r"an image URL must be a data: URL or http\(s\)"),
    ],
    ids=["not-base64", "not-an-image", "ftp"],
)
def test_an_unreadable_image_is_a_400_naming_it(server, url, message):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    with pytest.raises(openai.BadRequestError, match=message) as refused:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}], max_tokens=2)
    assert refused.value.status_code == 400


def test_no_image_urls_refuses_http_images(checkpoint):
    proc, url = start_server(
        "--model", str(checkpoint), "--max-model-len", "256", "--no-image-urls", "--served-model-name", "m"
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        content = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]
        with pytest.raises(openai.BadRequestError, match="this server fetches no image URLs"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}], max_tokens=2)
    finally:
        stop_server(proc)
