"""How big a KV cache an engine builds for a model: its settings against the memory the device has left."""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from ...cache.disk import DiskSpec
from ...cache.layout import KVLayout
from ...cache.manager import KVCacheManager, prefix_cached
from ...cache.page_group import window_pool_pages
from ...cache.storage import check_quantization, kv_bytes_per_token, per_layer
from ...config import EngineConfig
from ...errors import MemoryBudgetError, counted
from ..model_kv import ModelKV


def context_length(max_model_len: int | None, model_max_len: int | None) -> int:
    """Most tokens one sequence may hold: `max_model_len`, else the model's context, else 4096."""
    return max_model_len or model_max_len or 4096


def window_pages(config: EngineConfig, window: int) -> int:
    """Pages a group of sliding-window layers needs so that it never runs out in one of this engine's steps."""
    return window_pool_pages(window, config.page_size, config.max_num_seqs, config.max_num_batched_tokens)


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB"


@dataclass(frozen=True)
class KVCacheSizing:
    """The cache `build_kv_cache` makes: how many sequences of how many tokens, the full-attention
    layers' pages (paged layout), and each sliding-window group's pages."""

    max_num_seqs: int
    max_model_len: int
    num_pages: int | None
    layer_windows: list[int | None]
    window_pages: dict[int, int]
    bytes: int  # of every page and recurrent state, the draft model's pages included


@dataclass(frozen=True)
class _KVCosts:
    """What a model's cache costs before it has any pages: the bytes per token of the layers that
    take pages from the budget, and the bytes taken first (window groups, recurrent states)."""

    windows: list[int | None]  # each layer's window where it has a page group of its own
    grouped: dict[int, int]  # pages of each window group
    bytes_per_token: int  # of the full-attention layers (and the draft model)
    window_bytes: int
    state_bytes: int

    @property
    def fixed_bytes(self) -> int:
        """Taken before the full-attention layers' pages."""
        return self.window_bytes + self.state_bytes


def size_kv_cache(config: EngineConfig, model: ModelKV, room: int, draft: ModelKV | None = None) -> KVCacheSizing:
    """The KV cache for `model` within `room` bytes (what the memory budget leaves it), `draft`'s
    pages, as many as the model's, included.

    In the paged layout the pages of sliding-window layers (`layer_windows`) are a fixed, small
    pool (`window_pages` per window) taken from the budget first; the rest buys pages for the
    full-attention layers, whose bytes per token count only those layers. In the contiguous
    layout the budget buys whole `max_model_len` pages, at most `max_num_seqs`. A hybrid model's
    recurrent state, one for each of `max_num_seqs` sequences and `prefix_states` more kept for the
    prefix cache when it shares prefixes, is taken from the budget first too."""
    check_quantization(config.kv_bits, config.kv_group_size, model.head_dim)  # before sizing by its groups
    max_len = context_length(config.max_model_len, model.context)
    contiguous = config.kv_layout is KVLayout.CONTIGUOUS
    costs = _kv_costs(config, model, draft)
    if not costs.bytes_per_token:
        return _states_only(config, costs, max_len, room)
    available = max(0, room - costs.fixed_bytes)
    per_seq = max_len if contiguous else -(-max_len // config.page_size) * config.page_size
    asked_memory = int(config.kv_cache_memory) if config.kv_cache_memory is not None else None
    budget = (
        asked_memory - costs.fixed_bytes
        if asked_memory
        else min(config.max_num_seqs * per_seq * costs.bytes_per_token, int(config.kv_cache_fraction * available))
    )
    if config.num_pages is not None:
        asked, what = config.num_pages * config.page_size * costs.bytes_per_token, f"num_pages={config.num_pages}"
    else:
        asked, what = budget, f"kv_cache_memory={_gb(budget)}"
    if asked > available:
        raise MemoryBudgetError(
            f"{what} asks for {_gb(asked)} of KV cache, but at most {_gb(available)} fits "
            f"in the memory budget (memory_limit) beside the weights and a step's temporaries"
        )
    if contiguous:
        return _contiguous(config, costs, max_len, budget)
    pages = config.num_pages or budget // (config.page_size * costs.bytes_per_token)
    if pages <= 0:
        source = "kv_cache_memory" if asked_memory else f"kv_cache_fraction={config.kv_cache_fraction}"
        raise MemoryBudgetError(
            f"the KV budget ({source}) leaves {max(budget, 0)} bytes for the full-attention layers, "
            f"less than one page of {counted(config.page_size, 'token')}{_beside(costs)}"
        )
    pool_bytes = costs.fixed_bytes + pages * config.page_size * costs.bytes_per_token
    return KVCacheSizing(config.max_num_seqs, max_len, pages, costs.windows, costs.grouped, pool_bytes)


def _kv_costs(config: EngineConfig, model: ModelKV, draft: ModelKV | None) -> _KVCosts:
    """`model`'s cache costs under `config`, `draft`'s pages counted with the model's."""
    layout = KVLayout.CONTIGUOUS if config.kv_layout is KVLayout.CONTIGUOUS else KVLayout.PAGED
    windows: list[int | None] = [None] * model.num_layers
    if layout is KVLayout.PAGED and model.layer_windows is not None:
        windows = list(model.layer_windows)
    heads = per_layer("num_kv_heads", model.num_kv_heads, model.num_layers)
    dims = per_layer("head_dim", model.head_dim, model.num_layers)
    bits, group_size = config.kv_bits, config.kv_group_size
    layer_bytes = [
        kv_bytes_per_token(1, h, d, model.dtype, bits, group_size, [0] if i in model.keys_only else [])
        for i, (h, d) in enumerate(zip(heads, dims))
    ]
    bytes_per_token = sum(size for size, w in zip(layer_bytes, windows) if w is None) + draft_bytes_per_token(draft)
    grouped = {w: window_pages(config, w) for w in set(windows) if w is not None}
    window_bytes = sum(grouped[w] * config.page_size * size for size, w in zip(layer_bytes, windows) if w is not None)
    kept = config.max_num_seqs if config.prefix_states is None else config.prefix_states
    hybrid = bool(model.state_shapes)
    shares = prefix_cached(layout, config.prefix_caching, hybrid, config.kv_bits, kept)
    state_bytes = (config.max_num_seqs + (kept if shares else 0)) * model.state_bytes_per_sequence
    return _KVCosts(windows, grouped, bytes_per_token, window_bytes, state_bytes)


def _contiguous(config: EngineConfig, costs: _KVCosts, max_len: int, budget: int) -> KVCacheSizing:
    """The contiguous layout's cache: as many whole `max_len` pages as `budget` buys."""
    sequences = min(config.max_num_seqs, budget // (max_len * costs.bytes_per_token))
    if sequences == 0:
        raise MemoryBudgetError(
            f"the contiguous layout needs {max_len * costs.bytes_per_token / 2**20:.1f} MiB per sequence "
            f"(max_model_len={max_len}) but the KV budget is {budget / 2**20:.1f} MiB; "
            "raise kv_cache_memory or lower max_model_len"
        )
    pool_bytes = costs.fixed_bytes + sequences * max_len * costs.bytes_per_token
    return KVCacheSizing(sequences, max_len, None, costs.windows, costs.grouped, pool_bytes)


def _states_only(config: EngineConfig, costs: _KVCosts, max_len: int, room: int) -> KVCacheSizing:
    """The cache of a model none of whose layers keeps K/V (Mamba's, RWKV's): its pages hold no
    bytes and only count each sequence's tokens, so every sequence gets its whole context; the
    recurrent states alone take memory, and must fit `room`."""
    if costs.state_bytes > room:
        raise MemoryBudgetError(
            f"the recurrent state of max_num_seqs={config.max_num_seqs} sequences (and the prefix cache's) takes "
            f"{_gb(costs.state_bytes)}, more than the {_gb(room)} the memory budget (memory_limit) leaves "
            "beside the weights and a step's temporaries; lower max_num_seqs or prefix_states"
        )
    whole = config.max_num_seqs * -(-max_len // config.page_size)
    pages = None if config.kv_layout is KVLayout.CONTIGUOUS else config.num_pages or whole
    return KVCacheSizing(config.max_num_seqs, max_len, pages, costs.windows, costs.grouped, costs.state_bytes)


def _beside(costs: _KVCosts) -> str:
    """What else the budget paid for, where a page no longer fits."""
    return "".join(
        f" beside the {size} bytes of the {what}"
        for size, what in ((costs.window_bytes, "sliding-window layers' pages"), (costs.state_bytes, "recurrent state"))
        if size
    )


def draft_bytes_per_token(draft: ModelKV | None) -> int:
    """Bytes a token takes in a draft model's pages (float, every layer attending fully)."""
    if draft is None:
        return 0
    return kv_bytes_per_token(
        draft.num_layers, draft.num_kv_heads, draft.head_dim, draft.dtype, keys_only=draft.keys_only
    )


def build_kv_cache(
    config: EngineConfig, model: ModelKV, sizing: KVCacheSizing, disk: DiskSpec | None = None
) -> KVCacheManager:
    """The KV cache `sizing` (from `size_kv_cache`) plans for `model`, allocated, over the disk tier `disk`."""
    return KVCacheManager(
        model.num_layers,
        model.num_kv_heads,
        model.head_dim,
        max_num_seqs=sizing.max_num_seqs,
        max_model_len=sizing.max_model_len,
        layout=config.kv_layout,
        page_size=config.page_size,
        num_pages=sizing.num_pages,
        dtype=model.dtype,
        prefix_caching=config.prefix_caching,
        prefix_states=config.prefix_states,
        pinned_fraction=config.pinned_fraction,
        kv_bits=config.kv_bits,
        keys_only=model.keys_only,
        kv_group_size=config.kv_group_size,
        layer_windows=sizing.layer_windows,
        window_pages=sizing.window_pages,
        state_shapes=model.state_shapes,
        disk=disk,
    )


def agreed(sizing: KVCacheSizing, group: mx.distributed.Group) -> KVCacheSizing:
    """`sizing` cut to what every rank of a tensor-parallel `group` can hold (the fewest sequences and
    pages any planned), so that one page table addresses the same pages everywhere."""
    mine = mx.array([sizing.max_num_seqs, sizing.num_pages or 0])
    seqs, pages = np.array(mx.distributed.all_min(mine, group=group, stream=mx.cpu)).tolist()
    if (seqs, pages or None) == (sizing.max_num_seqs, sizing.num_pages):
        return sizing
    scale = (pages or seqs) / (sizing.num_pages or sizing.max_num_seqs)  # about: the fixed pools scale too
    return replace(sizing, max_num_seqs=seqs, num_pages=pages or None, bytes=int(sizing.bytes * scale))
