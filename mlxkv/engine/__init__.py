"""The engine: requests, the scheduler, the model runner, sampling and text, one step at a time.

A request (`request`) waits in the `scheduler`, which packs decodes and prefill chunks into
a batch; the `model_runner` runs the model over it with attention reading the KV cache;
`sampling` picks tokens and `text` turns them into streamed text. `llm_engine` is the step
loop and `async_llm` runs it on a thread of its own for asyncio code.
"""

from .async_llm import AsyncLLM
from .llm_engine import LLMEngine, RequestOutput

__all__ = ["AsyncLLM", "LLMEngine", "RequestOutput"]
