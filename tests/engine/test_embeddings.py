"""Embedding requests through the paged engine: a decoder embedding model's prompts are computed in
chunks beside other requests, and each ends with its normalised last-token hidden state, equal to
mlx-lm's model run directly, whether alone, split over steps, from cached prefix pages, or 64 at once
beside streaming chats whose tokens stay their own."""

import json
import random
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

from mlxkv import LLM, RequestTooLong, SamplingParams
from mlxkv.config import EngineConfig
from mlxkv.engine.llm_engine import LLMEngine
from mlxkv.errors import ModelLoadError
from mlxkv.models.loading import load
from mlxkv.models.pooling import Pooling
from mlxkv.models.random_model import make_embedder

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return make_embedder(tmp_path_factory.mktemp("embedder"))


@pytest.fixture(scope="module")
def direct(embedder):
    """A prompt's vector as mlx-lm's own model makes it: the last token's final hidden state, normalised."""
    model, _ = mlx_lm_load(str(embedder))

    def vector(ids: list[int]) -> np.ndarray:
        last = model.model(mx.array(ids)[None])[0, -1].astype(mx.float32)
        return np.array(last / mx.linalg.norm(last))

    return vector


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 320) for _ in range(rng.randint(1, 60))] for _ in range(count)]


def test_one_vector_equals_mlx_lm_direct(embedder, direct):
    llm = LLM(str(embedder), max_model_len=256, num_pages=64)
    ids = prompts(1)[0]
    (vector,) = llm.embed([ids])
    assert len(vector) == 64
    np.testing.assert_allclose(vector, direct(ids), atol=TOLERANCE)
    assert abs(np.linalg.norm(vector) - 1) < TOLERANCE


def test_text_is_tokenized_with_the_tokenizers_special_tokens(embedder, direct):
    llm = LLM(str(embedder), max_model_len=256, num_pages=64)
    ids = llm.tokenizer.encode("notes on paged attention")
    np.testing.assert_allclose(llm.embed("notes on paged attention")[0], direct(ids), atol=TOLERANCE)


def test_prompts_split_over_steps_and_from_cached_pages_give_the_same_vectors(embedder, direct):
    llm = LLM(str(embedder), max_model_len=256, num_pages=64, max_num_batched_tokens=16, max_num_seqs=4)
    batch = [ids * 3 for ids in prompts(6, seed=1)]  # up to 180 tokens: a dozen chunks of 16
    first = llm.embed(batch)
    again = llm.embed(batch)
    for ids, one, two in zip(batch, first, again):
        np.testing.assert_allclose(one, direct(ids), atol=TOLERANCE)
        np.testing.assert_allclose(two, direct(ids), atol=TOLERANCE)
    assert llm.stats().prefix_cache.cached_tokens == sum(len(ids) - 1 for ids in batch)  # all but the last token


def test_64_at_once_beside_streaming_chats(embedder, direct):
    model = load(embedder)
    chats = prompts(8, seed=2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = LLM(model, max_num_seqs=1)
    expected = [alone.generate(p, params)[0].token_ids for p in chats]
    pooling = Pooling("last", normalize=True)
    engine = LLMEngine(
        *model, EngineConfig(max_num_seqs=32, max_num_batched_tokens=128, num_pages=256), pooling=pooling
    )
    for ids in chats:
        engine.add_request(ids, params)
    batch = prompts(64, seed=3)
    embedding = [engine.add_embedding(ids) for ids in batch]
    tokens: dict[str, list[int]] = {}
    vectors: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            if output.embedding is not None:
                vectors[output.request_id] = output.embedding
    assert [tokens[str(i)] for i in range(8)] == expected
    for request, ids in zip(embedding, batch):
        np.testing.assert_allclose(vectors[request.request_id], direct(ids), atol=TOLERANCE)
    assert (engine.cache.free_pages, engine.cache.num_sequences) == (engine.cache.pool.capacity, 0)


def test_an_aborted_embedding_frees_its_pages(embedder):
    engine = LLMEngine(
        *load(embedder), EngineConfig(num_pages=64, max_num_batched_tokens=16), pooling=Pooling("last", True)
    )
    request = engine.add_embedding(list(range(1, 100)))
    engine.step()
    assert engine.cache.free_pages < 64
    engine.abort(request.request_id)
    while engine.has_unfinished():
        assert engine.step() == []
    assert request.finish_reason == "abort" and request.embedding is None
    assert engine.cache.free_pages == 64


def test_refusals(embedder, checkpoint):
    chat = LLM(checkpoint("llama-fp32"))
    with pytest.raises(ValueError, match=r"^input: this model is not an embedding model"):
        chat.embed("hello")
    llm = LLM(str(embedder), max_model_len=64, num_pages=64)
    with pytest.raises(RequestTooLong, match=r"^input of 65 tokens; one embedding input can have at most 64$"):
        llm.embed([list(range(1, 66))])
    with pytest.raises(ValueError, match=r"^prompt is empty$"):
        llm.embed([[]])
    with pytest.raises(ValueError, match=r"^pooling: a decoder embedding model runs in the engine with last-token"):
        LLMEngine(*load(embedder), pooling=Pooling("mean", True))
    assert (llm.stats().running, llm.engine.cache.free_pages) == (0, 64)


def test_a_checkpoint_without_a_head_loads_as_qwen3_embeddings_larger_ones_ship(embedder, direct, tmp_path):
    headless = tmp_path / "headless"
    shutil.copytree(embedder, headless)
    weights = mx.load(str(headless / "model.safetensors"))
    config = json.loads((headless / "config.json").read_text())
    assert "lm_head.weight" in weights and not config["tie_word_embeddings"]
    del weights["lm_head.weight"]
    mx.save_safetensors(str(headless / "model.safetensors"), weights)
    ids = prompts(1, seed=4)[0]
    np.testing.assert_allclose(LLM(str(headless), num_pages=64).embed([ids])[0], direct(ids), atol=TOLERANCE)
    bare = {name.removeprefix("model."): value for name, value in weights.items()}
    mx.save_safetensors(str(headless / "model.safetensors"), bare)
    with pytest.raises(ModelLoadError, match="are named as transformers' base model"):
        LLM(str(headless))
