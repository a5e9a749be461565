"""Bad input through the API and the CLI: one clear line naming the argument, and nothing
disturbed (a normal request afterwards gets its reference tokens, every page free)."""

import math
import re

import numpy as np
import pytest
from helpers import mlx_lm_greedy
from typer.testing import CliRunner

from mlxkv import LLM, ModelLoadError, RequestTooLong, SamplingParams, UnknownSequenceError
from mlxkv.entrypoints.cli import app
from mlxkv.models.loading import load

NORMAL = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def setup(checkpoint):
    path = checkpoint("llama-fp32")
    loaded = load(path)
    llm = LLM(loaded, page_size=4, max_model_len=64)
    return llm, loaded, mlx_lm_greedy(path, NORMAL, max_tokens=8)


API = [
    (lambda llm, m: SamplingParams(seed=-1), ValueError, r"seed must be an integer in \[0, 2\*\*64\) or None, got -1"),
    (lambda llm, m: SamplingParams(seed=2**64), ValueError, r"seed must be an integer in \[0, 2\*\*64\)"),
    (lambda llm, m: SamplingParams(seed=1.5), ValueError, r"seed must be an integer .* got 1.5"),
    (lambda llm, m: SamplingParams(temperature=-1), ValueError, "temperature must be a number >= 0, got -1"),
    (lambda llm, m: SamplingParams(temperature=math.nan), ValueError, "temperature must be a number >= 0, got nan"),
    (lambda llm, m: SamplingParams(top_p=0), ValueError, r"top_p must be a number in \(0, 1\], got 0"),
    (lambda llm, m: SamplingParams(top_k=-1), ValueError, "top_k must be an integer >= 0"),
    (lambda llm, m: SamplingParams(min_p=1), ValueError, r"min_p must be a number in \[0, 1\), got 1"),
    (lambda llm, m: SamplingParams(max_tokens=0), ValueError, "max_tokens must be a positive integer, got 0"),
    (lambda llm, m: SamplingParams(max_tokens=True), ValueError, "max_tokens must be a positive integer, got True"),
    (lambda llm, m: SamplingParams(stop=5), ValueError, "stop must be a non-empty string or a list of them, got 5"),
    (lambda llm, m: SamplingParams(stop=[""]), ValueError, r"stop must be .* got \(''?,\)"),
    (lambda llm, m: SamplingParams(ignore_eos="no"), ValueError, "ignore_eos must be True or False, got 'no'"),
    (
        lambda llm, m: SamplingParams(logprobs=21),
        ValueError,
        r"logprobs must be an integer in \[0, 20\] or None, got 21",
    ),
    (
        lambda llm, m: llm.generate(b"abc"),
        TypeError,
        "prompts must be text, token ids, an ImagePrompt, or a list of those, got bytes",
    ),
    (
        lambda llm, m: llm.generate(5.0),
        TypeError,
        "prompts must be text, token ids, an ImagePrompt, or a list of those, got float",
    ),
    (lambda llm, m: llm.generate([[1.5, 2]]), TypeError, "prompt token ids must be integers, got 1.5"),
    (lambda llm, m: llm.generate([["5", "6"]]), TypeError, "prompt token ids must be integers, got '5'"),
    (lambda llm, m: llm.generate([[True, 2]]), TypeError, "prompt token ids must be integers, got True"),
    (
        lambda llm, m: llm.generate(np.array([[1.0, 2.0]])),
        TypeError,
        "a prompt array must be 1-D integer token ids, got 1-D float64",
    ),
    (lambda llm, m: llm.generate([[]]), ValueError, "prompt is empty"),
    (lambda llm, m: llm.generate(""), ValueError, "prompt is empty"),
    (lambda llm, m: llm.generate([[1, 999]]), ValueError, r"prompt token ids must be in \[0, 320\), got \[999\]"),
    (lambda llm, m: llm.generate([[-1]]), ValueError, r"prompt token ids must be in \[0, 320\), got \[-1\]"),
    (lambda llm, m: llm.generate([1, 2], [SamplingParams()] * 2), ValueError, "got 1 prompt but 2 SamplingParams"),
    (lambda llm, m: llm.generate([1, 2], 5), TypeError, "params must be SamplingParams, got int"),
    (
        lambda llm, m: llm.generate([7], SamplingParams(max_tokens=64)),
        RequestTooLong,
        "prompt of 1 token plus max_tokens=64 makes 65 tokens",
    ),
    (
        lambda llm, m: llm.generate([NORMAL, list(range(70))], SamplingParams(max_tokens=4)),
        RequestTooLong,
        "prompt of 70 tokens plus max_tokens=4 makes 74 tokens; one request can have at most 64",
    ),
    (lambda llm, m: llm.stream(list(range(60)), SamplingParams(max_tokens=10)), RequestTooLong, "makes 70 tokens"),
    (lambda llm, m: llm.engine.abort("nope"), UnknownSequenceError, "unknown sequence id 'nope'"),
    (
        lambda llm, m: llm.engine.add_request([1], request_id=1.5),
        TypeError,
        "request_id must be a string or an integer, got float",
    ),
    (lambda llm, m: LLM(m, kv_layout="dense"), ValueError, "kv_layout must be 'paged' or 'contiguous', got 'dense'"),
    (lambda llm, m: LLM(m, page_size=None), ValueError, "page_size must be a positive integer, got None"),
    (lambda llm, m: LLM(m, max_num_seqs=-1), ValueError, "max_num_seqs must be a positive integer, got -1"),
    (lambda llm, m: LLM(m, num_pages=0), ValueError, "num_pages must be a positive integer or None, got 0"),
    (lambda llm, m: LLM(m, max_model_len=2.5), ValueError, "max_model_len must be a positive integer or None, got 2.5"),
    (lambda llm, m: LLM(m, attention=5), ValueError, "attention must be 'metal', 'reference' or None, got 5"),
    (lambda llm, m: LLM(m, attention="cuda"), ValueError, "attention must be 'metal', 'reference' or None, got 'cuda'"),
    (lambda llm, m: LLM(m, kv_cache_memory="0.5"), ValueError, r"kv_cache_memory must be a size .* got '0.5'"),
    (
        lambda llm, m: LLM(m, kv_cache_memory="999999GB"),
        ValueError,
        r"kv_cache_memory=999999.0 GB asks for 999999.0 GB of KV cache, but at most [\d.]+ GB fits",
    ),
    (lambda llm, m: LLM(m, num_pages=10**12), ValueError, "num_pages=1000000000000 asks for .* of KV cache"),
    (lambda llm, m: LLM(m, kv_cache_fraction=2), ValueError, r"kv_cache_fraction must be a number in \(0, 1\]"),
    (lambda llm, m: LLM(m, prefix_caching="yes"), ValueError, "prefix_caching must be True or False, got 'yes'"),
    (lambda llm, m: llm.generate(NORMAL, cache_salt=""), ValueError, "cache_salt must be None or a non-empty string"),
    (
        lambda llm, m: llm.stream(NORMAL, cache_salt=7),
        ValueError,
        "cache_salt must be None or a non-empty string, got 7",
    ),
    (lambda llm, m: LLM(m, kv_layout="contiguous", num_pages=4), ValueError, "num_pages applies to the paged layout"),
    (lambda llm, m: LLM(5), ModelLoadError, "model must be a checkpoint directory or a Hugging Face repo id, got int"),
    (lambda llm, m: LLM("/nonexistent/model"), ModelLoadError, "model path '/nonexistent/model' does not exist"),
]


@pytest.mark.parametrize("call, error, message", API, ids=[f"api-{i}" for i in range(len(API))])
def test_bad_api_input_is_one_clear_line_and_disturbs_nothing(setup, call, error, message):
    llm, loaded, reference = setup
    with pytest.raises(error, match=message) as raised:
        call(llm, loaded)
    assert "\n" not in str(raised.value)
    assert llm.generate(NORMAL, SamplingParams(max_tokens=8))[0].token_ids == reference
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity
    assert not llm.engine.has_unfinished()


CLI = [
    (["--temp", "-1"], None, "--temperature/--temp must be a number >= 0, got -1.0"),
    (["--top-p", "1.5"], None, r"--top-p must be a number in \(0, 1\], got 1.5"),
    (["--seed", "-1"], None, r"--seed must be an integer in \[0, 2\*\*64\)"),
    (["--kv-layout", "dense"], None, "--kv-layout must be 'paged' or 'contiguous', got 'dense'"),
    (["--kv-cache-memory", "lots"], None, "--kv-cache-memory must be a size such as 2GB"),
    (["--kv-cache-memory", "0.5"], None, r"--kv-cache-memory must be a size .* got '0.5'"),
    (["--kv-cache-memory", "999999GB"], None, "--kv-cache-memory=999999.0 GB asks for 999999.0 GB of KV cache"),
    (["--num-pages", "100000000"], None, "--num-pages=100000000 asks for .* of KV cache, but at most"),
    (["--page-size", "0"], None, "--page-size must be a positive integer, got 0"),
    (["--max-num-seqs", "0"], None, "--max-num-seqs must be a positive integer, got 0"),
    (["--num-pages", "2", "--page-size", "4", "-m", "100"], None, "prompt of .* tokens plus --max-tokens=100"),
    (["--prompt", "-"], b"caf\xe9\xff", r"the prompt on stdin is not UTF-8 text \(invalid continuation byte"),
    (["--model", "/nonexistent/model"], None, "model path '/nonexistent/model' does not exist"),
]


@pytest.mark.parametrize("args, stdin, message", CLI, ids=[f"cli-{i}" for i in range(len(CLI))])
def test_bad_cli_input_is_one_clear_line_and_a_failing_exit(checkpoint, args, stdin, message):
    model = [] if "--model" in args else ["--model", str(checkpoint("llama-fp32"))]
    prompt = [] if "--prompt" in args else ["--prompt", "The quick"]
    result = CliRunner().invoke(app, ["generate", *model, *prompt, *args], input=stdin)
    assert result.exit_code == 1
    assert result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and re.search(message, line), line


def test_a_normal_cli_request_after_the_bad_ones_gets_its_reference_text(checkpoint):
    result = CliRunner().invoke(
        app, ["generate", "--model", str(checkpoint("llama-fp32")), "--prompt", "The quick", "-m", "8", "--no-verbose"]
    )
    assert result.exit_code == 0
    _, tokenizer = load(checkpoint("llama-fp32"))
    tokens = mlx_lm_greedy(checkpoint("llama-fp32"), tokenizer.encode("The quick"), max_tokens=8)
    assert result.stdout == tokenizer.decode(tokens) + "\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "99999"], r"Invalid value for '--port': .*65535"),
        (["--max-queue", "-1"], r"Invalid value for '--max-queue': .*greater than or equal to 0"),
    ],
)
def test_bad_serve_options_are_refused_before_anything_loads(args, message):
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 2 and re.search(message, result.stderr), result.stderr
    assert "Traceback" not in result.stderr and "loading" not in result.stderr
