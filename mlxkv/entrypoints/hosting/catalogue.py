"""The catalogue: the models a server may serve, by name, and nothing else (the allow-list).

It comes from `--model` (repeatable; a folder of checkpoint folders lists each of them under its
folder's name) and from a models file, TOML with a table per model:

    [models.chat]
    path = "mlx-community/Qwen3-8B-4bit"  # a checkpoint folder or a Hugging Face repo id
    aliases = ["qwen3"]                    # other names requests may use
    keep_alive = "30m"                     # how long it stays loaded idle (else the server's)
    max_model_len = 32768                  # any engine setting, as `EngineConfig` names it
    kv_cache_memory = "4GB"

The first model listed is the default: the one a request that names none gets. Each model loads
within its `memory_limit`; one that gives none gets a share of the server's budget in proportion
to the size of its weights (the whole budget when it is the only one listed).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomllib

from ...config import EngineConfig
from ..durations import seconds

ENTRY_KEYS = ("path", "aliases", "keep_alive")  # a models file's keys besides the engine settings


@dataclass(frozen=True)
class ListedModel:
    """A model the catalogue lists: its `name` (and `aliases`), its checkpoint (`path`: a folder
    or a repo id; None for the shipped demo model), the engine settings it changes from the
    server's, and its own `keep_alive` in seconds (None: the server's)."""

    name: str
    path: str | None
    aliases: tuple[str, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    keep_alive: float | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def config(self, server: EngineConfig) -> EngineConfig:
        """The engine settings this model runs with: the server's, changed by its own."""
        return replace(server, **self.settings)


class Catalogue:
    """The listed models, found by any of their names (Ollama's `:latest` tag ignored)."""

    def __init__(self, models: Sequence[ListedModel]) -> None:
        if not models:
            raise ValueError("the catalogue lists no model; give --model or --models-file")
        self.models = list(models)
        self._by_name: dict[str, ListedModel] = {}
        for model in self.models:
            for name in model.names:
                if name in self._by_name:
                    raise ValueError(f"two models answer to the name {name!r}; give each a name of its own")
                self._by_name[name] = model

    @property
    def default(self) -> ListedModel:
        return self.models[0]

    def find(self, name: str | None) -> ListedModel | None:
        """The model `name` names (None: the default), or None if it lists no such model."""
        if name is None:
            return self.default
        return self._by_name.get(name) or self._by_name.get(name.removesuffix(":latest"))

    def __iter__(self) -> Iterator[ListedModel]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    def shared(self, budget: int, sizes: Mapping[str, int]) -> Catalogue:
        """This catalogue with a `memory_limit` for each model that gives none: a share of `budget`
        in proportion to its weights' bytes among those models (`sizes`, by name; one not known
        yet counts as the known ones' mean)."""
        if len(self.models) == 1:
            return self
        known = [size for size in sizes.values() if size > 0]
        mean = sum(known) // len(known) if known else 1
        weights = {
            model.name: sizes.get(model.name) or mean for model in self.models if "memory_limit" not in model.settings
        }
        total = sum(weights.values())
        return Catalogue(
            [
                model
                if "memory_limit" in model.settings
                else replace(model, settings={**model.settings, "memory_limit": budget * weights[model.name] // total})
                for model in self.models
            ]
        )


def catalogue_of(
    models: Sequence[str],
    models_file: Path | None = None,
    names: Sequence[str] = (),
    server: EngineConfig | None = None,
) -> Catalogue:
    """The catalogue of `--model` values (`names`: `--served-model-name`, the first model's names),
    then the models file's entries; the demo model alone if neither gives one. Each entry's
    settings are checked against `server`'s (ValueError naming the model and the setting)."""
    listed: list[ListedModel] = []
    for path in models:
        listed.extend(_folder_models(path))
    if not listed and models_file is None:
        listed.append(ListedModel("mlxkv-demo", None))
    if names:
        if len(listed) != 1:
            raise ValueError("--served-model-name names one model; name several in a models file")
        listed[0] = replace(listed[0], name=names[0], aliases=tuple(names[1:]))
    if models_file is not None:
        listed.extend(read_models_file(models_file))
    if server is not None:
        for model in listed:
            try:
                model.config(server)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"model {model.name!r}: {exc}") from None
    return Catalogue(listed)


def _folder_models(path: str) -> list[ListedModel]:
    """`--model path`: one model named as given, or, for a folder of checkpoint folders, each
    of them under its folder's name."""
    folder = Path(path).expanduser()
    if folder.is_dir() and not (folder / "config.json").exists():
        inside = sorted(p for p in folder.iterdir() if (p / "config.json").is_file())
        if inside:
            return [ListedModel(p.name, str(p)) for p in inside]
    return [ListedModel(path, path)]


def read_models_file(path: Path) -> list[ListedModel]:
    """The entries of a models file (see the module); ValueError naming the file, the model and
    the key for anything it cannot take."""
    try:
        table = tomllib.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"models file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"models file {str(path)!r} is not valid TOML: {exc}") from None
    unknown = set(table) - {"models"}
    if unknown or not isinstance(table.get("models"), dict) or not table["models"]:
        raise ValueError(f"models file {str(path)!r} must hold [models.<name>] tables, one per model")
    return [_entry(str(path), name, entry) for name, entry in table["models"].items()]


def _entry(source: str, name: str, entry: Any) -> ListedModel:
    where = f"models file {source!r}, model {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a table of its settings")
    settings = {key: value for key, value in entry.items() if key not in ENTRY_KEYS}
    known = {f.name for f in fields(EngineConfig)}
    for key in settings:
        if key not in known:
            raise ValueError(
                f"{where}: {key!r} is not a setting (expected path, aliases, keep_alive or an engine setting)"
            )
    aliases = entry.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ValueError(f"{where}: aliases must be a list of names")
    path = entry.get("path", name)  # a repo id may be the model's name
    if not isinstance(path, str):
        raise ValueError(f"{where}: path must be a checkpoint folder or a repo id")
    try:
        keep_alive = seconds(entry["keep_alive"]) if "keep_alive" in entry else None
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return ListedModel(name, path, tuple(aliases), settings, keep_alive)
