"""Old names of renamed public names, kept working for one release with a DeprecationWarning."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

REMOVED_IN = "mlxkv 0.3"
T = TypeVar("T")


def warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is now called {new}; the old name goes in {REMOVED_IN}", DeprecationWarning, stacklevel=3)


def renamed_keywords(**old_names: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: keyword `old` still works for its new name; a settings record (a dataclass)
    also refuses an unknown keyword, listing the names it takes."""

    def decorate(cls: type[T]) -> type[T]:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: T, *args: Any, **kwargs: Any) -> None:
            for old, new in old_names.items():
                if old in kwargs:
                    warn(f"{cls.__name__}({old}=...)", new)
                    kwargs.setdefault(new, kwargs.pop(old))
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
