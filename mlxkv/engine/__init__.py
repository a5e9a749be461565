"""The engine: requests, the scheduler, the model runner, sampling and text, one step at a time.

A request (`request`, its prompt normalised by `inputs`) waits in the `scheduler`, which packs
decodes and prefill chunks into a batch within the KV cache that `kv_budget` sized; the
`model_runner` runs the model over it with attention reading the cache; `sampling` picks tokens
as `sampling_params` say and `text` turns them into streamed text. `llm_engine` is the step
loop, reporting `outputs` and `stats`; `async_llm` runs it on a thread of its own for asyncio code.
"""

from .async_llm import AsyncLLM
from .llm_engine import LLMEngine
from .outputs import RequestOutput, Usage
from .sampling_params import SamplingParams
from .stats import EngineStats

__all__ = ["AsyncLLM", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams", "Usage"]
