"""A prompt that quotes an output of the engine is encoded as that output's token ids, where it
quotes it right after the text of the prompt it followed; nowhere else, and never across salts."""

import pytest

from mlxkv import LLM, SamplingParams

PROMPT = "Question 0: how does the import statement work?"
MORE = "\nAnd the from form?"
# Sampled at 0.7 with this seed, the demo model writes "\n" "\n" "\n", which encodes back as "\n\n" "\n".
SAMPLED = SamplingParams(max_tokens=200, temperature=0.7, seed=0)


@pytest.fixture
def llm():
    return LLM(max_model_len=1024, max_num_seqs=4)


def answer(llm, prompt=PROMPT, params=SAMPLED, **kw):
    [done] = llm.generate(prompt, params, continuation=False, **kw)
    return done


def encode(llm, text):
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_a_quoted_reply_keeps_the_ids_it_was_produced_as(llm):
    done = answer(llm)
    assert encode(llm, done.text) != list(done.token_ids)  # re-encoding it would leave the cached pages
    quoting = PROMPT + done.text + MORE
    assert llm.engine.encode(quoting) == list(done.prompt_token_ids) + list(done.token_ids) + encode(llm, MORE)
    follow = answer(llm, quoting)
    assert follow.num_cached_tokens == len(done.prompt_token_ids) + len(done.token_ids) - 1  # the last never ran


def test_a_reply_quoted_elsewhere_or_under_another_salt_is_encoded_as_text(llm):
    done = answer(llm, cache_salt="alice")
    assert llm.engine.encode(PROMPT + done.text, "bob") == encode(llm, PROMPT + done.text)
    elsewhere = "Something else entirely." + done.text
    assert llm.engine.encode(elsewhere, "alice") == encode(llm, elsewhere)
    assert llm.engine.encode(PROMPT + done.text, "alice") == list(done.prompt_token_ids) + list(done.token_ids)


def test_a_quote_of_the_reply_s_start_keeps_the_ids_of_that_start(llm):
    done = answer(llm)
    ids = list(done.token_ids)
    start = llm.tokenizer.decode(ids[:40])
    quoting = PROMPT + start + " but then something else"
    assert llm.engine.encode(quoting)[: len(done.prompt_token_ids) + 40] == list(done.prompt_token_ids) + ids[:40]


def test_a_reply_cut_by_a_stop_string_keeps_the_ids_of_the_text_before_it(llm):
    whole = answer(llm, cache_salt="probe")
    stop = whole.text[60:64]
    done = answer(llm, params=SamplingParams(max_tokens=200, temperature=0.7, seed=0, stop=[stop]))
    assert done.text == whole.text[: whole.text.index(stop)]
    ids = list(done.token_ids)
    kept = max(k for k in range(len(ids) + 1) if done.text.startswith(llm.tokenizer.decode(ids[:k])))
    rest = done.text[len(llm.tokenizer.decode(ids[:kept])) :] + MORE
    expected = list(done.prompt_token_ids) + ids[:kept] + encode(llm, rest)
    assert kept >= len(ids) - 2 and llm.engine.encode(PROMPT + done.text + MORE) == expected


def test_without_prefix_caching_nothing_is_kept():
    llm = LLM(max_model_len=1024, max_num_seqs=4, prefix_caching=False)
    done = answer(llm)
    assert llm.engine.recent is None
    assert llm.engine.encode(PROMPT + done.text) == encode(llm, PROMPT + done.text)
