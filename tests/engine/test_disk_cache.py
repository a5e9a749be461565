"""The prefix cache's disk tier through the engine: a prompt's pages outlive the engine that
computed them, and a restored prompt gives the tokens its pages give from the pool (a cold run's,
with float pages) and reports them as cached."""

import pytest

from mlxkv import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPT = list(range(3, 116))  # 113 tokens: 7 full pages of 16, then the last one
OTHERS = [list(range(200, 230)), list(range(40, 61))]


@pytest.mark.parametrize("kv_bits", [None, 8, 4])
def test_a_prompt_restored_from_disk_gives_the_tokens_of_its_pages_in_the_pool(checkpoint, tmp_path, kv_bits):
    path = str(checkpoint("qwen3-fp32-d64"))
    settings = dict(kv_bits=kv_bits, max_num_seqs=4)
    cold = [o.token_ids for o in LLM(path, prefix_caching=False, **settings).generate([PROMPT, *OTHERS], GREEDY)]
    first = LLM(path, disk_cache=str(tmp_path), **settings)
    (done,) = first.generate([PROMPT], GREEDY)
    assert done.num_cached_tokens == 0 and done.token_ids == cold[0]
    (hit,) = first.generate([PROMPT], GREEDY)  # the same pages, from the pool
    assert hit.num_cached_tokens == 112 and (kv_bits is not None or hit.token_ids == cold[0])
    assert first.engine.cache.disk.flush(10)
    again = LLM(path, disk_cache=str(tmp_path), **settings)  # as after a restart
    done = again.generate([PROMPT, *OTHERS], GREEDY)
    assert [o.token_ids for o in done] == [hit.token_ids, *cold[1:]]
    assert done[0].num_cached_tokens == 112 == (len(PROMPT) - 1) // 16 * 16
    assert "; disk: 7 pages restored" in str(again.stats().kv)
    assert again.stats().kv.pages_used == 0


@pytest.mark.parametrize("seconds_a_token, restored", [(1e-12, 0), (1.0, 112)])
def test_pages_are_read_back_only_where_reading_beats_computing(checkpoint, tmp_path, seconds_a_token, restored):
    """The engine's fitted step time against the disk's read rate: where computing 112 tokens takes
    about a nanosecond they are computed, where it takes minutes they are read."""
    from dataclasses import replace

    from mlxkv.engine.memory.step_time import StepTime

    path = str(checkpoint("qwen3-fp32-d64"))
    first = LLM(path, disk_cache=str(tmp_path))
    (done,) = first.generate([PROMPT], GREEDY)
    assert first.engine.cache.disk.flush(10)
    again = LLM(path, disk_cache=str(tmp_path))
    fitted = StepTime()
    for tokens in (1, 64, 1, 256, 8):
        fitted.record(tokens, 0, 1e-3 + seconds_a_token * tokens)
    scheduler = again.engine.scheduler
    scheduler.sizer = replace(scheduler.sizer, step_time=fitted)
    (after,) = again.generate([PROMPT], GREEDY)
    assert after.num_cached_tokens == restored and after.token_ids == done.token_ids


def test_a_request_waits_for_its_pages_from_disk_while_the_others_step(checkpoint, tmp_path, monkeypatch):
    """Reading a prompt's pages back runs on the tier's reader thread: the request waits in the
    queue meanwhile, and every step goes on for the others. Its page keys are computed once."""
    import threading

    import mlxkv.cache.disk.tier as tier
    from mlxkv import KVCacheManager

    path = str(checkpoint("qwen3-fp32-d64"))
    first = LLM(path, disk_cache=str(tmp_path))
    (done,) = first.generate([PROMPT], GREEDY)
    assert first.engine.cache.disk.flush(10)
    release, read = threading.Event(), tier.read_payload
    monkeypatch.setattr(tier, "read_payload", lambda *args: release.wait(30) and read(*args))
    hashed, keys = [], KVCacheManager.prompt_keys
    monkeypatch.setattr(KVCacheManager, "prompt_keys", lambda self, t, *a: hashed.append(len(t)) or keys(self, t, *a))
    engine = LLM(path, disk_cache=str(tmp_path)).engine
    other = engine.add_request(OTHERS[0], SamplingParams(max_tokens=12, ignore_eos=True))
    restoring = engine.add_request(PROMPT, GREEDY)
    for _ in range(8):
        engine.step()
    assert other.num_outputs >= 6 and restoring.num_computed == 0 and restoring in engine.scheduler.waiting
    while other.finish_reason is None:
        engine.step()
    waits, wait = [], engine.cache.disk.wait
    monkeypatch.setattr(engine.cache.disk, "wait", lambda timeout: waits.append(timeout) or wait(timeout))
    engine.step()  # nothing to run but the read: the step waits for it instead of spinning
    assert waits == [0.01] and restoring.num_computed == 0
    release.set()
    while engine.has_unfinished():
        engine.step()
    assert restoring.num_cached_tokens == 112 and restoring.output_ids == done.token_ids
    assert hashed == [len(OTHERS[0]), len(PROMPT)]  # once each, however many steps one waited


def test_a_hybrid_restores_its_pages_and_its_recurrent_state_from_disk(tmp_path):
    """Qwen3.5's Gated DeltaNet layers need their state where the reused pages end: the state kept
    at the prompt's snapshot point is filed beside the pages and read back with them."""
    from helpers import BASE, HYBRIDS

    from mlxkv.models.random_model import make_checkpoint

    path = str(make_checkpoint(tmp_path / "qwen3_5", "qwen3_5", shape={**BASE, **HYBRIDS["qwen3_5"]}))
    first = LLM(path, disk_cache=str(tmp_path / "disk"))
    (done,) = first.generate([PROMPT], GREEDY)
    (hit,) = first.generate([PROMPT], GREEDY)  # the pages and the state, from memory
    assert hit.num_cached_tokens == 112 and hit.token_ids == done.token_ids
    assert first.engine.cache.disk.flush(10)
    again = LLM(path, disk_cache=str(tmp_path / "disk"))
    (after,) = again.generate([PROMPT], GREEDY)
    assert after.num_cached_tokens == 112 and after.token_ids == done.token_ids
    assert again.stats().kv.pages_used == 0


@pytest.mark.parametrize("name, kv_bits", [("gemma4_text", None), ("gemma4_text", 8), ("gpt_oss", None)])
def test_a_sliding_window_model_restores_its_window_pages_beside_the_others(tmp_path, name, kv_bits):
    """Gemma 4's and gpt-oss's sliding-window layers keep pages of their own: the one their window
    of 8 reaches at the prefix's end is filed and read back beside the 7 full-attention pages, and
    the tokens are those of the pages in the pool (a cold run's, with float pages), alone and batched."""
    from helpers import family_checkpoint

    path = str(family_checkpoint(tmp_path / name, name))
    settings = dict(kv_bits=kv_bits, max_num_seqs=4)
    cold = [o.token_ids for o in LLM(path, prefix_caching=False, **settings).generate([PROMPT, *OTHERS], GREEDY)]
    first = LLM(path, disk_cache=str(tmp_path / "disk"), **settings)
    (done,) = first.generate([PROMPT], GREEDY)
    (hit,) = first.generate([PROMPT], GREEDY)  # from the pool: the window group's pages are still there
    assert hit.num_cached_tokens == 112 and (kv_bits is not None or done.token_ids == hit.token_ids == cold[0])
    assert first.engine.cache.disk.flush(10)
    for prompts in ([PROMPT], [PROMPT, *OTHERS]):  # alone, then batched, each after a restart
        again = LLM(path, disk_cache=str(tmp_path / "disk"), **settings)
        restored = again.generate(prompts, GREEDY)
        assert [o.token_ids for o in restored] == [hit.token_ids, *cold[1 : len(prompts)]]
        assert restored[0].num_cached_tokens == 112 and "; disk: 8 pages restored" in str(again.stats().kv)


def test_a_disk_tier_too_small_for_a_page_keeps_serving(checkpoint, tmp_path):
    path = str(checkpoint("qwen3-fp32-d64"))
    cold = LLM(path, prefix_caching=False).generate([PROMPT, *OTHERS], GREEDY)
    tiny = LLM(path, disk_cache=str(tmp_path), disk_cache_size="1KB")
    for _ in range(2):
        assert [o.token_ids for o in tiny.generate([PROMPT, *OTHERS], GREEDY)] == [o.token_ids for o in cold]
    disk = tiny.engine.cache.disk
    assert disk.flush(10) and disk.bytes_stored == 0 and disk.stats.bytes_written > 0
    assert not list(tmp_path.rglob("*.run"))  # each file went as soon as it was written
