"""The package's layers import only downward: cache < attention < engine < entrypoints."""

import ast
from pathlib import Path

import mlxkv

# Lowest first. `models` (loading) sits beside the engine, below it: the engine runs models,
# loading never runs the engine. `config` sizes the cache for the engine.
LAYERS = ["errors", "settings", "deprecation", "cache", "attention", "models", "config", "engine", "entrypoints"]
TOP = len(LAYERS)  # mlxkv/__init__.py and __main__.py may import anything
PACKAGE = Path(mlxkv.__file__).parent


def layer_of(module: str) -> int:
    """The layer rank of a module of the package (`mlxkv.cache.pool` -> rank of `cache`)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__init__", "__main__"):
        return TOP
    if parts[1] not in LAYERS:
        raise AssertionError(f"{module} is in no layer; add {parts[1]!r} to LAYERS")
    return LAYERS.index(parts[1])


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path) -> list[str]:
    """Every module of the package that `path` imports, at top level or inside functions."""
    name, package = module_name(path, root), root.name
    here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                found.append(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.append(node.module)
    return [m for m in found if m == package or m.startswith(package + ".")]


def upward_imports(root: Path) -> list[str]:
    """'importer -> imported' for each import of a higher layer by a lower one."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        importer = module_name(path, root)
        for imported in imported_modules(path, root):
            if layer_of(imported) > layer_of(importer):
                bad.append(f"{importer} -> {imported}")
    return bad


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports(PACKAGE) == []


def test_every_subpackage_and_module_has_a_layer():
    entries = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()
    }
    assert entries - {"__init__", "__main__"} == set(LAYERS)


def test_an_upward_import_is_caught(tmp_path):
    root = tmp_path / "mlxkv"
    for folder in ("cache", "engine"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "cache" / "pool.py").write_text("def f():\n    from ..engine.scheduler import Scheduler\n")
    (root / "engine" / "scheduler.py").write_text("from ..cache import pool\nfrom mlxkv.errors import E\n")
    assert upward_imports(root) == ["mlxkv.cache.pool -> mlxkv.engine.scheduler"]
