"""The simulator's counts on disk: counted once, read back after, counted again when a source changes."""

import dataclasses

from mlxkv.attention.lab import build, count_cache
from mlxkv.attention.lab.simulator import Counters

FIELDS = [field.name for field in dataclasses.fields(Counters) if field.type == "int"]


def launches() -> list[Counters]:
    """Two launches as a count would give them, each field its own value."""
    ints = {name: i for i, name in enumerate(FIELDS)}
    return [Counters("main", **ints, dynamic_arrays=("acc at body:3",)), Counters("merge", **ints)]


def test_a_count_is_kept_and_read_back_until_a_kernel_source_changes(tmp_path, monkeypatch):
    kernel = tmp_path / "metal" / "paged_attention.h"
    kernel.parent.mkdir()
    kernel.write_text("float attend();")
    monkeypatch.setattr(build, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(count_cache, "SOURCES", (kernel.parent,))
    counted = []

    def count() -> list[Counters]:
        counted.append(1)
        return launches()

    first = count_cache.counted("paged row 4096", count)
    again = count_cache.counted("paged row 4096", count)
    assert first == again == tuple(launches()) and len(counted) == 1  # read back, not counted again
    count_cache.counted("paged row 512", count)
    assert len(counted) == 2  # other arguments, another count
    kernel.write_text("float attend(int);")
    count_cache.counted("paged row 4096", count)
    assert len(counted) == 3  # the kernel changed: counted afresh
    assert len(list((tmp_path / "cache").glob("*.counts"))) == 3
