"""An environment holding only what `pip install -e ".[extras]"` brings: a virtual environment whose
site-packages links the distributions of that install (mlxkv's requirements for those extras, and
theirs, as installed here), so that an example that needs anything else fails there as it would
after that install. Built from the environment running the tests: no network, about a second."""

from __future__ import annotations

import sysconfig
import venv
from collections import defaultdict
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def requirements(extras: tuple[str, ...]) -> set[str]:
    """The canonical names of the distributions that mlxkv with `extras` needs, installed here."""
    needed: set[str] = set()
    seen: set[tuple[str, tuple[str, ...]]] = set()  # a distribution may be asked for with more extras later
    todo = [("mlxkv", extras)]
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # a requirement for another platform
            continue
        needed.add(name)
        for line in dist.requires or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in ("", *wanted)):
                todo.append((canonicalize_name(requirement.name), tuple(requirement.extras)))
    return needed


@cache
def environment(root: Path, extras: tuple[str, ...]) -> Path:
    """The bin folder of the environment of mlxkv with `extras`, built under `root`."""
    home = root / ("mlxkv" + "".join(f"-{e}" for e in extras))
    venv.EnvBuilder(symlinks=True, with_pip=False).create(home)
    bin_dir = home / "bin"
    here = Path(sysconfig.get_paths()["purelib"])
    there = Path(sysconfig.get_paths(vars={"base": str(home), "platbase": str(home)})["purelib"])
    needed = requirements(extras)
    owners: dict[str, set[str]] = defaultdict(set)
    files: dict[str, list[Path]] = defaultdict(list)
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        for file in dist.files or []:
            if file.parts[0] != "..":  # scripts and data outside site-packages are made below
                owners[file.parts[0]].add(name)
                files[name].append(Path(file))
    for top, names in owners.items():
        if names <= needed:
            (there / top).symlink_to(here / top)
        else:  # a folder shared with what the install does not bring: only the needed files
            for name in names & needed:
                for file in (f for f in files[name] if f.parts[0] == top):
                    (there / file).parent.mkdir(parents=True, exist_ok=True)
                    (there / file).symlink_to(here / file)
    for name in needed:
        for entry in metadata.distribution(name).entry_points.select(group="console_scripts"):
            _script(bin_dir / entry.name, bin_dir / "python", entry.module, entry.attr)
    return bin_dir


def _script(path: Path, python: Path, module: str, attr: str) -> None:
    """A console script as pip writes one: `module`'s `attr` called with this environment's Python."""
    path.write_text(f"#!{python}\nimport sys\nfrom {module} import {attr.split('.')[0]} as main\n")
    with path.open("a") as script:
        for part in attr.split(".")[1:]:
            script.write(f"main = main.{part}\n")
        script.write("sys.exit(main())\n")
    path.chmod(0o755)
