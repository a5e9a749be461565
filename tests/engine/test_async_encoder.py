"""An encoder on its own thread: requests from an event loop get their own vectors, those that
arrive together are embedded in one batch, and a shut-down encoder refuses more."""

import asyncio
import threading

import numpy as np
import pytest

from mlxkv.engine.async_encoder import AsyncEncoder
from mlxkv.models.encoder import Encoder
from mlxkv.models.random_model import make_encoder

pytest.importorskip("mlx_embeddings", reason="the embeddings extra is not installed")


class Held:
    """An encoder whose batches wait for `release`, each counted in `calls` (`entered`: one has begun)."""

    def __init__(self, folder):
        self.encoder = Encoder.load(make_encoder(folder))
        self.calls, self.entered, self.release = [], threading.Event(), threading.Event()
        self.embed = self.encoder.embed
        self.encoder.embed = self.held  # type: ignore[method-assign]

    def held(self, batch):
        self.entered.set()
        self.release.wait()
        self.calls.append(len(batch))
        return self.embed(batch)


def test_concurrent_requests_get_their_own_vectors_batched_together(tmp_path):
    held = Held(tmp_path / "bert")
    inputs = [[2, 10 + i, 3] for i in range(6)] + [[2] + list(range(20, 60)) + [3]]
    expected = held.embed(inputs)
    running = AsyncEncoder(held.encoder)

    async def ask():
        asked = asyncio.gather(*(running.vectors([ids]) for ids in inputs), running.vectors(inputs[:2]))
        await asyncio.sleep(0.01)  # every request queued: none can be answered before the release
        held.release.set()
        return await asked

    *each, pair = asyncio.run(ask())
    running.shutdown()
    np.testing.assert_allclose([vectors[0] for vectors in each], expected, atol=1e-6)
    np.testing.assert_allclose(pair, expected[:2], atol=1e-6)
    assert sum(held.calls) == 9 and len(held.calls) <= 2  # those that queued while a batch ran went as one
    with pytest.raises(RuntimeError, match=r"^the encoder has been shut down$"):
        asyncio.run(running.vectors(inputs[:1]))


def test_a_request_whose_asker_left_is_dropped_before_its_batch(tmp_path):
    held = Held(tmp_path / "bert")
    running = AsyncEncoder(held.encoder)

    async def ask():
        first = asyncio.ensure_future(running.vectors([[2, 5, 3]]))
        await asyncio.to_thread(held.entered.wait)  # the first is running (held); the next two queue behind it
        left, stayed = (asyncio.ensure_future(running.vectors([[2, n, 3]] * 4)) for n in (6, 7))
        await asyncio.sleep(0)
        left.cancel()
        held.release.set()
        return await first, await stayed

    first, stayed = asyncio.run(ask())
    running.shutdown()
    assert held.calls == [1, 4] and len(first) == 1 and len(stayed) == 4
