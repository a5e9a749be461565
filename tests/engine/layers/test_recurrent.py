"""A hybrid's recurrent layers over packed steps leave every sequence exactly the state mlx-lm's own
cache holds after the same tokens: prefill chunks of different lengths in one step, then decodes."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import BASE, HYBRIDS
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import ArraysCache

from mlxkv.engine.llm_engine import LLMEngine
from mlxkv.models import load
from mlxkv.models.random_model import make_checkpoint
from mlxkv.models.structure import text_model

LENGTHS = (5, 9, 1, 7)  # three chunks padded to 9 tokens, beside a one-token row


def mlx_lm_states(model, tokens):
    """Every recurrent layer's state in mlx-lm's own cache after `tokens`, the sequence alone."""
    cache = model.make_cache()
    model(mx.array(tokens)[None], cache=cache)
    return [[np.array(array[0]) for array in c.cache] for c in cache if isinstance(c, ArraysCache)]


def pool_states(engine, seq_id):
    """Every recurrent layer's state of `seq_id` in the engine's state pool."""
    index = int(engine.cache.fetch([seq_id]).state_indices[0])
    return [[np.array(array[index]) for array in layer] for layer in engine.cache.states.arrays]


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_every_sequences_state_is_mlx_lms_after_a_padded_prefill_and_a_decode(tmp_path, name):
    path = make_checkpoint(tmp_path / name, name, shape={**BASE, **HYBRIDS[name]})
    engine = LLMEngine(*load(str(path)))
    reference = text_model(mlx_lm_load(str(path))[0])
    rng = np.random.default_rng(1)
    tokens = [rng.integers(1, 300, n + 1).tolist() for n in LENGTHS]  # each prompt, then one decode token
    seq_ids = engine.cache.claim(len(tokens))
    done = [0] * len(tokens)
    for counts in ([*LENGTHS], [1] * len(tokens)):
        batch = engine.cache.append(seq_ids, counts)
        packed = [t for ids, start, n in zip(tokens, done, counts) for t in ids[start : start + n]]
        engine.runner.hidden(mx.array(packed), batch, [0] * len(counts))
        mx.eval(engine.cache.tensors)
        done = [d + n for d, n in zip(done, counts)]
        for seq_id, ids, n in zip(seq_ids, tokens, done):
            for got, want in zip(pool_states(engine, seq_id), mlx_lm_states(reference, ids[:n])):
                for a, b in zip(got, want):
                    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{name}, {n} tokens")
