import random

import pytest
from helpers import BASE, GEMMA4, HYBRIDS, drafts_always_pay, perturbed_copy

from mlxkv import LLM, EngineConfig, LLMEngine, SamplingParams
from mlxkv.engine.speculative.speculation import Speculation, accepted_prefix
from mlxkv.models.loading import load
from mlxkv.models.random_model import make_checkpoint


@pytest.fixture(scope="module")
def model(checkpoint):
    return load(checkpoint("llama-fp32"))


@pytest.fixture(scope="module")
def draft(checkpoint, tmp_path_factory):
    """A draft model that mostly agrees with the model: its weights, moved a little."""
    return str(perturbed_copy(checkpoint("llama-fp32"), tmp_path_factory.mktemp("draft"), scale=0.1))


@pytest.fixture(params=["prompt-lookup", "draft-model"])
def drafter(request, draft):
    """The engine settings of each drafter."""
    return dict(prompt_lookup=True) if request.param == "prompt-lookup" else dict(draft_model=draft)


@pytest.fixture(scope="module")
def prompts():
    """Prompts that repeat themselves, and which the random model continues in loops: prompt lookup
    finds drafts in both, and the model accepts many and rejects some."""
    rng = random.Random(0)
    prompts = []
    for _ in range(8):
        motif = [rng.randrange(3, 320) for _ in range(rng.randint(3, 8))]
        prompts.append((motif * 4 + [rng.randrange(3, 320) for _ in range(rng.randint(0, 6))])[: rng.randint(9, 40)])
    return prompts


def generate(model, prompts, params, **config):
    """Each request's tokens, and what speculation did (None without it)."""
    llm = LLM(model, max_num_seqs=4, max_model_len=256, page_size=4, **config)
    drafts_always_pay(llm.engine)
    outputs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats.running == stats.waiting == 0 and stats.kv.pages_used == 0
    return [o.token_ids for o in outputs], stats.speculation


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=7)],
    ids=["greedy", "seeded"],
)
def test_speculation_changes_no_token(model, prompts, drafter, layout, params):
    expected, _ = generate(model, prompts, params, kv_layout=layout)
    got, stats = generate(model, prompts, params, kv_layout=layout, **drafter)
    assert got == expected
    assert 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize(
    "name, config",
    [
        ("llama-fp32", dict(num_pages=20, max_num_batched_tokens=32)),  # preempts
        ("llama-fp32-d64", dict(kv_bits=8, kv_group_size=32)),
        ("llama-fp32", dict(pipeline=False)),
        ("llama-fp32", dict(num_draft_tokens=1)),
    ],
    ids=["preemption", "quantized", "unpipelined", "one-draft-token"],
)
def test_speculation_changes_no_token_in_any_engine(checkpoint, prompts, drafter, name, config):
    model, params = load(checkpoint(name)), SamplingParams(max_tokens=30)
    if "draft_model" in drafter and name != "llama-fp32":
        drafter = dict(draft_model=str(checkpoint(name)))  # the model drafting for itself
    expected, _ = generate(model, prompts, params, **config)
    got, stats = generate(model, prompts, params, **drafter, **config)
    assert got == expected
    assert stats.accepted > 0


@pytest.mark.parametrize(
    "model_type, shape",
    [
        ("llama", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)),
        ("gemma4_text", GEMMA4),
    ],
    ids=["sliding-window", "gemma4-kv-shared"],
)
def test_windowed_and_kv_shared_layers_rewind_alike(tmp_path, prompts, model_type, shape):
    path = make_checkpoint(tmp_path / "model", model_type, shape={**BASE, **shape}, max_position_embeddings=256)
    drafts = str(perturbed_copy(path, tmp_path / "draft", scale=0.1))  # windows in the draft's cache too
    model, params = load(path), SamplingParams(max_tokens=30)
    expected, _ = generate(model, prompts, params)
    for drafter in (dict(prompt_lookup=True), dict(draft_model=drafts)):
        got, stats = generate(model, prompts, params, **drafter)
        assert got == expected
    assert 0 < stats.accepted < stats.drafted  # the draft model's, rejections included


def test_log_probabilities_of_accepted_drafts_are_the_models(model, prompts, drafter):
    def scores(config):
        engine = LLMEngine(*model, EngineConfig(max_num_seqs=4, max_model_len=256, page_size=4, **config))
        requests = [engine.add_request(p, SamplingParams(max_tokens=20, logprobs=2)) for p in prompts[:4]]
        found: dict[str, list] = {r.request_id: [] for r in requests}
        while engine.has_unfinished():
            for output in engine.step():
                found[output.request_id] += output.logprobs
        return [[(s.token, s.logprob, [t for t, _ in s.top]) for s in found[r.request_id]] for r in requests]

    expected, got = scores({}), scores(drafter)
    assert [[(t, top) for t, _, top in row] for row in got] == [[(t, top) for t, _, top in row] for row in expected]
    flat = [[v for row in rows for _, v, _ in row] for rows in (got, expected)]
    assert flat[0] == pytest.approx(flat[1], abs=1e-4)


def test_stop_strings_eos_and_max_tokens_inside_accepted_drafts(checkpoint, prompts, drafter):
    model = load(checkpoint("llama-fp32"))  # its own tokenizer, given one more EOS token below
    llm = LLM(model, max_num_seqs=4, max_model_len=256, page_size=4)
    long = llm.generate(prompts, SamplingParams(max_tokens=40))
    stops = [o.text[len(o.text) // 2 : len(o.text) // 2 + 2] or "x" for o in long]
    eos = long[0].token_ids[20]
    cases = [SamplingParams(max_tokens=40, stop=stop) for stop in stops] + [SamplingParams(max_tokens=13)]
    for engine_config in ({}, drafter):
        speculating = LLM(model, max_num_seqs=4, max_model_len=256, page_size=4, **engine_config)
        speculating.engine.tokenizer.add_eos_token(eos)
        outputs = [(o.text, o.finish_reason, o.token_ids) for o in speculating.generate(prompts + prompts[:1], cases)]
        if not engine_config:
            expected = outputs
    assert outputs == expected
    assert outputs[0][2] == long[0].token_ids[: long[0].token_ids.index(eos)]  # EOS ended the loop early


def test_a_prefix_hit_and_an_abort_mid_draft_leave_the_rest_alone(model, prompts, drafter):
    params = SamplingParams(max_tokens=40)
    expected, _ = generate(model, prompts, params)
    engine = LLMEngine(*model, EngineConfig(max_num_seqs=8, max_model_len=256, page_size=4, **drafter))
    drafts_always_pay(engine)
    for _ in range(2):  # the second round starts from the first's cached pages
        requests = [engine.add_request(p, params) for p in prompts]
        for _ in range(8):
            engine.step()
        victim = requests[3]
        engine.abort(victim.request_id)
        while engine.has_unfinished():
            engine.step()
        assert victim.finish_reason == "abort"
        assert [r.output_ids for i, r in enumerate(requests) if i != 3] == expected[:3] + expected[4:]
    assert engine.cache.pool.used_count == 0
    assert engine.stats().prefix_cache.cached_tokens > 0 and engine.stats().speculation.accepted > 0


def test_a_drafter_that_fails_costs_its_drafts_and_no_request(model, prompts, drafter, monkeypatch, caplog):
    params = SamplingParams(max_tokens=30)
    expected, _ = generate(model, prompts, params)
    llm = LLM(model, max_num_seqs=4, max_model_len=256, page_size=4, **drafter)
    drafts_always_pay(llm.engine)
    drafts, calls = llm.engine.speculator.drafter, []

    def every_third_fails(requests, lengths):
        calls.append(len(requests))
        if len(calls) % 3 == 0:
            raise RuntimeError("out of memory")
        return type(drafts).propose(drafts, requests, lengths)

    monkeypatch.setattr(drafts, "propose", every_third_fails)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert len(calls) >= 3 and "drafting failed (out of memory); this step runs without draft tokens" in caplog.text
    assert llm.stats().kv.pages_used == 0 and llm.stats().speculation.accepted > 0


def test_structured_output_holds_draft_tokens_to_its_grammar(model, prompts, drafter):
    params = SamplingParams(max_tokens=24, regex="(ab|cd){8,12}[0-9]{3}")  # long enough to draft
    expected, _ = generate(model, prompts[:4], params)
    got, stats = generate(model, prompts[:4], params, **drafter)
    assert got == expected
    assert stats.drafted > 0


def test_a_model_with_recurrent_layers_neither_speculates_nor_drafts(model, tmp_path):
    name = sorted(HYBRIDS)[0]
    path = make_checkpoint(tmp_path, name, shape={**BASE, **HYBRIDS[name]})
    with pytest.raises(ValueError, match=r"speculative decoding \(prompt_lookup\) needs .* recurrent layers"):
        LLM(load(path), prompt_lookup=True, max_model_len=64)
    with pytest.raises(ValueError, match=rf"draft_model='{path}' has recurrent layers"):
        LLM(model, draft_model=str(path), max_model_len=64)


def test_a_draft_model_that_cannot_serve_is_refused_by_name(model, tmp_path):
    with pytest.raises(ValueError, match="draft_model='/nowhere': "):
        LLM(model, draft_model="/nowhere", max_model_len=64)
    other = make_checkpoint(tmp_path, "llama", shape={**BASE, "vocab_size": 400})
    with pytest.raises(ValueError, match=r"tokenizer of \d+ tokens, the model's has 320: a draft model must"):
        LLM(model, draft_model=str(other), max_model_len=64)
    with pytest.raises(ValueError, match="give prompt_lookup or draft_model, not both"):
        EngineConfig(prompt_lookup=True, draft_model=str(other))


def test_drafts_are_accepted_up_to_the_first_the_model_would_not_draw():
    assert accepted_prefix([5, 6, 7], [5, 6, 8, 9]) == 2
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 9]) == 3
    assert accepted_prefix([5], [4, 5]) == 0


def test_a_request_drafts_while_its_acceptance_beats_the_share_of_the_step():
    speculation = Speculation(rate=0.6)
    assert speculation.length(most=8, share=0.3) == 2  # 0.6 and 0.36 beat 0.3; 0.216 does not
    assert speculation.length(most=1, share=0.0) == 1
    speculation.record(drafted=3, accepted=1)  # one success and one failure: 0.5 this time
    assert speculation.rate == pytest.approx(0.6 + 0.3 * (0.5 - 0.6))
    assert (speculation.drafted, speculation.accepted) == (3, 1)


def test_a_request_whose_drafts_do_not_pay_rests_twice_as_long_each_time():
    speculation, rests = Speculation(), []
    for _ in range(4):
        assert speculation.length(most=4, share=0.9) == 0  # stops paying
        rest = 0
        while speculation.length(most=4, share=0.0) == 0:
            rest += 1
        rests.append(rest)
        speculation.record(drafted=4, accepted=0)  # the fresh trial fails
    assert rests == [1, 2, 4, 8]
    speculation.record(drafted=4, accepted=2)
    speculation.length(most=4, share=0.9)
    assert speculation.rest == 1  # a success starts the rests afresh
