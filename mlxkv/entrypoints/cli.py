"""`mlxkv generate` and `mlxkv chat`: text from a model with a paged KV cache, and the figures."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from importlib.metadata import version
from typing import Optional

import mlx.core as mx
import typer

from ..cache.layout import KVLayout
from ..config import EngineConfig, context_length
from ..engine.async_llm import AsyncLLM
from ..engine.llm_engine import LLMEngine
from ..engine.request import Request
from ..engine.sampling import SamplingParams
from ..errors import MlxkvError
from ..models.loading import load
from .llm import LLM, Stream
from .prompts import prompt_ids

app = typer.Typer(help="Local LLM inference with MLX over a paged KV cache.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]})

MODEL = typer.Option(None, "--model", help="mlx-lm checkpoint directory or Hugging Face repo id "
                                            "[default: the shipped demo model]", show_default=False)
TEMP = typer.Option(0.0, help="Sampling temperature; 0 is greedy.")
TOP_P = typer.Option(1.0, help="Nucleus sampling threshold in (0, 1].")
TOP_K = typer.Option(0, help="Sample from the k most likely tokens; 0 disables.")
MIN_P = typer.Option(0.0, help="Drop tokens below min_p times the top probability.")
SEED = typer.Option(None, help="Seed for reproducible sampling, in [0, 2**64).")
SYSTEM = typer.Option(None, help="System prompt for the chat template.")
NO_TEMPLATE = typer.Option(False, help="Use the prompt as is, without the chat template.")
LAYOUT = typer.Option(None, help="KV layout: paged or contiguous [default: $MLXKV_KV_LAYOUT or paged].",
                      show_default=False)
BLOCK = typer.Option(16, help="Tokens per KV page.")
MEMORY = typer.Option(None, help="KV cache size, e.g. 2GB or 512MiB [default: what the job needs].",
                      show_default=False)
BLOCKS = typer.Option(None, help="Number of KV pages (paged layout), instead of --kv-cache-memory.")
MAX_LEN = typer.Option(None, help="Most tokens one sequence may hold [default: the model's context].",
                       show_default=False)
MAX_SEQS = typer.Option(1, help="Most sequences the KV cache is sized and scheduled for.")
PREFIX = typer.Option(True, "--prefix-caching/--no-prefix-caching",
                      help="Reuse the KV pages of a prompt prefix computed before (paged layout).")
KV_BITS = typer.Option(None, "--kv-bits", help="Quantize the KV pages to 8 or 4 bits [default: the model's dtype].")
KV_GROUP = typer.Option(64, "--kv-group-size", help="Values sharing one scale and bias in quantized pages: "
                                                    "32, 64 or 128.")
VERBOSE = typer.Option(True, "--verbose/--no-verbose", help="Print the figures after the text; with "
                                                             "--no-verbose only the text goes to stdout.")


def fail(message: object) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def show_version(value: bool) -> None:
    if value:
        typer.echo(f"mlxkv {version('mlxkv')}")
        raise typer.Exit()


@app.callback()
def main(_: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                help="Print the version and exit.")) -> None:
    """Local LLM inference with MLX over a paged KV cache."""


def sampling(max_tokens: int, temp: float, top_p: float, top_k: int, min_p: float, seed: int | None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)


def prefix_figures(llm: LLM, request: Request) -> str:
    """What the prefix cache did for `request`, or why it did nothing."""
    cache = llm.engine.cache
    if cache.prefix_caching:
        return f"prefix cache: {request.num_cached_tokens} of {len(request.prompt_ids)} prompt tokens reused"
    if cache.layout is KVLayout.CONTIGUOUS:
        return "prefix cache: none (the contiguous layout gives each sequence its own slot and shares nothing)"
    return "prefix cache: off"


def run_and_report(llm: LLM, prompt: list[int], params: SamplingParams, verbose: bool) -> Request:
    """Stream one completion to stdout, then (verbose) print mlx-lm's figures and the KV cache's; returns
    the finished request."""
    llm.engine.reset_peak_usage()
    stream: Stream = llm.stream(prompt, params)
    if verbose:
        typer.echo("==========")
    try:
        for delta in stream:
            typer.echo(delta, nl=False)
    finally:
        stream.close()
    typer.echo()
    request = stream.request
    if verbose and request.first_token_time is not None:
        typer.echo("==========")
        typer.echo(f"Prompt: {len(request.prompt_ids)} tokens, {request.prompt_tps:.3f} tokens-per-sec")
        typer.echo(f"Generation: {len(request.output_ids)} tokens, {request.generation_tps:.3f} tokens-per-sec")
        typer.echo(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
        typer.echo(f"KV cache: {llm.engine.peak_usage}; {prefix_figures(llm, request)}")
    return request


def utf8(text: str | bytes, what: str) -> str:
    """`text` if it is valid UTF-8 (bytes decoded; undecodable input arrives as surrogates)."""
    try:
        return text.decode("utf-8") if isinstance(text, bytes) else text.encode("utf-8").decode("utf-8")
    except UnicodeError as exc:
        raise ValueError(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


@app.command()
def generate(
    model: Optional[str] = MODEL,
    prompt: str = typer.Option("hello", "--prompt", "-p", help="The prompt; - reads it from stdin."),
    max_tokens: int = typer.Option(100, "--max-tokens", "-m", help="Most tokens to generate."),
    temp: float = TEMP, top_p: float = TOP_P, top_k: int = TOP_K, min_p: float = MIN_P,
    seed: Optional[int] = SEED, system_prompt: Optional[str] = SYSTEM,
    ignore_chat_template: bool = NO_TEMPLATE, kv_layout: Optional[str] = LAYOUT, block_size: int = BLOCK,
    kv_cache_memory: Optional[str] = MEMORY, num_blocks: Optional[int] = BLOCKS,
    max_model_len: Optional[int] = MAX_LEN, max_num_seqs: int = MAX_SEQS, prefix_caching: bool = PREFIX,
    kv_bits: Optional[int] = KV_BITS, kv_group_size: int = KV_GROUP, verbose: bool = VERBOSE,
) -> None:
    """Generate a completion for one prompt, streamed, then print speed and memory figures.

    The KV cache is sized to this one request (prompt plus --max-tokens) unless
    --kv-cache-memory or --num-blocks says otherwise."""
    try:
        params = sampling(max_tokens, temp, top_p, top_k, min_p, seed)
        text = utf8(sys.stdin.buffer.read(), "the prompt on stdin") if prompt == "-" else utf8(prompt, "--prompt")
        loaded = load(model)
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": text}]
        ids = prompt_ids(loaded[1], messages, ignore_chat_template)
        context = context_length(max_model_len, getattr(loaded[0].args, "max_position_embeddings", None))
        length = min(context, len(ids) + max_tokens)
        llm = LLM(loaded, kv_layout=kv_layout, block_size=block_size, kv_cache_memory=kv_cache_memory,
                  num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_model_len=length,
                  enable_prefix_caching=prefix_caching, kv_bits=kv_bits, kv_group_size=kv_group_size)
        run_and_report(llm, ids, params, verbose)
    except (MlxkvError, ValueError, TypeError) as exc:
        fail(exc)


BANNER = "Chat: type a message. /reset starts over, /exit or Ctrl-D quits, Ctrl-C stops a reply (and drops the turn)."


@app.command()
def chat(
    model: Optional[str] = MODEL,
    max_tokens: int = typer.Option(512, "--max-tokens", "-m", help="Most tokens per reply."),
    temp: float = TEMP, top_p: float = TOP_P, top_k: int = TOP_K, min_p: float = MIN_P,
    seed: Optional[int] = SEED, system_prompt: Optional[str] = SYSTEM, kv_layout: Optional[str] = LAYOUT,
    block_size: int = BLOCK, kv_cache_memory: Optional[str] = MEMORY, num_blocks: Optional[int] = BLOCKS,
    max_model_len: Optional[int] = MAX_LEN, prefix_caching: bool = PREFIX, kv_bits: Optional[int] = KV_BITS,
    kv_group_size: int = KV_GROUP, verbose: bool = VERBOSE,
) -> None:
    """A multi-turn chat in the terminal. The KV cache holds one conversation of --max-model-len
    tokens; with prefix caching each turn computes only what the turn before did not."""
    try:
        params = sampling(max_tokens, temp, top_p, top_k, min_p, seed)
        loaded = load(model)
        llm = LLM(loaded, kv_layout=kv_layout, block_size=block_size, kv_cache_memory=kv_cache_memory,
                  num_blocks=num_blocks, max_num_seqs=1, max_model_len=max_model_len,
                  enable_prefix_caching=prefix_caching, kv_bits=kv_bits, kv_group_size=kv_group_size)
    except (MlxkvError, ValueError, TypeError) as exc:
        fail(exc)
    typer.echo(BANNER)
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages = list(system)
    while True:
        try:
            line = utf8(input(">> "), "that line")
        except EOFError:
            typer.echo()
            return
        except KeyboardInterrupt:
            typer.echo()
            continue
        except (UnicodeError, ValueError) as exc:
            typer.echo(f"error: {exc}; type it again", err=True)
            continue
        if line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": line})
        messages = chat_turn(llm, messages, params, verbose)


def chat_turn(llm: LLM, messages: list[dict], params: SamplingParams, verbose: bool) -> list[dict]:
    """Answer the last message within what is left of the context; returns the conversation after it."""
    ids = prompt_ids(llm.tokenizer, messages, False)
    room = llm.engine.max_request_tokens - len(ids) + 1
    if room < 1:
        typer.echo(f"error: the conversation ({len(ids)} tokens) has outgrown the context of "
                   f"{llm.engine.max_request_tokens} tokens; /reset starts a new one", err=True)
        return messages[:-1]
    turn = replace(params, max_tokens=min(params.max_tokens, room))
    try:
        request = run_and_report(llm, ids, turn, verbose)
    except KeyboardInterrupt:
        typer.echo("\n[reply stopped]")
        return messages[:-1]
    except (MlxkvError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        return messages[:-1]
    # The reply exactly as generated (the streamed text drops a leading space, as mlx-lm's does),
    # so the next turn's prompt starts with the tokens this turn stored and reuses their pages.
    return messages + [{"role": "assistant", "content": llm.tokenizer.decode(request.output_ids)}]


@app.command()
def serve(
    model: Optional[str] = MODEL,
    host: str = typer.Option("127.0.0.1", help="Address to listen on; the default answers this machine only."),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port."),
    kv_layout: Optional[str] = LAYOUT, block_size: int = BLOCK, kv_cache_memory: Optional[str] = MEMORY,
    num_blocks: Optional[int] = BLOCKS, max_model_len: Optional[int] = MAX_LEN,
    max_num_seqs: int = typer.Option(16, help="Most sequences computed at once."),
    max_num_batched_tokens: int = typer.Option(512, help="Most tokens one engine step computes."),
    prefix_caching: bool = PREFIX, kv_bits: Optional[int] = KV_BITS, kv_group_size: int = KV_GROUP,
    api_key: Optional[str] = typer.Option(None, help="Require 'Authorization: Bearer <key>' (all but /health)."),
    allowed_origins: list[str] = typer.Option([], help="Origins browsers may call from (CORS); repeatable."),
    max_queue: int = typer.Option(1024, min=0, help="Most requests waiting; more are answered 503."),
) -> None:
    """Serve the model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/models),
    with /health, /metrics and a chat page at /."""
    import uvicorn  # the server's imports wait until a server is asked for

    from .server import build_app

    try:
        typer.echo(f"mlxkv: loading {model or 'the demo model'} ...", err=True)
        started = time.perf_counter()
        loaded = load(model)
        config = EngineConfig(kv_layout=kv_layout, block_size=block_size, num_blocks=num_blocks,
                              kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                              enable_prefix_caching=prefix_caching, kv_bits=kv_bits, kv_group_size=kv_group_size)
        engine = LLMEngine(*loaded, config)
    except (MlxkvError, ValueError, TypeError) as exc:
        fail(exc)
    typer.echo(f"mlxkv: loaded in {time.perf_counter() - started:.1f} s; KV cache: {engine.cache.usage()}", err=True)
    llm = AsyncLLM(engine)
    app_ = build_app(llm, model or "mlxkv-demo", api_key=api_key, allowed_origins=allowed_origins,
                     max_queue=max_queue)
    typer.echo(f"mlxkv: serving on http://{host}:{port} (chat page at /)", err=True)
    try:
        uvicorn.run(app_, host=host, port=port, log_level="warning")
    finally:
        llm.shutdown()
