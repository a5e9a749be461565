import re
from dataclasses import replace

import mlx.core as mx
import pytest
from helpers import mutant_kernels
from typer.testing import CliRunner

from mlxkv.attention.kernels import PagedAttentionKernels
from mlxkv.entrypoints.cli import app
from mlxkv.entrypoints.doctor import SECONDS_PER_COUNT, Grid, KernelCheck, checks, modelled, report

SMALL = Grid(
    batches=(1, 8),
    modelled_batches=(1, 8),
    modelled_contexts=(512,),
    contexts=(512,),
    groups=(4,),
    kv_heads=8,
    head_dim=64,
    prefill_chunks=(2,),
    prefill_context=64,
    repeats=1,
    checks=(KernelCheck(mx.float32, 64, 4, 2), KernelCheck(mx.float16, 64, 4, 2, kv_bits=8)),
    variants=("plain", "sinks"),
    parity_tokens=8,
)


BUDGET = (
    r"memory: [\d.]+ [MG]B of a [\d.]+ GB budget: weights [\d.]+ MB, KV [\d.]+ [kM]B, step reserve [\d.]+ MB, "
    r"buffer cache [\d.]+ MB \(the demo model, default settings; the device can use [\d.]+ GB\)"
)


@pytest.mark.skipif(mx.metal.is_available(), reason="the Mac branch runs on a Mac")
def test_off_a_mac_it_says_so_and_prints_the_modelled_table(capsys):
    modelled(lambda line: None, SMALL)  # counted beforehand: no line about counting
    capsys.readouterr()
    report(grid=SMALL)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "mlxkv doctor: paste everything below into an issue"
    assert lines[1].startswith("machine: ") and "no Metal GPU" in lines[1] and " GiB; Linux " in lines[1]
    assert re.fullmatch(r"versions: Python \S+, MLX \S+, mlx-lm \S+, mlxkv \S+", lines[2])
    assert lines[3].startswith("Metal: not available (Linux ") and lines[3].endswith("nothing to time here.")
    assert lines[4].startswith("modelled instead (not measured): the paged kernel's decode on an M5 Pro")
    assert lines[6] == "batch 1, 8 at contexts 512 (every other row of the grid: docs/benchmarks.md):"
    assert lines[7].split() == ["batch", "context", "G", "GB/s", "of", "BW", "bound"]
    rows = [line.split() for line in lines[8:10]]
    assert [row[:3] for row in rows] == [["1", "512", "4"], ["8", "512", "4"]]
    assert all(re.fullmatch(r"\d+%", row[4]) and row[5] in ("dram", "issue", "l1", "latency", "chain") for row in rows)
    assert re.fullmatch(BUDGET, lines[10])
    assert lines[11] == "greedy parity with mlx-lm on the demo model (8 tokens, reference path): identical"
    assert len(lines) == 12


@pytest.mark.skipif(mx.metal.is_available(), reason="the Mac branch runs on a Mac")
def test_off_a_mac_the_first_lines_and_the_wait_come_before_the_slow_counting(monkeypatch):
    """Nothing cached: the report's first lines, then a line saying what it counts, how long that
    takes and where it keeps the counts, all said before the simulator counts the first row."""
    from mlxkv.attention.lab import build, cost_model

    lines: list[str] = []
    paged_work = cost_model.paged_work

    def counted_slowly(*args: int) -> list[cost_model.Work]:
        lines.append("<counting>")
        return paged_work(*args)

    monkeypatch.setattr(cost_model, "uncounted", lambda counts: list(dict.fromkeys(counts)))
    monkeypatch.setattr(cost_model, "paged_work", counted_slowly)
    grid = replace(SMALL, modelled_contexts=(512, 4096), modelled_batches=(1,), parity_tokens=1)
    report(lines.append, grid)
    first = lines.index("<counting>")
    assert lines[0] == "mlxkv doctor: paste everything below into an issue"
    assert lines[first - 2] == (
        f"counting 2 decode rows in the CPU simulator (first run only, about {2 * SECONDS_PER_COUNT} s on a busy "
        f"2-core x86 machine; cached in {build.CACHE})"
    )
    assert lines[first - 3] == "batch 1 at contexts 512, 4096 (every other row of the grid: docs/benchmarks.md):"
    assert lines[first - 1].split()[0] == "batch" and lines[first + 1].split()[:2] == ["1", "512"]
    assert lines.count("<counting>") == 2


def test_with_the_simulator_standing_in_for_metal_it_runs_the_mac_report(capsys):
    """The Mac branch end to end, its kernels run by the CPU simulator: the start-up check's
    verdicts, a decode and a prefill row, and parity through the kernels."""
    from mlxkv.attention.lab.simulator import metal_kernel

    grid = replace(SMALL, batches=(1,), contexts=(64,), groups=(2,), kv_heads=1)
    report(grid=grid, metal_kernel=metal_kernel)
    lines = capsys.readouterr().out.splitlines()
    assert lines[3] == "kernel check (the engine's start-up check; variants plain, sinks; split and unsplit):"
    assert lines[4:6] == [
        "  float32, head_dim 64, 4/2 heads, float pages: ok, matches the reference",
        "  float16, head_dim 64, 4/2 heads, 8-bit pages: ok, matches the reference",
    ]
    assert lines[6].startswith("decode, K/V GB/s (float16, 1 KV heads, head_dim 64, pages of 16;")
    assert lines[8].split()[:3] == ["1", "64", "2"] and len(lines[8].split()) == 6
    assert lines[9] == "prefill chunks at context 64 (float16, GQA 4), ms:"
    assert lines[11].split()[0] == "2" and len(lines[11].split()) == 4
    assert re.fullmatch(BUDGET, lines[12])
    assert lines[13] == "greedy parity with mlx-lm on the demo model (8 tokens, Metal kernels): identical"


def test_a_kernel_that_fails_its_check_is_named_with_the_reason(capsys):
    grid = replace(SMALL, checks=SMALL.checks[:1], variants=("plain",))
    planted = mutant_kernels("static_cast<T>(acc / sum)", "static_cast<T>(-acc / sum)")
    checks(print, grid, PagedAttentionKernels(planted))
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(
        "  float32, head_dim 64, 4/2 heads, float pages: FAILED: paged_attention differs from the reference attention"
    )


def test_the_cli_has_a_doctor_command():
    result = CliRunner().invoke(app, ["doctor", "--help"])
    assert result.exit_code == 0
    assert "Print a report to paste into an issue" in result.stdout
