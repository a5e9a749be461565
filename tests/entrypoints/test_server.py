"""`mlxkv serve` over real HTTP on 127.0.0.1, driven by the official `openai` client."""

import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import httpx
import openai
import pytest
from helpers import start_server, stop_server

import mlxkv
from mlxkv import LLM, SamplingParams
from mlxkv.entrypoints.prompts import prompt_ids

MODEL = "mlxkv-demo"
HELLO = [{"role": "user", "content": "The import statement"}]
LIMIT = 2**16  # the request body limit the module's server has


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--max-num-seqs", "16", "--max-model-len", "256", "--max-request-bytes", str(LIMIT))
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


@pytest.fixture(scope="module")
def reference():
    """Greedy text of a prompt (token ids) from `LLM` in this process, as the server should give it."""
    llm = LLM(max_num_seqs=1, max_model_len=256)

    def text(ids, n=16, continuation=True):  # a completion's text, or (continuation=False) a chat reply's
        return llm.generate(ids, SamplingParams(max_tokens=n), continuation=continuation)[0].text

    return text, llm.tokenizer


def metric(url: str, name: str) -> float:
    """`name`'s value on /metrics (its first line: the one model's, whatever its labels)."""
    return float(re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", httpx.get(f"{url}/metrics").text, re.MULTILINE).group(1))


def test_models_lists_the_one_model(client):
    [model] = client.models.list().data
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "mlxkv") and model.created > 0


def test_chat_is_the_engine_s_greedy_text_streamed_or_not(client, reference):
    generate, tokenizer = reference
    expected = generate(prompt_ids(tokenizer, HELLO), continuation=False)
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (3, 16, 19)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    text_chunks = chunks[:-1]
    assert "".join(c.choices[0].delta.content or "" for c in text_chunks) == expected
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_completions_streamed_and_not_and_the_wire_format(server, client, reference):
    generate, tokenizer = reference
    expected = generate(tokenizer.encode("The class"), 8)
    reply = client.completions.create(model=MODEL, prompt="The class", max_tokens=8, temperature=0)
    assert reply.choices[0].text == expected and reply.object == "text_completion"
    streamed = client.completions.create(model=MODEL, prompt="The class", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected
    with httpx.stream(
        "POST", f"{server}/v1/completions", json={"prompt": "The class", "max_tokens": 2, "stream": True}
    ) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        body = raw.read().decode()
    assert body.endswith("data: [DONE]\n\n") and all(e.startswith("data: ") for e in body.split("\n\n") if e)


def test_n_choices_stop_strings_and_seeds(client):
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, n=2, temperature=1.0, seed=3)
    assert [c.index for c in reply.choices] == [0, 1]
    again = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, n=2, temperature=1.0, seed=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    full = client.completions.create(model=MODEL, prompt="The import statement", max_tokens=12, temperature=0)
    stop = full.choices[0].text.split()[2]
    cut = client.completions.create(
        model=MODEL, prompt="The import statement", max_tokens=12, temperature=0, stop=[stop]
    )
    assert stop not in cut.choices[0].text and full.choices[0].text.startswith(cut.choices[0].text)
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_in_the_chat_and_the_legacy_forms(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob  # greedy
    assert "".join(e.token for e in content).endswith(reply.choices[0].message.content)
    legacy = client.completions.create(model=MODEL, prompt="The class", max_tokens=3, temperature=0, logprobs=1)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


def test_a_repeated_prompt_reports_its_cached_tokens(client):
    messages = [{"role": "user", "content": "The with statement is used to wrap the execution of a block " * 3}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0 or first.usage.prompt_tokens > 16
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    salted = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"cache_salt": "tenant-b"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize(
    "body, status, param, message",
    [
        ("{not json", 400, None, "the body is not valid JSON"),
        ({"messages": []}, 400, "messages", "messages: List should have at least 1 item"),
        ({"messages": HELLO, "temperature": "hot"}, 400, "temperature", "temperature must be a number >= 0, got 'hot'"),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            400,
            "messages.0.role",
            "messages.0.role: Input should be",
        ),
        ({"messages": HELLO, "top_p": 2}, 400, "top_p", r"top_p must be a number in \(0, 1\], got 2"),
        ({"messages": HELLO, "max_tokens": 0}, 400, "max_tokens", "max_tokens must be a positive integer, got 0"),
        ({"messages": HELLO, "n": 0}, 400, "n", "n: Input should be greater than or equal to 1"),
        ({"messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", r"top_logprobs must be"),
        ({"messages": [{"role": "user", "content": "word " * 300}]}, 400, None, "holds at most 256 per request"),
        ({"messages": HELLO, "cache_salt": ""}, 400, "cache_salt", "cache_salt must be None or a non-empty string"),
        ({"messages": HELLO, "model": "gpt-9"}, 404, "model", "model 'gpt-9' does not exist"),
        ({"messages": HELLO, "stream": "yes"}, 400, "stream", "stream: Input should be a valid boolean"),
        ({"messages": HELLO, "logprobs": 1}, 400, "logprobs", "logprobs: Input should be a valid boolean"),
    ],
)
def test_bad_requests_get_openai_error_shapes(server, body, status, param, message):
    reply = httpx.post(
        f"{server}/v1/chat/completions",
        content=body if isinstance(body, str) else json.dumps(body),
        headers={"content-type": "application/json"},
    )
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert re.search(message, error["message"]), error["message"]


def test_errors_reach_the_openai_client_as_its_exceptions(client):
    with pytest.raises(openai.BadRequestError, match="top_p must be a number"):
        client.chat.completions.create(model=MODEL, messages=HELLO, top_p=3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HELLO)


def test_api_key_cors_and_a_full_queue():
    proc, url = start_server("--api-key", "sesame", "--max-queue", "0", "--allowed-origins", "http://front.test")
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        preflight = httpx.options(
            f"{url}/v1/chat/completions",
            headers={
                "origin": "http://front.test",
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization,content-type",
            },
        )
        assert preflight.headers["access-control-allow-origin"] == "http://front.test"
        other = httpx.options(
            f"{url}/v1/models", headers={"origin": "http://evil.test", "access-control-request-method": "GET"}
        )
        assert "access-control-allow-origin" not in other.headers
        assert httpx.get(f"{url}/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong").models.list()
        allowed = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame")
        assert allowed.models.list().data[0].id == MODEL
        busy = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers={"authorization": "Bearer sesame"})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "queue_full"
    finally:
        stop_server(proc)


def settled(url: str) -> float:
    """Tokens generated so far, once no request runs and no page is held (within 10 s)."""
    for _ in range(200):
        if metric(url, "mlxkv_running_requests") == 0 and metric(url, "mlxkv_kv_pages_used") == 0:
            break
        time.sleep(0.05)
    assert metric(url, "mlxkv_running_requests") == 0 and metric(url, "mlxkv_kv_pages_used") == 0
    return metric(url, "mlxkv_generation_tokens_total")


def test_a_streaming_client_that_goes_away_is_aborted_at_once(server):
    before = settled(server)
    with httpx.stream(
        "POST",
        f"{server}/v1/completions",
        json={"prompt": "The import statement", "max_tokens": 200, "stream": True, "ignore_eos": True},
    ) as raw:
        next(raw.iter_lines())
    generated = settled(server) - before
    assert generated < 100, f"{generated} of 200 tokens generated for a client that left after the first"


def test_a_waiting_client_that_goes_away_is_aborted_at_once(server):
    before = settled(server)
    body = {"prompt": "The class", "max_tokens": 200, "ignore_eos": True}  # sampled: it may draw EOS early
    try:
        response = httpx.post(f"{server}/v1/completions", json=body, timeout=0.3)
    except httpx.ReadTimeout:
        pass
    else:
        pytest.fail(f"a response came back within 0.3 s: {response.status_code} {response.text[:300]!r}")
    generated = settled(server) - before
    assert generated < 150, f"{generated} of 200 tokens generated for a client that left after 0.3 s"


def test_64_streaming_clients_with_a_quarter_walking_away(server, reference):
    """Every stream that completes equals its prompt's non-streaming greedy text; afterwards no
    request runs and every page is free."""
    rng = random.Random(5)
    words = [
        "the",
        "import",
        "class",
        "statement",
        "with",
        "a",
        "module",
        "for",
        "while",
        "return",
        "value",
        "name",
        "object",
    ]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(64)]
    leavers = set(rng.sample(range(64), 16))

    async def one(api: openai.AsyncOpenAI, index: int) -> str | None:
        stream = await api.completions.create(
            model=MODEL, prompt=prompts[index], max_tokens=24, temperature=0, stream=True
        )
        text, quit_after = "", rng.randint(0, 10)
        async for chunk in stream:
            text += chunk.choices[0].text
            if index in leavers and quit_after == 0:
                await stream.close()
                return None
            quit_after -= 1
        return text

    async def everyone() -> list[str | None]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as api:
            return await asyncio.gather(*(one(api, i) for i in range(64)))

    texts = asyncio.run(everyone())
    generate, tokenizer = reference
    for index, text in enumerate(texts):
        if text is not None:
            assert text == generate(tokenizer.encode(prompts[index]), 24), index
    assert sum(t is None for t in texts) >= 8
    settled(server)  # no request runs and no page is held (the walked-away ones aborted)
    assert metric(server, "mlxkv_waiting_requests") == 0


def test_metrics_and_the_chat_page(server):
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "mlxkv_running_requests",
        "mlxkv_waiting_requests",
        "mlxkv_kv_pages_used",
        "mlxkv_kv_pages_total",
        "mlxkv_kv_bytes_holding_tokens",
        "mlxkv_states_used",
        "mlxkv_states_total",
        "mlxkv_state_bytes_used",
        "mlxkv_preemptions",
        "mlxkv_prefix_cache_hit_rate",
        "mlxkv_prompt_tokens_total",
        "mlxkv_generation_tokens_total",
        "mlxkv_time_to_first_token_seconds_bucket",
        "mlxkv_inter_token_latency_seconds_bucket",
    ):
        assert re.search(rf"^{name}", text, re.MULTILINE), name
    page = httpx.get(f"{server}/")
    assert page.status_code == 200 and "<title>mlxkv chat</title>" in page.text
    assert "innerHTML" not in page.text.split("<script>")[1].replace("never innerHTML", "")


def test_a_speculating_server_streams_the_same_text_and_counts_its_drafts(reference):
    demo = str(Path(mlxkv.__file__).parent / "demo_model")
    proc, url = start_server("--max-num-seqs", "4", "--max-model-len", "256", "--draft-model", demo)
    try:
        prompts = ["The for statement", "The import statement", "The with statement", "The while statement"]

        async def one(api, prompt: str) -> str:
            stream = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream])

        async def everyone() -> list[str]:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as api:
                return await asyncio.gather(*(one(api, p) for p in prompts))

        generate, tokenizer = reference
        assert asyncio.run(everyone()) == [generate(tokenizer.encode(p), 24) for p in prompts]
        drafted = metric(url, "mlxkv_spec_draft_tokens_total")
        accepted = metric(url, "mlxkv_spec_accepted_tokens_total")
        assert 0 < accepted <= drafted
        assert metric(url, "mlxkv_spec_acceptance_rate") == pytest.approx(accepted / drafted)
    finally:
        stop_server(proc)


def test_a_long_prefill_sends_keepalive_comments_before_the_first_token():
    """In process (the interval is a `build_app` argument): a 1,500-token prompt takes longer
    to prefill than a 1 ms keepalive interval, so the stream opens with comment lines."""
    from mlxkv import AsyncLLM, EngineConfig, LLMEngine, load
    from mlxkv.entrypoints.server import build_app

    llm = AsyncLLM(LLMEngine(*load(), EngineConfig(max_num_seqs=1, max_model_len=1600)))
    app = build_app(llm, MODEL, keepalive_s=0.001)

    async def fetch() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as api:
            reply = await api.post(
                "/v1/completions", json={"prompt": list(range(1, 1501)), "max_tokens": 2, "stream": True}
            )
            return reply.text

    try:
        body = asyncio.run(fetch())
    finally:
        llm.shutdown()
    events = [e for e in body.split("\n\n") if e]
    assert events[0] == ": keepalive" and events[-1] == "data: [DONE]"
    assert all(e == ": keepalive" or e.startswith("data: ") for e in events)


def test_a_request_that_fails_gets_a_500_or_an_error_event_and_the_rest_go_on(monkeypatch):
    """In process, with one request's sampler failing: a non-streaming client gets OpenAI's
    error body with status 500; a streaming one, whose status line has gone, an error event."""
    from helpers import ExplodingSampler

    from mlxkv import AsyncLLM, EngineConfig, LLMEngine, load
    from mlxkv.engine.sampling.sampler import TokenSampler
    from mlxkv.entrypoints.server import build_app

    original = TokenSampler.key
    monkeypatch.setattr(
        TokenSampler,
        "key",
        lambda self, index: ExplodingSampler.key(self, index) if self.params.seed == 13 else original(self, index),
    )
    llm = AsyncLLM(LLMEngine(*load(), EngineConfig(max_num_seqs=4, max_model_len=256)))
    app = build_app(llm, MODEL)
    bad = {"prompt": "The class", "max_tokens": 4, "temperature": 1.0, "seed": 13}

    async def run() -> tuple:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as api:
            return await asyncio.gather(
                api.post("/v1/completions", json=bad),
                api.post("/v1/completions", json={**bad, "stream": True}),
                api.post("/v1/completions", json={"prompt": "The class", "max_tokens": 4}),
            )

    try:
        plain, streamed, fine = asyncio.run(run())
    finally:
        llm.shutdown()
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "server_error"
    assert "sampler exploded" in plain.json()["error"]["message"]
    *_, error, done = [e for e in streamed.text.split("\n\n") if e]
    assert json.loads(error.removeprefix("data: "))["error"]["message"].endswith("sampler exploded")
    assert done == "data: [DONE]"
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 4


def test_each_choice_of_a_seeded_request_draws_its_own_reproducible_stream(client):
    def texts(n, seed):
        reply = client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=16, n=n, temperature=1.5, seed=seed
        )
        return [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]

    three = texts(3, seed=7)
    assert len(set(three)) == 3
    assert texts(3, seed=7) == three  # reproducible
    assert [texts(1, seed=7 + j)[0] for j in range(3)] == three  # choice j draws with seed + j


def test_max_tokens_is_cut_to_exactly_what_the_context_leaves(client, reference):
    _, tokenizer = reference
    prompt = tokenizer.encode("The import statement")
    done = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=100_000, temperature=0, extra_body={"ignore_eos": True}
    )
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt), 256 - len(prompt))
    assert done.choices[0].finish_reason == "length"
    last = client.completions.create(model=MODEL, prompt=list(range(1, 256)), max_tokens=50, temperature=0)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (255, 1)
    with pytest.raises(openai.BadRequestError, match="the prompt has 256 tokens; this server holds at most 256"):
        client.completions.create(model=MODEL, prompt=list(range(1, 257)), max_tokens=1)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_a_batch_of_prompts_n_choices_each_in_openai_order(client, reference, stream):
    generate, tokenizer = reference
    texts = ["The import statement", "A class definition"]
    expected = [generate(tokenizer.encode(t), 8) for t in texts]
    for prompts in (texts, [tokenizer.encode(t) for t in texts]):
        reply = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0, stream=stream)
        if stream:
            got = [""] * 4
            for chunk in reply:
                for choice in chunk.choices:
                    got[choice.index] += choice.text
        else:
            assert [c.index for c in reply.choices] == [0, 1, 2, 3]
            got = [c.text for c in reply.choices]
            assert reply.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
            assert reply.usage.completion_tokens == 4 * 8
        assert got == [expected[0], expected[0], expected[1], expected[1]]
    with pytest.raises(openai.BadRequestError, match="prompt 1: prompt token ids must be in"):
        client.completions.create(model=MODEL, prompt=[[5, 6], [99_999]], max_tokens=2)


def test_serve_on_a_port_in_use_says_so_in_one_line_before_loading_anything():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "mlxkv", "serve", "--port", str(port)], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 1
    assert done.stderr == f"error: port {port} on 127.0.0.1 is in use (another server?); choose another with --port\n"


def test_a_hybrid_model_serves_its_text_reuses_a_prefix_and_reports_its_states(tmp_path):
    """Qwen3.5 (Gated DeltaNet beside attention) over HTTP: the text `LLM` gives, a second prompt
    that extends the first reuses it (`cached_tokens`), and /metrics counts the recurrent states."""
    from helpers import BASE, HYBRIDS

    from mlxkv.models.random_model import make_checkpoint

    path = make_checkpoint(tmp_path / "qwen3_5", "qwen3_5", shape={**BASE, **HYBRIDS["qwen3_5"]})
    proc, url = start_server("--model", str(path), "--max-num-seqs", "4", "--page-size", "4")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        [model] = client.models.list().data
        first = [(5 * i) % 300 + 1 for i in range(30)]
        second = first + [7, 8, 9]
        llm = LLM(str(path), page_size=4, max_num_seqs=1)
        for prompt, cached in ((first, 0), (second, 28)):  # 28: the first prompt's last full page before its end
            done = client.completions.create(model=model.id, prompt=prompt, max_tokens=6, temperature=0)
            assert done.choices[0].text == llm.generate(prompt, SamplingParams(max_tokens=6))[0].text
            assert done.usage.prompt_tokens_details.cached_tokens == cached
        assert metric(url, "mlxkv_states_total") == 4 and metric(url, "mlxkv_states_used") == 0
    finally:
        stop_server(proc)


def test_long_prompts_under_a_tight_budget_get_200_or_503_and_memory_stays_within_it():
    """32 clients at once, each with a prompt of about 1,500 tokens, against 40 MB for everything: a few
    requests run, a few wait, the rest are told to retry; none fails, and MLX never held more than
    the budget."""
    flags = ["--memory-limit", "40MB", "--max-num-seqs", "4", "--max-model-len", "2048", "--max-queue", "6"]
    proc, url = start_server(*flags)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        words = ["paged", "attention", "keeps", "keys", "and", "values", "in", "pages", "of", "tokens"]

        def ask(seed: int) -> int:
            prompt = " ".join(random.Random(seed).choices(words, k=700))
            try:
                reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
            except openai.APIStatusError as error:
                assert error.response.headers.get("retry-after") == "1"
                return error.status_code
            assert reply.usage.completion_tokens == 8
            return 200

        with ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(ask, range(32)))
        assert set(codes) == {200, 503} and codes.count(200) >= 4
        assert metric(url, "mlxkv_memory_limit_bytes") == 40e6
        assert 0 < metric(url, "mlxkv_memory_peak_bytes") <= 40e6
        assert settled(url) > 0
    finally:
        stop_server(proc)


SHAPES = {  # a path of each API, and where its error bodies keep the message
    "openai": ("/v1/chat/completions", lambda body: body["error"]["message"]),
    "responses": ("/v1/responses", lambda body: body["error"]["message"]),
    "anthropic": ("/v1/messages", lambda body: body["type"] == "error" and body["error"]["message"]),
    "ollama": ("/api/chat", lambda body: body["error"]),
}


@pytest.mark.parametrize("api", list(SHAPES))
def test_every_refusal_takes_the_shape_of_the_api_it_was_sent_to(server, api):
    """Bodies that are not JSON (bad UTF-8, nesting past the parser's limit) or over the body
    limit, an unknown route under the API's path and a wrong method: each answered in the API's
    error shape, never FastAPI's `{"detail": ...}`."""
    path, message = SHAPES[api]
    headers = {"content-type": "application/json"}
    cases = [
        (httpx.post(f"{server}{path}", content=b'{"model": "\xff\xfe"}', headers=headers), 400, "not valid JSON"),
        (httpx.post(f"{server}{path}", content=b"[" * 10**4 + b"]" * 10**4, headers=headers), 400, "not valid JSON"),
        (httpx.post(f"{server}{path}", content=b" " * (LIMIT + 1), headers=headers), 413, f"({LIMIT} bytes"),
        (httpx.post(f"{server}{path}/no/such", json={}), 404, f"there is no {path}/no/such here"),
        (httpx.delete(f"{server}{path}"), 405, f"{path} does not take DELETE"),
    ]
    for reply, status, text in cases:
        assert (reply.status_code, "detail" in reply.json()) == (status, False), reply.text
        assert text in message(reply.json()), reply.text


def test_health_tells_mlxkv_s_version(server):
    assert httpx.get(f"{server}/health").json() == {"status": "ok", "version": version("mlxkv")}


@pytest.mark.parametrize(
    "extra, field", [({"echo": True}, "echo"), ({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of")]
)
def test_completion_fields_that_would_change_the_text_are_refused_not_ignored(client, extra, field):
    with pytest.raises(openai.BadRequestError, match=f"{field} is not supported by mlxkv's completions") as refused:
        client.completions.create(model=MODEL, prompt="The import statement", max_tokens=2, extra_body=extra)
    assert refused.value.body["param"] == field


def test_completions_continue_their_prompts_exactly_whole_and_streamed(client):
    """50 prompts: each completion's text is what its tokens add to the prompt's decoded text, a
    first token's leading space included, whole and streamed (greedy, so the tokens are those of
    `LLM` in this process)."""
    llm = LLM(max_num_seqs=1, max_model_len=256)
    rng = random.Random(8)
    words = ["The", " import", " statement", " is", " a", " module", " name", ".", "\n", " for"]
    prompts = [llm.tokenizer.encode("".join(rng.choice(words) for _ in range(rng.randint(1, 6)))) for _ in range(50)]
    decode, spaced = llm.tokenizer.decode, 0
    for prompt in prompts:
        [local] = llm.generate(prompt, SamplingParams(max_tokens=6))
        expected = decode(prompt + local.token_ids)[len(decode(prompt)) :]
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        parts = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
        assert whole.choices[0].text == "".join(part.choices[0].text for part in parts) == expected
        spaced += expected.startswith(" ")
    assert spaced >= 10  # many open with a space, which mlx-lm's detokenizer would drop


def test_served_model_names_name_the_model_and_the_first_is_reported():
    proc, url = start_server("--max-model-len", "64", "--served-model-name", "qwen", "--served-model-name", "local")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["qwen"]
        for name in ("qwen", "local"):
            reply = client.completions.create(model=name, prompt="The import statement", max_tokens=2)
            assert reply.model == "qwen"
        with pytest.raises(
            openai.NotFoundError, match="model 'mlxkv-demo' does not exist here; this server serves 'qwen'"
        ):
            client.completions.create(model="mlxkv-demo", prompt="The import statement", max_tokens=2)
        assert [m["name"] for m in httpx.get(f"{url}/api/tags").json()["models"]] == ["qwen"]
    finally:
        stop_server(proc)
