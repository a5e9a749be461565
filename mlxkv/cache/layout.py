"""The two KV layouts, and how one is chosen (argument first, then `MLXKV_KV_LAYOUT`)."""

from __future__ import annotations

import enum
import os

ENV_VAR = "MLXKV_KV_LAYOUT"


class KVLayout(str, enum.Enum):
    """`paged`: pages of `page_size` tokens; `contiguous`: one page of `max_model_len` tokens per sequence."""

    PAGED = "paged"
    CONTIGUOUS = "contiguous"


def resolve_layout(layout: str | KVLayout | None = None) -> KVLayout:
    """The layout to use: `layout` when given, else the environment, else paged."""
    if isinstance(layout, KVLayout):
        return layout
    source, value = ("kv_layout", layout) if layout is not None else (ENV_VAR, os.environ.get(ENV_VAR))
    if value is None or value == "":
        return KVLayout.PAGED
    try:
        return KVLayout(str(value).strip().lower())
    except ValueError:
        raise ValueError(f"{source} must be 'paged' or 'contiguous', got {value!r}") from None
