import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import bench_prefix


def test_a_small_run_reuses_all_but_the_new_tokens_and_prints_the_summary(checkpoint, capsys):
    bench_prefix.main(
        [
            "--model",
            str(checkpoint("llama-fp32")),
            "--turns",
            "3",
            "--turn-len",
            "20",
            "--reply-len",
            "5",
            "--repeats",
            "1",
            "--num-requests",
            "6",
            "--system-len",
            "40",
            "--question-len",
            "8",
            "--output-len",
            "4",
            "--max-num-seqs",
            "4",
            "--agent-turns",
            "3",
            "--agent-start",
            "64",
            "--agent-end",
            "192",
            "--agent-repeats",
            "1",
            "--traffic-len",
            "48",
        ]
    )
    out = capsys.readouterr().out
    assert out.startswith("With its defaults this takes about ")
    rows = re.findall(r"^ +(\d) +(\d+) +(\d+) +(\d+) +[\d.]+ +[\d.]+ +[\d.]+$", out, re.MULTILINE)
    assert [(turn, computed) for turn, _, _, computed in rows] == [("1", "20"), ("2", "21"), ("3", "21")]
    assert "replies identical with caching on and off: True; equal to mlx-lm's: True" in out
    assert "outputs identical with caching on and off: True" in out
    # the first 4 are admitted together and each computes the prefix; the other 2 reuse its 2 full pages
    assert re.search(r"^prefix caching on +[\d.]+ +[\d.]+ +[\d.]+ +64\.000$", out, re.MULTILINE)
    assert re.search(
        r"^chat_ttft_turn3_over_turn1=[\d.]+ chat_turn3_ttft_vs_mlx_lm=[\d.]+ "
        r"shared_prefix_speedup=[\d.]+$",
        out,
        re.MULTILINE,
    )

    agent = re.findall(r"^ +(\d) +(\d+) +(\d+) +(\d+) +[\d.]+$", out, re.MULTILINE)
    assert [(turn, prompt) for turn, prompt, _, _ in agent] == [("1", "64"), ("2", "128"), ("3", "192")]
    assert all(int(computed) < int(prompt) for _, prompt, _, computed in agent[1:])  # the pinned prefix is reused
    assert re.search(r"^agent_turn_ttft_p50_ratio=[\d.]+$", out, re.MULTILINE)
