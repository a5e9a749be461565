"""How an engine is put together, in order: the model's K/V shape, the memory sizing, the KV cache, the
attention path, the model runner, the drafter and the scheduler."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..attention.backend import expected_temporary_bytes, temporary_bytes_of
from ..attention.kernels import PagedAttentionKernels
from ..attention.reference import reference_attention
from ..cache.disk import DiskSpec
from ..cache.manager import KVCacheManager
from ..config import EngineConfig
from ..models.identity import weights_digest
from ..models.structure import held_arrays, position_table, text_model, vocab_size
from ..models.vision import Vision, attached
from .memory.chunk_sizing import ChunkSizer
from .memory.kv_budget import agreed, build_kv_cache
from .memory.memory_budget import MemoryBudget, split_memory
from .memory.step_memory import StepMemory
from .memory.step_time import StepTime
from .model_kv import attention_for, attention_heads, model_kv
from .model_runner import ModelRunner
from .parallel.launcher_watch import watch_launcher
from .parallel.rank_zero import Alone, RankZero
from .parallel.step_plan import check_tensor_parallel
from .sampling.structured_output import StructuredOutput
from .scheduler import Scheduler
from .speculative.draft_model import DraftModel
from .speculative.prompt_lookup import PromptLookup
from .speculative.speculation import Speculator

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """An engine's parts: the cache and its memory budget, the runner over the model, what fits the
    step's time, the drafter (None: no speculation), the constraints' masks, the scheduler, and
    rank 0's side of a tensor-parallel group (`Alone` on any other engine)."""

    cache: KVCacheManager
    memory: MemoryBudget
    runner: ModelRunner
    step_time: StepTime
    speculator: Speculator | None
    structured: StructuredOutput
    scheduler: Scheduler
    rank_zero: RankZero | Alone
    vision: Vision | None


def build_engine(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    config: EngineConfig,
    kernels: PagedAttentionKernels | None,
    group: mx.distributed.Group | None,
    apply_memory: bool = True,
) -> EngineParts:
    """The parts of an engine running `model` (see `LLMEngine`); `group`: a tensor-parallel group of
    more than one process, or None; MLX's memory limits set to its budget if `apply_memory`."""
    vision = attached(model)
    if vision is not None and group is not None:
        logger.warning("images are not served across processes: this model runs on text only here")
        vision = None
    model = text_model(model)
    table = position_table(model)
    if table is not None and (config.max_model_len or 0) > table:
        raise ValueError(
            f"max_model_len={config.max_model_len} is more than the {table} positions this model's learned "
            "position embeddings hold; expected at most that"
        )
    shape = model_kv(model)
    if group is not None:
        check_tensor_parallel(shape)
        watch_launcher()  # every rank ends with its launcher
    draft = DraftModel.checkpoint(config, tokenizer) if config.draft_model is not None else None
    planned = StepMemory.of(model, attention_heads(model), expected_temporary_bytes(config.attention, kernels))
    vision_bytes = vision.weight_bytes + vision.cache_bytes if vision is not None else 0
    memory, sizing = split_memory(config, shape, planned, draft[1] if draft is not None else None, vision_bytes)
    if group is not None:
        sizing = agreed(sizing, group)
    cache = build_kv_cache(config, shape, sizing, disk_spec(config, model, vision, group))
    attention = attention_for(model, cache, config.attention, kernels)
    if apply_memory:
        memory.apply()
    logger.info(
        "KV cache: %s; attention: %s; memory: %s",
        cache.usage(),
        "reference" if attention is reference_attention else "Metal kernels",
        memory,
    )
    runner = ModelRunner(model, cache, attention, vision)
    # Whichever thread steps the engine: nothing it was built with is a lazy graph of this one's.
    mx.eval(held_arrays(model), held_arrays(draft[0]) if draft is not None else [], vision.weights() if vision else [])
    step_time = StepTime()
    itl = config.max_itl_ms
    sizer = ChunkSizer(
        replace(planned, attention=temporary_bytes_of(attention)),
        memory.reserve,
        step_time,
        itl / 1000 if itl else None,
        config.max_itl_factor or None,
    )
    zero = rank_zero(config, group)
    if isinstance(zero, RankZero) and cache.disk is not None:
        cache.share_disk(zero.ask_disk)
    return EngineParts(
        cache,
        memory,
        runner,
        step_time,
        speculator(config, cache, step_time, vocab_size(model), draft[0] if draft else None, kernels),
        StructuredOutput(tokenizer, vocab_size(model)),
        Scheduler(cache, config.max_num_seqs, config.max_num_batched_tokens, sizer),
        zero,
        vision,
    )


def disk_spec(
    config: EngineConfig, model: nn.Module, vision: Vision | None, group: mx.distributed.Group | None
) -> DiskSpec | None:
    """The disk tier `config` asks for, its pages named by the model's weights (and its vision
    tower's, which makes an image's K/V). In a tensor-parallel group each rank keeps its own heads'
    pages, named by its own share of the weights and its rank, so no rank ever reads another's."""
    if config.disk_cache is None:
        return None
    model_digest = weights_digest(model, vision.model if vision is not None else None)
    if group is not None:
        model_digest += f"/rank {group.rank()} of {group.size()}"
    return DiskSpec(Path(config.disk_cache).expanduser(), int(config.disk_cache_size), model_digest)


def rank_zero(config: EngineConfig, group: mx.distributed.Group | None) -> RankZero | Alone:
    """Rank 0's side of `group` (`Alone` on any other rank, and without a group)."""
    if group is None or group.rank() != 0:
        return Alone()
    return RankZero(group, config.rank_timeout_s, config.rank_nap_s)


def speculator(
    config: EngineConfig,
    cache: KVCacheManager,
    step_time: StepTime,
    vocab_size: int,
    draft: nn.Module | None,
    kernels: PagedAttentionKernels | None,
) -> Speculator | None:
    """The speculative decoding `config` asks for, if any (`draft`: the draft model, loaded); a
    hybrid model's recurrent state cannot be rewound past rejected draft tokens, so it cannot
    speculate."""
    if not config.prompt_lookup and config.draft_model is None:
        return None
    name = "prompt_lookup" if config.prompt_lookup else "draft_model"
    if cache.states is not None:
        raise ValueError(
            f"speculative decoding ({name}) needs a model whose every layer keeps K/V; this one has "
            "recurrent layers, whose state cannot be rewound past rejected draft tokens"
        )
    if draft is None:
        return Speculator(PromptLookup(), config.num_draft_tokens, step_time)
    drafter = DraftModel.build(config, draft, cache, vocab_size, kernels)
    return Speculator(drafter, config.num_draft_tokens, step_time)
