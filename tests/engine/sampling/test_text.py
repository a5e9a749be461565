import random

import pytest
from helpers import mlx_lm_text

from mlxkv import LLM, SamplingParams
from mlxkv.engine.sampling.text import TextStream
from mlxkv.models.random_model import make_checkpoint


class CharDetokenizer:
    """Stands in for mlx-lm's streaming detokenizers: token i is chr(i)."""

    def __init__(self):
        self.text = ""

    def add_token(self, token):
        self.text += chr(token)

    def finalize(self):
        pass


def feed(stream, text):
    deltas = []
    for ch in text:
        stopped = stream.add(ord(ch))
        deltas.append(stream.take_delta())
        if stopped:
            break
    stream.finish()
    deltas.append(stream.take_delta())
    return deltas


def test_without_stop_strings_every_token_is_streamed_at_once():
    assert feed(TextStream(CharDetokenizer(), ()), "abc") == ["a", "b", "c", ""]


def test_stop_string_is_cut_and_never_streamed():
    stream = TextStream(CharDetokenizer(), ("END",))
    deltas = feed(stream, "helloENDmore")
    assert "".join(deltas) == "hello" == stream.text
    assert stream.stopped


def test_text_that_only_looked_like_a_stop_string_is_released():
    stream = TextStream(CharDetokenizer(), ("END",))
    assert feed(stream, "aENx") == ["a", "", "", "ENx", ""]
    assert not stream.stopped


def test_earliest_of_several_stop_strings_wins():
    stream = TextStream(CharDetokenizer(), ("xyz", "y"))
    feed(stream, "abxyz")
    assert stream.text == "abx"


@pytest.fixture(scope="module", params=["demo", "random-bpe"])
def llm(request, tmp_path_factory):
    """The demo model, and a random model of another byte-level BPE vocabulary."""
    if request.param == "demo":
        return LLM(max_num_seqs=16, max_model_len=256)
    return LLM(str(make_checkpoint(tmp_path_factory.mktemp("bpe") / "bpe", seed=3)), max_num_seqs=16, max_model_len=256)


def prompts_of(llm) -> list[list[int]]:
    """50 prompts: texts of a few words (many replies then open with a space) and random token ids."""
    rng = random.Random(5)
    words = ["The", " import", " statement", " is", " a", " class", " def", "(", " x", ",", "\n", " return"]
    texts = ["".join(rng.choice(words) for _ in range(rng.randint(1, 8))) for _ in range(25)]
    vocab = llm.engine.vocab_size
    return [llm.tokenizer.encode(t) for t in texts] + [[rng.randrange(3, vocab) for _ in range(6)] for _ in range(25)]


def test_a_completion_continues_its_prompt_exactly_whole_and_streamed(llm):
    """`prompt + text` reads as `prompt_ids + output_ids` decode, a first token's leading space
    included (mlx-lm's detokenizer drops it), whole and as streamed deltas, at temperature 1."""
    prompts = prompts_of(llm)
    params = [SamplingParams(max_tokens=40, temperature=1, seed=i) for i in range(len(prompts))]
    completions = llm.generate(prompts, params)
    decode = llm.tokenizer.decode
    for prompt, sampling, completion in zip(prompts, params, completions):
        head = decode(prompt)
        assert completion.text == decode(prompt + completion.token_ids)[len(head) :]
        assert "".join(llm.stream(prompt, sampling)) == completion.text


def test_the_demo_model_s_completion_keeps_its_first_space():
    """The case a user met: the first token is " still", which mlx-lm's detokenizer shows as "still"."""
    llm = LLM(max_num_seqs=1, max_model_len=64)
    [completion] = llm.generate("The import statement is", SamplingParams(max_tokens=4))
    assert completion.text.startswith(" ") and completion.text[1:] == mlx_lm_text(llm.tokenizer, completion.token_ids)


def test_a_reply_after_a_chat_template_starts_as_mlx_lm_s_does(llm):
    prompt = llm.tokenizer.encode("The import statement is")
    [reply] = llm.generate(prompt, SamplingParams(max_tokens=12), continuation=False)
    assert reply.text == mlx_lm_text(llm.tokenizer, reply.token_ids)
