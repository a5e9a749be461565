"""Batched sampling: one argmax for greedy rows, one draw for all the others, each row as if alone."""

import mlx.core as mx
import numpy as np
import pytest

from mlxkv import SamplingParams
from mlxkv.engine.sampling.sampler import SamplingFailed, TokenSampler, sample

MIX = [
    dict(),
    dict(temperature=0.7),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.2, top_k=20),
    dict(temperature=0.8, min_p=0.05),
    dict(temperature=1.0, top_p=0.5, top_k=10, min_p=0.1),
    dict(),
    dict(temperature=2.0, top_p=0.95, top_k=50, min_p=0.02),
    dict(temperature=1.0, top_k=1),
]


def logits(rows, vocab=500, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal((rows, vocab)).astype(np.float32) * 3)


def test_each_row_draws_what_it_would_draw_alone():
    samplers = [TokenSampler(SamplingParams(seed=i, **kw)) for i, kw in enumerate(MIX)]
    scores = logits(len(MIX))
    for step in range(10):
        indices = [step + i for i in range(len(MIX))]
        together = sample(scores, samplers, indices).tolist()
        alone = [sample(scores[i : i + 1], [s], [n]).item() for i, (s, n) in enumerate(zip(samplers, indices))]
        assert together == alone


def test_greedy_rows_take_the_argmax_and_seeds_repeat():
    samplers = [TokenSampler(SamplingParams(seed=7, **kw)) for kw in MIX]
    scores = logits(len(MIX), seed=1)
    first = sample(scores, samplers, [3] * len(MIX)).tolist()
    assert first == sample(scores, samplers, [3] * len(MIX)).tolist()
    greedy = np.argmax(np.array(scores), axis=-1)
    assert [first[i] for i in (0, 6, 8)] == [greedy[0], greedy[6], greedy[8]]  # top_k=1 is greedy too


def test_filters_keep_the_draw_inside_top_k_and_top_p():
    scores = logits(1, seed=2)
    order = np.argsort(-np.array(scores[0]))
    top_k = {
        sample(scores, [TokenSampler(SamplingParams(temperature=5.0, top_k=3, seed=s))], [0]).item() for s in range(200)
    }
    assert top_k <= set(order[:3].tolist()) and len(top_k) == 3


def test_a_failing_row_is_named():
    class Broken(TokenSampler):
        def key(self, index):
            raise RuntimeError("no key")

    samplers = [TokenSampler(SamplingParams(temperature=1.0)), Broken(SamplingParams(temperature=1.0))]
    with pytest.raises(SamplingFailed) as error:
        sample(logits(2), samplers, [0, 0])
    assert error.value.row == 1 and str(error.value.cause) == "no key"
