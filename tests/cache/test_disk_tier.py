"""The disk tier: pages filed under their keys survive the manager, come back equal, and a file
that does not belong or is damaged is ignored with one line, never read into a page."""

import logging

import mlx.core as mx
import numpy as np
import pytest

from mlxkv import KVCacheManager
from mlxkv.cache.disk import DiskSpec

TOKENS = list(range(100, 118))  # 18 tokens: 4 full pages of 4 before the last token


def cache_on(folder, model="model-a", bits=None, page_size=4, max_bytes=10**9):
    cache = KVCacheManager(
        2,
        2,
        32,
        max_num_seqs=2,
        max_model_len=64,
        page_size=page_size,
        dtype=mx.float16,
        kv_bits=bits,
        kv_group_size=32,
        disk=DiskSpec(folder, max_bytes, model),
    )
    return cache, cache.disk


def computed(cache, tokens=TOKENS, seed=0):
    """A sequence that computed `tokens` (random K/V), published and released; its K/V per layer."""
    rng = np.random.default_rng(seed)
    (seq,) = cache.claim(1)
    batch = cache.append([seq], [len(tokens)])
    written = []
    for layer in range(2):
        k, v = (mx.array(rng.standard_normal((len(tokens), 2, 32)), mx.float16) for _ in "kv")
        cache.write(layer, batch, k, v)
    cache.evaluate()
    cache.publish([seq], [tokens], [len(tokens)])
    for layer in range(2):
        written.append(cache.storage.read(layer, cache.fetch([seq]).page_tables[0][:5].tolist(), 16))
    cache.release(seq)
    return written


def restored(cache, tokens=TOKENS):
    (seq,) = cache.claim(1)
    reused = cache.reuse_prefix(seq, tokens)
    pages = cache.fetch([seq]).page_tables[0][: reused // cache.page_size].tolist()
    cache.evaluate()
    return reused, [cache.storage.read(layer, pages, reused) for layer in range(2)]


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_pages_come_back_from_disk_in_another_manager_as_they_were(tmp_path, bits):
    first, disk = cache_on(tmp_path, bits=bits)
    written = computed(first)
    assert disk.flush(10)
    second, again = cache_on(tmp_path, bits=bits)
    reused, read = restored(second)
    assert reused == 16 and again.stats.pages_restored == 4
    for (k, v), (k2, v2) in zip(written, read):
        assert mx.array_equal(k, k2).item() and mx.array_equal(v, v2).item()
    assert "; disk: 4 pages restored" in str(second.usage())


def test_a_prompt_over_more_files_than_are_kept_read_ahead_still_comes_back(tmp_path, monkeypatch):
    """A prompt's own read-ahead files are never let go for room, however many: they are all in
    memory when it is admitted (before, a prompt over more files than the cap waited for ever)."""
    first, disk = cache_on(tmp_path)
    (seq,) = first.claim(1)
    for page in range(4):  # a page a step: four files
        batch = first.append([seq], [4])
        for layer in range(2):
            first.write(layer, batch, *(mx.ones((4, 2, 32), mx.float16) * (page + 1) for _ in "kv"))
        first.evaluate()
        first.publish([seq], [TOKENS], [4 * page + 4])
    assert disk.flush(10) and len(list(tmp_path.rglob("*.run"))) == 4
    monkeypatch.setattr("mlxkv.cache.disk.tier.READY_BYTES", 0)
    second, again = cache_on(tmp_path)
    keys = second.prompt_keys(TOKENS)
    waits = 0
    while second.restoring(keys):
        again.wait(1.0)
        waits += 1
        assert waits < 100
    reused, read = restored(second)
    assert reused == 16 and again.stats.pages_restored == 4
    assert [float(read[0][0][4 * page, 0, 0]) for page in range(4)] == [1.0, 2.0, 3.0, 4.0]


def only_file(folder):
    (path,) = [p for p in folder.rglob("*.run")]
    return path


@pytest.mark.parametrize(
    "damage", ["flipped byte", "truncated", "another model", "another page size", "not a run file"]
)
def test_a_damaged_or_foreign_file_is_ignored_with_one_line_and_nothing_is_read(tmp_path, caplog, damage):
    first, disk = cache_on(tmp_path)
    computed(first)
    assert disk.flush(10)
    path = only_file(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flipped byte":
        data[-5] ^= 0x10
    elif damage == "truncated":
        data = data[:-7]
    elif damage == "not a run file":
        data = b"hello" + data
    path.write_bytes(bytes(data))
    if damage.startswith("another"):  # a file of another model or page size, in this one's folder
        kind = dict(model="model-b") if damage == "another model" else dict(page_size=8)
        other, other_disk = cache_on(tmp_path / "other", **kind)
        computed(other)
        assert other_disk.flush(10)
        path.unlink()
        only_file(tmp_path / "other").rename(path)
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        second, again = cache_on(tmp_path)
        reused, _ = restored(second)
    assert reused == 0 and again.stats.pages_restored == 0 and again.stats.files_rejected == 1
    assert [r.getMessage().split(": ")[0] for r in caplog.records] == ["disk cache"]
    computed(second)  # it recomputes, and files the pages again
    assert again.flush(10) and restored(cache_on(tmp_path)[0])[0] == 16


def test_files_beyond_the_size_go_least_recently_used_first(tmp_path):
    cache, disk = cache_on(tmp_path)
    computed(cache)
    assert disk.flush(10)
    one_run = disk.bytes_stored
    small, disk = cache_on(tmp_path, max_bytes=2 * one_run)
    computed(small, list(range(300, 318)), seed=1)
    assert disk.flush(10)
    assert restored(small)[0] == 16  # the first run, read now: the most recently used
    computed(small, list(range(500, 518)), seed=2)
    assert disk.flush(10)
    assert disk.bytes_stored <= 2 * one_run and len(list(tmp_path.rglob("*.run"))) == 2
    assert restored(cache_on(tmp_path)[0], list(range(300, 318)))[0] == 0  # the least recently used went


def test_a_full_queue_drops_pages_rather_than_wait(tmp_path, caplog):
    cache, disk = cache_on(tmp_path)
    disk.writer.queue_bytes = 0
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        computed(cache)
    assert disk.stats.writes_dropped == 1 and disk.flush(10) and not list(tmp_path.rglob("*.run"))
    assert [r.getMessage() for r in caplog.records] == [
        "disk cache: pages not written, as its queue is full (said once)"
    ]


def test_a_folder_that_cannot_be_made_leaves_the_cache_without_a_disk_tier(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        cache, disk = cache_on(blocked / "kv")
    assert disk is None and cache.prefix_caching
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [f"disk cache: cannot use {blocked / 'kv'}"]
