"""The model host, in process over real tiny engines: a listed model loads when a request names it,
idle ones go least recently used first when the budget needs their room, never one a request holds;
keep-alive runs on an injected clock, and an unloaded model's memory is given back."""

import asyncio
import gc
import json
import threading
from dataclasses import replace

import httpx
import mlx.core as mx
import pytest
from helpers import mlx_lm_greedy

from mlxkv import SamplingParams
from mlxkv.config import EngineConfig
from mlxkv.entrypoints.errors import ServingError
from mlxkv.entrypoints.hosting import ModelHost, catalogue_of
from mlxkv.entrypoints.hosting.loading import Loader
from mlxkv.entrypoints.server import build_app
from mlxkv.models.random_model import make_checkpoint

CONFIG = EngineConfig(num_pages=32, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64, disk_cache=None)
PROMPT = [1, 17, 42, 99, 7, 64, 3]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    return [make_checkpoint(folder / name, seed=seed) for seed, name in enumerate(("a", "b", "c"))]


def host_of(paths, budget, limit=None, keep_alive=300.0, clock=None, pages=32, loader=Loader, app=False):
    """A host of `paths` within `budget` bytes, each model within `limit` (None: the budget) and
    with `pages` KV pages (and, with `app`, its app, whose streams send keepalives every 1 ms)."""
    config = replace(CONFIG, num_pages=pages, memory_limit=limit)
    host = ModelHost(catalogue_of([str(p) for p in paths]), loader(config), budget, keep_alive, clock or Clock())
    served = build_app(host, keepalive_s=0.001)  # each model's serving core, as the server makes it
    return (host, served) if app else host


async def tokens(host, path):
    """Greedy tokens of PROMPT from the model at `path`, through a lease as a request holds one."""

    async def generate(core):
        out = []
        async for output in core.llm.outputs(PROMPT, GREEDY):
            out.extend(output.token_ids)
        return out

    return await host.serve(str(path), "test", lambda core: core, generate)


def planned(paths, part="planned"):
    """The bytes one of these models' budget plans (the three have one shape and the same
    settings), or of them its buffer cache (`part` "cache")."""

    async def load():
        host = host_of(paths[:1], 2**40)
        resident = await host.resident(str(paths[0]))
        await host.unload(str(paths[0]))
        return getattr(resident, part)

    return asyncio.run(load())


def test_requests_cycling_over_three_models_evict_the_least_recently_used_and_stay_within_the_budget(
    paths, monkeypatch
):
    one, cache = planned(paths), planned(paths, "cache")
    expected = {str(p): mlx_lm_greedy(p, PROMPT, 6) for p in paths}
    limits = []  # every memory limit MLX is given meanwhile: the host's, never one engine's own plan
    monkeypatch.setattr(
        mx, "set_memory_limit", lambda limit, original=mx.set_memory_limit: limits.append(limit) or original(limit)
    )

    async def cycle():
        host = host_of(paths, 2 * one + one // 2, one)  # room for two
        gc.collect()
        mx.clear_cache()
        base = mx.get_active_memory()  # what the process holds besides (earlier tests' arrays)
        mx.reset_peak_memory()
        seen = []
        for path in [paths[0], paths[1], paths[2], paths[0], paths[1], paths[1], paths[2]]:
            assert await tokens(host, path) == expected[str(path)]
            seen.append([name.split("/")[-1] for name in host.residents])
            assert host.used <= host.budget
        await host.unload(str(paths[2]))
        return seen, mx.get_peak_memory() - base

    seen, peak = asyncio.run(cycle())
    assert seen == [["a"], ["a", "b"], ["b", "c"], ["c", "a"], ["a", "b"], ["a", "b"], ["b", "c"]]
    assert peak <= 2 * one + one // 2
    assert limits and all(limit >= 2 * one + one // 2 - 2 * cache for limit in limits)  # the budget less caches


def test_a_model_a_request_holds_is_never_let_go_and_a_load_that_cannot_fit_is_a_503_naming_the_holders(paths):
    one = planned(paths)

    async def run():
        host = host_of(paths, 2 * one + one // 2, one)
        release = asyncio.Event()

        async def held(core):
            await release.wait()
            return "done"

        holding_a = asyncio.create_task(host.serve(str(paths[0]), "test", lambda core: core, held))
        while str(paths[0]) not in host.residents or not host.residents[str(paths[0])].leases:
            await asyncio.sleep(0.01)
        await tokens(host, paths[1])
        await tokens(host, paths[2])  # b goes, not a
        after_c = list(host.residents)
        holding_c = asyncio.create_task(host.serve(str(paths[2]), "test", lambda core: core, held))
        while not host.residents[str(paths[2])].leases:
            await asyncio.sleep(0.01)
        with pytest.raises(ServingError) as refused:
            await tokens(host, paths[1])
        release.set()
        assert await holding_a == await holding_c == "done"
        await tokens(host, paths[1])  # now an idle one goes
        return after_c, refused.value, list(host.residents)

    after_c, refused, finally_ = asyncio.run(run())
    assert [p.split("/")[-1] for p in after_c] == ["a", "c"]
    assert refused.status == 503 and refused.headers == {"Retry-After": "5"} and refused.param == "model"
    assert f"model {str(paths[1])!r} does not fit in the memory budget" in str(refused)
    assert f"{paths[0]!s} (" in str(refused) and "1 requests" in str(refused)
    assert [p.split("/")[-1] for p in finally_] == ["c", "b"]


def test_keep_alive_zero_unloads_at_once_an_idle_model_goes_when_its_time_runs_out_and_its_memory_comes_back(paths):
    async def run():
        clock = Clock()
        host = host_of(paths, 2**40, keep_alive=300.0, clock=clock, pages=1024)  # 8 MiB of KV
        gc.collect()
        before = mx.get_active_memory()
        await host.serve(str(paths[0]), "test", lambda core: core, lambda core: asyncio.sleep(0), keep_alive=0)
        for _ in range(500):
            if not host.residents:
                break
            await asyncio.sleep(0.01)
        gone_at_once = not host.residents
        await tokens(host, paths[1])
        loaded = mx.get_active_memory()
        clock.now += 299
        await host.reap()
        kept = list(host.residents)
        clock.now += 2
        await host.reap()
        return gone_at_once, kept, before, loaded, mx.get_active_memory(), list(host.residents)

    gone_at_once, kept, before, loaded, after, residents = asyncio.run(run())
    assert gone_at_once and [p.split("/")[-1] for p in kept] == ["b"] and residents == []
    assert loaded - before > 8 * 2**20 and after - before < 2**20  # what it held is given back


def test_a_model_not_listed_is_a_404_and_loads_nothing(paths):
    async def run():
        host = host_of(paths[:1], 2**40)
        with pytest.raises(ServingError) as refused:
            await host.resident("another/model")
        return refused.value, list(host.residents)

    refused, residents = asyncio.run(run())
    assert (refused.status, refused.code, refused.param) == (404, "model_not_found", "model") and residents == []
    assert str(refused) == f"model 'another/model' does not exist here; this server serves {str(paths[0])!r}"


def test_a_stream_whose_model_must_load_gets_keepalives_until_it_has_loaded_and_load_failures_as_error_events(
    paths, tmp_path, monkeypatch
):
    """In process: the loader holds until the stream has sent a keepalive, so the stream opens with
    one whatever the machine's speed; then comes the reply. A model that cannot load ends its
    stream with the API's error event."""
    from mlxkv.entrypoints.openai import router, serving

    kept = threading.Event()
    waiting = serving.WAITING
    monkeypatch.setattr(router, "WAITING", replace(waiting, keepalive=lambda: kept.set() or waiting.keepalive()))

    class Held(Loader):
        def __call__(self, listed, room):
            assert kept.wait(60)
            return super().__call__(listed, room)

    (tmp_path / "broken").mkdir()
    host, app = host_of([paths[0], tmp_path / "broken"], 2**40, loader=Held, app=True)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "stream": True}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as api:
            loaded = await api.post("/v1/chat/completions", json=chat | {"model": str(paths[0])})
            broken = await api.post("/v1/chat/completions", json=chat | {"model": str(tmp_path / "broken")})
            await host.unload(str(paths[0]))
            return loaded, broken

    loaded, broken = asyncio.run(run())
    events = [e for e in loaded.text.split("\n\n") if e]
    assert loaded.status_code == 200 and events[0] == ": keepalive" and events[-1] == "data: [DONE]"
    assert any('"content"' in e for e in events if e.startswith("data: {"))
    failed = [e for e in broken.text.split("\n\n") if e and e != ": keepalive"]
    assert broken.status_code == 200 and failed[-1] == "data: [DONE]"
    assert json.loads(failed[0].removeprefix("data: "))["error"]["message"].startswith(
        f"model {str(tmp_path / 'broken')!r} could not be loaded: "
    )
