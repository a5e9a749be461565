from mlxkv.engine.speculative.prompt_lookup import NgramIndex


def test_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    assert index.propose(tokens, 3) == [5, 6, 1]  # "1 2 3" last ended before "5"; "6 1 2 3" never occurred
    tokens.append(5)
    assert index.propose(tokens, 3) == [6, 1, 2]  # "1 2 3 5" occurred: the longest wins
    assert index.propose(tokens, 8) == [6, 1, 2, 3, 5]  # no further than the tokens go


def test_proposes_nothing_without_an_earlier_occurrence():
    assert NgramIndex().propose([1, 2, 3, 4], 3) == []
    assert NgramIndex().propose([7], 3) == []
    assert NgramIndex().propose([7, 7, 7], 2) == [7]  # "7 7" ended at position 2, before the last token
