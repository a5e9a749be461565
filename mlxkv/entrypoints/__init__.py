"""What users call: the `LLM` API, the `mlxkv` command line and the `mlxkv serve` HTTP server.

`llm` is `LLM`, whose `prompts` turn a conversation into prompt ids through the chat template, and
`sampling_defaults` say how a conversation samples where its request does not. `cli`
holds the commands, their options derived from the settings by `cli_options`, and `doctor` the
report a Mac user pastes into an issue. `server` builds the HTTP app: each API's folder (`openai/`,
`anthropic/`, `ollama/`) owns its routes, request and response bodies and serving, over the model
host of `hosting/` (the models a server may serve, loaded on demand within one memory budget,
idle ones let go after their keep-alive, read by `durations`), which gives each request its
model's serving `core` that starts requests (their images read by `images`) and `replies` that
frames them (a stream skeleton shared by every API), or an embedding model's `embedder`,
refusing with `errors`' `ServingError` (bodies over the limit, before they are read: `body_limit`);
`tool_calls/` splits and forces tool calls, `shutdown` ends the server on Ctrl-C, `metrics` feeds
`/metrics`, and `chat.html` is the chat page.
"""

from .llm import LLM, Completion, Stream

__all__ = ["LLM", "Completion", "Stream"]
