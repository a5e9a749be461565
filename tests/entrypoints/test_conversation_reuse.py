"""A conversation stays cached: 5 turns at temperature 0.7 through each API's official client and
`mlxkv chat`, on a model with a chat template and on the demo model (which has none). Each turn
reuses every token the engine computed for the turns before: the previous prompt and reply, less
the reply's last token when `max_tokens` cut it (sampled, never run through the model)."""

import re
import subprocess
import sys
from dataclasses import dataclass

import httpx
import pytest
from helpers import start_server, stop_server

from mlxkv.models.random_model import TOOLS_CHAT_TEMPLATE, make_checkpoint

openai = pytest.importorskip("openai", reason="the openai package could not be installed")
anthropic = pytest.importorskip("anthropic", reason="the anthropic package could not be installed")
ollama = pytest.importorskip("ollama", reason="the ollama package could not be installed")

TURNS = 5
MAX_TOKENS = 200  # long enough that re-encoding a reply would change its tokens (it does, at this length)
TEMPERATURE = 0.7
SEED = 7  # where the API takes one: sampling at 0.7 may end a turn at its first token otherwise


@dataclass
class Turn:
    prompt: int  # prompt tokens
    reused: int  # of them, found in the prefix cache
    reply: int  # tokens generated
    cut: bool  # ended by max_tokens


def questions(api: str) -> list[str]:
    """Messages of a conversation of its own (no API's first turn hits another's)."""
    return [f"{api} asks question {n}: what does a context manager do in Python?" for n in range(TURNS)]


def expected(turns: list[Turn]) -> list[int]:
    return [0] + [t.prompt + t.reply - t.cut for t in turns[:-1]]


@pytest.fixture(scope="module", params=["templated", "demo"])
def server(request, tmp_path_factory):
    flags = ["--max-model-len", "2048"]
    if request.param == "templated":
        path = tmp_path_factory.mktemp("reuse") / "tiny-chat"
        make_checkpoint(path, chat_template=TOOLS_CHAT_TEMPLATE, max_position_embeddings=4096)
        flags += ["--model", str(path)]
    proc, url = start_server(*flags)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    yield url, model, flags
    stop_server(proc)


def hit_tokens(url: str) -> int:
    text = httpx.get(f"{url}/metrics").text
    return int(
        float(
            re.search(r"^mlxkv_prefix_cache_hit_tokens_total\{model=\"[^\"]+\"\} (\S+)$", text, re.MULTILINE).group(1)
        )
    )


def openai_chat(url: str, model: str) -> list[Turn]:
    client, messages, turns = openai.OpenAI(base_url=f"{url}/v1", api_key="none"), [], []
    for question in questions("chat"):
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(
            model=model, messages=messages, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=SEED
        )
        usage, choice = reply.usage, reply.choices[0]
        cached = usage.prompt_tokens_details.cached_tokens
        turns.append(Turn(usage.prompt_tokens, cached, usage.completion_tokens, choice.finish_reason == "length"))
        messages.append({"role": "assistant", "content": choice.message.content})
    return turns


def openai_responses(url: str, model: str) -> list[Turn]:
    client, items, turns = openai.OpenAI(base_url=f"{url}/v1", api_key="none"), [], []
    for question in questions("responses"):
        items.append({"role": "user", "content": question})
        reply = client.responses.create(
            model=model, input=items, temperature=TEMPERATURE, max_output_tokens=MAX_TOKENS, extra_body={"seed": SEED}
        )
        usage = reply.usage
        cached = usage.input_tokens_details.cached_tokens
        turns.append(Turn(usage.input_tokens, cached, usage.output_tokens, reply.status == "incomplete"))
        items.append({"role": "assistant", "content": reply.output_text})
    return turns


def anthropic_messages(url: str, model: str) -> list[Turn]:
    client, messages, turns = anthropic.Anthropic(base_url=url, api_key="none"), [], []
    for question in questions("anthropic"):
        messages.append({"role": "user", "content": question})
        reply = client.messages.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, extra_body={"temperature": TEMPERATURE}
        )
        usage = reply.usage
        prompt = usage.input_tokens + usage.cache_read_input_tokens
        turns.append(
            Turn(prompt, usage.cache_read_input_tokens, usage.output_tokens, reply.stop_reason == "max_tokens")
        )
        messages.append({"role": "assistant", "content": "".join(block.text for block in reply.content)})
    return turns


def ollama_chat(url: str, model: str) -> list[Turn]:
    """Ollama's replies carry no cache figures: the server's `/metrics` counter of hits tells."""
    client, messages, turns = ollama.Client(host=url), [], []
    for question in questions("ollama"):
        messages.append({"role": "user", "content": question})
        before = hit_tokens(url)
        options = {"temperature": TEMPERATURE, "num_predict": MAX_TOKENS, "seed": SEED}
        reply = client.chat(model=model, messages=messages, options=options)
        cut = reply.done_reason == "length"
        turns.append(Turn(reply.prompt_eval_count, hit_tokens(url) - before, reply.eval_count, cut))
        messages.append({"role": "assistant", "content": reply.message.content})
    return turns


@pytest.mark.parametrize("api", [openai_chat, openai_responses, anthropic_messages, ollama_chat])
def test_each_turn_reuses_every_token_computed_for_the_turns_before(server, api):
    url, model, _ = server
    turns = api(url, model)
    assert [t.reused for t in turns] == expected(turns)
    assert sum(t.reply for t in turns) > 0  # a turn may end at its first token; not all five (Anthropic's has no seed)


def test_the_terminal_chat_reuses_every_token_computed_for_the_turns_before(server):
    _, _, flags = server
    lines = [line for question in questions("terminal") for line in (question, "/stats")]
    command = [sys.executable, "-m", "mlxkv", "chat", *flags, "--temp", str(TEMPERATURE)]
    done = subprocess.run(
        [*command, "--max-tokens", str(MAX_TOKENS)], input="\n".join(lines) + "\n", capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    reused = [(int(a), int(b)) for a, b in re.findall(r"prefix cache: (\d+) of (\d+) prompt tokens", done.stdout)]
    generated = [int(n) for n in re.findall(r"^Generation: (\d+) tokens", done.stdout, re.MULTILINE)]
    assert len(reused) == len(generated) == TURNS
    turns = [Turn(prompt, hit, reply, reply == MAX_TOKENS) for (hit, prompt), reply in zip(reused, generated)]
    assert [t.reused for t in turns] == expected(turns)
