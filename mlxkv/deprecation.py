"""Old names of renamed public names, kept working for one release with a DeprecationWarning."""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

REMOVED_IN = "mlxkv 0.3"
PACKAGE = str(Path(__file__).parent)
T = TypeVar("T")


def warn(old: str, new: str) -> None:
    """Warn where the caller's code uses `old`: at the first frame outside mlxkv, which is where
    Python shows a DeprecationWarning by default (in `__main__`)."""
    frame: FrameType | None = sys._getframe(1)
    level = 2  # stacklevel 2 is the frame that called warn()
    while frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(f"{old} is now called {new}; the old name goes in {REMOVED_IN}", DeprecationWarning, stacklevel=level)


def renamed_keywords(**old_names: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: keyword `old` still works for its new name; a settings record (a dataclass)
    also refuses an unknown keyword, listing the names it takes."""

    def decorate(cls: type[T]) -> type[T]:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: T, *args: Any, **kwargs: Any) -> None:
            for old, new in old_names.items():
                if old in kwargs:
                    if new in kwargs:  # dataclasses.replace passes every field by its new name
                        raise TypeError(f"{cls.__name__} got both {new} and its old name {old}; give {new}")
                    warn(f"the setting {old}", new)
                    kwargs[new] = kwargs.pop(old)
            if is_dataclass(cls):
                names = [item.name for item in fields(cls)]
                unknown = sorted(set(kwargs) - set(names))
                if unknown:
                    raise TypeError(
                        f"{cls.__name__} has no setting {unknown[0]!r}; its settings are {', '.join(names)}"
                    )
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[method-assign,assignment]
        return cls

    return decorate


class RenamedAttribute:
    """A class attribute standing for the renamed attribute `new` (a method or a property)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = f"{owner.__name__}.{name}"

    def __get__(self, instance: object, owner: type) -> Any:
        warn(self.old, self.new)
        return getattr(owner if instance is None else instance, self.new)


def module_getattr(module: str, renamed: dict[str, tuple[str, Any]]) -> Callable[[str], Any]:
    """A module `__getattr__` that serves each old name in `renamed` (old -> (new, object))."""

    def __getattr__(name: str) -> Any:
        if name not in renamed:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new, value = renamed[name]
        warn(f"{module}.{name}", new)
        return value

    return __getattr__
