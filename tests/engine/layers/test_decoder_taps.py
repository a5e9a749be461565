"""Modules a decoder calls without a cache, in a step: GPT-2's learned absolute position embeddings
give each packed token its own position's embedding (and no sequence outgrows the table), and a
decoder that computes the logits itself (GPT-NeoX's, Lille's) hands the runner its final hidden
states."""

import numpy as np
import pytest
from helpers import mlx_lm_greedy

from mlxkv import LLM, SamplingParams
from mlxkv.engine.layers.decoder_taps import FinalNorm
from mlxkv.models.random_model import make_checkpoint
from mlxkv.models.structure import decoder, final_norm
from mlxkv.models.tiny_configs import tiny_config

PROMPTS = [[int(t) for t in np.random.default_rng(n).integers(1, 300, n)] for n in (3, 11, 26)]


def batched_like_mlx_lm(tmp_path, model_type):
    """A tiny `model_type` whose prompts, in chunks beside decodes, get mlx-lm's tokens: (llm, config, path)."""
    config = tiny_config(model_type)
    path = make_checkpoint(tmp_path, config.pop("model_type"), shape=config)
    llm = LLM(str(path), page_size=4, max_num_seqs=3, max_num_batched_tokens=8)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [mlx_lm_greedy(path, p, max_tokens=5) for p in PROMPTS]
    return llm, config, path


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_bigcode"])
def test_chunks_beside_decodes_equal_mlx_lm_and_the_context_is_the_tables(tmp_path, model_type):
    llm, config, path = batched_like_mlx_lm(tmp_path, model_type)
    assert llm.engine.max_request_tokens == config["n_positions"]
    with pytest.raises(ValueError, match=r"max_model_len=1025 is more than the 1024 positions"):
        LLM(str(path), max_model_len=config["n_positions"] + 1)


@pytest.mark.parametrize("model_type", ["gpt_neox", "lille-130m"])
def test_a_decoder_that_computes_the_logits_hands_over_its_final_hidden_states(tmp_path, model_type):
    llm, _, _ = batched_like_mlx_lm(tmp_path, model_type)
    assert type(getattr(decoder(llm.engine.runner.model), final_norm(llm.engine.runner.model))) is FinalNorm
