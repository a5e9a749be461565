"""`mlxkv generate`, `chat` and `serve`: text from a model with a paged KV cache, and the figures.

Every field of `EngineConfig` and `SamplingParams` is an option of the commands that take one
(`with_settings`), with the field's own help text, so a setting is declared in one place.
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import Field, fields, replace
from importlib.metadata import version
from typing import Any, NoReturn, Optional, get_args, get_type_hints

import mlx.core as mx
import typer
from tqdm import tqdm

from ..cache.layout import KVLayout
from ..config import EngineConfig
from ..engine.async_llm import AsyncLLM
from ..engine.llm_engine import LLMEngine
from ..engine.memory.kv_budget import context_length
from ..engine.parallel.rank_watchdog import GRACE_S
from ..engine.request import Request
from ..engine.sampling.params import SamplingParams
from ..errors import MlxkvError
from ..models.loading import load, model_context
from ..models.sharding import world
from .llm import LLM, Stream
from .prompts import prompt_ids

logger = logging.getLogger("mlxkv")

app = typer.Typer(
    help="Local LLM inference with MLX over a paged KV cache.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

MODEL = typer.Option(
    None,
    "--model",
    help="mlx-lm checkpoint directory or Hugging Face repo id [default: the shipped demo model]",
    show_default=False,
)
SYSTEM = typer.Option(None, help="System prompt for the chat template.")
VERBOSE = typer.Option(
    True,
    "--verbose/--no-verbose",
    help="Print the figures after the text; with --no-verbose only the text goes to stdout.",
)
SERVE_MAX_ITL_FACTOR = 2.0  # a server's decodes should feel smooth while prompts prefill beside them
SETTINGS = {"config": EngineConfig, "params": SamplingParams}  # a command's parameter -> the record it gets


def fail(message: object) -> NoReturn:
    """End the command with one `error:` line, in the user's words (the flags they type)."""
    typer.echo(f"error: {in_flags(str(message))}", err=True)
    raise typer.Exit(1)


def cli() -> None:
    """The `mlxkv` command. Click's own errors (an unknown option, a value of the wrong type) are
    one `error:` line too, not its usage block."""
    try:
        code = app(prog_name="mlxkv", standalone_mode=False)  # an exit code, when a command exits with one
    except typer.TyperException as error:
        typer.echo(f"error: {error.format_message()}", err=True)
        sys.exit(error.exit_code)
    except typer.Abort:
        typer.echo("error: interrupted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def _flags(item: Field[Any]) -> tuple[str, ...]:
    """A settings field's flags: its own, else `--` and its name with dashes."""
    return item.metadata["flags"] or (f"--{item.name.replace('_', '-')}",)


def _long_flags(item: Field[Any]) -> str:
    """How an error names a setting: its long flags (`--temperature/--temp`)."""
    return "/".join(flag for flag in _flags(item) if flag.startswith("--"))


def in_flags(message: str) -> str:
    """`message` with the settings it names written as the flags a user types: `max_tokens must
    be ...` is `--max-tokens must be ...`, and `8, 4 or None` is `8 or 4 (or left out)`. A one-word
    name (`seed`) is replaced only where it is the subject or an assignment, so that a word of
    English is not taken for it."""
    for item in (item for record in SETTINGS.values() for item in fields(record)):
        pattern = rf"\b{item.name}\b" if "_" in item.name else rf"\b{item.name}\b(?= must| cannot|=)"
        message = re.sub(pattern, _long_flags(item), message)
    message = re.sub(r", ([^,\s()\[\]]+) or None\b", r" or \1 or None", message)
    return re.sub(r" or None\b", " (or left out)", message)


def _cli_type(item: Field[Any], hint: Any) -> Any:
    """The type the command line parses a field as: its declared one, else its type less None."""
    return item.metadata["cli_type"] or next((a for a in get_args(hint) if a is not type(None)), hint)


def _old_name(flag: str) -> str:
    return "old_" + flag.lstrip("-").replace("-", "_")


def _old_option(name: str, flag: str, hint: Any) -> inspect.Parameter:
    """A hidden option for a setting's old flag (the command warns when it is given)."""
    option = typer.Option(None, flag, hidden=True)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=Optional[hint])  # noqa: UP045


def _option(item: Field[Any], hint: Any, default: Any) -> inspect.Parameter:
    """The command-line option of one settings field: its flags, help text, default and type."""
    meta = item.metadata
    flags = _flags(item)
    kind = _cli_type(item, hint)
    if kind is bool:
        flags = (f"{flags[0]}/--no-{flags[0][2:]}",)
    if default == ():
        default = None  # a repeatable option's "none given"
    metavar = "<str>" if meta["cli_type"] == list[str] else None  # typer would print <list[str]>
    option = typer.Option(default, *flags, help=meta["help"], show_default=default is not None, metavar=metavar)
    annotation = Optional[kind] if default is None else kind  # noqa: UP045 (typer reads the annotation)
    return inspect.Parameter(item.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def with_settings(
    defaults: Mapping[str, Any] | None = None, fixed: Mapping[str, Any] | None = None
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command one option per field of `EngineConfig` (if it takes `config`) and of
    `SamplingParams` (if it takes `params`), with `defaults` of its own; `fixed` fields are set, not
    offered. The command is called with the records built from the options; a bad value ends it
    with one error line naming the setting."""
    defaults, fixed = dict(defaults or {}), dict(fixed or {})

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command)
        records = {name: cls for name, cls in SETTINGS.items() if name in signature.parameters}
        offered = {name: [f for f in fields(cls) if f.name not in fixed] for name, cls in records.items()}
        options = [
            _option(f, get_type_hints(records[name])[f.name], defaults.get(f.name, f.default))
            for name, items in offered.items()
            for f in items
        ]
        old = {
            _old_name(flag): (flag, f, records[name])
            for name, items in offered.items()
            for f in items
            for flag in f.metadata["old_flags"]
        }
        hidden = [
            _old_option(name, flag, _cli_type(f, get_type_hints(cls)[f.name])) for name, (flag, f, cls) in old.items()
        ]

        @functools.wraps(command)
        def run(**kwargs: Any) -> None:
            for name, (flag, f, _) in old.items():
                value = kwargs.pop(name)
                if value is not None:
                    typer.echo(f"warning: {flag} is now {_flags(f)[0]}; the old name goes in mlxkv 0.3", err=True)
                    kwargs[f.name] = value
            try:
                built = {
                    name: cls(
                        **{f.name: kwargs.pop(f.name) for f in offered[name]},
                        **{k: v for k, v in fixed.items() if k in {f.name for f in fields(cls)}},
                    )
                    for name, cls in records.items()
                }
            except (ValueError, TypeError) as exc:
                fail(exc)
            command(**kwargs, **built)

        own = [p for p in signature.parameters.values() if p.name not in records]
        run.__signature__ = signature.replace(parameters=own + options + hidden)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in own + options + hidden}
        return run

    return decorate


def show_version(value: bool) -> None:
    if value:
        typer.echo(f"mlxkv {version('mlxkv')}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def main(
    context: typer.Context,
    _: bool = typer.Option(
        False, "--version", callback=show_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Local LLM inference with MLX over a paged KV cache."""
    logging.basicConfig(format="%(name)s: %(message)s", stream=sys.stderr)
    if context.invoked_subcommand is None:  # plain `mlxkv`: the help
        typer.echo(context.get_help())


def prefix_figures(llm: LLM, request: Request) -> str:
    """What the prefix cache did for `request`, or why it did nothing."""
    stats = llm.stats()
    if stats.prefix_caching:
        return f"prefix cache: {request.num_cached_tokens} of {len(request.prompt_ids)} prompt tokens reused"
    if stats.kv.layout is KVLayout.CONTIGUOUS:
        return "prefix cache: none (the contiguous layout gives each sequence its own page and shares nothing)"
    return "prefix cache: off"


def speculation_figures(request: Request) -> str:
    """What speculative decoding did for `request` (nothing when it proposed no draft)."""
    spec = request.speculation
    if not spec.drafted:
        return ""
    rate = spec.accepted / spec.drafted
    return f"; speculation: {spec.accepted} of {spec.drafted} draft tokens accepted ({rate:.0%})"


def run_and_report(llm: LLM, prompt: list[int], params: SamplingParams, verbose: bool) -> Request:
    """Stream one completion to stdout, then (verbose) print mlx-lm's figures and the KV cache's;
    returns the finished request."""
    llm.engine.cache.reset_peak_usage()
    stream = llm.stream(prompt, params)
    if verbose:
        typer.echo("==========")
    try:
        show_prefill(stream)
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
        typer.echo(f"Memory: {llm.engine.memory}")
        typer.echo(
            f"KV cache: {llm.engine.cache.peak_usage}; {prefix_figures(llm, request)}{speculation_figures(request)}"
        )
    return request


PREFILL_BAR_AFTER = 0.5  # seconds; a shorter prefill shows no bar


def show_prefill(stream: Stream) -> None:
    """A progress bar on stderr while a long prompt is prefilled, where stderr is a terminal:
    a prompt of thousands of tokens can take a while before the first token on a small Mac."""
    with tqdm(
        total=len(stream.request.prompt_ids),
        desc="prefill",
        unit="tok",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
        delay=PREFILL_BAR_AFTER,
        smoothing=0,
    ) as bar:
        for computed in stream.prefill():
            bar.update(computed - bar.n)


def utf8(text: str | bytes, what: str) -> str:
    """`text` if it is valid UTF-8 (bytes decoded; undecodable input arrives as surrogates)."""
    try:
        return text.decode("utf-8") if isinstance(text, bytes) else text.encode("utf-8").decode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError) as exc:
        raise ValueError(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


@app.command()
@with_settings(defaults={"max_num_seqs": 1, "max_tokens": 100}, fixed={"logprobs": None})
def generate(
    model: Optional[str] = MODEL,  # noqa: UP045
    prompt: str = typer.Option("hello", "--prompt", "-p", help="The prompt; - reads it from stdin."),
    system_prompt: Optional[str] = SYSTEM,  # noqa: UP045
    ignore_chat_template: bool = typer.Option(False, help="Use the prompt as is, without the chat template."),
    verbose: bool = VERBOSE,
    *,
    config: EngineConfig,
    params: SamplingParams,
) -> None:
    """Generate a completion for one prompt, streamed, then print speed and memory figures.

    The KV cache is sized to this one request (prompt plus --max-tokens) unless
    --kv-cache-memory or --num-pages says otherwise."""
    try:
        text = utf8(sys.stdin.buffer.read(), "the prompt on stdin") if prompt == "-" else utf8(prompt, "--prompt")
        group = world()
        loaded = load(model, group)
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": text}
        ]
        ids = prompt_ids(loaded[1], messages, ignore_chat_template)
        context = context_length(config.max_model_len, model_context(loaded[0]))
        config = replace(config, max_model_len=min(context, len(ids) + params.max_tokens))
        run_and_report(LLM(loaded, config=config, group=group), ids, params, verbose)
    except (MlxkvError, ValueError, TypeError) as exc:
        fail(exc)


BANNER = "Chat: type a message. /reset starts over, /exit or Ctrl-D quits, Ctrl-C stops a reply (and drops the turn)."


@app.command()
@with_settings(defaults={"max_tokens": 512}, fixed={"max_num_seqs": 1, "logprobs": None})
def chat(
    model: Optional[str] = MODEL,  # noqa: UP045
    system_prompt: Optional[str] = SYSTEM,  # noqa: UP045
    verbose: bool = VERBOSE,
    *,
    config: EngineConfig,
    params: SamplingParams,
) -> None:
    """A multi-turn chat in the terminal. The KV cache holds one conversation of --max-model-len
    tokens; with prefix caching each turn computes only what the turn before did not."""
    try:
        group = world()
        llm = LLM(load(model, group), config=config, group=group)
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
            typer.echo("[conversation reset]")
            continue
        messages.append({"role": "user", "content": line})
        messages = chat_turn(llm, messages, params, verbose)


def chat_turn(llm: LLM, messages: list[dict[str, str]], params: SamplingParams, verbose: bool) -> list[dict[str, str]]:
    """Answer the last message within what is left of the context; returns the conversation after it."""
    ids = prompt_ids(llm.tokenizer, messages, False)
    room = llm.engine.max_request_tokens - len(ids)
    if room < 1:
        typer.echo(
            f"error: the conversation ({len(ids)} tokens) has outgrown the context of "
            f"{llm.engine.max_request_tokens} tokens; /reset starts a new one",
            err=True,
        )
        return messages[:-1]
    turn = replace(params, max_tokens=min(params.max_tokens, room))
    try:
        request = run_and_report(llm, ids, turn, verbose)
    except KeyboardInterrupt:
        typer.echo("\n[reply stopped]")
        return messages[:-1]
    except (MlxkvError, ValueError) as exc:
        typer.echo(f"error: {in_flags(str(exc))}", err=True)
        return messages[:-1]
    # The reply exactly as generated (the streamed text drops a leading space, as mlx-lm's does),
    # so the next turn's prompt starts with the tokens this turn stored and reuses their pages.
    return messages + [{"role": "assistant", "content": llm.tokenizer.decode(request.output_ids)}]


@app.command()
@with_settings(defaults={"max_itl_factor": SERVE_MAX_ITL_FACTOR})
def serve(
    model: Optional[str] = MODEL,  # noqa: UP045
    host: str = typer.Option("127.0.0.1", help="Address to listen on; the default answers this machine only."),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port."),
    api_key: Optional[str] = typer.Option(  # noqa: UP045
        None, help="Require 'Authorization: Bearer <key>' on the API (not on /health and the chat page, which asks)."
    ),
    allowed_origins: list[str] = typer.Option([], help="Origins browsers may call from (CORS); repeatable."),
    max_queue: int = typer.Option(1024, min=0, help="Most requests waiting; more are answered 503."),
    *,
    config: EngineConfig,
) -> None:
    """Serve the model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/models),
    with /health, /metrics and a chat page at /."""
    import uvicorn  # the server's imports wait until a server is asked for

    from .server import build_app

    group = world()
    if group.rank() != 0:  # rank 0 serves; the others run the steps it plans
        follow_rank_0(model, config, group)
        return
    logger.setLevel(logging.INFO)
    listener = listen(host, port)  # first: a port in use is one line, before a model is loaded
    try:
        logger.info("loading %s ...", model or "the demo model")
        started = time.perf_counter()
        engine = LLMEngine(*load(model, group), config, group=group)
    except (MlxkvError, ValueError, TypeError) as exc:
        fail(exc)
    logger.info("loaded in %.1f s", time.perf_counter() - started)
    llm = AsyncLLM(engine)
    app_ = build_app(llm, model or "mlxkv-demo", api_key=api_key, allowed_origins=allowed_origins, max_queue=max_queue)
    logger.info("serving on http://%s:%d (chat page at /)", host, listener.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app_, log_level="warning"))
    threading.Thread(target=end_when_lost, args=(engine, server), daemon=True).start()
    try:
        server.run(sockets=[listener])
    finally:
        llm.shutdown()
    if engine.lost is not None:
        fail(engine.lost)


def follow_rank_0(model: str | None, config: EngineConfig, group: mx.distributed.Group) -> None:
    """What `serve` runs on every rank but 0: its share of the model, and the steps rank 0 plans."""
    try:
        LLMEngine(*load(model, group), config, group=group).follow()
    except (MlxkvError, ValueError, TypeError) as exc:
        fail(exc)


def end_when_lost(engine: LLMEngine, server: Any) -> None:
    """End `server` soon after the engine's tensor-parallel group fails (a rank died or stopped answering)."""
    while not server.should_exit:
        if engine.lost is not None:
            logger.error("%s; the server is ending", engine.lost)
            time.sleep(GRACE_S)
            server.should_exit = True
        time.sleep(0.1)


@app.command()
def doctor() -> None:
    """Print a report to paste into an issue: this machine, whether each Metal kernel variant compiled
    and matched the reference, the paged kernel's decode and prefill speed against MLX's SDPA, and
    greedy parity with mlx-lm on the demo model. Off a Mac: the cost model's table instead of timings."""
    from .doctor import report

    try:
        report(lambda line: print(line, flush=True))
    except (MlxkvError, ValueError, TypeError) as exc:
        fail(exc)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port`, or one error line: the port is taken, or why it cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            fail(f"port {port} on {host} is in use (another server?); choose another with --port")
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    return listener
