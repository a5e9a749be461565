"""How `mlxkv serve` loads a listed model: its checkpoint, an engine with the server's settings
changed by the model's own and its memory limit cut to the room the host gives it, and the
sampling its requests use where they say nothing."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from ...config import EngineConfig
from ...engine.async_encoder import AsyncEncoder
from ...engine.async_llm import AsyncLLM
from ...engine.llm_engine import LLMEngine
from ...engine.memory.memory_budget import device_memory, gb, memory_limit
from ...errors import MemoryBudgetError
from ...models.encoder import Encoder, is_encoder
from ...models.loading import DEMO_MODEL, load, resolve_model_path
from ...models.pooling import pooling_of
from ..sampling_defaults import conversation_sampling
from .catalogue import ListedModel
from .checkpoints import facts_of
from .host import Loaded

logger = logging.getLogger(__name__)


class Loader:
    """The model host's `build`: `server`'s settings for every model (changed by its own),
    `thinking_token_budget` for the requests that set no budget of their own, `group` a
    tensor-parallel group."""

    def __init__(
        self, server: EngineConfig, thinking_token_budget: int | None = None, group: mx.distributed.Group | None = None
    ) -> None:
        self.server, self.thinking_token_budget, self.group = server, thinking_token_budget, group

    def wants(self, listed: ListedModel) -> int:
        return memory_limit(listed.config(self.server), device_memory())

    def __call__(self, listed: ListedModel, room: int) -> Loaded:
        folder = resolve_model_path(listed.path or DEMO_MODEL)
        if is_encoder(facts_of(listed).model_type):
            return self._encoder(listed, folder, room)
        config = listed.config(self.server)
        config = replace(config, memory_limit=min(self.wants(listed), room))
        model, tokenizer = load(listed.path, self.group)
        pooling = pooling_of(folder)
        engine = LLMEngine(model, tokenizer, config, group=self.group, shares_memory=True, pooling=pooling)
        if pooling is not None:
            logger.info("%s: an embedding model, pooling %s", listed.name, pooling)
            return Loaded(AsyncLLM(engine))
        sampling = conversation_sampling(folder)
        if self.thinking_token_budget is not None:
            sampling["thinking_token_budget"] = self.thinking_token_budget
        logger.info(
            "%s: requests that do not say sample with %s",
            listed.name,
            ", ".join(f"{k}={v}" for k, v in sampling.items()),
        )
        return Loaded(AsyncLLM(engine), sampling)

    def _encoder(self, listed: ListedModel, folder: Path, room: int) -> Loaded:
        """An encoder embedding model, refused (`MemoryBudgetError`) if its weights need more than `room` bytes."""
        encoder = Encoder.load(folder)
        if encoder.weight_bytes > room:
            raise MemoryBudgetError(f"{listed.name}: its weights take {gb(encoder.weight_bytes)}, more than {gb(room)}")
        logger.info("%s: an encoder embedding model, pooling %s", listed.name, encoder.pooling)
        return Loaded(None, encoder=AsyncEncoder(encoder))
