"""What a thinking model's next turn costs, per chat template: a conversation of `--turns` turns
through the `anthropic` client, passing each reply's thinking block back, and through the `openai`
client, passing the answer only, against `mlxkv serve` on tiny random checkpoints whose templates
render past reasoning as these families do:

- `qwen3`: the reasoning of the replies after the last user message (an agent's tool loop), none
  before it (Qwen3's rule);
- `qwen3.5`: the same, unless the template's `preserve_thinking` is set (Qwen3.6's option), here
  from `serve --chat-template-kwargs`: then every reply's (`qwen3.5+preserve`);
- `gpt-oss`: harmony's channels, the analysis of earlier turns left out.

A random model never opens its thinking, so each template here opens it in the prompt, and
renders the reasoning as the model wrote it (Qwen's templates give back the newlines a Qwen model
writes around it). Every reply thinks for `--budget` tokens, then answers up to `--max-tokens`.

Per turn: the prompt's tokens, of them those the prefix cache held, and what is prefilled. A cold
prefill computes the whole prompt. Prints a Markdown table (docs/prefix-caching.md) and a line
`prefilled_share_<template>_<client>=...` per run: tokens prefilled over all turns, over the
tokens of all prompts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
from bench_serve import free_port, launch
from progress import bar, expect

from mlxkv.models.random_model import HARMONY_CHAT_TEMPLATE, HARMONY_MARKERS, make_checkpoint

DEFAULTS_TAKE = 30  # seconds on progress.MACHINE (docs/benchmarks.md)


def qwen_template(keep: str) -> str:
    """A Qwen-style ChatML template that opens the reply's thinking and renders a reply's
    reasoning where `keep` (a Jinja test on `loop.index0` and `last`) holds."""
    return (
        "{%- set last = namespace(user=-1) -%}"
        "{%- for m in messages %}{% if m.role == 'user' %}{% set last.user = loop.index0 %}{% endif %}{% endfor -%}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        f"{{% if m.role == 'assistant' and m.reasoning_content and ({keep}) %}}"
        "<think>\n{{ m.reasoning_content }}</think>{% endif %}"
        "{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )


AFTER_LAST_USER = "loop.index0 > last.user"
TEMPLATES: dict[str, dict] = {
    "qwen3": {"chat_template": qwen_template(AFTER_LAST_USER)},
    "qwen3.5": {"chat_template": qwen_template(f"preserve_thinking or {AFTER_LAST_USER}")},
    "gpt-oss": {
        "chat_template": HARMONY_CHAT_TEMPLATE,
        "markers": HARMONY_MARKERS,
        "tokenizer_config": {"eos_token": "<|return|>"},
    },
}
RUNS = {  # a run: its template, and the server's template kwargs
    "qwen3": ("qwen3", None),
    "qwen3.5": ("qwen3.5", None),
    "qwen3.5+preserve": ("qwen3.5", '{"preserve_thinking": true}'),
    "gpt-oss": ("gpt-oss", None),
}


@dataclass
class Turn:
    prompt: int  # prompt tokens
    reused: int  # of them, held by the prefix cache
    reply: int  # tokens generated
    cut: bool  # ended by max_tokens


def questions(client: str, turns: int) -> list[str]:
    return [f"{client} asks question {n}: what does a context manager do?" for n in range(turns)]


def anthropic_turns(url: str, model: str, turns: int, budget: int, max_tokens: int) -> list[Turn]:
    """Each reply goes back whole: its thinking block (with its signature) and its text."""
    client, messages, done = anthropic.Anthropic(base_url=url, api_key="none"), [], []
    for question in questions("anthropic", turns):
        messages.append({"role": "user", "content": question})
        reply = client.messages.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            thinking={"type": "enabled", "budget_tokens": budget},
            extra_body={"temperature": 0},
        )
        usage = reply.usage
        prompt = usage.input_tokens + usage.cache_read_input_tokens
        done.append(Turn(prompt, usage.cache_read_input_tokens, usage.output_tokens, reply.stop_reason == "max_tokens"))
        messages.append({"role": "assistant", "content": [block.model_dump() for block in reply.content]})
    return done


def openai_turns(url: str, model: str, turns: int, budget: int, max_tokens: int) -> list[Turn]:
    """Each reply goes back as its answer only, as most chat apps send it."""
    client, messages, done = openai.OpenAI(base_url=f"{url}/v1", api_key="none"), [], []
    for question in questions("openai", turns):
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"thinking_token_budget": budget},
        )
        usage, choice = reply.usage, reply.choices[0]
        cached = usage.prompt_tokens_details.cached_tokens
        done.append(Turn(usage.prompt_tokens, cached, usage.completion_tokens, choice.finish_reason == "length"))
        messages.append({"role": "assistant", "content": choice.message.content})
    return done


CLIENTS: dict[str, Callable[..., list[Turn]]] = {"anthropic": anthropic_turns, "openai": openai_turns}


@contextmanager
def server(path: Path, template_kwargs: str | None, log: Path) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "mlxkv", "serve", "--model", str(path), "--port", str(port)]
    command += ["--disk-cache", "none"]  # each run starts from an empty cache
    command += ["--max-model-len", "4096"] + (["--chat-template-kwargs", template_kwargs] if template_kwargs else [])
    proc = launch(command, port, log)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def measure(runs: list[str], turns: int, budget: int, max_tokens: int, work: Path) -> dict[tuple[str, str], list[Turn]]:
    """Each run's turns through each client, its server started afresh."""
    results, progress = {}, bar(len(runs) * len(CLIENTS), "conversations", "conversation")
    for run in runs:
        template, kwargs = RUNS[run]
        path = work / template
        if not path.exists():
            make_checkpoint(path, max_position_embeddings=4096, **TEMPLATES[template])
        with server(path, kwargs, work / f"{run}.log") as url:
            for client, turns_of in CLIENTS.items():
                progress.set_description(f"{run}, {client}")
                results[run, client] = turns_of(url, str(path), turns, budget, max_tokens)
                progress.update()
    progress.close()
    return results


def table(results: dict[tuple[str, str], list[Turn]]) -> str:
    turns = len(next(iter(results.values())))
    head = ["template", "client"] + [f"turn {n + 1}" for n in range(turns)] + ["prefilled, all turns"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (run, client), done in results.items():
        cells = [f"{t.reused}/{t.prompt}" for t in done]
        prefilled, cold = sum(t.prompt - t.reused for t in done), sum(t.prompt for t in done)
        back = "thinking passed back" if client == "anthropic" else "answer only"
        lines.append(f"| {run} | {client} ({back}) | " + " | ".join(cells) + f" | {prefilled} of {cold} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[tuple[str, str], list[Turn]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--budget", type=int, default=16, help="each reply's thinking budget")
    parser.add_argument("--max-tokens", type=int, default=48, help="each reply's tokens, its thinking's included")
    args = parser.parse_args(argv)
    expect(DEFAULTS_TAKE, "token counts, which no BLAS changes")
    with tempfile.TemporaryDirectory() as work:
        results = measure(args.runs, args.turns, args.budget, args.max_tokens, Path(work))
    print("Each cell: prompt tokens the prefix cache held / prompt tokens (a cold prefill computes all).")
    print(table(results))
    for (run, client), done in results.items():
        share = sum(t.prompt - t.reused for t in done) / sum(t.prompt for t in done)
        print(f"prefilled_share_{run}_{client}={share:.3f}")
    return results


if __name__ == "__main__":
    main()
