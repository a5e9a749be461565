"""`mlxkv doctor`: one report a Mac user pastes into an issue: the machine, whether each Metal
kernel variant compiled and matched the reference, the paged kernel's speed against MLX's own
attention (decode and prefill), the memory budget an engine gets here, and greedy-token parity with
mlx-lm on the demo model.

Off a Mac it says so, prints the cost model's table (`mlxkv.attention.lab.cost_model`) for batch 1
at short contexts in place of the timings (saying first how long the simulator takes to count it, where it is not
cached yet), and still checks parity on the reference path. `report(metal_kernel=...)` runs the
Mac branch with another kernel factory: the tests pass the CPU simulator.
"""

from __future__ import annotations

import itertools
import platform
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import mlx.core as mx

from ..attention.kernels import Factory, PagedAttentionKernels, gpu_cores
from ..attention.lab import speed
from ..attention.variant import PLAIN, Variant
from ..cache.storage import dtype_name
from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..engine.sampling.params import SamplingParams
from ..models import DEMO_MODEL, load

Say = Callable[[str], None]
PARITY_PROMPT = "The paged KV cache"


@dataclass(frozen=True)
class KernelCheck:
    """One model shape the start-up check runs for, every attention variant at once."""

    dtype: mx.Dtype
    head_dim: int
    q_heads: int
    kv_heads: int
    kv_bits: int | None = None

    def describe(self) -> str:
        pages = f"{self.kv_bits}-bit pages" if self.kv_bits else "float pages"
        return f"{dtype_name(self.dtype)}, head_dim {self.head_dim}, {self.q_heads}/{self.kv_heads} heads, {pages}"


# The demo model's shape in every dtype and page format, and two common larger ones (GQA 4, GQA 7).
CHECKS = tuple(
    KernelCheck(dtype, 64, 4, 2, bits)
    for dtype, bits in itertools.product((mx.float16, mx.bfloat16, mx.float32), (None, 8, 4))
) + (KernelCheck(mx.float16, 128, 32, 8), KernelCheck(mx.bfloat16, 128, 28, 4))
VARIANTS = ("plain", "window", "softcap", "sinks")
SECONDS_PER_COUNT = 5  # to count one modelled case on a busy 2-core x86 machine, building its kernels included


@dataclass(frozen=True)
class Grid:
    """What the report measures: the issue's grid by default; tests shrink it."""

    batches: Sequence[int] = (1, 8, 64)
    contexts: Sequence[int] = (512, 4096, 32768)
    modelled_batches: Sequence[int] = (1,)  # off a Mac, the rows whose bounds differ: one sequence,
    modelled_contexts: Sequence[int] = (512, 4096)  # short contexts (the others are all DRAM-bound)
    groups: Sequence[int] = (1, 4, 8)
    kv_heads: int = 8
    head_dim: int = 128
    prefill_chunks: Sequence[int] = (1, 8, 64, 512)
    prefill_context: int = 4096
    repeats: int = 20
    checks: Sequence[KernelCheck] = CHECKS
    variants: Sequence[str] = VARIANTS
    parity_tokens: int = 32


def report(say: Say = print, grid: Grid = Grid(), metal_kernel: Factory | None = None) -> None:
    """Print the whole report. With `metal_kernel` (a factory with `mx.fast.metal_kernel`'s
    signature) the kernel sections run on it whether or not this is a Mac."""
    say("mlxkv doctor: paste everything below into an issue")
    machine(say)
    if metal_kernel is None and not mx.metal.is_available():
        say(f"Metal: not available ({platform.system()} {platform.machine()}, not a Mac): nothing to time here.")
        modelled(say, grid)
        parity(say, grid, None)
        return
    kernels = PagedAttentionKernels(metal_kernel or mx.fast.metal_kernel)
    checks(say, grid, kernels)
    decode(say, grid, kernels)
    prefill(say, grid, kernels)
    parity(say, grid, kernels)


def machine(say: Say) -> None:
    """Chip, GPU cores, memory, OS, Python and the versions that matter."""
    gpu = mx.device_info(mx.gpu) if mx.metal.is_available() else {}
    chip = _command(["sysctl", "-n", "machdep.cpu.brand_string"]) or platform.processor() or platform.machine()
    memory = gpu.get("memory_size") or speed.ram()
    system = f"macOS {platform.mac_ver()[0]}" if platform.mac_ver()[0] else f"{platform.system()} {platform.release()}"
    say(f"machine: {chip}; {_gpu(gpu)}; memory {int(memory) / 2**30:.1f} GiB; {system}")
    say(
        f"versions: Python {platform.python_version()}, MLX {version('mlx')}, mlx-lm {version('mlx-lm')}, "
        f"mlxkv {version('mlxkv')}"
    )


def _gpu(info: dict[str, Any]) -> str:
    """The GPU's name, architecture and core count where the system says it."""
    if not info:
        return "no Metal GPU"
    cores = _command(["system_profiler", "SPDisplaysDataType"])
    found = [line.split(":")[1].strip() for line in cores.splitlines() if "Total Number of Cores" in line]
    count = found[0] if found else f"at least {gpu_cores()} (by its class)"
    return f"GPU {info.get('device_name', '?')} ({info.get('architecture', '?')}), {count} cores"


def _command(argv: list[str]) -> str:
    """A system command's output, or '' where it does not exist or fails."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def checks(say: Say, grid: Grid, kernels: PagedAttentionKernels) -> None:
    """The engine's start-up check for each shape: the verdict the engine would act on."""
    say(f"kernel check (the engine's start-up check; variants {', '.join(grid.variants)}; split and unsplit):")
    for check in grid.checks:
        variants = [_variant(name, check.q_heads) for name in grid.variants]
        problem = kernels.warm(
            check.dtype, check.head_dim, 16, check.q_heads, check.kv_heads, check.kv_bits, 64, variants
        )
        verdict = "ok, matches the reference" if problem is None else f"FAILED: {problem}"
        say(f"  {check.describe()}: {verdict}")


def _variant(name: str, q_heads: int) -> Variant:
    """The attention variant `name` (one of `VARIANTS`) for a model of `q_heads` query heads."""
    return {
        "plain": PLAIN,
        "window": Variant(window=64),
        "softcap": Variant(softcap=30.0),
        "sinks": Variant(sinks=mx.linspace(-1.0, 1.0, q_heads)),
    }[name]


def decode(say: Say, grid: Grid, kernels: PagedAttentionKernels) -> None:
    """K/V GB/s of a decode step, paged kernel against MLX's SDPA on the same K/V."""
    budget = speed.memory()
    say(
        f"decode, K/V GB/s (float16, {grid.kv_heads} KV heads, head_dim {grid.head_dim}, pages of 16; "
        "paged kernel vs mx.fast.scaled_dot_product_attention on the same K/V):"
    )
    say(f"{'batch':>6} {'context':>8} {'G':>3} {'paged GB/s':>11} {'SDPA GB/s':>10} {'paged/SDPA time':>16}")
    for group, context, batch in itertools.product(grid.groups, grid.contexts, grid.batches):
        geometry = speed.Geometry(group * grid.kv_heads, grid.kv_heads, grid.head_dim)
        kv = geometry.kv_bytes(batch, context)
        why = speed.too_big(geometry, batch, context, budget)
        if why:
            say(f"{batch:>6} {context:>8} {group:>3}  left out: {why}")
            continue
        paged, sdpa = speed.decode(kernels, geometry, batch, context, grid.repeats)
        say(
            f"{batch:>6} {context:>8} {group:>3} {kv / paged / 1e9:>11.1f} {kv / sdpa / 1e9:>10.1f} "
            f"{paged / sdpa:>16.2f}"
        )


def prefill(say: Say, grid: Grid, kernels: PagedAttentionKernels) -> None:
    """Milliseconds per prefill chunk, paged kernel against SDPA over the gathered pages."""
    geometry = speed.Geometry(4 * grid.kv_heads, grid.kv_heads, grid.head_dim)
    say(f"prefill chunks at context {grid.prefill_context} (float16, GQA 4), ms:")
    say(f"{'chunk':>6} {'paged':>9} {'SDPA':>9} {'paged/SDPA':>11}")
    for length in grid.prefill_chunks:
        paged, sdpa = speed.prefill(kernels, geometry, length, grid.prefill_context, grid.repeats)
        say(f"{length:>6} {paged * 1e3:>9.3f} {sdpa * 1e3:>9.3f} {paged / sdpa:>11.2f}")


def modelled(say: Say, grid: Grid) -> None:
    """The cost model's table for the grid's modelled decode cases on the calibrated M5 Pro, a row
    as each is counted in the simulator. A line first says how long counting takes where the counts
    are not cached (`count_cache`): only a first run, or one after a kernel change, waits."""
    from ..attention.lab.cost_model import M5_PRO, estimate, paged_work
    from ..attention.lab.simulator import SimulatorError

    say(f"modelled instead (not measured): the paged kernel's decode on an {M5_PRO.name}, K/V GB/s and share of")
    say("its bandwidth, from the CPU simulator's counts (see docs/metal-kernels.md, 'The cost model'); here")
    say(
        f"batch {_listed(grid.modelled_batches)} at contexts {_listed(grid.modelled_contexts)} (every other row of "
        "the grid: docs/benchmarks.md):"
    )
    rows = list(itertools.product(grid.groups, grid.modelled_contexts, grid.modelled_batches))
    try:
        _counting(say, grid, rows)
        say(f"{'batch':>6} {'context':>8} {'G':>3} {'GB/s':>6} {'of BW':>6} {'bound':>8}")
        for group, context, batch in rows:
            replicas = batch * grid.kv_heads
            est = estimate(paged_work(context, group, grid.head_dim, replicas, M5_PRO.cores), replicas, M5_PRO)
            say(
                f"{batch:>6} {context:>8} {group:>3} {est.rate / 1e9:>6.0f} {est.rate / M5_PRO.bandwidth:>6.0%} "
                f"{est.bound:>8}"
            )
    except SimulatorError as exc:
        say(f"(the model needs the CPU simulator: {str(exc).splitlines()[0]})")


def _listed(values: Sequence[int]) -> str:
    """`values` as a comma-separated list."""
    return ", ".join(map(str, values))


def _counting(say: Say, grid: Grid, rows: list[tuple[int, int, int]]) -> None:
    """Say how many of `rows` the simulator must count, and about how long that takes, if any."""
    from ..attention.lab import build
    from ..attention.lab.cost_model import M5_PRO, paged_count, uncounted

    counts = [paged_count(context, group, grid.head_dim, b * grid.kv_heads, M5_PRO.cores) for group, context, b in rows]
    todo = len(uncounted(counts))
    if todo:
        say(
            f"counting {todo} decode rows in the CPU simulator (first run only, about {SECONDS_PER_COUNT * todo} s "
            f"on a busy 2-core x86 machine; cached in {build.CACHE})"
        )


def parity(say: Say, grid: Grid, kernels: PagedAttentionKernels | None) -> None:
    """The memory budget of an engine for the demo model, then its greedy tokens through mlxkv's
    engine against mlx-lm's own generation."""
    from mlx_lm.generate import generate_step

    model, tokenizer = load(DEMO_MODEL)
    prompt = tokenizer.encode(PARITY_PROMPT)
    theirs = []
    for token, _ in generate_step(
        mx.array(prompt), model, max_tokens=grid.parity_tokens, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        theirs.append(int(token))
    attention = None if kernels else "reference"
    budget = LLMEngine(model, tokenizer, EngineConfig(attention=attention), kernels=kernels).memory
    say(f"memory: {budget} (the demo model, default settings; the device can use {budget.device / 1e9:.2f} GB)")
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=1, attention=attention), kernels=kernels)
    params = SamplingParams(max_tokens=grid.parity_tokens, temperature=0.0, ignore_eos=True)
    request = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    ours = list(request.output_ids)
    path = "Metal kernels" if kernels else "reference path"
    if ours == theirs:
        say(f"greedy parity with mlx-lm on the demo model ({len(ours)} tokens, {path}): identical")
        return
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    say(
        f"greedy parity with mlx-lm on the demo model ({path}): DIFFERS from token {at}: "
        f"mlxkv {ours[: at + 1]}, mlx-lm {theirs[: at + 1]}"
    )
