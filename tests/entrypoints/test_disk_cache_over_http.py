"""The disk tier over HTTP: a prompt served before a restart is read back from disk after it, its
tokens reported as cached by each API (`cached_tokens`, `cache_read_input_tokens`), and /metrics
counts what was restored."""

import re

import anthropic
import httpx
import openai
from helpers import start_server, stop_server

MODEL = "mlxkv-demo"
MESSAGES = [{"role": "user", "content": "The with statement is used to wrap the execution of a block " * 6}]


def chat(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused").chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0
    )


def message(url):
    return anthropic.Anthropic(base_url=url, api_key="unused").messages.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        extra_body={"temperature": 0},  # the client sends none itself
    )


def test_a_prompt_served_before_a_restart_is_read_back_from_disk(tmp_path):
    flags = ("--disk-cache", str(tmp_path), "--max-model-len", "512")
    proc, url = start_server(*flags)
    try:
        first = chat(url)
    finally:
        stop_server(proc)  # its writer files what it queued as the process ends
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and list(tmp_path.rglob("*.run"))
    proc, url = start_server(*flags)
    try:
        restored = message(url)  # Anthropic's template writes the same prompt
        again = chat(url)
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        stop_server(proc)
    full_pages = (first.usage.prompt_tokens - 1) // 16
    assert restored.usage.cache_read_input_tokens == 16 * full_pages > 0
    assert restored.usage.input_tokens + restored.usage.cache_read_input_tokens == first.usage.prompt_tokens
    assert restored.content[0].text == again.choices[0].message.content == first.choices[0].message.content
    restored_pages = re.search(r'^mlxkv_disk_cache_restored_pages_total\{model="[^"]+"\} (\S+)$', metrics, re.M)
    assert float(restored_pages.group(1)) == full_pages
