"""What every layer mlxkv puts in place of an mlx-lm module shares: it keeps that module as `inner`
and answers for its attributes, which the family's own code may read."""

from __future__ import annotations

from typing import Any

import mlx.nn as nn


class Wrapped(nn.Module):
    """A module standing in for mlx-lm's `inner`; an attribute it lacks is `inner`'s (EXAONE 4's
    decoder reads its attention's `is_local`, Kimi Linear's its layers' `is_linear`)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # nn.Module's __init__ has no annotations
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "inner":
                raise
            return getattr(self.inner, name)
