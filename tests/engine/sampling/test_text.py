from mlxkv.engine.sampling.text import TextStream


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
