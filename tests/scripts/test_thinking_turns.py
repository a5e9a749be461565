import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
pytest.importorskip("openai", reason="the openai package could not be installed")
pytest.importorskip("anthropic", reason="the anthropic package could not be installed")

import thinking_turns

from mlxkv.config import EngineConfig

# The tokens a template opens the reply's thinking with: `<think>` `\n`, or harmony's `analysis` `<|message|>`.
OPENED = 2


def test_a_template_that_keeps_the_reasoning_reuses_all_one_that_drops_it_up_to_the_reply(capsys):
    """Where the template renders a reply as written, the next turn reuses every token computed for
    the turns before; where it drops the reasoning, every page before the reply's start."""
    page = EngineConfig().page_size
    results = thinking_turns.main(["--turns", "3", "--runs", "qwen3.5", "qwen3.5+preserve", "gpt-oss"])
    assert "prefilled_share_qwen3.5+preserve_anthropic=" in capsys.readouterr().out
    for (run, client), turns in results.items():
        reused = [t.reused for t in turns[1:]]
        if (run, client) == ("qwen3.5+preserve", "anthropic"):
            assert reused == [t.prompt + t.reply - t.cut for t in turns[:-1]]
        else:
            assert reused == [(t.prompt - OPENED) // page * page for t in turns[:-1]], (run, client)
