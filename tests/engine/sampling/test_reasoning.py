"""A thinking model's reply split into reasoning and answer as its tokens are accepted."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import drafts_always_pay, mlx_lm_text

from mlxkv import LLM, LLMEngine, SamplingParams
from mlxkv.engine.sampling.reasoning import Reasoning, ThinkMarkers
from mlxkv.engine.sampling.sampler import draw
from mlxkv.entrypoints.prompts import prompt_ids
from mlxkv.models import load
from mlxkv.models.random_model import HARMONY_CHAT_TEMPLATE, HARMONY_MARKERS, make_checkpoint

SINGLE = ThinkMarkers(start=(5,), end=(6,))
DOUBLE = ThinkMarkers(start=(7, 8), end=(9, 8))
# Qwen3.5's way: the template opens the reply's thinking itself, unless told not to.
OPENING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}"
)


class Tokens:
    """A detokenizer that writes each token as its number and a space."""

    def __init__(self):
        self.text = ""

    def add_token(self, token):
        self.text += f"{token} "

    def finalize(self):
        pass


def split(markers, tokens, thinking=False):
    reasoning = Reasoning(markers, thinking, Tokens())
    routed = [r for t in tokens for r in reasoning.route(t)] + reasoning.flush()
    return [t for t, r in routed if r], [t for t, r in routed if not r], reasoning


def test_the_markers_are_dropped_and_the_tokens_between_are_reasoning():
    reasoning, answer, state = split(SINGLE, [5, 10, 11, 6, 12, 13])
    assert (reasoning, answer, state.tokens, state.ended) == ([10, 11], [12, 13], 4, True)


def test_thinking_starts_only_at_the_reply_s_start_and_never_again():
    assert split(SINGLE, [10, 5, 11, 6])[:2] == ([], [10, 5, 11, 6])
    assert split(SINGLE, [5, 10, 6, 12, 5, 13, 6])[:2] == ([10], [12, 5, 13, 6])


def test_markers_of_several_tokens_are_held_until_settled():
    reasoning, answer, state = split(DOUBLE, [7, 8, 1, 9, 2, 9, 8, 3])
    assert (reasoning, answer, state.tokens) == ([1, 9, 2], [3], 7)
    assert split(DOUBLE, [7, 8, 1, 9])[:2] == ([1, 9], [])  # a marker's start, then the end of the reply


def test_a_prompt_that_opens_thinking_starts_the_reply_inside_it():
    assert SINGLE.open_in([1, 5, 2]) and not SINGLE.open_in([1, 5, 2, 6, 3]) and not SINGLE.open_in([1, 2])
    assert DOUBLE.open_in([7, 8, 4]) and not DOUBLE.open_in([7, 4, 8])
    assert split(SINGLE, [10, 6, 11], thinking=True)[:2] == ([10], [11])


THINKERS = {
    "qwen3.5": {"chat_template": OPENING_TEMPLATE},
    "harmony": {"chat_template": HARMONY_CHAT_TEMPLATE, "markers": HARMONY_MARKERS},
}


@pytest.fixture(scope="module", params=list(THINKERS))
def thinker(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("think") / "tiny", **THINKERS[request.param])
    return LLM(str(Path(path)), max_model_len=256)


def end_of(llm):
    """The model's end marker: Qwen's `</think>`, or harmony's end of analysis and final channel's header."""
    return ThinkMarkers.of(llm.tokenizer).end


def test_the_tokenizer_s_markers_are_found_harmony_s_by_their_special_tokens(thinker):
    markers = ThinkMarkers.of(thinker.tokenizer)
    decoded = [thinker.tokenizer.decode(list(m)) for m in (markers.start, markers.end, markers.answer)]
    assert decoded in (
        ["<think>", "</think>", ""],
        [
            "<|channel|>analysis<|message|>",
            "<|end|><|start|>assistant<|channel|>final<|message|>",
            "<|channel|>final<|message|>",
        ],
    )


def test_a_reply_cut_inside_its_thinking_has_its_reasoning_and_no_answer(thinker):
    tokenizer = thinker.tokenizer
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": "Hello"}])
    assert tokenizer.decode(prompt).endswith(("<think>\n", "<|channel|>analysis<|message|>"))
    [done] = thinker.generate(prompt, SamplingParams(max_tokens=12), continuation=False)
    assert end_of(thinker)[0] not in done.token_ids  # the random model never ends its thinking
    assert (done.text, done.finish_reason) == ("", "length")
    assert done.reasoning == mlx_lm_text(tokenizer, done.token_ids)
    streamed = thinker.stream(prompt, SamplingParams(max_tokens=12), continuation=False)
    assert "".join(streamed) == "" and streamed.request.reasoning.stream.text == done.reasoning


def test_without_thinking_the_reply_is_all_answer(thinker):
    tokenizer = thinker.tokenizer
    if len(end_of(thinker)) > 1:
        pytest.skip("gpt-oss's template cannot turn thinking off")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, enable_thinking=False
    )
    [done] = thinker.generate(prompt, SamplingParams(max_tokens=12), continuation=False)
    assert (done.reasoning, done.text) == ("", mlx_lm_text(tokenizer, done.token_ids))


def test_a_budget_closes_the_thinking_and_an_answer_follows(thinker):
    tokenizer = thinker.tokenizer
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": "Hello"}])
    [free] = thinker.generate(prompt, SamplingParams(max_tokens=40), continuation=False)
    [held] = thinker.generate(prompt, SamplingParams(max_tokens=40, thinking_token_budget=16), continuation=False)
    end = end_of(thinker)
    first = 16 - len(end)  # free tokens, then the end marker's, 16 in all
    assert held.token_ids[:first] == free.token_ids[:first] and held.token_ids[first:16] == list(end)
    assert held.reasoning == mlx_lm_text(tokenizer, held.token_ids[:first])
    assert held.text == mlx_lm_text(tokenizer, held.token_ids[16:]) != ""


def test_budgets_in_a_batch_each_hold_their_own_request_only(thinker):
    tokenizer = thinker.tokenizer
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": f"Question {i}?"}]) for i in range(16)]
    params = [SamplingParams(max_tokens=30, thinking_token_budget=None if i % 4 == 0 else i) for i in range(16)]
    alone = [thinker.generate(p, sp, continuation=False)[0] for p, sp in zip(prompts, params)]
    together = thinker.generate(prompts, params, continuation=False)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    for done, sp in zip(together, params):
        budget = sp.thinking_token_budget
        if budget is not None:
            end = end_of(thinker)
            at = max(budget - len(end), 0)
            assert done.token_ids[at : at + len(end)] == list(end)


def test_speculation_drafts_nothing_past_where_a_budget_closes_the_thinking(thinker):
    tokenizer = thinker.tokenizer
    speculating = LLM((thinker.model, tokenizer), max_model_len=256, prompt_lookup=True)
    drafts_always_pay(speculating.engine)
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": f"Again and again {i}"}]) for i in range(6)]
    params = [SamplingParams(max_tokens=40, thinking_token_budget=4 + 3 * i) for i in range(6)]
    expected = [c.token_ids for c in thinker.generate(prompts, params, continuation=False)]
    assert [c.token_ids for c in speculating.generate(prompts, params, continuation=False)] == expected
    assert speculating.stats().speculation.drafted > 0


def test_a_constraint_holds_the_answer_only_the_reasoning_is_free(thinker):
    tokenizer = thinker.tokenizer
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": "Is it?"}])
    [free] = thinker.generate(prompt, SamplingParams(max_tokens=12), continuation=False)
    params = SamplingParams(max_tokens=60, json_schema=schema, thinking_token_budget=12)
    [done] = thinker.generate(prompt, params, continuation=False)
    first = 12 - len(end_of(thinker))
    assert done.token_ids[:first] == free.token_ids[:first]  # the reasoning as without a schema
    assert done.reasoning == mlx_lm_text(tokenizer, done.token_ids[:first])
    assert json.loads(done.text) in ({"ok": True}, {"ok": False}) and done.finish_reason == "stop"


def test_a_prompt_that_closed_an_empty_thinking_block_leaves_the_reply_all_answer():
    assert SINGLE.closed_in([1, 5, 2, 6, 3]) and not SINGLE.closed_in([1, 5, 2, 6, 3, 3, 3, 3, 3])
    assert split(SINGLE, [5, 10, 6])[:2] == ([10], [])
    reasoning = Reasoning(SINGLE, False, Tokens(), opening=False)
    assert [r for t in (5, 10, 6) for r in reasoning.route(t)] == [(5, False), (10, False), (6, False)]


# Harmony's markers, as a tokenizer with its special tokens and channel names of one token each
# encodes them: <|channel|> 7, analysis 18, <|message|> 8, <|end|> 9, <|start|> 6, assistant 17, final 19.
HARMONY = ThinkMarkers(
    start=(7, 18, 8), end=(9, 6, 17, 7, 19, 8), answer=(7, 19, 8), answer_text="<F>", close=(9,), start_text="<A>"
)


def test_harmony_s_analysis_channel_is_the_reasoning_its_final_channel_the_answer():
    reasoning, answer, state = split(HARMONY, [7, 18, 8, 1, 2, 9, 6, 17, 7, 19, 8, 3, 4])
    assert (reasoning, answer, state.tokens, state.ended) == ([1, 2], [3, 4], 11, True)
    assert state.opened == "<A>"  # written back before the reasoning's text


def test_a_harmony_reply_without_analysis_drops_its_final_channel_s_header():
    reasoning, answer, state = split(HARMONY, [7, 19, 8, 3, 4])
    assert (reasoning, answer, state.tokens, state.written("x")) == ([], [3, 4], 0, "<F>x")
    assert split(HARMONY, [7, 5, 3])[:2] == ([], [7, 5, 3])  # another channel: text, as written


def test_while_a_harmony_reply_opens_a_channel_the_tokens_that_go_on_with_it_are_known():
    state = Reasoning(HARMONY, False, Tokens())
    assert sorted(state.openers()) == [7] and state.continuations() == ()
    assert state.route(7) == [] and sorted(state.continuations()) == [18, 19]
    assert state.route(19) == [] and state.continuations() == (8,)
    assert state.route(8) == [] and not state.opening and state.continuations() == ()


def test_a_harmony_prompt_opens_or_closes_the_reply_s_analysis():
    assert HARMONY.open_in([6, 17, 7, 18, 8]) and not HARMONY.open_in([7, 18, 8, 1, 9, 6, 17])
    assert HARMONY.closed_in([1, 9, 6, 17, 7, 19, 8]) and not HARMONY.closed_in([1, 9, 6, 17])


def test_a_constrained_reply_that_begins_a_channel_header_is_held_to_it(tmp_path):
    """gpt-oss writes its channel header before a constrained answer: once it has begun one, the
    grammar waits and only the header's next tokens may follow (every constrained row of the step
    being such a row too)."""
    harmony_as_gpt_oss = HARMONY_CHAT_TEMPLATE.replace(
        "<|start|>assistant<|channel|>analysis<|message|>{% endif", "<|start|>assistant{% endif"
    )
    path = make_checkpoint(tmp_path / "gpt-oss", chat_template=harmony_as_gpt_oss, markers=HARMONY_MARKERS)
    engine = LLMEngine(*load(str(path)))
    vocab = engine.tokenizer.get_vocab()
    prompt = prompt_ids(engine.tokenizer, [{"role": "user", "content": "Is it?"}])
    request = engine.add_request(prompt, SamplingParams(temperature=1.0, json_schema={"type": "object"}))
    assert request.reasoning.opening and engine.tokenizer.decode(prompt).endswith("<|start|>assistant")
    logits = mx.zeros((1, engine.vocab_size))
    first = {int(draw(logits, [request], [i], [[]], engine.structured)[0][0]) for i in range(40)}
    assert vocab["<|channel|>"] in first and len(first) > 1  # the header, or what the grammar allows
    request.reasoning.route(vocab["<|channel|>"])
    after = {int(draw(logits, [request], [i], [[]], engine.structured)[0][0]) for i in range(40)}
    assert after == {vocab["analysis"], vocab["final"]}


def test_an_end_marker_that_starts_again_inside_a_partial_one_still_ends_the_thinking():
    reasoning, answer, state = split(HARMONY, [7, 18, 8, 1, 9, 9, 6, 17, 7, 19, 8, 3])
    assert (reasoning, answer, state.ended) == ([1, 9], [3], True)


def test_a_budget_holds_though_the_model_begins_the_end_marker_and_turns_away():
    for turn_away in (False, True):
        state = Reasoning(HARMONY, True, Tokens(), budget=10)
        written = [1, 2, 9, 5 if turn_away else 6]  # `<|end|>`, then something else or `<|start|>`
        for token in written:
            assert state.forced() is None
            state.route(token)
        while not state.ended:
            state.route(state.forced())
        assert state.tokens == (10 if turn_away else 8)  # never over the budget
