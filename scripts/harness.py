"""What the benchmark scripts share: workloads, and one loop per engine that records every step.

Each run records, per request, the time of every generated token, and, per step, the KV
bytes allocated to sequences, the KV bytes holding tokens, and the tokens in flight counted
independently of the cache (from the requests' own progress).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache
from tqdm import tqdm

from mlxkv import SamplingParams
from mlxkv.cache.storage import check_quantization, kv_bytes_per_token
from mlxkv.config import EngineConfig
from mlxkv.engine import LLMEngine
from mlxkv.engine.model_kv import kv_shape, model_kv
from mlxkv.models.random_model import LLAMA_100M, make_checkpoint
from mlxkv.models.structure import text_model
from mlxkv.models.tiny_configs import MODEL_TYPES, tiny_config

DEFAULT_MODEL = Path.home() / ".cache" / "mlxkv" / "bench-llama-100m"
MODEL_HELP = (
    "mlx-lm checkpoint directory, or an mlx-lm model_type (deepseek_v3, glm4_moe, ...) to build a random "
    f"checkpoint of [default: a random ~100M Llama built in {DEFAULT_MODEL}]"
)
# A family's census config (mlxkv.models.tiny_configs) widened to benchmark size, where it has the field.
BENCH_WIDTHS = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    moe_intermediate_size=384,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    n_routed_experts=8,
    kv_lora_rank=256,
    q_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    max_position_embeddings=32768,
)


def blas_in_use() -> str:
    """Which BLAS MLX's matmuls go through in this process."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    maps = Path("/proc/self/maps").read_text()
    for name in ("openblas", "mkl", "blis"):
        if f"lib{name}" in maps:
            return f"{name} (loaded into the process)"
    return "the reference BLAS bundled with mlx[cpu] (slow at float32; docs/benchmarks.md: preloading OpenBLAS)"


def load_bench_model(path: Path | None):
    """(text model, tokenizer) of `path`, or of the random ~100M-parameter float32 Llama the
    benchmarks share (built once in `DEFAULT_MODEL`); prints what runs it. Both engines get the
    text model: a multimodal checkpoint's (Qwen3.5's) only hands its tokens to it."""
    if path is None:
        path = DEFAULT_MODEL
        if not (path / "config.json").exists():
            make_checkpoint(path, "llama", "float32", shape=LLAMA_100M, max_position_embeddings=32768)
    elif not path.exists() and str(path) in MODEL_TYPES:
        path = family_checkpoint(str(path))
    print(f"model: {path}\nBLAS: {blas_in_use()}\nMLX {mx.__version__}, device {mx.default_device()}")
    model, tokenizer = mlx_lm_load(str(path))
    return text_model(model), tokenizer


def family_checkpoint(model_type: str) -> Path:
    """A random float32 checkpoint of `model_type` at benchmark width (`BENCH_WIDTHS`), built once."""
    path = DEFAULT_MODEL.parent / f"bench-{model_type}"
    if not (path / "config.json").exists():
        config = tiny_config(model_type)
        config.update({name: value for name, value in BENCH_WIDTHS.items() if name in config})
        make_checkpoint(path, config.pop("model_type"), "float32", shape=config)
    return path


def _cache_bytes(cache) -> int:
    """Bytes of one layer's mlx-lm cache: its K/V, or a recurrent layer's state arrays."""
    if isinstance(cache, ArraysCache):  # it has no nbytes of its own
        return sum(array.nbytes for array in cache.cache if array is not None)
    return cache.nbytes


def model_kv_bytes_per_token(model) -> int:
    """K and V bytes one token of `model` takes across all layers, in the model's dtype."""
    kv = model_kv(model)  # a latent attention layer (DeepSeek's) keeps one row, in mlx-lm as in mlxkv
    return kv_bytes_per_token(kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype, keys_only=kv.keys_only)


def runnable(model, config: EngineConfig, name: str) -> bool:
    """Whether mlxkv can run `model` with `config`, checked as its cache checks it (quantized pages need
    a group size that divides head_dim); if not, one printed line says why, and the caller skips row `name`."""
    try:
        check_quantization(config.kv_bits, config.kv_group_size, kv_shape(model)[2])
    except ValueError as reason:
        print(f"skipped: {name}: {reason}")
        return False
    return True


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]

    @property
    def size(self) -> int:
        return len(self.prompts)


@dataclass
class Sample:
    """The KV cache after one engine step: bytes from the cache, and the tokens each live
    sequence holds counted from the requests. `lengths_known` is False while mlx-lm is mid-prefill,
    when the requests alone can't say how many of their tokens its cache holds."""

    time: float
    allocated: int
    holding: int
    lengths: list[int]
    sequences: int
    lengths_known: bool = True

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class Run:
    name: str
    bytes_per_token: int
    token_times: dict[int, list[float]] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    pool_bytes: int = 0
    peak_memory: int = 0

    @property
    def peak_allocated(self) -> int:
        return max((s.allocated for s in self.samples), default=0)

    def weighted(self, value) -> float:
        """Time-weighted mean of `value(sample)` or a sample attribute (each sample holds until the next)."""
        times = np.array([self.start] + [s.time for s in self.samples])
        values = np.array([value(s) if callable(value) else getattr(s, value) for s in self.samples], dtype=float)
        return float(np.sum(values * np.diff(times)) / max(times[-1] - times[0], 1e-9))

    def waste(self) -> float:
        """Share of the allocated KV bytes not holding tokens, time-weighted."""
        return 1 - self.weighted("holding") / max(self.weighted("allocated"), 1e-9)

    def latency(self, workload: Workload) -> dict[str, float]:
        ttft = [self.token_times[i][0] - (self.start + a) for i, a in enumerate(workload.arrivals)]
        itl = np.concatenate([np.diff(t) for t in self.token_times.values()])
        generated = sum(len(t) for t in self.token_times.values())
        return {
            "tok/s": generated / (self.end - self.start),
            "TTFT mean s": float(np.mean(ttft)),
            "TTFT p99 s": float(np.percentile(ttft, 99)),
            "ITL p50 ms": 1e3 * float(np.percentile(itl, 50)),
            "ITL p99 ms": 1e3 * float(np.percentile(itl, 99)),
        }


def _arrived(pending: list[int], workload: Workload, start: float) -> tuple[list[int], list[int]]:
    """(requests that have arrived by now, those still to come) among `pending`."""
    now = time.perf_counter()
    due = [start + workload.arrivals[i] <= now for i in pending]
    return [i for i, d in zip(pending, due) if d], [i for i, d in zip(pending, due) if not d]


def run_mlx_lm(model, workload: Workload, max_num_seqs: int, bytes_per_token: int, progress: tqdm | None = None) -> Run:
    """mlx-lm's BatchGenerator: continuous batching over a dense, left-padded cache; `progress`
    counts the tokens it generates."""
    gen = BatchGenerator(model, completion_batch_size=max_num_seqs, prefill_batch_size=min(8, max_num_seqs))
    run = Run("mlx-lm BatchGenerator", bytes_per_token)
    pending, live = list(range(workload.size)), {}
    mx.reset_peak_memory()
    run.start = time.perf_counter()
    while pending or live:
        arrived, pending = _arrived(pending, workload, run.start)
        if arrived:
            uids = gen.insert([workload.prompts[i] for i in arrived], [workload.output_lens[i] for i in arrived])
            live.update(zip(uids, arrived))
        if not live:
            time.sleep(0.001)
            continue
        _, responses = gen.next()
        now = time.perf_counter()
        if progress is not None:
            progress.update(len(responses))
        for r in responses:
            run.token_times.setdefault(live[r.uid], []).append(now)
            if r.finish_reason is not None:
                del live[r.uid]
        run.samples.append(_mlx_lm_sample(gen, live, workload, run, now))
    run.end = time.perf_counter()
    run.peak_memory = mx.get_peak_memory()
    run.pool_bytes = run.peak_allocated
    gen.close()
    return run


def _mlx_lm_sample(gen: BatchGenerator, live: dict[int, int], workload: Workload, run: Run, now: float) -> Sample:
    """Bytes from the caches themselves; held tokens from each row's offset. The independent
    count: a row of the generation batch holds its prompt plus the tokens it has emitted."""
    batches = [b for b in (gen._prompt_batch, gen._generation_batch) if b.prompt_cache]
    allocated = sum(_cache_bytes(c) for b in batches for c in b.prompt_cache)
    first_kv = [next(c for c in b.prompt_cache if not isinstance(c, ArraysCache)) for b in batches]
    held = sum(int(np.maximum(np.array(c.offset), 0).sum()) for c in first_kv)
    requests = [live[uid] for uid in gen._generation_batch.uids if uid in live]
    lengths = [len(workload.prompts[i]) + len(run.token_times.get(i, ())) for i in requests]
    return Sample(
        now,
        allocated,
        held * run.bytes_per_token,
        lengths,
        sum(len(b.uids) for b in batches),
        lengths_known=not gen._prompt_batch.uids,
    )


def run_mlxkv(
    model, tokenizer, workload: Workload, config: EngineConfig, name: str, progress: tqdm | None = None
) -> tuple[Run, LLMEngine]:
    """mlxkv's engine in either layout; `progress` counts the tokens it generates."""
    engine = LLMEngine(model, tokenizer, config)
    run = Run(name, engine.cache.storage.bytes_per_token, pool_bytes=engine.cache.nbytes)
    pending = list(range(workload.size))
    mx.reset_peak_memory()
    run.start = time.perf_counter()
    while pending or engine.has_unfinished():
        arrived, pending = _arrived(pending, workload, run.start)
        for i in arrived:
            engine.add_request(
                workload.prompts[i],
                SamplingParams(max_tokens=workload.output_lens[i], ignore_eos=True),
                request_id=str(i),
            )
        outputs = engine.step()
        now = time.perf_counter()
        if progress is not None:
            progress.update(len(outputs))
        for out in outputs:
            run.token_times.setdefault(int(out.request_id), []).append(now)
        usage = engine.cache.usage()
        running = engine.scheduler.running
        run.samples.append(
            Sample(
                now, usage.bytes_allocated, usage.bytes_holding_tokens, [r.num_computed for r in running], len(running)
            )
        )
        if not outputs and not engine.has_unfinished():
            time.sleep(0.001)
    run.end = time.perf_counter()
    run.peak_memory = mx.get_peak_memory()
    return run, engine
