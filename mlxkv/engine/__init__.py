"""The engine: requests, the scheduler, the model runner, one step at a time.

A request (`request`, its prompt normalised by `inputs`, its images placed in it by `images`) waits
in the `scheduler`, which packs decodes and prefill chunks into a batch within the KV cache; the
`model_runner` runs the model over it, its layers (`layers/`) reading the cache, whose shape
`model_kv` reads off the model; `sampling/` picks tokens and turns them into text. `llm_engine` is
the step loop, put together by `builder`: the `output_processor` accepts each step's tokens into
its requests, reported as `outputs` and `stats`, and a failed step is undone by `recovery`;
`recent_outputs` keeps the ids of the text it produced lately, so that a prompt quoting it (a
chat's next turn) is encoded as it was generated; `async_llm` runs the loop on a thread of its own
for asyncio code, and `async_encoder` an encoder embedding model (which needs no KV cache)
likewise. What the engine may spend is `memory/`'s; `speculative/` proposes draft tokens;
`parallel/` runs the steps across the processes of a tensor-parallel group.
"""

from .async_llm import AsyncLLM
from .images import ImagePrompt
from .llm_engine import LLMEngine
from .outputs import RequestOutput, Usage
from .sampling.params import SamplingParams
from .stats import EngineStats

__all__ = ["AsyncLLM", "EngineStats", "ImagePrompt", "LLMEngine", "RequestOutput", "SamplingParams", "Usage"]
