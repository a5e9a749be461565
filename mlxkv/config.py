"""Engine settings, and how big a KV cache they make for a given model."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import mlx.core as mx

from .cache.layout import KVLayout, resolve_layout
from .cache.manager import KVCacheManager, window_pool_pages
from .cache.storage import check_quantization, kv_bytes_per_token
from .errors import positive_int

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as `2GB`, `512MiB` or `1.5GB` (at least one byte)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(value), re.IGNORECASE)
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]) if match else 0
    if size < 1:
        raise ValueError(f"kv_cache_memory must be a size such as 2GB or 512MiB (at least one byte), got {value!r}")
    return size


def device_memory() -> int:
    """Bytes the device running the model can use: Metal's recommended working set on a Mac,
    physical memory elsewhere."""
    info = mx.device_info()
    if "max_recommended_working_set_size" in info:
        return int(info["max_recommended_working_set_size"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def context_length(max_model_len: int | None, model_max_len: int | None) -> int:
    """Most tokens one sequence may hold: `max_model_len`, else the model's context, else 4096."""
    return max_model_len or model_max_len or 4096


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB"


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and how much KV cache it keeps.

    The KV cache is sized by `num_blocks` (paged only), else `kv_cache_memory`, else
    `kv_cache_fraction` of the memory the device can use after the model's weights, and
    never more than `max_num_seqs` sequences of `max_model_len` tokens need. A cache that
    would not fit beside the weights is refused before anything is allocated. In the
    contiguous layout the budget buys whole `max_model_len` slots, at most `max_num_seqs`.
    `attention` is `metal` or `reference` (default: `MLXKV_ATTENTION`, else Metal where
    available). `enable_prefix_caching` lets requests share the cached pages of a common
    prefix (paged layout only). `kv_bits` (8 or 4) quantizes the KV pages in groups of
    `kv_group_size` along the head dimension, so the same memory holds about twice (8-bit)
    or three and a half times (4-bit) as many tokens. `pipeline` starts each step before the host
    reads the one before (see `LLMEngine`); off, every step is read before the next is built.
    """

    kv_layout: KVLayout | str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    attention: str | None = None
    kv_cache_fraction: float = 0.5
    enable_prefix_caching: bool = True
    kv_bits: int | None = None
    kv_group_size: int = 64
    pipeline: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_layout", resolve_layout(self.kv_layout))
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            positive_int(name, getattr(self, name))
        for name in ("num_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_memory(self.kv_cache_memory))
        if self.attention is not None and not isinstance(self.attention, str):
            raise ValueError(f"attention must be 'metal', 'reference' or None, got {self.attention!r}")
        fraction = self.kv_cache_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be a number in (0, 1], got {fraction!r}")
        for name in ("enable_prefix_caching", "pipeline"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_quantization(self.kv_bits, self.kv_group_size)
        if self.num_blocks is not None and self.kv_layout is KVLayout.CONTIGUOUS:
            raise ValueError("num_blocks applies to the paged layout; size the contiguous one with kv_cache_memory")

    def window_pages(self, window: int) -> int:
        """Pages a group of sliding-window layers needs so that it never runs out in one of this
        engine's steps."""
        return window_pool_pages(window, self.block_size, self.max_num_seqs, self.max_num_batched_tokens)

    def build_cache(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype,
                    model_max_len: int | None, weights_bytes: int = 0,
                    layer_windows: list[int | None] | None = None) -> KVCacheManager:
        """The KV cache for a model of this shape, checked against the memory left beside its weights.

        In the paged layout the pages of sliding-window layers (`layer_windows`) are a fixed,
        small pool (`window_pages` per window) taken from the budget first; the rest buys
        pages for the full-attention layers, whose bytes per token count only those layers."""
        max_len = context_length(self.max_model_len, model_max_len)
        check_quantization(self.kv_bits, self.kv_group_size, head_dim)
        windows = list(layer_windows) if layer_windows is not None else [None] * num_layers
        if self.kv_layout is KVLayout.CONTIGUOUS:
            windows = [None] * num_layers
        per_layer = kv_bytes_per_token(1, num_kv_heads, head_dim, dtype, self.kv_bits, self.kv_group_size)
        bytes_per_token = per_layer * sum(w is None for w in windows)
        window_bytes = sum(self.window_pages(w) * self.block_size * per_layer * windows.count(w)
                           for w in set(windows) - {None})
        memory = device_memory()
        available = max(0, memory - weights_bytes - window_bytes)
        per_seq = max_len if self.kv_layout is KVLayout.CONTIGUOUS else -(-max_len // self.block_size) * self.block_size
        full = self.max_num_seqs * per_seq * bytes_per_token
        budget = self.kv_cache_memory - window_bytes if self.kv_cache_memory else \
            min(full, int(self.kv_cache_fraction * available))
        if self.num_blocks is not None:
            asked, what = self.num_blocks * self.block_size * bytes_per_token, f"num_blocks={self.num_blocks}"
        else:
            asked, what = budget, f"kv_cache_memory={_gb(budget)}"
        if asked > available:
            raise ValueError(f"{what} asks for {_gb(asked)} of KV cache, but at most {_gb(available)} fits "
                             f"({_gb(memory)} the device can use, less {_gb(weights_bytes)} of weights)")
        shape = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                     max_seq_len=max_len, layout=self.kv_layout, prefix_caching=self.enable_prefix_caching,
                     kv_bits=self.kv_bits, kv_group_size=self.kv_group_size, layer_windows=windows)
        if self.kv_layout is KVLayout.CONTIGUOUS:
            slots = min(self.max_num_seqs, budget // (max_len * bytes_per_token))
            if slots == 0:
                raise ValueError(
                    f"the contiguous layout needs {max_len * bytes_per_token / 2**20:.1f} MiB per sequence "
                    f"(max_model_len={max_len}) but the KV budget is {budget / 2**20:.1f} MiB; "
                    "raise kv_cache_memory or lower max_model_len"
                )
            return KVCacheManager(max_seqs=slots, **shape)
        blocks = self.num_blocks or budget // (self.block_size * bytes_per_token)
        if blocks <= 0:
            beside = f" beside the {window_bytes} bytes of the sliding-window layers' pages" if window_bytes else ""
            source = "kv_cache_memory" if self.kv_cache_memory else f"kv_cache_fraction={self.kv_cache_fraction}"
            raise ValueError(f"the KV budget ({source}) leaves {max(budget, 0)} bytes for the full-attention layers, "
                             f"less than one page of {self.block_size} tokens{beside}")
        return KVCacheManager(max_seqs=self.max_num_seqs, block_size=self.block_size, num_blocks=blocks,
                              window_pages={w: self.window_pages(w) for w in set(windows) - {None}}, **shape)
