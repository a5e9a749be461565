"""Engine settings, declared once: `LLM(...)` keywords and the CLI's options are derived from `EngineConfig`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .attention.backend import BACKENDS
from .cache.layout import KVLayout, resolve_layout
from .cache.storage import BITS, GROUP_SIZES, KV_BITS, KV_GROUP_SIZES
from .deprecation import RenamedAttribute, renamed_keywords
from .settings import BOOLEAN, POSITIVE, TEXT, Check, integer, number, one_of, optional, setting, validate

FACTOR = Check(lambda v: number(0).accepts(v) and (v == 0 or v >= 1), "0 or a number >= 1")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_memory(value: int | str | None, name: str = "kv_cache_memory") -> int | None:
    """Bytes from an int or a string such as `2GB`, `512MiB` or `1.5GB` (at least one byte); None stays
    None. A bad value is a ValueError naming the setting `name`."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(value), re.IGNORECASE)
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]) if match else 0
    if size < 1:
        raise ValueError(f"{name} must be a size such as 2GB or 512MiB (at least one byte), got {value!r}")
    return size


def parse_limit(value: float | int | str | None) -> float | int | None:
    """A memory limit: a share of the device's memory (a number in (0, 1], given as a float or a
    string with a decimal point, such as 0.8) or a size in bytes (`parse_memory`)."""
    if isinstance(value, str) and re.fullmatch(r"\s*\d*\.\d+\s*", value):
        value = float(value)
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"memory_limit must be a share in (0, 1] or a size such as 16GB, got {value!r}")
        return value
    return parse_memory(value, "memory_limit")


@renamed_keywords(block_size="page_size", num_blocks="num_pages", enable_prefix_caching="prefix_caching")
@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine batches requests and how much KV cache it keeps, checked when made.

    The KV cache is sized by `num_pages` (paged layout), else `kv_cache_memory`, else
    `kv_cache_fraction` of the memory the device can use beside the model's weights, and never
    more than `max_num_seqs` sequences of `max_model_len` tokens need.
    """

    kv_layout: KVLayout | str | None = setting(
        None,
        "KV layout: paged or contiguous [default: $MLXKV_KV_LAYOUT, else paged].",
        convert=resolve_layout,
        cli_type=str,
        choices=tuple(layout.value for layout in KVLayout),
        panel="Memory",
    )
    page_size: int = setting(16, "Tokens per KV page.", POSITIVE, old_flags=("--block-size",), panel="Memory")
    num_pages: int | None = setting(
        None,
        "KV pages in the pool (paged layout), instead of --kv-cache-memory.",
        optional(POSITIVE),
        old_flags=("--num-blocks",),
        panel="Memory",
    )
    kv_cache_memory: int | str | None = setting(
        None,
        "KV cache size, such as 2GB or 512MiB [default: what the sequences need, at most "
        "--kv-cache-fraction of the memory left].",
        convert=parse_memory,
        cli_type=str,
        panel="Memory",
    )
    kv_cache_fraction: float = setting(
        0.5,
        "Share of the memory left beside the weights that the KV cache takes, when no size is given.",
        number(0, 1, low_open=True),
        panel="Memory",
    )
    memory_limit: float | int | str | None = setting(
        None,
        "Most memory the engine may use, weights included: a share of what the device can use (0.8) or "
        "a size (16GB) [default: what the device can use: Metal's recommended working set, else RAM].",
        convert=parse_limit,
        cli_type=str,
        panel="Memory",
    )
    max_num_seqs: int = setting(16, "Most sequences computed at once.", POSITIVE, panel="Engine")
    max_num_batched_tokens: int = setting(512, "Most tokens one engine step computes.", POSITIVE, panel="Engine")
    max_itl_factor: float | None = setting(
        None,
        "Inter-token latency target, relative: prefill chunks are cut so that a step with running decodes takes "
        "at most this many times its decodes alone; 0 or none: no such target [default: none; serve: 2].",
        optional(FACTOR),
        panel="Engine",
    )
    max_itl_ms: float | None = setting(
        None,
        "Inter-token latency target in milliseconds, beside --max-itl-factor: a step with running decodes takes "
        "about this long at most, or the relative target if that is longer; 0 or none: no such target.",
        optional(number(0)),
        panel="Engine",
    )
    max_model_len: int | None = setting(
        None, "Most tokens one sequence may hold [default: the model's context].", optional(POSITIVE), panel="Memory"
    )
    prefix_caching: bool = setting(
        True, "Reuse the KV pages of a prompt prefix computed before (paged layout).", BOOLEAN, panel="Memory"
    )
    disk_cache: str | None = setting(
        None,
        "Folder for the prefix cache's disk tier: full KV pages are filed there, so that a prompt prefix "
        "outlives the pool and the process; none: no disk tier [default: none; serve: ~/.cache/mlxkv/kv].",
        optional(TEXT),
        convert=lambda value: None if isinstance(value, str) and value.strip().lower() in ("", "none") else value,
        panel="Memory",
    )
    disk_cache_size: int | str = setting(
        "16GB",
        "Most bytes the disk tier keeps (each rank's, under tensor parallel), such as 16GB; the least "
        "recently used pages go first.",
        convert=lambda value: parse_memory(value, "disk_cache_size"),
        cli_type=str,
        panel="Memory",
    )
    prefix_states: int | None = setting(
        None,
        "Recurrent states a hybrid model keeps for prefix-cache hits, each as large as a running "
        "sequence's; 0 keeps none and reuses no prefix [default: --max-num-seqs].",
        optional(integer(0)),
        panel="Memory",
    )
    pinned_fraction: float = setting(
        0.5,
        "Most share of the pages that pinned prompt prefixes (cache_control) may hold; 0 pins nothing.",
        number(0, 1),
        panel="Memory",
    )
    kv_bits: int | None = setting(
        None,
        f"Quantize the KV pages to {one_of(*BITS).expected} bits [default: the model's dtype].",
        KV_BITS,
        choices=tuple(map(str, BITS)),
        panel="Memory",
    )
    kv_group_size: int = setting(
        64,
        f"Values sharing one scale and bias in quantized pages: {KV_GROUP_SIZES.expected}.",
        KV_GROUP_SIZES,
        choices=tuple(map(str, GROUP_SIZES)),
        panel="Memory",
    )
    attention: str | None = setting(
        None,
        "Attention: metal or reference [default: $MLXKV_ATTENTION, else metal where available].",
        optional(one_of(*BACKENDS)),
        convert=lambda value: value.strip().lower() if isinstance(value, str) else value,
        choices=BACKENDS,
        panel="Engine",
    )
    pipeline: bool = setting(
        True,
        "Start each step before reading the tokens of the one before (no: read every step first).",
        BOOLEAN,
        panel="Engine",
    )
    prompt_lookup: bool = setting(
        False,
        "Speculative decoding with draft tokens looked up in each request's own prompt and output.",
        BOOLEAN,
        panel="Speculation",
    )
    draft_model: str | None = setting(
        None,
        "Speculative decoding with draft tokens from this mlx-lm checkpoint (path or Hugging Face repo id), "
        "which must share the model's tokenizer.",
        optional(TEXT),
        panel="Speculation",
    )
    num_draft_tokens: int = setting(
        3,
        "Most draft tokens a speculating request proposes per step (fewer while fewer are accepted).",
        POSITIVE,
        panel="Speculation",
    )
    rank_timeout_s: float = setting(
        60.0,
        "Under tensor parallel (mlx.launch): seconds one step may wait on the other processes before the "
        "group is declared failed and this process ends.",
        number(0, low_open=True),
        panel="Tensor parallel",
    )
    rank_nap_s: float = setting(
        0.5,
        "Under tensor parallel (mlx.launch): the longest the other processes sleep while rank 0 has no "
        "step to run, rather than poll for its next one at a core each; the first step after an idle "
        "spell may start this much later. 0: they never sleep.",
        number(0, 60),
        panel="Tensor parallel",
    )

    block_size = RenamedAttribute("page_size")
    num_blocks = RenamedAttribute("num_pages")
    enable_prefix_caching = RenamedAttribute("prefix_caching")

    def __post_init__(self) -> None:
        validate(self)
        if self.prompt_lookup and self.draft_model is not None:
            raise ValueError("give prompt_lookup or draft_model, not both: a request drafts one way")
        if self.num_pages is not None and self.kv_layout is KVLayout.CONTIGUOUS:
            raise ValueError("num_pages applies to the paged layout; size the contiguous one with kv_cache_memory")
