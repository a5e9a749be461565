"""`mlxkv generate` and `mlxkv chat`: text from a model with a paged KV cache, and the figures."""

from __future__ import annotations

import sys
from typing import Optional

import mlx.core as mx
import typer

from ..engine.sampling import SamplingParams
from ..errors import MlxkvError
from .llm import LLM, Stream

app = typer.Typer(help="Local LLM inference with MLX over a paged KV cache.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)

MODEL = typer.Option(None, help="mlx-lm checkpoint directory or Hugging Face repo id [default: the shipped demo model]")
MAX_TOKENS = typer.Option(100, "--max-tokens", "-m", help="Most tokens to generate.")
TEMP = typer.Option(0.0, help="Sampling temperature; 0 is greedy.")
TOP_P = typer.Option(1.0, help="Nucleus sampling threshold in (0, 1].")
TOP_K = typer.Option(0, help="Sample from the k most likely tokens; 0 disables.")
MIN_P = typer.Option(0.0, help="Drop tokens below min_p times the top probability.")
SEED = typer.Option(None, help="Seed for reproducible sampling.")
SYSTEM = typer.Option(None, help="System prompt for the chat template.")
NO_TEMPLATE = typer.Option(False, help="Use the prompt as is, without the chat template.")
LAYOUT = typer.Option(None, help="KV layout: paged or contiguous [default: $MLXKV_KV_LAYOUT or paged].")
BLOCK = typer.Option(16, help="Tokens per KV page.")
MEMORY = typer.Option(None, help="KV cache size, e.g. 2GB or 512MiB.")
BLOCKS = typer.Option(None, help="Number of KV pages (paged layout), instead of --kv-cache-memory.")


def fail(message: object) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def build(model, layout, block_size, memory, blocks, max_tokens, temp, top_p, top_k, min_p, seed):
    """Validate the sampling options first (cheap), then load the model."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    llm = LLM(model, kv_layout=layout, block_size=block_size, kv_cache_memory=memory, num_blocks=blocks, max_num_seqs=1)
    return llm, params


def prompt_ids(llm: LLM, messages: list[dict], ignore_template: bool) -> list[int] | str:
    if llm.tokenizer.has_chat_template and not ignore_template:
        return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages if m["role"] != "system")


def run_and_report(llm: LLM, prompt, params: SamplingParams) -> str:
    """Stream one completion to stdout, then print mlx-lm's figures and the KV cache's."""
    llm.engine.reset_peak_usage()
    stream: Stream = llm.stream(prompt, params)
    for delta in stream:
        typer.echo(delta, nl=False)
    request, usage = stream.request, llm.engine.peak_usage
    typer.echo("\n==========")
    typer.echo(f"Prompt: {len(request.prompt_ids)} tokens, {request.prompt_tps:.3f} tokens-per-sec")
    typer.echo(f"Generation: {len(request.output_ids)} tokens, {request.generation_tps:.3f} tokens-per-sec")
    typer.echo(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    typer.echo(f"KV cache: {usage.layout.value}, {usage.pages_used}/{usage.pages_total} pages of "
               f"{usage.block_size} tokens, {usage.bytes_holding_tokens / 2**20:.2f} of "
               f"{usage.bytes_allocated / 2**20:.2f} MiB holding tokens")
    return request.stream.text


@app.command()
def generate(
    model: Optional[str] = MODEL,
    prompt: str = typer.Option("hello", "--prompt", "-p", help="The prompt; - reads it from stdin."),
    max_tokens: int = MAX_TOKENS, temp: float = TEMP, top_p: float = TOP_P, top_k: int = TOP_K,
    min_p: float = MIN_P, seed: Optional[int] = SEED, system_prompt: Optional[str] = SYSTEM,
    ignore_chat_template: bool = NO_TEMPLATE, kv_layout: Optional[str] = LAYOUT, block_size: int = BLOCK,
    kv_cache_memory: Optional[str] = MEMORY, num_blocks: Optional[int] = BLOCKS,
) -> None:
    """Generate a completion for one prompt, streamed, then print speed and memory figures."""
    try:
        if prompt == "-":
            prompt = sys.stdin.read()
        llm, params = build(model, kv_layout, block_size, kv_cache_memory, num_blocks,
                            max_tokens, temp, top_p, top_k, min_p, seed)
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": prompt}]
        typer.echo("==========")
        run_and_report(llm, prompt_ids(llm, messages, ignore_chat_template), params)
    except (MlxkvError, ValueError, TypeError) as exc:
        fail(exc)


@app.command()
def chat(
    model: Optional[str] = MODEL, max_tokens: int = typer.Option(512, "--max-tokens", "-m", help="Most tokens per reply."),
    temp: float = TEMP, top_p: float = TOP_P, top_k: int = TOP_K, min_p: float = MIN_P,
    seed: Optional[int] = SEED, system_prompt: Optional[str] = SYSTEM, kv_layout: Optional[str] = LAYOUT,
    block_size: int = BLOCK, kv_cache_memory: Optional[str] = MEMORY, num_blocks: Optional[int] = BLOCKS,
) -> None:
    """A multi-turn chat in the terminal (/reset starts over, /exit or Ctrl-D quits)."""
    try:
        llm, params = build(model, kv_layout, block_size, kv_cache_memory, num_blocks,
                            max_tokens, temp, top_p, top_k, min_p, seed)
    except (MlxkvError, ValueError, TypeError) as exc:
        fail(exc)
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages = list(system)
    while True:
        try:
            line = input(">> ")
        except EOFError:
            typer.echo()
            return
        if line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = run_and_report(llm, prompt_ids(llm, messages, False), params)
        except (MlxkvError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
