"""Lazy constraints: a grammar that holds the output only from each time it samples the trigger
token until the grammar completes (a tool call under `tool_choice` 'auto'), the output free and
exactly as unconstrained elsewhere, with speculative decoding too."""

import re

import pytest

from mlxkv import LLM, SamplingParams

TRIGGER = " the"  # one token of the demo model's vocabulary, and a frequent one
GRAMMAR = 'start: " the" "[" /[0-9]{2}/ "]"'  # what must follow each " the"
SEEDS = range(8)


def free(seed):
    return SamplingParams(max_tokens=64, temperature=0.9, seed=seed)


def lazy(seed):
    return SamplingParams(max_tokens=64, temperature=0.9, seed=seed, grammar=GRAMMAR, grammar_trigger=TRIGGER)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=16, max_model_len=256)


@pytest.fixture(scope="module")
def outputs(llm):
    """Each seed's free and lazy outputs, all in one batch."""
    done = llm.generate(["The import statement"] * 16, [free(s) for s in SEEDS] + [lazy(s) for s in SEEDS])
    return done[:8], done[8:]


def test_the_output_is_free_up_to_the_first_trigger(outputs, llm):
    trigger = llm.tokenizer.encode(TRIGGER, add_special_tokens=False)[0]
    triggered = 0
    for plain, held in zip(*outputs):
        ids = list(plain.token_ids)
        first = ids.index(trigger) + 1 if trigger in ids else len(ids)
        assert list(held.token_ids[:first]) == ids[:first]
        triggered += trigger in ids
    assert triggered >= 4  # the test is not vacuous: most draws write the trigger


def test_each_trigger_is_followed_by_what_the_grammar_holds(outputs, llm):
    trigger = llm.tokenizer.encode(TRIGGER, add_special_tokens=False)[0]
    held = 0
    for output in outputs[1]:
        ids = list(output.token_ids)
        for at in (i for i, token in enumerate(ids) if token == trigger):
            after = llm.tokenizer.decode(ids[at + 1 :])
            assert re.match(r"\[[0-9]{2}\]", after) or re.fullmatch(r"\[?[0-9]{0,2}", after), after  # or cut short
            held += 1
    assert held >= 8


def test_speculative_decoding_gives_the_same_tokens():
    """Prompt lookup drafts tokens; none is the trigger or lies in a held stretch, so the tokens are
    those drawn without drafting."""
    plain = LLM(max_num_seqs=4, max_model_len=256)
    drafting = LLM(max_num_seqs=4, max_model_len=256, prompt_lookup=True)
    prompts = ["The import statement the import statement the import"] * 4
    params = [lazy(s) for s in range(4)]
    assert [o.token_ids for o in drafting.generate(prompts, params)] == [
        o.token_ids for o in plain.generate(prompts, params)
    ]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(grammar_trigger=TRIGGER), "grammar_trigger needs a grammar to trigger"),
        (dict(grammar=GRAMMAR, grammar_trigger=" the import"), "grammar_trigger must be one token"),
    ],
)
def test_a_trigger_needs_a_grammar_and_one_token(llm, fields, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("The import statement", SamplingParams(max_tokens=4, **fields))
