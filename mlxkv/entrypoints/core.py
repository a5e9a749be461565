"""The serving core every HTTP API of `mlxkv serve` shares: a conversation through the model's chat
template, sampling cut to the room the context leaves, constraints compiled before a reply
starts, and each choice's engine outputs as one stream of events (`start`, a `Run`). Each API
(`openai/`, `anthropic/`, `ollama/`) adapts its request bodies to it and frames the run in its own
response shapes (see `replies`), rendering `ServingError` in its own error shape.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, Iterator, Mapping
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, replace
from typing import Any

from ..cache.pins import Pin
from ..engine.async_llm import AsyncLLM
from ..engine.outputs import RequestOutput
from ..engine.sampling.params import CONSTRAINTS, SamplingParams
from ..errors import counted
from .errors import ServingError, UnreadableImage, UnsupportedContent, refused_as
from .metrics import ModelMetrics
from .prompts import prompt_ids
from .replies import Event, Run
from .sampling_defaults import CONVERSATION
from .tool_calls import ToolCallStream, lazy_tool_grammar, tool_grammar

Choice = tuple[list[int], SamplingParams]  # one choice's prompt and sampling


@dataclass(frozen=True)
class Tools:
    """What a chat request does with tools: those its template shows (OpenAI's entries), and the
    grammar that holds its calls: from the first token for a required or named tool, or, under
    'auto', lazily from each call's opening marker (`trigger`) to its end. None: calls are free."""

    shown: list[dict[str, Any]]
    grammar: str | None = None
    trigger: str | None = None

    @property
    def forced(self) -> bool:
        return self.grammar is not None and self.trigger is None

    @property
    def source(self) -> str:
        """The field to name when the grammar cannot be compiled."""
        return "tool_choice" if self.forced else "tools"

    def constrain(self, fields: dict[str, Any]) -> dict[str, Any]:
        """`SamplingParams` fields with the calls' grammar: a forced one always (a second constraint
        is then refused), a lazy one only where the request brings no constraint of its own."""
        if self.grammar is None or (not self.forced and any(fields.get(name) for name in CONSTRAINTS)):
            return fields
        return fields | {"grammar": self.grammar, "grammar_trigger": self.trigger}


EMPTY_CHAT = (
    "there is nothing to reply to (a model without a chat template reads only the user and assistant "
    "messages' text, leaving system prompts out)"
)
TTL = re.compile(r"(\d+(?:\.\d+)?)\s*([smh])")
SECONDS = {"s": 1, "m": 60, "h": 3600}


def pin_of(cache_control: Any, tokens: int) -> Pin | None:
    """The pin a `cache_control` asks for (`{"type": "ephemeral", "ttl": "5m"}`: Anthropic's, also
    taken as an extra field of OpenAI's bodies) over a prompt's first `tokens` tokens; 5 minutes
    unless its `ttl` says otherwise ("30s", "5m", "1h"). None when there is none."""
    if not isinstance(cache_control, dict) or tokens < 1:
        return None
    if cache_control.get("type") != "ephemeral":
        raise ServingError(400, "cache_control must be {'type': 'ephemeral'} with an optional ttl", "cache_control")
    ttl = cache_control.get("ttl") or "5m"
    found = TTL.fullmatch(str(ttl))
    if found is None:
        raise ServingError(400, f"cache_control.ttl must be like '5m' or '1h', got {ttl!r}", "cache_control")
    try:
        return Pin(tokens, float(found.group(1)) * SECONDS[found.group(2)])
    except ValueError as exc:
        raise ServingError(400, f"cache_control: {exc}", "cache_control") from None


def forced_tools(shown: list[dict[str, Any]], choice: str | None, name: str | None = None) -> list[dict[str, Any]]:
    """The tools (OpenAI's entries) a reply must call one of: the one `name`d, every one shown when
    `choice` requires a call (OpenAI's 'required', Anthropic's 'any'), else none (the model
    decides); a 400 naming `tool_choice` if there is none to call."""
    if name is not None:
        named = [tool for tool in shown if tool["function"]["name"] == name]
        if not named:
            raise ServingError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return named
    if choice in ("required", "any"):
        if not shown:
            raise ServingError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
        return shown
    return []


def seeded_choices(runs: list[Choice], n: int) -> list[Choice]:
    """`n` choices of each prompt. With a seed, choice j of a prompt draws with seed + j, so that
    each choice is its own reproducible stream, and choice 0 is what the same request with n=1 gives."""
    return [
        (prompt, params if params.seed is None or j == 0 else replace(params, seed=(params.seed + j) % 2**64))
        for prompt, params in runs
        for j in range(n)
    ]


class ServingCore:
    """One model behind every API: its prompts, sampling, constraints and running choices (the
    model host has already found it by the request's `model`)."""

    def __init__(
        self,
        llm: AsyncLLM,
        model_id: str,
        metrics: ModelMetrics,
        max_queue: int,
        keepalive_s: float,
        sampling: Mapping[str, Any] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        fetch_image_urls: bool = True,
    ) -> None:
        """`sampling`: the fields a request that gives none samples with (see `sampling_defaults`);
        `template_kwargs`: what the chat template reads where a request does not say;
        `fetch_image_urls`: whether an image named by an http(s) URL is fetched (else refused)."""
        self.fetch_image_urls = fetch_image_urls
        self.llm, self.model_id, self.metrics = llm, model_id, metrics
        self.defaults = dict(CONVERSATION if sampling is None else sampling)
        self.template_kwargs = dict(template_kwargs or {})
        self.max_queue, self.keepalive_s = max_queue, keepalive_s
        self.tokenizer = llm.engine.tokenizer

    @contextmanager
    def reading(self, field: str) -> Iterator[None]:
        """Reading a request's conversation: content the model cannot read (`UnsupportedContent`) is
        a 400 naming its kind and the model, any other ValueError a 400 naming `field`."""
        try:
            yield
        except UnsupportedContent as exc:
            raise self.unsupported(exc, field) from None
        except ValueError as exc:
            raise ServingError(400, str(exc), field) from None

    def unsupported(self, content: UnsupportedContent, field: str) -> ServingError:
        """The 400 for content the model cannot read, naming its kind, its block and the model."""
        message = f"{content.kind} content is not supported by {self.model_id} ({content.block} in {field}; it reads "
        message += "text and images)" if self.llm.engine.vision is not None else "text)"
        return ServingError(400, message, field, "unsupported_content")

    def tools(self, shown: list[dict[str, Any]], forced: list[dict[str, Any]], parallel: bool, field: str) -> Tools:
        """The tools of a chat request (OpenAI's entries): `forced` are those the reply must call
        one of (none: the model decides, each call it opens held to its tool's schema where the
        format allows, see `lazy_tool_grammar`); a 400 naming `field` if the model cannot call them."""
        if shown and not self.tokenizer.has_tool_calling:
            raise ServingError(
                400, "this model's chat template has no tool calls (mlx-lm finds no tool-call format)", field
            )
        with refused_as(field):
            if forced:
                return Tools(shown, tool_grammar(self.tokenizer, forced, parallel))
            lazy = lazy_tool_grammar(self.tokenizer, shown, parallel) if shown else None
            return Tools(shown, *lazy) if lazy else Tools(shown)

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: Tools | None = None,
        field: str = "messages",
        salt: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt of a conversation (role/content dicts, as chat templates read them), built on a
        worker thread (a long conversation takes the template and tokenizer seconds: the event loop
        keeps serving everyone else meanwhile), replies the engine produced (under `salt`) kept as
        their token ids, the template reading `template_kwargs` over the server's; a 400 naming
        `field` if it gives nothing to reply to."""
        shown = tools.shown if tools else None
        try:
            prompt = await asyncio.to_thread(
                prompt_ids,
                self.tokenizer,
                messages,
                tools=shown,
                engine=self.llm.engine,
                cache_salt=salt,
                template_kwargs=self.template_kwargs | (template_kwargs or {}),
                fetch_urls=self.fetch_image_urls,
            )
        except UnsupportedContent as exc:
            raise self.unsupported(exc, field) from None
        except UnreadableImage as exc:
            raise ServingError(400, str(exc), field, "invalid_image") from None
        except Exception as exc:
            raise ServingError(400, f"the messages do not fit the model's chat template: {exc}", field) from None
        if not prompt:
            raise ServingError(400, f"the prompt made of {field} is empty: {EMPTY_CHAT}", field, "empty_prompt")
        return prompt

    async def encode(self, text: str | list[int], field: str = "prompt", salt: str | None = None) -> list[int]:
        """A completion prompt's token ids (text with the tokenizer's BOS and outputs of the engine as
        their ids, or ids checked), encoded on a worker thread; a 400 naming `field` if it is empty
        or not a prompt."""
        try:
            return await asyncio.to_thread(self.llm.engine.encode, text, salt)
        except (TypeError, ValueError) as exc:
            raise ServingError(400, str(exc), field) from None

    def room(self, prompt: list[int], max_tokens: int | None) -> int:
        """`max_tokens` (None: as many as fit) cut to what the context leaves after `prompt`;
        a prompt that leaves nothing is a 400."""
        most = self.llm.engine.max_request_tokens
        room = most - len(prompt)
        if room < 1:
            raise ServingError(
                400,
                f"the prompt has {counted(len(prompt), 'token')}; this server holds at most {most} per request, "
                "prompt and reply",
                None,
                "context_length_exceeded",
            )
        return room if max_tokens is None else min(room, max_tokens) if max_tokens >= 1 else max_tokens

    async def compile(self, params: SamplingParams, source: str | None = None) -> None:
        """Compile the request's constraint before any reply starts (on a worker thread: a large
        schema takes a while), so that one llguidance refuses is a 400 naming where it came from
        (`source`, else the `SamplingParams` field)."""
        try:
            await asyncio.to_thread(self.llm.engine.structured.compile, params)
        except ValueError as exc:
            field = str(exc).split()[0]  # the field named at the start of the message
            where = source or field
            raise ServingError(400, str(exc) if where == field else f"{where}: {exc}", where) from None

    def check_queue(self, choices: int) -> None:
        if self.llm.engine.num_waiting + choices > self.max_queue:
            raise ServingError(
                503,
                f"the server is busy ({counted(self.max_queue, 'request')} waiting); retry shortly",
                code="queue_full",
                kind="overloaded_error",
                headers={"Retry-After": "1"},
            )

    def sampling(
        self, prompt: list[int], max_tokens: int | None, fields: dict[str, Any], names: dict[str, str] | None = None
    ) -> SamplingParams:
        """`SamplingParams` of `fields`, `max_tokens` cut to the room `prompt` leaves (see `room`); a
        bad value is a 400 naming its field as this API calls it (`names`)."""
        limit = self.room(prompt, max_tokens)
        with refused_as(names=names):
            return SamplingParams(**fields, max_tokens=limit)

    async def start(
        self,
        choices: list[Choice],
        tools: Tools | None,
        source: str | None,
        salt: str | None = None,
        pin: Pin | None = None,
        continuation: bool = False,
    ) -> Run:
        """Compile the choices' constraint (a 400 naming `source`, if it came from there, when
        llguidance refuses it), check the queue, and start every choice: its outputs as a `Run`,
        their text continuing the prompt's exactly for a completion (`continuation`), else
        starting a reply."""
        await self.compile(choices[0][1], source)
        self.check_queue(len(choices))
        return Run(self.run(choices, salt, pin, continuation), self.splitters(len(choices), tools))

    def splitters(self, n: int, tools: Tools | None) -> list[ToolCallStream | None]:
        """One splitter of content and tool calls per choice where tools were shown."""
        return [ToolCallStream(self.tokenizer, tools.shown) if tools and tools.shown else None for _ in range(n)]

    async def run(
        self, choices: list[Choice], salt: str | None, pin: Pin | None = None, continuation: bool = False
    ) -> AsyncGenerator[Event, None]:
        """The outputs of every choice as they come, tagged by choice index; None every
        `keepalive_s` without any. Leaving early aborts every choice still running. Call
        `check_queue` first, while an error can still be answered."""
        queue: asyncio.Queue[tuple[int, RequestOutput | None, Exception | None]] = asyncio.Queue()
        n = len(choices)
        timer = self.metrics.timer(n)

        async def pump(index: int) -> None:
            prompt, params = choices[index]
            try:
                started = self.llm.outputs(prompt, params, cache_salt=salt, pin=pin, continuation=continuation)
                async with aclosing(started) as outputs:
                    async for output in outputs:
                        timer.observe(index, output)
                        await queue.put((index, output, None))
            except Exception as exc:  # handed to the consumer, which raises it
                await queue.put((index, None, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(n)]
        try:
            finished = 0
            while finished < n:
                try:
                    index, output, error = await asyncio.wait_for(queue.get(), self.keepalive_s)
                except asyncio.TimeoutError:
                    yield None
                    continue
                if error is not None:
                    raise error
                assert output is not None
                finished += output.finished
                yield index, output
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
