import gc
import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import SPECS
from helpers import (
    MAX_TOKENS,
    ExplodingSampler,
    mlx_lm_generate,
    mlx_lm_greedy,
    mlx_lm_quantized_greedy,
    mlx_lm_text,
)
from mlx_lm import load as mlx_lm_load

from mlxkv import LLM, ModelLoadError, RequestFailed, RequestTooLong, SamplingParams
from mlxkv.engine.sampling.sampler import TokenSampler

PROMPTS = [list(range(5, 8)), list(range(10, 27)), list(range(30, 70))]


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_tokens_equal_mlx_lm_alone_and_batched(checkpoint, name, layout):
    path = checkpoint(name)
    expected = [mlx_lm_greedy(path, p) for p in PROMPTS]
    llm = LLM(str(path), kv_layout=layout, page_size=16, max_num_seqs=4, max_num_batched_tokens=32)
    batched = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    alone = [llm.generate(p, SamplingParams(max_tokens=MAX_TOKENS))[0] for p in PROMPTS]
    assert [c.token_ids for c in batched] == expected
    assert [c.token_ids for c in alone] == expected
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity


NEAR_TIE = {8: 0.05, 4: 0.3}  # log-probability gap under which a divergence from mlx-lm is allowed
LONG_PROMPT = [int(t) for t in np.random.default_rng(3).integers(1, 320, 100)]


def assert_equal_up_to_a_near_tie(ours, theirs, gaps, bits):
    """Equal tokens, or equal up to a step where mlx-lm's own top two were within `NEAR_TIE`."""
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if step is None:
        assert ours == theirs
    else:
        assert gaps[step] <= NEAR_TIE[bits], (
            f"step {step}: {ours[step]} != mlx-lm's {theirs[step]}, whose top two are {gaps[step]:.3f} apart"
        )


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("name", ["llama-fp32-d64", "qwen3-fp32-d64"])
def test_quantized_pages_give_mlx_lm_quantized_kv_tokens_alone_and_batched(checkpoint, name, layout, bits):
    """mlx-lm's `kv_bits` generation, prompt by prompt. Where mlxkv's prompt tokens attend
    quantized K/V and mlx-lm's do not, tokens may differ at a near-tie: after a prefix-cache
    hit (the paged prompts run alone reuse full pages of the batched run), and in the tail
    of the 100-token prompt, longer than the span one step computes (64 - 3 tokens)."""
    path = checkpoint(name)
    prompts = PROMPTS + [LONG_PROMPT]
    expected = [mlx_lm_quantized_greedy(path, p, bits) for p in prompts]
    llm = LLM(str(path), kv_layout=layout, max_num_seqs=4, max_num_batched_tokens=64, kv_bits=bits)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    batched = llm.generate(prompts, params)
    alone = [llm.generate(p, params)[0] for p in prompts]
    for completion, (tokens, gaps) in zip(batched + alone, expected + expected):
        assert_equal_up_to_a_near_tie(completion.token_ids, tokens, gaps, bits)
    assert [c.num_cached_tokens for c in alone] == ([0, 16, 32, 96] if layout == "paged" else [0] * 4)
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity


def test_results_come_back_in_prompt_order_with_per_prompt_params(checkpoint):
    llm = LLM(str(checkpoint("llama-fp32")), max_num_seqs=2)
    params = [SamplingParams(max_tokens=n) for n in (7, 3, 5)]
    out = llm.generate(PROMPTS, params)
    assert [len(c.token_ids) for c in out] == [7, 3, 5]
    assert [c.finish_reason for c in out] == ["length"] * 3
    assert [c.prompt_token_ids for c in out] == PROMPTS


def test_text_prompts_stream_the_same_text_generate_returns(checkpoint):
    llm = LLM(str(checkpoint("qwen3-bf16")))
    params = SamplingParams(max_tokens=12)
    (completion,) = llm.generate(["The quick brown fox"], params)
    assert "".join(llm.stream("The quick brown fox", params)) == completion.text
    assert completion.text == mlx_lm_text(llm.tokenizer, completion.token_ids)


def test_prefill_counts_the_prompt_chunk_by_chunk_and_the_text_is_unchanged(checkpoint):
    llm = LLM(str(checkpoint("llama-fp32")), max_num_batched_tokens=16)
    prompt = list(range(1, 41))
    params = SamplingParams(max_tokens=8)
    stream = llm.stream(prompt, params)
    assert list(stream.prefill()) == [16, 32, 40]
    assert list(stream.prefill()) == []
    assert "".join(stream) == llm.generate([prompt], params)[0].text


def test_stop_string_ends_the_text_before_it(checkpoint):
    llm = LLM(str(checkpoint("qwen3-bf16")))
    full = llm.generate(PROMPTS[1], SamplingParams(max_tokens=20))[0].text
    stop = full[5:8]
    cut = llm.generate(PROMPTS[1], SamplingParams(max_tokens=20, stop=[stop]))[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop"
    assert "".join(llm.stream(PROMPTS[1], SamplingParams(max_tokens=20, stop=[stop]))) == cut.text


def test_seeded_sampling_is_reproducible_in_any_batch(checkpoint):
    llm = LLM(str(checkpoint("llama-fp32")), max_num_seqs=4)
    params = SamplingParams(max_tokens=15, temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, seed=7)
    alone = llm.generate(PROMPTS[0], params)[0].token_ids
    batched = llm.generate([PROMPTS[2], PROMPTS[0]], [SamplingParams(max_tokens=9, temperature=0.8), params])
    assert batched[1].token_ids == alone
    other = llm.generate(PROMPTS[0], SamplingParams(max_tokens=15, temperature=1.0, seed=8))[0].token_ids
    assert other != alone


def test_breaking_out_of_a_stream_frees_its_pages(checkpoint):
    llm = LLM(str(checkpoint("llama-fp32")))
    stream = llm.stream(PROMPTS[2], SamplingParams(max_tokens=50))
    next(iter(stream))
    assert llm.engine.cache.free_pages < llm.engine.cache.pool.capacity
    stream.close()
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity
    assert stream.request.finish_reason == "abort"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), r"temperature must be a number >= 0, got -1.0"),
        (dict(top_p=0.0), r"top_p must be a number in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be a number in \(0, 1\], got 1.5"),
        (dict(max_tokens=0), "max_tokens must be a positive integer, got 0"),
        (dict(top_k=-2), r"top_k must be an integer >= 0"),
        (dict(min_p=1.0), r"min_p must be a number in \[0, 1\)"),
    ],
)
def test_invalid_sampling_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_the_cache_can_never_hold_is_refused_and_nothing_is_held(checkpoint):
    llm = LLM(str(checkpoint("llama-fp32")), num_pages=4, page_size=16)
    with pytest.raises(
        RequestTooLong,
        match=r"prompt of 60 tokens plus max_tokens=10 makes 70 tokens; "
        r"one request can have at most 64",
    ):
        llm.generate([PROMPTS[0], list(range(60))], SamplingParams(max_tokens=10))
    assert llm.engine.cache.free_pages == 4
    assert not llm.engine.has_unfinished()
    assert len(llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))[0].token_ids) == 4


def test_a_text_too_long_for_the_model_is_refused_in_our_words_alone():
    # A fresh process: transformers warns once per tokenizer, and the demo model's says 2,048 tokens.
    code = """
from mlxkv import LLM, RequestTooLong
try:
    LLM().generate("def f(x): return x " * 300)
except RequestTooLong as exc:
    print(exc)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.endswith("one request can have at most 2048\n")
    assert done.stderr == ""


def test_bad_prompts_are_named(checkpoint):
    llm = LLM(str(checkpoint("llama-fp32")))
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 320\), got \[999\]"):
        llm.generate([[1, 999]])
    with pytest.raises(ValueError, match="got 2 prompts but 1 SamplingParams"):
        llm.generate(PROMPTS[:2], [SamplingParams()])
    with pytest.raises(TypeError, match="params must be SamplingParams, got str"):
        llm.generate(PROMPTS[0], "greedy")  # not a sequence of nine one-letter params
    assert not llm.engine.has_unfinished()


def test_model_loading_errors_are_specific(tmp_path, checkpoint):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt7"}')
    with pytest.raises(
        ModelLoadError, match=r"unsupported model_type 'gpt7' in .*: mlx-lm \S+ has no such model family"
    ):
        LLM(str(tmp_path))
    for model_type, layers in (
        (
            "iquestloopcoder",
            "a loop that runs every layer twice, the second pass attending the first pass's keys and values",
        ),
        (
            "afm7",
            "KV-reuse layers (its last layers attend the keys and values the decoder reads back from another's cache)",
        ),
        ("falcon_h1", "layers that run a Mamba mixer and attention side by side, on one cache of both"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        with pytest.raises(ModelLoadError) as refused:
            LLM(str(tmp_path))
        assert str(refused.value) == (
            f"unsupported model_type {model_type!r} in {str(tmp_path / 'config.json')!r}: it uses {layers}, "
            "not supported yet"
        )


def test_unknown_layout_is_a_clear_error(checkpoint):
    with pytest.raises(ValueError, match="kv_layout must be 'paged' or 'contiguous', got 'ragged'"):
        LLM(str(checkpoint("llama-fp32")), kv_layout="ragged")


def test_a_model_handed_to_mlxkv_still_runs_under_mlx_lm(checkpoint):
    path = checkpoint("qwen2-fp32")
    model, tokenizer = mlx_lm_load(str(path))
    ours = LLM((model, tokenizer)).generate(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS))[0].token_ids
    theirs = [
        int(t)
        for t, _ in mlx_lm_generate.generate_step(
            mx.array(PROMPTS[1]), model, max_tokens=MAX_TOKENS, sampler=lambda x: mx.argmax(x, axis=-1)
        )
    ]
    assert ours == theirs[: len(ours)] == mlx_lm_greedy(path, PROMPTS[1])


def test_forcing_metal_where_there_is_none_is_a_clear_error(checkpoint):
    with pytest.raises(ValueError, match="attention='metal' but Metal is not available"):
        LLM(str(checkpoint("llama-fp32")), attention="metal")


def test_two_streams_and_generate_share_the_engine_without_losing_text(checkpoint):
    llm = LLM(str(checkpoint("llama-fp32")))
    params = SamplingParams(max_tokens=12)
    expected = [c.text for c in llm.generate(PROMPTS, params)]
    first, second = llm.stream(PROMPTS[0], params), llm.stream(PROMPTS[1], params)
    text = {0: next(first), 1: ""}
    for delta in second:
        text[1] += delta
    [completion] = llm.generate(PROMPTS[2], params)
    text[0] += "".join(first)
    assert [text[0], text[1], completion.text] == expected
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity


def test_a_stream_never_iterated_is_aborted_when_dropped(checkpoint):
    llm = LLM(str(checkpoint("llama-fp32")))
    stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=50))
    request = stream.request
    del stream
    gc.collect()
    assert request.finish_reason == "abort"
    assert not llm.engine.has_unfinished()
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity


def test_a_failed_request_raises_in_its_own_consumer_only(checkpoint, monkeypatch):
    llm = LLM(str(checkpoint("llama-fp32")))
    params = SamplingParams(max_tokens=6)
    expected = llm.generate(PROMPTS[1], params)[0].text
    bad, good = llm.stream(PROMPTS[0], params), llm.stream(PROMPTS[1], params)
    bad.request.sampler = ExplodingSampler(SamplingParams(temperature=1.0))
    assert "".join(good) == expected
    with pytest.raises(RequestFailed, match=r"request '\d+' failed: sampler exploded"):
        next(bad)
    original = TokenSampler.key
    monkeypatch.setattr(
        TokenSampler,
        "key",
        lambda self, index: (
            ExplodingSampler.key(self, index) if self.params.temperature == 0.5 else original(self, index)
        ),
    )
    with pytest.raises(RequestFailed, match="sampler exploded"):
        llm.generate([PROMPTS[0], PROMPTS[2]], [params, SamplingParams(max_tokens=6, temperature=0.5)])
    assert llm.engine.cache.free_pages == llm.engine.cache.pool.capacity


def test_a_vanishing_temperature_is_greedy_not_token_zero(checkpoint):
    llm = LLM(str(checkpoint("llama-fp32")))
    greedy = llm.generate(PROMPTS[1], SamplingParams(max_tokens=8))[0].token_ids
    assert llm.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=1e-300))[0].token_ids == greedy
    assert greedy != [0] * 8


def test_numpy_token_ids_are_prompts(checkpoint):
    llm = LLM(str(checkpoint("llama-fp32")))
    expected = llm.generate(PROMPTS[1], SamplingParams(max_tokens=6))[0].token_ids
    for prompt in (np.array(PROMPTS[1]), [np.int64(t) for t in PROMPTS[1]]):
        assert llm.generate(prompt, SamplingParams(max_tokens=6))[0].token_ids == expected
    assert [c.token_ids for c in llm.generate(np.array([PROMPTS[1]] * 2), SamplingParams(max_tokens=6))] == [
        expected
    ] * 2
