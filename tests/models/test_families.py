"""Every supported family: greedy tokens equal mlx-lm's own, in both layouts, alone and batched."""

import threading

import mlx.core as mx
import numpy as np
import pytest
from helpers import BASE, FAMILIES, WINDOW, family_checkpoint, mlx_lm_greedy

from mlxkv import LLM, LLMEngine, SamplingParams
from mlxkv.attention.kernels import PagedAttentionKernels
from mlxkv.attention.lab.simulator import metal_kernel
from mlxkv.config import EngineConfig
from mlxkv.engine.request import NO_SEQUENCE
from mlxkv.models.loading import SUPPORTED_MODEL_TYPES, load
from mlxkv.models.random_model import make_checkpoint

PROMPTS = [[int(t) for t in np.random.default_rng(n).integers(1, 320, n)] for n in (3, 7, 8, 9, 17, 30)]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            built[name] = family_checkpoint(tmp_path_factory.mktemp(name), name)
        return built[name]

    return get


def test_every_supported_model_type_is_covered():
    assert set(SUPPORTED_MODEL_TYPES) <= {FAMILIES[n].get("model_type", n) for n in FAMILIES}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_equal_mlx_lm_in_both_layouts_alone_and_batched(family, name):
    path = family(name)
    expected = [mlx_lm_greedy(path, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for layout in ("paged", "contiguous"):
        llm = LLM(str(path), kv_layout=layout, page_size=4, max_num_seqs=6, max_num_batched_tokens=24)
        batched = llm.generate(PROMPTS, params)
        alone = [llm.generate(p, params)[0] for p in PROMPTS]
        for completions in (batched, alone):
            assert [c.token_ids[: len(e)] for c, e in zip(completions, expected)] == expected, layout


def on_new_thread(function):
    """`function()` run on a thread of its own, which MLX's streams are per."""
    result = {}

    def run():
        try:
            result["value"] = function()
        except Exception as exc:  # handed to the caller
            result["error"] = exc
        finally:
            mx.clear_streams()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_an_engine_built_on_one_thread_runs_on_any_other(family, name):
    """`LLM` built here, then every step run on a new thread (as `serve` steps its engine on
    AsyncLLM's thread): nothing made lazily at load (RoPE tables, recurrent state) stays tied
    to the building thread, and the tokens are those of one thread, sampled and greedy."""
    path = family(name)
    params = [SamplingParams(max_tokens=8, ignore_eos=True), SamplingParams(max_tokens=8, temperature=1.0, seed=5)]
    expected = [c.token_ids for c in LLM(str(path), page_size=4).generate(PROMPTS[4:6], params)]
    engine = LLM(str(path), page_size=4).engine
    requests = [engine.add_request(p, q) for p, q in zip(PROMPTS[4:6], params)]
    while engine.has_unfinished():
        on_new_thread(engine.step)
    assert [list(r.output_ids) for r in requests] == expected


@pytest.mark.parametrize("name", ["llama", "gemma2", "gemma3_text", "gpt_oss", "gemma4_text"])
def test_attention_variants_through_the_simulated_kernels(family, name):
    """Plain, soft-capped (Gemma 2), windowed (Gemma 3), windowed with sinks (GPT-OSS), and
    layers of two head dims, some reading another layer's pages (Gemma 4)."""
    path = family(name)
    model, tokenizer = load(str(path))
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(page_size=4, max_num_seqs=2, max_num_batched_tokens=16),
        kernels=PagedAttentionKernels(metal_kernel),
    )
    prompts = [PROMPTS[3], PROMPTS[4][:12]]
    requests = [engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in requests] == [mlx_lm_greedy(path, p, max_tokens=4) for p in prompts]
    mx.clear_cache()


GEMMA3 = dict(
    BASE,
    num_hidden_layers=6,
    query_pre_attn_scalar=64,
    sliding_window=32,
    sliding_window_pattern=6,
    rope_theta=1e6,
    rope_local_base_freq=1e4,
)  # 5 local layers, then a global one


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_local_layers_hold_only_their_window_over_1000_tokens(tmp_path, layout):
    """Two 1,000-token Gemma-3-shaped sequences: after every step each one holds at most
    32 / 16 + 1 pages in the five window-32 layers, the global layer holds them all, and the
    tokens are mlx-lm's own (its local layers keep a rotating 32-token cache)."""
    path = make_checkpoint(tmp_path / "gemma3", "gemma3_text", "float32", shape=GEMMA3, max_position_embeddings=2048)
    model, tokenizer = load(str(path))
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(kv_layout=layout, page_size=16, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=1024),
    )
    prompts = [PROMPTS[5], PROMPTS[4]]
    requests = [engine.add_request(p, SamplingParams(max_tokens=1000 - len(p), ignore_eos=True)) for p in prompts]
    most = 0
    while engine.has_unfinished():
        engine.step()
        if layout == "paged":
            group = engine.cache.windowed[32]
            most = max([most] + [len(group.pool.pages(r.seq_id)) for r in requests if r.seq_id != NO_SEQUENCE])
    assert [len(r.prompt_ids) + len(r.output_ids) for r in requests] == [1000, 1000]
    if layout == "paged":
        assert most == 3
        assert engine.cache.windowed[32].layers == [0, 1, 2, 3, 4] and engine.cache.storage.num_layers == 1
    expected = [mlx_lm_greedy(path, p, max_tokens=300) for p in prompts]  # up to EOS, which mlxkv ignores here
    assert [r.output_ids[: len(e)] for r, e in zip(requests, expected)] == expected and min(map(len, expected)) > 90


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("name", ["qwen3_5", "lfm2", "granitemoehybrid", "nemotron_h", "gemma4_text"])
def test_hybrids_batched_8_at_a_time_through_preemption_free_every_page_and_state(family, name, layout):
    """Eight prompts of different lengths at once, in a pool too small for all of them: requests
    are preempted and recompute their state (Gemma 4: its pages) from the prompt, and every
    request's greedy tokens still equal mlx-lm's; afterwards no page and no recurrent state is held."""
    path = family(name)
    prompts = [
        [int(t) for t in np.random.default_rng(40 + n).integers(1, 320, n)] for n in (5, 33, 1, 12, 26, 2, 19, 40)
    ]
    expected = [mlx_lm_greedy(path, p, max_tokens=16) for p in prompts]
    pages = dict(num_pages=24) if layout == "paged" else dict(max_model_len=64)
    llm = LLM(str(path), kv_layout=layout, page_size=4, max_num_seqs=8, max_num_batched_tokens=32, **pages)
    done = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [c.token_ids[: len(e)] for c, e in zip(done, expected)] == expected
    stats = llm.stats()
    assert stats.preemptions > 0 or layout == "contiguous"  # a contiguous sequence holds its page from the start
    assert stats.kv.pages_used == 0 and stats.kv.states_used == 0
    assert stats.kv.states_total == (0 if name == "gemma4_text" else 8)
    assert all(usage.pages_used == 0 for _, usage in stats.kv.windowed)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_gemma4s_kv_shared_layers_hold_no_pages(family, layout):
    """Of the tiny Gemma 4's six layers, the last two read the pages of layers 3 (sliding) and 2
    (global): the cache holds pages for four layers, the global one's 128 wide where the sliding
    ones' are 64, and in the paged layout the three sliding layers hold only their window's."""
    llm = LLM(str(family("gemma4_text")), kv_layout=layout, page_size=4, max_num_seqs=2, max_model_len=64)
    cache = llm.engine.cache
    sliding, full = 2 * 2 * 64 * 4, 2 * 2 * 128 * 4  # K and V, 2 KV heads, float32
    if layout == "paged":
        group = cache.windowed[WINDOW]
        assert (group.layers, group.storage.head_dims, cache.storage.head_dims) == ([0, 1, 3], (64,) * 3, (128,))
        assert cache.storage.bytes_per_token == full and group.storage.bytes_per_token == 3 * sliding
    else:
        assert cache.storage.head_dims == (64, 64, 128, 64) and cache.storage.bytes_per_token == 3 * sliding + full
    assert cache.nbytes == cache.pool.capacity * cache.page_size * cache.storage.bytes_per_token + sum(
        g.pool.capacity * cache.page_size * g.storage.bytes_per_token for g in cache.windowed.values()
    )


@pytest.mark.parametrize("name", ["qwen3_5", "granitemoehybrid"])
def test_a_hybrid_chat_turn_resumes_from_the_previous_turns_kept_state(family, name):
    """The second turn's prompt starts with the first turn's prompt and reply: it reuses the pages
    up to the first prompt's snapshot point, starts its recurrent state from the state kept
    there, and gives the tokens of a cold run and of mlx-lm."""
    path = family(name)
    config = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    first = PROMPTS[5]  # 30 tokens: its state is kept after 28
    llm = LLM(str(path), **config)
    reply = llm.generate(first, SamplingParams(max_tokens=6, ignore_eos=True))[0]
    second = first + list(reply.token_ids) + [5, 6, 7]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    warm = llm.generate(second, params)[0]
    cold = LLM(str(path), **config).generate(second, params)[0]
    assert warm.num_cached_tokens == 28 and cold.num_cached_tokens == 0
    assert warm.token_ids == cold.token_ids
    expected = mlx_lm_greedy(path, second, max_tokens=8)
    assert list(warm.token_ids[: len(expected)]) == expected


@pytest.mark.parametrize("name", ["gemma2", "granite", "granitemoehybrid"])
def test_log_probabilities_are_the_models_after_its_final_soft_cap_or_scaling(family, name):
    """Gemma 2 soft-caps its final logits and Granite divides them by `logits_scaling`: greedy
    tokens are the same either way, but the log-probabilities (and what a temperature samples)
    are mlx-lm's only with them applied."""
    from mlx_lm import load as mlx_lm_load

    path = family(name)
    prompt = PROMPTS[3]
    engine = LLMEngine(*load(str(path)))
    engine.add_request(prompt, SamplingParams(max_tokens=1, logprobs=4))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    reference, _ = mlx_lm_load(str(path))
    out = reference(mx.array(prompt)[None])[0, -1]
    expected = (out - mx.logsumexp(out)).tolist()
    (first,) = [lp for o in outputs for lp in o.logprobs]
    assert [round(lp, 4) for _, lp in first.top] == [round(expected[t], 4) for t, _ in first.top]
