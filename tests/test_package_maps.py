"""Every package's docstring maps it: it names each module and sub-package in it, so that reading the
package's `__init__.py` first shows where each concern lives."""

import ast
import re
from pathlib import Path

import pytest

import mlxkv

PACKAGE = Path(mlxkv.__file__).parent
PACKAGES = sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


def members(package: Path) -> list[str]:
    modules = [p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
    return sorted(modules + [p.parent.name for p in package.glob("*/__init__.py")])


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_the_docstring_names_every_module(package):
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    named = set(re.findall(r"`([\w/]+?)/?(?:\.py)?`", docstring))
    assert [m for m in members(package) if m not in named] == []
