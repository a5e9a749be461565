import io
import itertools
import re
import subprocess
import sys

import pytest
from helpers import BASE, HYBRIDS, mlx_lm_greedy, mlx_lm_quantized_greedy, mlx_lm_text
from mlx_lm import load as mlx_lm_load
from typer.testing import CliRunner

from mlxkv import LLM, SamplingParams
from mlxkv.entrypoints import cli
from mlxkv.entrypoints.cli import app
from mlxkv.models.random_model import make_checkpoint

runner = CliRunner()
PROMPT = "The quick brown fox jumps"
STATS = [
    r"^Prompt: \d+ tokens, [\d.]+ tokens-per-sec$",
    r"^Generation: \d+ tokens, [\d.]+ tokens-per-sec$",
    r"^Peak memory: [\d.]+ GB$",
    r"^Memory: [\d.]+ [kMG]B of a [\d.]+ [MG]B budget: weights [\d.]+ [kMG]B, KV [\d.]+ [kMG]B, "
    r"step reserve [\d.]+ [kMG]B, buffer cache [\d.]+ [kMG]B$",
    r"^KV cache: (paged|contiguous)(, [48]-bit)?, \d+/\d+ pages of \d+ tokens in use(, \d+ more cached)? "
    r"\(pool [\d.]+ [MG]iB\), [\d.]+ of [\d.]+ MiB in use holding tokens; "
    r"prefix cache: (\d+ of \d+ prompt tokens reused|none \(the contiguous layout .*\)|off)$",
]


def generated_text(output: str) -> str:
    return output.split("==========\n", 1)[1].rsplit("\n==========", 1)[0]


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("name", ["llama-fp16", "qwen2-bf16", "qwen3-fp16", "llama-4bit"])
def test_generate_prints_mlx_lm_greedy_text_and_the_figures(checkpoint, name, layout):
    path = checkpoint(name)
    _, tokenizer = mlx_lm_load(str(path))
    expected = mlx_lm_text(tokenizer, mlx_lm_greedy(path, tokenizer.encode(PROMPT), max_tokens=24))
    result = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(path),
            "--prompt",
            PROMPT,
            "--max-tokens",
            "24",
            "--kv-layout",
            layout,
            "--page-size",
            "8",
        ],
    )
    assert result.exit_code == 0, result.output
    assert generated_text(result.stdout) == expected
    lines = result.stdout.strip().splitlines()[-5:]
    assert all(re.match(pattern, line) for pattern, line in zip(STATS, lines)), lines
    assert lines[4].startswith(f"KV cache: {layout}, ")


@pytest.mark.parametrize("bits", [8, 4])
def test_generate_with_quantized_pages_prints_mlx_lm_quantized_kv_text(checkpoint, bits):
    path = checkpoint("llama-fp32-d64")
    _, tokenizer = mlx_lm_load(str(path))
    tokens, _ = mlx_lm_quantized_greedy(path, tokenizer.encode(PROMPT), bits, max_tokens=16)
    eos = next((i for i, t in enumerate(tokens) if t in tokenizer.eos_token_ids), len(tokens))
    tokens = tokens[:eos]  # mlxkv stops at EOS, as mlx-lm's CLI does
    result = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(path),
            "--prompt",
            PROMPT,
            "--max-tokens",
            "16",
            "--kv-bits",
            str(bits),
            "--kv-group-size",
            "64",
        ],
    )
    assert result.exit_code == 0, result.output
    assert generated_text(result.stdout) == mlx_lm_text(tokenizer, tokens)
    assert re.match(STATS[4], result.stdout.strip().splitlines()[-1])
    assert f"KV cache: paged, {bits}-bit, " in result.stdout


def test_kv_line_counts_the_pages_one_request_used(checkpoint):
    result = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(checkpoint("llama-fp32")),
            "--prompt",
            PROMPT,
            "-m",
            "10",
            "--page-size",
            "4",
            "--num-pages",
            "64",
        ],
    )
    prompt_tokens = int(re.search(r"Prompt: (\d+) tokens", result.stdout).group(1))
    used = re.search(r"KV cache: paged, (\d+)/64 pages of 4 tokens", result.stdout)
    assert int(used.group(1)) == -(-(prompt_tokens + 9) // 4)


@pytest.mark.parametrize("drafting", [["--prompt-lookup"], ["--draft-model", "self"]], ids=["lookup", "draft"])
def test_speculation_prints_the_same_text_and_what_it_accepted(checkpoint, drafting, monkeypatch):
    from mlxkv.engine.speculative.speculation import Speculator

    monkeypatch.setattr(Speculator, "_share", lambda self, tokens, attended: 0.0)  # drafts pay, however loaded
    path = str(checkpoint("llama-fp32"))
    drafting = [path if arg == "self" else arg for arg in drafting]  # the model drafting for itself
    args = ["generate", "--model", path, "--prompt", "ab ab ab ab ab ab", "-m", "40", "--ignore-eos"]
    plain, speculating = runner.invoke(app, args), runner.invoke(app, args + drafting)
    assert speculating.exit_code == 0, speculating.output
    assert generated_text(speculating.stdout) == generated_text(plain.stdout)
    figures = re.search(r"; speculation: (\d+) of (\d+) draft tokens accepted \((\d+)%\)$", speculating.stdout.strip())
    accepted, drafted, rate = map(int, figures.groups())
    assert 0 < accepted <= drafted and rate == round(100 * accepted / drafted)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model"], "error: model path '/nonexistent/model' does not exist"),
        (["--temp", "-1"], "error: --temperature/--temp must be a number >= 0, got -1.0"),
        (["--top-p", "1.5"], r"error: --top-p must be a number in \(0, 1\], got 1.5"),
        (["--kv-layout", "dense"], "error: --kv-layout must be 'paged' or 'contiguous', got 'dense'"),
        (["--kv-cache-memory", "lots"], "error: --kv-cache-memory must be a size such as 2GB"),
        (["--num-pages", "2", "--page-size", "4", "-m", "100"], "error: prompt of .* tokens plus --max-tokens=100"),
        (["--kv-bits", "2"], r"error: --kv-bits must be 8 or 4 \(or left out\), got 2"),
        (["--attention", "cuda"], r"error: --attention must be 'metal' or 'reference' \(or left out\), got 'cuda'"),
        (["--seed", "-1"], r"error: --seed must be an integer in \[0, 2\*\*64\) \(or left out\), got -1"),
        (["--kv-bits", "8"], "error: the model's head_dim=16 is not a multiple of 32"),
        (
            ["--draft-model", "/nonexistent/draft"],
            "error: --draft-model='/nonexistent/draft': model path '/nonexistent/draft' does not exist",
        ),
        (["--prompt-lookup", "--draft-model", "x"], "error: give --prompt-lookup or --draft-model, not both"),
        (["--num-draft-tokens", "0"], "error: --num-draft-tokens must be a positive integer, got 0"),
    ],
)
def test_bad_input_gives_one_clear_line_and_a_failing_exit(checkpoint, args, message):
    if "--model" not in args:
        args = ["--model", str(checkpoint("llama-fp32"))] + args
    result = runner.invoke(app, ["generate", "--prompt", PROMPT] + args)
    assert result.exit_code == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert re.match(message, result.stderr)


def test_directory_without_config_and_unsupported_architecture(tmp_path):
    result = runner.invoke(app, ["generate", "--model", str(tmp_path)])
    assert result.exit_code == 1 and "has no config.json" in result.stderr
    (tmp_path / "config.json").write_text('{"model_type": "gpt7"}')
    result = runner.invoke(app, ["generate", "--model", str(tmp_path)])
    assert result.exit_code == 1 and "unsupported model_type 'gpt7'" in result.stderr


def test_installed_command_reads_the_prompt_from_stdin(checkpoint):
    path = checkpoint("qwen3-bf16")
    proc = subprocess.run(
        [sys.executable, "-m", "mlxkv", "generate", "--model", str(path), "--prompt", "-", "-m", "8"],
        input=PROMPT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    via_flag = runner.invoke(app, ["generate", "--model", str(path), "--prompt", PROMPT, "-m", "8"])
    assert generated_text(proc.stdout) == generated_text(via_flag.stdout)


def test_help_lists_both_commands():
    proc = subprocess.run([sys.executable, "-m", "mlxkv", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "generate" in proc.stdout and "chat" in proc.stdout


def test_chat_keeps_the_conversation_and_reports_each_turn(checkpoint):
    result = runner.invoke(
        app,
        ["chat", "--model", str(checkpoint("llama-fp32")), "--temp", "0", "-m", "6", "--verbose"],
        input="The quick\n/reset\nbrown fox\n",
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.count("KV cache: paged") == 2
    assert result.stdout.count("Generation: 6 tokens") == 2


def test_chat_shows_a_reply_s_figures_when_asked_with_stats(checkpoint):
    result = runner.invoke(
        app,
        ["chat", "--model", str(checkpoint("llama-fp32")), "--temp", "0", "-m", "6"],
        input="/stats\nThe quick\n/stats\n",
    )
    assert result.exit_code == 0, result.output
    before, after = result.stdout.split("[no reply yet]")
    assert "Generation:" not in before
    assert after.count("Generation: 6 tokens") == 1 and after.index("Generation") > after.index("==========")


def test_default_model_is_the_shipped_demo_and_writes_readable_text():
    result = runner.invoke(app, ["generate", "--prompt", "The import statement", "-m", "60"])
    assert result.exit_code == 0, result.output
    text = generated_text(result.stdout)
    words = text.split()
    assert len(words) >= 15
    assert sum(ch.isalpha() or ch.isspace() for ch in text) / len(text) > 0.75


def test_short_help_version_and_help_that_shows_its_defaults():
    assert runner.invoke(app, ["-h"]).exit_code == 0
    version = runner.invoke(app, ["--version"])
    assert re.fullmatch(r"mlxkv \d+\.\d+\.\d+\S*\n", version.stdout)
    help_text = " ".join(runner.invoke(app, ["generate", "-h"]).stdout.split())
    for note in (
        "[default: the shipped demo model]",
        "[default: $MLXKV_KV_LAYOUT, else paged]",
        "[default: what the sequences need, at most",
        "of the memory left]",
        "[default: the model's context]",
        "--max-num-seqs",
        "--verbose / --no-verbose",
        "--temperature, --temp <float> Sampling temperature; 0 is greedy. [default: 0.0]",
        "-m, --max-tokens <int> Most tokens to generate. [default: 100]",
    ):
        assert note in help_text, note
    serve_help = " ".join(runner.invoke(app, ["serve", "-h"]).stdout.split())
    factor = serve_help[serve_help.index("--max-itl-factor") : serve_help.index("--max-itl-ms")]
    assert factor.count("[default:") == 1 and "[default: none; serve: 2]" in factor


def test_help_groups_the_options_in_sections_sampling_first_with_their_choices():
    sections = {
        "generate": ["Sampling", "Prompt", "Model", "Engine", "Memory", "Speculation", "Tensor parallel"],
        "chat": ["Sampling", "Prompt", "Model", "Engine", "Memory", "Speculation", "Tensor parallel"],
        "serve": ["Sampling", "Prompt", "Model", "Serving", "Engine", "Memory", "Speculation", "Tensor parallel"],
    }
    for command, expected in sections.items():
        text = runner.invoke(app, [command, "-h"]).stdout
        assert re.findall(r"^(.+) options:$", text, re.MULTILINE) == expected
        assert text.index("Options:") > text.index("Tensor parallel options:")  # -h and the command's own last
    generate = " ".join(runner.invoke(app, ["generate", "-h"]).stdout.split())
    sampling = generate[generate.index("Sampling options:") : generate.index("Prompt options:")]
    assert "-m, --max-tokens" in sampling and "--temp" in sampling and "--stop" in sampling
    for choices in ("--kv-layout [paged|contiguous]", "--attention [metal|reference]", "--kv-bits [8|4]"):
        assert choices in generate
    serve = " ".join(runner.invoke(app, ["serve", "-h"]).stdout.split())
    assert serve.index("--served-model-name") < serve.index("Serving options:") < serve.index("--port")
    assert serve[serve.index("Sampling options:") : serve.index("Prompt options:")].count("--") == 1  # the budget


def test_chat_samples_as_the_model_recommends_unless_told(tmp_path):
    path = make_checkpoint(tmp_path / "tiny")
    (path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95, "top_k": 20}')

    def banner(*flags):
        result = runner.invoke(app, ["chat", "--model", str(path), *flags], input="")
        return result.stdout.splitlines()[1]

    assert banner() == "Sampling: --temp 0.6, --top-p 0.95, --top-k 20."
    assert banner("--temp", "0.3", "--top-k", "0") == "Sampling: --temp 0.3, --top-p 0.95."
    assert banner("--temp", "0") == "Sampling: greedy (--temp 0)."
    assert runner.invoke(app, ["chat"], input="").stdout.splitlines()[1] == "Sampling: --temp 0.7."


# A template that opens the reply's thinking unless told not to (mlx-lm sets `enable_thinking` for
# a vocabulary with think markers).
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    path = str(make_checkpoint(tmp_path_factory.mktemp("cli") / "thinker", chat_template=THINKING_TEMPLATE))
    return path, LLM(path, max_model_len=128)


def test_generate_prints_a_thinking_model_s_reasoning_first_unless_told_not_to(thinker):
    path, llm = thinker
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    [done] = llm.generate(prompt, SamplingParams(max_tokens=30, thinking_token_budget=10), continuation=False)
    assert done.reasoning and done.text
    flags = ["generate", "--model", path, "-p", "Hi", "-m", "30", "--thinking-token-budget", "10", "--no-verbose"]
    assert runner.invoke(app, flags).stdout == done.reasoning + "\n" + done.text + "\n"  # not a terminal: no dimming
    assert runner.invoke(app, [*flags, "--no-reasoning"]).stdout == done.text + "\n"


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_one_line(thinker):
    path, llm = thinker
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, enable_thinking=False
    )
    [done] = llm.generate(prompt, SamplingParams(max_tokens=8), continuation=False)
    flags = ["generate", "--model", path, "-p", "Hi", "-m", "8", "--no-verbose", "--chat-template-kwargs"]
    assert runner.invoke(app, [*flags, '{"enable_thinking": false}']).stdout == done.text + "\n"
    assert runner.invoke(app, [*flags, '{"enable_thinking": true}']).stdout != done.text + "\n"
    ignored = runner.invoke(app, [*flags, "{}", "--ignore-chat-template"])
    assert ignored.exit_code == 0  # nothing to ignore
    refused = runner.invoke(app, [*flags, '{"enable_thinking": false}', "--ignore-chat-template"])
    assert refused.stderr.strip() == (
        "error: --chat-template-kwargs is for the chat template, which --ignore-chat-template leaves out"
    )
    for bad, said in (
        ("[1]", 'must be a JSON object, such as {"enable_thinking": false}'),
        ('{"tokenize": 1}', "may not set tokenize: mlxkv sets them"),
        ("{", "is not JSON (Expecting property name enclosed in double quotes)"),
    ):
        failed = runner.invoke(app, ["chat", "--chat-template-kwargs", bad], input="")
        assert (failed.exit_code, failed.stderr.splitlines()[-1].split(";")[0]) == (
            1,
            f"error: --chat-template-kwargs {said}",
        )


def test_no_verbose_prints_only_the_text(checkpoint):
    path = checkpoint("llama-fp32")
    result = runner.invoke(app, ["generate", "--model", str(path), "--prompt", PROMPT, "-m", "12", "--no-verbose"])
    _, tokenizer = mlx_lm_load(str(path))
    assert result.stdout == mlx_lm_text(tokenizer, mlx_lm_greedy(path, tokenizer.encode(PROMPT), 12)) + "\n"


def test_chat_banner_and_a_conversation_that_outgrows_the_context(checkpoint):
    result = runner.invoke(
        app,
        [
            "chat",
            "--model",
            str(checkpoint("llama-fp32")),
            "--temp",
            "0",
            "-m",
            "6",
            "--max-model-len",
            "24",
            "--no-verbose",
        ],
        input="The quick brown\nfox jumps over\nthe lazy dog\n/reset\nhi\n",
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Chat: type a message. /stats shows the last reply's figures, /reset starts over")
    assert re.search(
        r"error: the conversation \(\d+ tokens\) has outgrown the context of 24 tokens; "
        r"/reset starts a new one",
        result.stderr,
    )
    assert result.stdout.count(">> ") == 6


def test_ctrl_c_stops_the_reply_and_keeps_the_session(checkpoint, monkeypatch):
    from mlxkv.entrypoints.llm import Stream

    original, calls = Stream._next_piece, iter(range(10**6))

    def interrupted_once(self):  # Ctrl-C while the third piece of the first reply is awaited
        if next(calls) == 2:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(Stream, "_next_piece", interrupted_once)
    result = runner.invoke(
        app,
        ["chat", "--model", str(checkpoint("llama-fp32")), "--temp", "0", "-m", "6", "--verbose"],
        input="The quick\nbrown fox\n",
    )
    assert result.exit_code == 0, result.output
    assert "[reply stopped]" in result.stdout
    assert result.stdout.count("Generation: 6 tokens") == 1


def test_chat_names_a_line_that_is_not_utf8_and_goes_on(checkpoint):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxkv",
            "chat",
            "--model",
            str(checkpoint("llama-fp32")),
            "--temp",
            "0",
            "-m",
            "4",
            "--verbose",
        ],
        input=b"caf\xe9\xff\nThe quick\n",
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert b"error: that line is not UTF-8 text" in proc.stderr
    assert proc.stdout.count(b"Generation: 4 tokens") == 1


@pytest.mark.parametrize("flags", [[], ["--page-size", "4"]])
def test_each_chat_turn_computes_only_what_the_turn_before_did_not(checkpoint, monkeypatch, flags):
    """Turn N reuses every full page of what turn N-1 stored (prompt and answer) that its own
    prompt starts with; the KV line says how many prompt tokens that was."""
    from mlxkv.entrypoints.llm import LLM

    requests, original = [], LLM.stream
    monkeypatch.setattr(LLM, "stream", lambda self, *a, **kw: requests.append(original(self, *a, **kw)) or requests[-1])
    result = runner.invoke(
        app,
        ["chat", "--model", str(checkpoint("llama-fp32")), "--temp", "0", "-m", "12", "--verbose", *flags],
        input="The quick brown fox\njumps over the lazy dog\nPaged attention keeps keys\n",
    )
    assert result.exit_code == 0, result.output
    block = int(flags[1]) if flags else 16
    turns = [s.request for s in requests]
    reused = [int(n) for n in re.findall(r"prefix cache: (\d+) of \d+ prompt tokens reused", result.stdout)]
    assert reused == [t.num_cached_tokens for t in turns] and reused[0] == 0
    for before, turn in itertools.pairwise(turns):
        stored = before.all_token_ids[: before.num_computed]
        common = next((i for i, (a, b) in enumerate(zip(stored, turn.prompt_ids)) if a != b), len(stored))
        last = min(common, len(turn.prompt_ids) - 1)  # never the prompt's last token
        partial = len(stored) // block * block  # where turn N-1's partly filled last page starts
        # that page is cached under every prefix of what it holds: reused as far as the prompt agrees
        assert turn.num_cached_tokens == (last if last > partial else last // block * block)
        assert turn.num_cached_tokens >= len(before.prompt_ids) // block * block - block


@pytest.mark.parametrize(
    "flags, figure",
    [
        ([], "prefix cache: 0 of 14 prompt tokens reused"),
        (["--no-prefix-caching"], "prefix cache: off"),
        (
            ["--kv-layout", "contiguous"],
            "prefix cache: none (the contiguous layout gives each sequence its own page and shares nothing)",
        ),
    ],
)
def test_the_kv_line_says_what_the_prefix_cache_did(checkpoint, flags, figure):
    result = runner.invoke(
        app, ["generate", "--model", str(checkpoint("llama-fp32")), "--prompt", PROMPT, "-m", "2", *flags]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip().endswith(f"in use holding tokens; {figure}")


@pytest.mark.parametrize(
    "args, line",
    [
        (["generate", "--temp", "abc"], "error: Invalid value for '--temperature' / '--temp': "),
        (["generate", "--max-tokens", "x"], "error: Invalid value for '--max-tokens' / '-m': "),
        (["generate", "--no-such-flag"], "error: No such option: --no-such-flag"),
        (["nonsense"], "error: No such command 'nonsense'."),
    ],
)
def test_usage_errors_are_one_line_naming_the_flag_not_a_usage_block(args, line):
    done = subprocess.run([sys.executable, "-m", "mlxkv", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith(line) and done.stderr.count("\n") == 1, done.stderr


def test_reset_in_chat_says_so(checkpoint):
    result = runner.invoke(
        app,
        ["chat", "--model", str(checkpoint("llama-fp32")), "--temp", "0", "-m", "3", "--no-verbose"],
        input="The quick\n/reset\n",
    )
    assert result.exit_code == 0, result.output
    assert ">> [conversation reset]\n>> " in result.stdout


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_prefill_longer_than_half_a_second_shows_a_bar_on_a_terminal(checkpoint, monkeypatch):
    llm = LLM(str(checkpoint("llama-fp32")), max_num_batched_tokens=16)
    terminal = Terminal()
    monkeypatch.setattr(cli, "PREFILL_BAR_AFTER", 0)
    monkeypatch.setattr(sys, "stderr", terminal)
    request = cli.run_and_report(llm, list(range(1, 41)), SamplingParams(max_tokens=4), verbose=False)
    assert len(request.output_ids) == 4
    drawn = terminal.getvalue().split("\r")
    assert re.match(r"prefill: +0%\|.*\| 0/40 \[00:00<\?, \?tok/s\]", drawn[1])
    assert drawn[-2].strip() == drawn[-1] == ""  # cleared, so the reply's text starts on a clean line


def test_a_hybrid_generates_mlx_lms_text_and_its_chat_turns_reuse_the_one_before(tmp_path):
    path = make_checkpoint(tmp_path / "qwen3_5", "qwen3_5", shape={**BASE, **HYBRIDS["qwen3_5"]})
    _, tokenizer = mlx_lm_load(str(path))
    expected = mlx_lm_text(tokenizer, mlx_lm_greedy(path, tokenizer.encode(PROMPT), max_tokens=12))
    result = runner.invoke(app, ["generate", "--model", str(path), "--prompt", PROMPT, "-m", "12", "--page-size", "4"])
    assert result.exit_code == 0, result.output
    assert generated_text(result.stdout) == expected
    kv_line = result.stdout.strip().splitlines()[-1]
    assert re.search(r", recurrent state 1/1 sequences of 0\.04 MiB, 1 kept for prefix hits \(pool", kv_line), kv_line
    chat = runner.invoke(
        app,
        ["chat", "--model", str(path), "--temp", "0", "-m", "6", "--page-size", "4", "--verbose"],
        input=f"{PROMPT} over the lazy dog\nbrown fox\n",
    )
    assert chat.exit_code == 0, chat.output
    reused = [int(n) for n in re.findall(r"prefix cache: (\d+) of \d+ prompt tokens reused", chat.stdout)]
    assert len(reused) == 2 and reused[0] == 0 and reused[1] > 0, chat.stdout


@pytest.fixture(scope="module")
def seeing(tmp_path_factory):
    """A tiny Qwen3-VL checkpoint and a picture for it, as files."""
    pytest.importorskip("mlx_vlm")
    import numpy as np
    from PIL import Image

    from mlxkv.models.random_vision_model import make_vision_checkpoint

    folder = tmp_path_factory.mktemp("seeing")
    picture = folder / "cat.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(picture)
    return make_vision_checkpoint(folder / "qwen3-vl", "qwen3_vl"), picture


def test_generate_and_chat_read_an_image_file(seeing):
    from mlxkv import ImagePrompt

    path, picture = seeing
    llm = LLM(str(path))
    content = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    (expected,) = llm.generate(ImagePrompt(text, [str(picture)]), greedy, continuation=False)
    flags = ["--model", str(path), "--temp", "0", "-m", "6"]
    result = runner.invoke(app, ["generate", *flags, "--image", str(picture), "--prompt", "What is this?"])
    assert result.exit_code == 0, result.output
    assert generated_text(result.stdout) == expected.text
    result = runner.invoke(app, ["chat", *flags], input=f"/image {picture}\nWhat is this?\n/image nowhere.png\n")
    assert result.exit_code == 0, result.output
    assert (
        "/image PATH attaches an image" in result.stdout and "[1 image attached to your next message]" in result.stdout
    )
    assert expected.text in result.stdout
    assert "error: /image: cannot read 'nowhere.png' (No such file or directory)" in result.output


def test_generate_refuses_an_image_for_a_text_model_in_one_line(checkpoint, tmp_path):
    picture = tmp_path / "cat.png"
    picture.write_bytes(b"\x89PNG")
    result = runner.invoke(
        app, ["generate", "--model", str(checkpoint("llama-fp32")), "--image", str(picture), "-m", "2"]
    )
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == "error: image content (--image) is not supported by this model"
