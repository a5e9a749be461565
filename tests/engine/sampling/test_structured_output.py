"""Structured output in the engine: outputs held to a JSON schema, regex, choice or grammar, row by
row inside batched, pipelined steps."""

import json
import re

import jsonschema
import mlx.core as mx
import pytest

from mlxkv import LLM, EngineConfig, LLMEngine, SamplingParams
from mlxkv.models import load

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=16, max_model_len=512)


def constrained(seed, **constraint):
    return SamplingParams(max_tokens=120, temperature=0.9, seed=seed, **constraint)


def test_each_constraint_holds_in_a_batch_beside_free_rows(llm):
    """Sixteen requests in one batch, half constrained four ways, half free; the free ones give what
    they give alone."""
    kinds = [
        dict(json_schema=PERSON),
        dict(regex=r"[0-9]{3}-[a-z]{2}"),
        dict(choice=["yes", "no", "maybe not"]),
        dict(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]/'),
    ]
    params = [constrained(i, **kinds[i // 2 % 4]) if i % 2 == 0 else constrained(i) for i in range(16)]
    outputs = llm.generate(["The import statement"] * 16, params)
    for i in range(0, 16, 2):
        out = outputs[i]
        assert out.finish_reason == "stop", (i, out.text)
        kind = kinds[i // 2 % 4]
        if "json_schema" in kind:
            jsonschema.validate(json.loads(out.text), PERSON)
        elif "regex" in kind:
            assert re.fullmatch(kind["regex"], out.text)
        elif "choice" in kind:
            assert out.text in kind["choice"]
        else:
            assert re.fullmatch(r"\([0-9](\+[0-9])*\)", out.text)
    free = [llm.generate("The import statement", params[i])[0].text for i in (1, 3)]
    assert free == [outputs[1].text, outputs[3].text]


def test_a_constrained_output_is_the_same_alone_batched_and_after_preemption():
    """Same seed, same tokens: alone, beside fifteen others, and in a pool so small that
    requests are preempted and recomputed (the matcher keeps what it had read)."""
    prompt = "The import statement"
    alone = LLM(max_num_seqs=1).generate(prompt, constrained(7, json_schema=PERSON))[0]
    small = LLM(max_num_seqs=8, num_pages=40, page_size=4, max_model_len=160)
    batch = small.generate([prompt] * 8, [constrained(7, json_schema=PERSON)] + [constrained(i) for i in range(7)])
    assert small.stats().preemptions > 0
    assert batch[0].token_ids == alone.token_ids and batch[0].text == alone.text
    jsonschema.validate(json.loads(alone.text), PERSON)


@pytest.mark.parametrize("config", [dict(kv_bits=8), dict(pipeline=False), dict(kv_layout="contiguous")])
def test_constraints_hold_with_quantized_pages_unpipelined_and_contiguous(config):
    llm = LLM(max_num_seqs=4, **config)
    outputs = llm.generate(["The import", "A class"], [constrained(1, json_schema=PERSON), constrained(2)])
    jsonschema.validate(json.loads(outputs[0].text), PERSON)


def test_a_prefix_hit_changes_nothing_for_a_constrained_request(llm):
    prompt = "The import statement " * 8
    first = llm.generate(prompt, constrained(3, choice=["alpha", "beta", "gamma"]))[0]
    again = llm.generate(prompt, constrained(3, choice=["alpha", "beta", "gamma"]))[0]
    assert again.num_cached_tokens > 0 and again.text == first.text


def test_ignore_eos_still_ends_where_the_grammar_does(llm):
    out = llm.generate("x", SamplingParams(max_tokens=50, choice=["yes", "no"], ignore_eos=True))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_max_tokens_cuts_a_constrained_output_as_any_other(llm):
    out = llm.generate("x", SamplingParams(max_tokens=3, json_schema=PERSON))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_an_abort_mid_constraint_frees_the_request():
    model, tokenizer = load()
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=2))
    request = engine.add_request("The import", constrained(5, json_schema=PERSON))
    other = engine.add_request("The import", constrained(6))
    for _ in range(4):
        engine.step()
    engine.abort(request.request_id)
    while engine.has_unfinished():
        engine.step()
    assert other.finish_reason is not None and engine.cache.pages_in_use == 0


@pytest.mark.parametrize(
    "constraint, message",
    [
        (dict(json_schema={"type": "object", "if": {}}), r'json_schema cannot be used: Unimplemented keys: \["if"\]'),
        (dict(regex="a("), "(?s)regex cannot be used: .*unclosed group"),
        (dict(grammar="start: missing"), "(?s)grammar cannot be used: .*missing"),
    ],
)
def test_a_constraint_llguidance_refuses_is_a_clear_error_before_admission(llm, constraint, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("x", SamplingParams(**constraint))
    stats = llm.stats()
    assert (stats.running, stats.waiting, llm.engine.cache.pages_in_use) == (0, 0, 0)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(json_schema="{x"), "json_schema must be a JSON schema, as a dict, JSON text or None, got '{x'"),
        (dict(choice=[]), r"choice must be a list of non-empty strings or None, got \(\)"),
        (
            dict(regex="a", choice=["b"]),
            "give at most one of json_schema, regex, choice, grammar; got regex and choice",
        ),
    ],
)
def test_sampling_params_check_the_constraint_fields(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_a_schema_keeps_its_property_order():
    assert SamplingParams(json_schema={"z": 1, "a": 2}).json_schema == '{"z": 1, "a": 2}'


def test_a_step_that_cannot_be_read_while_the_next_waits_for_it_fails_its_own_requests_only(monkeypatch):
    """The constrained row's mask waits for the step in flight; that step's tokens cannot be
    read, so its requests fail, and the request admitted beside them is undone and recomputed
    to exactly its solo tokens."""
    model, tokenizer = load()
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=4))
    solo = LLM((model, tokenizer), max_num_seqs=1).generate("A class", constrained(9, choice=["yes", "no"]))[0]
    failed = [engine.add_request("The import", constrained(i, json_schema=PERSON)) for i in range(2)]
    engine.step()
    engine.step()  # a step in flight, whose tokens the constrained rows' next masks need
    late = engine.add_request("A class", constrained(9, choice=["yes", "no"]))
    real_eval, failures = mx.eval, iter([True])

    def failing_eval(*args):
        if next(failures, False):
            raise RuntimeError("device lost")
        return real_eval(*args)

    monkeypatch.setattr(mx, "eval", failing_eval)
    while engine.has_unfinished():
        engine.step()
    assert [r.finish_reason for r in failed] == ["error", "error"] and str(failed[0].error) == "device lost"
    assert late.output_ids == list(solo.token_ids) and engine.cache.pages_in_use == 0
