"""Tensor parallel over `mlx.launch -n 2 --backend ring` on 127.0.0.1: the same greedy tokens as one
process through `LLM`, `mlxkv generate` and `mlxkv serve`, a killed rank ends the server, and a
killed launcher leaves no rank behind."""

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from helpers import family_checkpoint, launched, start_server, stop_server

from mlxkv import LLM, SamplingParams
from mlxkv.models.random_model import make_checkpoint
from mlxkv.models.tiny_configs import tiny_config

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import census

PROMPTS = [[1 + (i * 7 + j) % 300 for j in range(20 + 9 * i)] for i in range(16)]  # 20 to 155 tokens
SETTINGS = dict(max_num_batched_tokens=64, max_model_len=256)  # the longest prompt prefills in 3 chunks
PARAMS = SamplingParams(max_tokens=12)
SCRIPT = """
import json, sys
from mlxkv import LLM, SamplingParams
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))  # every rank but 0 ends in here
prompts, params = json.loads(sys.argv[3]), SamplingParams(max_tokens=12)
outputs = llm.generate(prompts, params)
again = llm.generate(prompts, params) if sys.argv[4] == "again" else []  # from the prefix cache
engine = llm.engine
print(json.dumps({"tokens": [o.token_ids for o in outputs], "again": [o.token_ids for o in again],
                  "cached": sum(o.num_cached_tokens for o in again), "pages": engine.cache.pool.capacity,
                  "first_cached": sum(o.num_cached_tokens for o in outputs),
                  "preemptions": engine.scheduler.num_preemptions, "ranks": engine.group_size}))
"""


def run_launched(tmp_path, *command: str, env: dict | None = None) -> str:
    done = subprocess.run(
        launched(2, *command), capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def generate_launched(tmp_path, path, settings: dict, layout: str, again: bool = False) -> dict:
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT)
    out = run_launched(
        tmp_path,
        sys.executable,
        str(script),
        str(path),
        json.dumps(settings),
        json.dumps(PROMPTS),
        "again" if again else "once",
        env={"MLXKV_KV_LAYOUT": layout},
    )
    [line] = out.splitlines()  # rank 0 alone prints
    return json.loads(line)


@pytest.mark.parametrize(
    "layout, settings",
    [
        ("paged", {}),  # run twice: the second time from the prefix cache
        ("paged", dict(num_pages=30)),  # 16 prompts of up to 11 pages each: preemption is forced
        ("paged", dict(kv_cache_memory="256KB")),
        ("paged", dict(kv_bits=8, prompt_lookup=True)),
        ("contiguous", dict(max_num_seqs=4, pipeline=False)),
    ],
)
def test_a_batch_of_16_gives_the_one_process_tokens(checkpoint, tmp_path, monkeypatch, layout, settings):
    path = checkpoint("llama-fp32-d64" if "kv_bits" in settings else "llama-fp32")  # quantized: head_dim 64
    monkeypatch.setenv("MLXKV_KV_LAYOUT", layout)
    alone = LLM(str(path), **SETTINGS, **settings)
    expected = [o.token_ids for o in alone.generate(PROMPTS, PARAMS)]
    got = generate_launched(tmp_path, path, {**SETTINGS, **settings}, layout, again=not settings)
    assert got["ranks"] == 2 and got["tokens"] == expected
    if not settings:
        again = alone.generate(PROMPTS, PARAMS)
        assert got["again"] == expected and got["cached"] == sum(o.num_cached_tokens for o in again) > 0
    if "num_pages" in settings:
        assert got["preemptions"] > 0 and got["pages"] == alone.engine.cache.pool.capacity
    if "kv_cache_memory" in settings:  # each rank holds half the KV heads: twice the pages
        assert got["pages"] == 2 * alone.engine.cache.pool.capacity


def test_each_rank_restores_its_own_heads_pages_from_disk_after_a_restart(checkpoint, tmp_path):
    """With the disk tier, each rank files its own KV heads' pages in a folder of its own, and after a
    restart rank 0 restores what every rank holds: the one-process tokens, with prompt tokens cached.
    Where either rank lost its files, nothing is restored and the tokens are the same."""
    path = checkpoint("llama-fp32")
    settings = {**SETTINGS, "disk_cache": str(tmp_path / "disk")}
    expected = [o.token_ids for o in LLM(str(path), **SETTINGS).generate(PROMPTS, PARAMS)]
    first = generate_launched(tmp_path, path, settings, "paged")
    assert first["tokens"] == expected and first["first_cached"] == 0
    folders = sorted((tmp_path / "disk").iterdir())
    assert len(folders) == 2 and all(list(folder.glob("*.run")) for folder in folders)  # a namespace a rank
    again = generate_launched(tmp_path, path, settings, "paged")
    restored = sum((len(p) - 1) // 16 * 16 for p in PROMPTS)  # every prompt's full pages but the last token's
    assert again["tokens"] == expected and again["first_cached"] == restored
    for lost in folders:
        shutil.rmtree(lost)
        alone = generate_launched(tmp_path, path, settings, "paged")  # files the lost pages again
        assert alone["tokens"] == expected and alone["first_cached"] == 0


def test_a_draft_model_drafts_on_rank_0_and_the_tokens_are_the_one_process_ones(checkpoint, tmp_path):
    path, draft = checkpoint("llama-fp32"), make_checkpoint(tmp_path / "draft", seed=1)  # rejects most drafts
    settings = dict(SETTINGS, draft_model=str(draft))
    expected = [o.token_ids for o in LLM(str(path), **settings).generate(PROMPTS, PARAMS)]
    assert generate_launched(tmp_path, path, settings, "paged")["tokens"] == expected


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe", "deepseek_v3", "glm4_moe", "minimax", "mistral3"])
def test_families_mlx_lm_shards_give_the_one_process_tokens(tmp_path, family):
    """One family of each kind the census lists with tensor parallel: adapter families, latent
    attention (DeepSeek V3), families run through their own module, a multimodal wrapper."""
    assert "tensor parallel" in census.documented()[family].detail
    config = tiny_config(family)
    path = make_checkpoint(tmp_path / family, config.pop("model_type"), shape=config)
    alone = LLM(str(path), **SETTINGS)
    expected = [o.token_ids for o in alone.generate(PROMPTS, PARAMS)]
    assert generate_launched(tmp_path, path, SETTINGS, "paged")["tokens"] == expected


FAILING = """
import json, sys
from mlxkv import SamplingParams
from mlxkv.engine.llm_engine import LLMEngine
from mlxkv.engine.sampling.sampler import TokenSampler
from mlxkv.models.loading import load
from mlxkv.models.sharding import world
original = TokenSampler.key
TokenSampler.key = lambda self, i: (1 / 0) if self.params.seed == 13 else original(self, i)
group = world()
engine = LLMEngine(*load(sys.argv[1], group), group=group)
if engine.rank != 0:
    engine.follow()
    sys.exit(0)
requests = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=1.0, seed=s))
            for p, s in zip(json.loads(sys.argv[2]), (5, 13, 7))]
while engine.has_unfinished():
    engine.step()
print(json.dumps([[r.output_ids, str(r.error)] for r in requests]))
"""


def test_a_request_whose_sampling_fails_fails_alone_and_the_others_sample_as_one_process(checkpoint, tmp_path):
    script, path = tmp_path / "failing.py", str(checkpoint("llama-fp32"))
    script.write_text(FAILING)
    prompts = json.dumps(PROMPTS[:3])
    alone = subprocess.run([sys.executable, str(script), path, prompts], capture_output=True, text=True, check=True)
    launched_out = run_launched(tmp_path, sys.executable, str(script), path, prompts)
    expected = json.loads(alone.stdout)
    assert json.loads(launched_out) == expected
    assert expected[1] == [[], "division by zero"] and len(expected[0][0]) == len(expected[2][0]) == 12


def test_mlxkv_generate_prints_the_one_process_text_once(checkpoint, tmp_path):
    command = [sys.executable, "-m", "mlxkv", "generate", "--model", str(checkpoint("llama-fp32"))]
    command += ["--prompt", "the quick brown fox", "--max-tokens", "30"]
    alone = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout
    out = run_launched(tmp_path, *command)
    assert out.count("==========") == 2 and out.split("Prompt:")[0] == alone.split("Prompt:")[0]


def test_a_family_mlx_lm_cannot_shard_or_heads_that_do_not_divide_are_named(checkpoint, tmp_path):
    command = [sys.executable, "-m", "mlxkv", "generate", "--model", str(checkpoint("llama-fp32")), "--max-tokens", "2"]
    done = subprocess.run(launched(4, *command), capture_output=True, text=True, timeout=120)
    assert "has 2 KV heads, which do not divide by the 4 processes" in done.stderr


def serve_launched(path: str, *flags: str) -> tuple[subprocess.Popen, str, int]:
    """`mlxkv serve` over two ranks: the launcher, its URL, and rank 1's process id."""
    proc, url = start_server("--model", path, "--max-num-seqs", "16", "--max-model-len", "256", *flags, ranks=2)
    [follower] = [pid for pid in ranks_of(url.rsplit(":", 1)[1]) if rank_of(pid) == "1"]
    return proc, url, follower


async def streams(url: str, model: str, prompts: list[str]) -> list[str]:
    """Each prompt's streamed text, beside one more stream that leaves after its first chunk."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")

    async def one(prompt: str, leave: bool = False) -> str:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0, stream=True)
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            if leave:
                await stream.close()  # the server aborts it: its rows are gone from the next plan
                break
        return text

    texts = await asyncio.gather(one(prompts[0] * 3, leave=True), *(one(p) for p in prompts))
    return texts[1:]


def test_serve_answers_16_concurrent_openai_streams_as_one_process(tmp_path):
    """Llama 3's published fields (its RoPE scaling keeps a table mlx-lm makes lazily, which rank 0
    steps on another thread than it loaded on)."""
    path = str(family_checkpoint(tmp_path / "llama", "llama"))
    proc, url, _ = serve_launched(path)
    try:
        prompts = [f"prompt number {i} " * (1 + i % 5) for i in range(16)]
        alone = LLM(path, max_num_seqs=16, max_model_len=256)
        expected = [c.text for c in alone.generate(prompts, SamplingParams(max_tokens=20))]
        assert asyncio.run(streams(url, path, prompts)) == expected
        metrics = httpx.get(f"{url}/metrics").text
        assert f'mlxkv_kv_pages_used{{model="{path}"}} 0.0' in metrics
        assert f'mlxkv_running_requests{{model="{path}"}} 0.0' in metrics
    finally:
        stop_server(proc)


LOSING = """
import os, sys
import mlx.core as mx
from mlxkv import SamplingParams
from mlxkv.engine.llm_engine import LLMEngine
from mlxkv.engine.parallel.step_plan import PlanChannel
from mlxkv.errors import TensorParallelError
from mlxkv.models.loading import load
from mlxkv.models.sharding import world
group = world()
engine = LLMEngine(*load(sys.argv[1], group), group=group)
if engine.rank == 1:
    channel, previous = PlanChannel(group), None
    for _ in range(3):  # three steps, then this rank is gone
        plan = channel.receive()
        mx.eval(engine.runner.hidden(plan.inputs(previous), plan.kv, plan.own_kv), engine.cache.tensors)
        previous = channel.share_tokens(mx.zeros(plan.samples, mx.int32))
        mx.eval(previous)
    os._exit(0)
engine.add_request([1, 2, 3], SamplingParams(max_tokens=50))
try:
    while engine.has_unfinished():
        engine.step()
except TensorParallelError as exc:
    print(exc)
try:
    engine.add_request([1, 2, 3])
except TensorParallelError as exc:
    print("refused:", exc)
"""


def test_a_rank_that_dies_fails_rank_0_s_step_with_a_clear_error(checkpoint, tmp_path):
    script = tmp_path / "losing.py"
    script.write_text(LOSING)
    out = run_launched(tmp_path, sys.executable, str(script), str(checkpoint("llama-fp32")))
    lost = "the tensor-parallel group of 2 processes failed: [ring] connection to a peer was lost"
    assert out.splitlines() == [lost, f"refused: {lost}"]


def test_a_killed_rank_ends_the_server(checkpoint):
    """mlx.launch ends the other ranks when one dies (rank 0's own check is the test above)."""
    proc, url, follower = serve_launched(str(checkpoint("llama-fp32")))
    os.kill(follower, signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert "Node with rank 1 exited with code -9" in err
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


def test_both_ranks_end_soon_after_their_launcher_is_killed(checkpoint):
    """A launcher killed outright cannot end its ranks: each ends itself once its parent is gone."""
    proc, url, _ = serve_launched(str(checkpoint("llama-fp32")))
    ranks = [pid for pid in ranks_of(url.rsplit(":", 1)[1]) if rank_of(pid) is not None]  # not the launcher
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    try:
        deadline = time.monotonic() + 60  # they poll every second: generous for a busy machine
        while any(map(running, ranks)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(ranks) == 2 and not any(map(running, ranks))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what outlived the launcher, if a rank did


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_rank_that_stops_answering_ends_the_server_with_a_clear_error(checkpoint):
    path = str(checkpoint("llama-fp32"))
    proc, url, follower = serve_launched(path, "--rank-timeout-s", "2")
    [leader] = [pid for pid in ranks_of(url.rsplit(":", 1)[1]) if rank_of(pid) == "0"]
    os.kill(follower, signal.SIGSTOP)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with ThreadPoolExecutor(1) as pool:
            request = pool.submit(client.completions.create, model=path, prompt="hello", max_tokens=4)
            assert "a step waited more than 2 s" in health_once_failed(url)["error"]
            with pytest.raises(openai.APIError):
                request.result()
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{leader}") and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        os.kill(follower, signal.SIGKILL)  # the launcher cannot end a stopped process
    _, err = proc.communicate(timeout=30)
    assert "error: the tensor-parallel group failed: a step waited more than 2 s (rank_timeout_s)" in err
    assert "Node with rank 0 exited with code 1" in err


def health_once_failed(url: str) -> dict:
    """/health's body once it answers 503 (within 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health", timeout=5)
        if health.status_code == 503:
            return health.json()
        time.sleep(0.1)
    raise TimeoutError("/health never reported the failure")


def ranks_of(port: str) -> list[int]:
    """The processes serving on `port` (mlx.launch's ranks)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mlxkv" in argv and b"serve" in argv and port.encode() in argv:
            found.append(int(pid))
    return found


def rank_of(pid: int) -> str | None:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"MLX_RANK=")), None)
