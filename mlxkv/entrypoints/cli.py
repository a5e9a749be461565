"""`mlxkv generate`, `chat`, `serve` and `doctor`: text from a model with a paged KV cache, and the
figures. Each command's settings are options derived from `EngineConfig` and `SamplingParams`
(`cli_options.with_settings`)."""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import mlx.core as mx
import typer
from tqdm import tqdm

from ..cache.layout import KVLayout
from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..engine.memory.kv_budget import context_length
from ..engine.parallel.rank_watchdog import GRACE_S
from ..engine.request import Request
from ..engine.sampling.params import SamplingParams
from ..errors import MlxkvError, counted
from ..models.loading import DEMO_MODEL, load, model_context, resolve_model_path
from ..models.sharding import world
from ..models.vision import attached
from .cli_options import PanelledCommand, fail, in_flags, with_settings
from .images import ImageRef, from_file, template_content
from .llm import LLM, Stream
from .prompts import prompt_ids, template_kwargs_of
from .sampling_defaults import CONVERSATION, conversation_sampling

if TYPE_CHECKING:  # the server's modules load when a server is asked for
    from .hosting import ModelHost

logger = logging.getLogger(__name__)

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
    rich_help_panel="Model",
)
SYSTEM = typer.Option(None, help="System prompt for the chat template.", rich_help_panel="Prompt")
TEMPLATE_KWARGS = typer.Option(
    None,
    help="What the chat template reads besides the messages, as a JSON object: '{\"enable_thinking\": false}'.",
    metavar="<json>",
    rich_help_panel="Prompt",
)
REASONING = typer.Option(
    True,
    "--reasoning/--no-reasoning",
    help="Print a thinking model's reasoning before its answer (dimmed on a terminal).",
)
VERBOSE = typer.Option(
    True,
    "--verbose/--no-verbose",
    help="Print the figures after the text; with --no-verbose only the text goes to stdout.",
)
SERVING = "Serving"
SERVE_MAX_ITL_FACTOR = 2.0  # a server's decodes should feel smooth while prompts prefill beside them


def serve_disk_cache() -> str:
    """Where `serve` keeps its disk tier unless told: the user's cache folder (`$XDG_CACHE_HOME`, else ~/.cache)."""
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlxkv" / "kv")


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
    logging.basicConfig(format="mlxkv: %(message)s", stream=sys.stderr)
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


def run_and_report(
    llm: LLM, prompt: list[int], params: SamplingParams, verbose: bool, reasoning: bool = True
) -> Request:
    """Stream one completion to stdout (a thinking model's reasoning first, dimmed on a terminal,
    unless not `reasoning`), then (verbose) print mlx-lm's figures and the KV cache's; returns the
    finished request."""
    llm.engine.cache.reset_peak_usage()
    stream = llm.stream(prompt, params, continuation=False)  # a reply, printed as mlx-lm prints it
    if verbose:
        typer.echo("==========")
    dim, thinking = sys.stdout.isatty(), False
    try:
        show_prefill(stream)
        for text, thought in stream.pieces():
            if thought and not reasoning:
                continue
            if thought != thinking:
                typer.echo(switch(thought, dim), nl=False)
                thinking = thought
            typer.echo(text, nl=False)
    finally:
        stream.close()
        if thinking and dim:
            typer.echo(PLAIN, nl=False)
    typer.echo()
    if verbose:
        report(llm, stream.request)
    return stream.request


DIM, PLAIN = "\x1b[2m", "\x1b[0m"  # a terminal's faint text, and back


def switch(thought: bool, dim: bool) -> str:
    """What is printed where the reasoning starts (dimming, on a terminal) or ends (plain text again,
    and the answer on a line of its own)."""
    if thought:
        return DIM if dim else ""
    return (PLAIN if dim else "") + "\n"


def report(llm: LLM, request: Request) -> None:
    """mlx-lm's figures of a finished request, and the KV cache's (nothing before its first token)."""
    if request.first_token_time is None:
        return
    typer.echo("==========")
    typer.echo(f"Prompt: {len(request.prompt_ids)} tokens, {request.prompt_tps:.3f} tokens-per-sec")
    typer.echo(f"Generation: {len(request.output_ids)} tokens, {request.generation_tps:.3f} tokens-per-sec")
    typer.echo(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    typer.echo(f"Memory: {llm.engine.memory}")
    typer.echo(f"KV cache: {llm.engine.cache.peak_usage}; {prefix_figures(llm, request)}{speculation_figures(request)}")


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


@app.command(cls=PanelledCommand)
@with_settings(defaults={"max_num_seqs": 1, "max_tokens": 100}, fixed={"logprobs": None})
def generate(
    model: Optional[str] = MODEL,  # noqa: UP045
    prompt: str = typer.Option(
        "hello", "--prompt", "-p", help="The prompt; - reads it from stdin.", rich_help_panel="Prompt"
    ),
    system_prompt: Optional[str] = SYSTEM,  # noqa: UP045
    chat_template_kwargs: Optional[str] = TEMPLATE_KWARGS,  # noqa: UP045
    ignore_chat_template: bool = typer.Option(
        False, help="Use the prompt as is, without the chat template.", rich_help_panel="Prompt"
    ),
    image: list[str] = typer.Option(
        [],
        "--image",
        help="An image file the prompt is about, for a multimodal model (repeatable).",
        rich_help_panel="Prompt",
    ),
    verbose: bool = VERBOSE,
    reasoning: bool = REASONING,
    *,
    config: EngineConfig,
    params: SamplingParams,
) -> None:
    """Generate a completion for one prompt, streamed, then print speed and memory figures.

    The KV cache is sized to this one request (prompt plus --max-tokens) unless
    --kv-cache-memory or --num-pages says otherwise."""
    try:
        kwargs = template_kwargs_of(chat_template_kwargs)
        if kwargs and ignore_chat_template:
            raise ValueError("--chat-template-kwargs is for the chat template, which --ignore-chat-template leaves out")
        text = utf8(sys.stdin.buffer.read(), "the prompt on stdin") if prompt == "-" else utf8(prompt, "--prompt")
        group = world()
        loaded = load(model, group)
        pieces: list[str | ImageRef] = [*(from_file(path, "--image") for path in image), text]
        system: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages = system + [{"role": "user", "content": template_content(pieces)}]
        vision = attached(loaded[0])
        ids = prompt_ids(loaded[1], messages, ignore_chat_template, template_kwargs=kwargs, vision=vision)
        context = context_length(config.max_model_len, model_context(loaded[0]))
        config = replace(config, max_model_len=min(context, len(ids) + params.max_tokens))
        run_and_report(LLM(loaded, config=config, group=group), ids, params, verbose, reasoning)
    except (MlxkvError, ValueError, TypeError) as exc:
        fail(exc)


BANNER = (
    "Chat: type a message. /stats shows the last reply's figures, /reset starts over, /exit or Ctrl-D quits, "
    "Ctrl-C stops a reply (and drops the turn)."
)
IMAGE_HELP = "/image PATH attaches an image to your next message."
CHAT_VERBOSE = typer.Option(
    False, "--verbose/--no-verbose", help="Print the figures after each reply (/stats prints the last reply's)."
)


@app.command(cls=PanelledCommand)
@with_settings(defaults={"max_tokens": 512} | CONVERSATION, fixed={"max_num_seqs": 1, "logprobs": None})
def chat(
    ctx: typer.Context,
    model: Optional[str] = MODEL,  # noqa: UP045
    system_prompt: Optional[str] = SYSTEM,  # noqa: UP045
    chat_template_kwargs: Optional[str] = TEMPLATE_KWARGS,  # noqa: UP045
    verbose: bool = CHAT_VERBOSE,
    reasoning: bool = REASONING,
    *,
    config: EngineConfig,
    params: SamplingParams,
) -> None:
    """A multi-turn chat in the terminal. The KV cache holds one conversation of --max-model-len
    tokens; with prefix caching each turn computes only what the turn before did not. Sampling
    not given here is as the model's generation_config.json recommends, else at --temp 0.7."""
    try:
        kwargs = template_kwargs_of(chat_template_kwargs)
        group = world()
        llm = LLM(load(model, group), config=config, group=group)
        recommended = conversation_sampling(resolve_model_path(model or DEMO_MODEL))
        params = replace(params, **{k: v for k, v in recommended.items() if not given(ctx, k)})
    except (MlxkvError, ValueError, TypeError) as exc:
        fail(exc)
    typer.echo(BANNER + (" " + IMAGE_HELP if llm.engine.vision is not None else ""))
    typer.echo(f"Sampling: {sampling_line(params)}.")
    if sys.stdin.isatty():
        import readline  # noqa: F401  (input() gets line editing and history)
    system: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages, last, images = list(system), None, list[ImageRef]()
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
            messages, images = list(system), []
            typer.echo("[conversation reset]")
            continue
        if line.startswith("/image "):
            try:
                images.append(from_file(line.removeprefix("/image ").strip(), "/image"))
                typer.echo(f"[{counted(len(images), 'image')} attached to your next message]")
            except ValueError as exc:
                typer.echo(f"error: {exc}", err=True)
            continue
        if line.strip() == "/stats":
            if last is None:
                typer.echo("[no reply yet]")
            else:
                report(llm, last)
            continue
        messages.append({"role": "user", "content": template_content([*images, line])})
        messages, last = chat_turn(llm, messages, params, verbose, reasoning, kwargs)
        images = []


def sampling_line(params: SamplingParams) -> str:
    """How a reply is sampled, in the CLI's flags: `--temp 0.6, --top-p 0.95, --top-k 20` (greedy at 0)."""
    if params.temperature == 0:
        return "greedy (--temp 0)"
    shown = {"--temp": params.temperature, "--top-p": params.top_p, "--top-k": params.top_k, "--min-p": params.min_p}
    unset = {"--top-p": 1.0, "--top-k": 0, "--min-p": 0.0}
    return ", ".join(f"{flag} {value:g}" for flag, value in shown.items() if unset.get(flag) != value)


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the option of setting `name` was given (on the command line or in the environment)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def chat_turn(
    llm: LLM,
    messages: list[dict[str, Any]],
    params: SamplingParams,
    verbose: bool,
    reasoning: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], Request | None]:
    """Answer the last message within what is left of the context (the template reading
    `template_kwargs`); returns the conversation after it, and the reply's request (None when
    there was none)."""
    ids = prompt_ids(llm.tokenizer, messages, engine=llm.engine, template_kwargs=template_kwargs)
    room = llm.engine.max_request_tokens - len(ids)
    if room < 1:
        typer.echo(
            f"error: the conversation ({counted(len(ids), 'token')}) has outgrown the context of "
            f"{counted(llm.engine.max_request_tokens, 'token')}; /reset starts a new one",
            err=True,
        )
        return messages[:-1], None
    turn = replace(params, max_tokens=min(params.max_tokens, room))
    try:
        request = run_and_report(llm, ids, turn, verbose, reasoning)
    except KeyboardInterrupt:
        typer.echo("\n[reply stopped]")
        return messages[:-1], None
    except (MlxkvError, ValueError) as exc:
        typer.echo(f"error: {in_flags(str(exc))}", err=True)
        return messages[:-1], None
    # The reply as printed: the engine encodes it back as the tokens it produced, so that the next
    # turn's prompt starts with the tokens this turn stored and reuses their pages.
    assert request.stream is not None
    return messages + [{"role": "assistant", "content": request.stream.text}], request


@app.command(cls=PanelledCommand)
@with_settings(
    defaults={"max_itl_factor": SERVE_MAX_ITL_FACTOR, "disk_cache": serve_disk_cache()},
    sampling=("thinking_token_budget",),
)
def serve(
    model: list[str] = typer.Option(
        [],
        "--model",
        help="mlx-lm checkpoint directory or Hugging Face repo id, repeatable: each is served under the name "
        "given; a folder of checkpoint folders serves each under its folder's name [default: the shipped "
        "demo model]",
        show_default=False,
        rich_help_panel="Model",
    ),
    models_file: Optional[Path] = typer.Option(  # noqa: UP045
        None,
        help="A TOML file of models to serve ([models.<name>] tables: path, aliases, keep_alive, engine "
        "settings); with --model, both are served.",
        rich_help_panel="Model",
    ),
    keep_alive: str = typer.Option(
        "5m",
        help="How long a model stays loaded once idle (seconds or a duration such as '5m'; negative: for "
        "ever); a request's keep_alive (Ollama) or ttl (OpenAI) says otherwise for its model.",
        rich_help_panel="Model",
    ),
    host: str = typer.Option(
        "127.0.0.1", help="Address to listen on; the default answers this machine only.", rich_help_panel=SERVING
    ),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port.", rich_help_panel=SERVING),
    api_key: Optional[str] = typer.Option(  # noqa: UP045
        None,
        help="Require 'Authorization: Bearer <key>' on the API (not on /health and the chat page, which asks).",
        rich_help_panel=SERVING,
    ),
    allowed_origins: list[str] = typer.Option(
        [], help="Origins browsers may call from (CORS); repeatable.", rich_help_panel=SERVING
    ),
    max_queue: int = typer.Option(
        1024, min=0, help="Most requests waiting; more are answered 503.", rich_help_panel=SERVING
    ),
    max_request_bytes: Optional[int] = typer.Option(  # noqa: UP045
        None,
        min=1,
        help="Largest request body taken; larger ones are answered 413. Default: 4 MiB plus 32 bytes "
        "per token of the context.",
        rich_help_panel=SERVING,
    ),
    chat_template_kwargs: Optional[str] = TEMPLATE_KWARGS,  # noqa: UP045
    served_model_name: list[str] = typer.Option(
        [],
        help="A name the model answers to (repeatable): the first is the one the server reports "
        "[default: --model as given, or mlxkv-demo].",
        show_default=False,
        rich_help_panel="Model",
    ),
    image_urls: bool = typer.Option(
        True,
        help="Fetch images that requests name by http(s) URL (at most 20 MB each, within 10 s); with "
        "--no-image-urls only images sent as data are read.",
        rich_help_panel=SERVING,
    ),
    *,
    config: EngineConfig,
    params: SamplingParams,
) -> None:
    """Serve models over HTTP: OpenAI's Chat Completions, Completions and Responses APIs
    (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models), Anthropic's Messages API
    (/v1/messages) and Ollama's API (/api/chat, /api/generate, /api/tags, /api/ps), with /health,
    /metrics and a chat page at /. The first model is loaded at start; the others when a request
    names them, within --memory-limit (idle ones are let go first). --thinking-token-budget bounds
    the requests that set no budget (nor a reasoning effort) of their own."""
    import uvicorn  # the server's imports wait until a server is asked for

    from .server import build_app
    from .shutdown import Server

    group = world()
    if group.rank() != 0:  # rank 0 serves; the others run the steps it plans
        follow_rank_0(model[0] if model else None, config, group)
        return
    logging.getLogger("mlxkv").setLevel(logging.INFO)  # the package's loggers: what the server does
    listener = listen(host, port)  # first: a port in use is one line, before a model is loaded
    try:
        host_ = model_host(model, models_file, served_model_name, keep_alive, config, params, group)
        kwargs = template_kwargs_of(chat_template_kwargs)
        first = host_.catalogue.default
        logger.info("loading %s ...", first.name)
        started = time.perf_counter()
        loaded = host_.build(first, host_.budget)
    except (MlxkvError, ValueError, TypeError) as exc:
        fail(exc)
    logger.info("loaded in %.1f s", time.perf_counter() - started)
    app_ = build_app(
        host_,
        api_key=api_key,
        allowed_origins=allowed_origins,
        max_queue=max_queue,
        max_request_bytes=max_request_bytes,
        template_kwargs=kwargs,
        fetch_image_urls=image_urls,
    )
    host_.adopt(first, loaded)
    names = ", ".join(m.name for m in host_.catalogue)
    logger.info("serving %s on http://%s:%d (chat page at /)", names, host, listener.getsockname()[1])
    server = Server(uvicorn.Config(app_, log_level="warning"), host_)
    threading.Thread(target=end_when_lost, args=(host_, server), daemon=True).start()
    try:
        server.run(sockets=[listener])
    finally:
        host_.shutdown()
    if host_.lost is not None:
        fail(host_.lost)


def model_host(
    models: list[str],
    models_file: Path | None,
    names: list[str],
    keep_alive: str,
    config: EngineConfig,
    params: SamplingParams,
    group: mx.distributed.Group,
) -> ModelHost:
    """The model host of `serve`: its catalogue, loader and memory budget (ValueError for bad options)."""
    from ..engine.memory.memory_budget import device_memory, memory_limit
    from .durations import seconds
    from .hosting import ModelHost, catalogue_of, facts_of
    from .hosting.loading import Loader

    catalogue = catalogue_of(models, models_file, names, config)
    if group.size() > 1 and len(catalogue) > 1:
        raise ValueError("a tensor-parallel group serves one model; give one --model")
    budget = memory_limit(config, device_memory())
    catalogue = catalogue.shared(budget, {m.name: facts_of(m).weight_bytes for m in catalogue})
    build = Loader(config, params.thinking_token_budget, group if group.size() > 1 else None)
    return ModelHost(catalogue, build, budget, seconds(keep_alive, "--keep-alive"), fixed=group.size() > 1)


def follow_rank_0(model: str | None, config: EngineConfig, group: mx.distributed.Group) -> None:
    """What `serve` runs on every rank but 0: its share of the model, and the steps rank 0 plans."""
    try:
        LLMEngine(*load(model, group), config, group=group).follow()
    except (MlxkvError, ValueError, TypeError) as exc:
        fail(exc)


def end_when_lost(host: ModelHost, server: Any) -> None:
    """End `server` soon after a model's tensor-parallel group fails (a rank died or stopped answering)."""
    while not server.should_exit:
        if host.lost is not None:
            logger.error("%s; the server is ending", host.lost)
            time.sleep(GRACE_S)
            server.should_exit = True
        time.sleep(0.1)


@app.command()
def doctor() -> None:
    """Print a report to paste into an issue: this machine, whether each Metal kernel variant compiled
    and matched the reference, the paged kernel's decode and prefill speed against MLX's SDPA, and
    greedy parity with mlx-lm on the demo model. Off a Mac: the cost model's table (a few rows) instead of timings."""
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
