"""Embeddings over real HTTP with the official clients: a decoder embedding model (run by the engine)
and an encoder (run by mlx-embeddings) behind one server beside a chat model; vectors equal those
computed directly, base64 decodes to the same floats, `dimensions` cuts where the checkpoint allows,
and a model asked for what it does not do is a 400 naming it."""

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from helpers import start_server, stop_server

from mlxkv import LLM, SamplingParams
from mlxkv.entrypoints.prompts import prompt_ids
from mlxkv.models.random_model import TOOLS_CHAT_TEMPLATE, make_checkpoint, make_embedder, make_encoder

mlx_embeddings = pytest.importorskip("mlx_embeddings", reason="the embeddings extra is not installed")
ollama = pytest.importorskip("ollama", reason="the ollama package could not be installed")

TEXTS = ["paged attention", "a note on continuous batching", "the quick brown fox", "MLX on a Mac"]
HI = [{"role": "user", "content": "Hello there"}]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("embedding-models")
    make_checkpoint(folder / "chat", chat_template=TOOLS_CHAT_TEMPLATE)
    make_embedder(folder / "embedder", seed=1)
    make_encoder(folder / "encoder", seed=2)
    return folder


@pytest.fixture(scope="module")
def server(folder):
    proc, url = start_server("--model", str(folder), "--max-model-len", "256", "--num-pages", "256")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def decoder_vectors(folder):
    """The decoder embedder's vectors of TEXTS, in process (the engine test checks them against mlx-lm)."""
    return np.array(LLM(str(folder / "embedder"), max_model_len=256, num_pages=64).embed(TEXTS))


@pytest.fixture(scope="module")
def encoder_vectors(folder):
    """The encoder's vectors of TEXTS as mlx-embeddings itself makes them (mean pooled, normalised)."""
    model, tokenizer = mlx_embeddings.load(str(folder / "encoder"))
    batch = tokenizer._tokenizer(TEXTS, padding=True, return_tensors="np")
    out = model(mx.array(batch["input_ids"]), attention_mask=mx.array(batch["attention_mask"]))
    return np.array(out.text_embeds)


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused")


def test_openai_client_gets_the_vectors_of_both_kinds(server, decoder_vectors, encoder_vectors):
    for model, expected in (("embedder", decoder_vectors), ("encoder", encoder_vectors)):
        reply = client(server).embeddings.create(model=model, input=TEXTS)  # the client asks for base64
        np.testing.assert_allclose([d.embedding for d in reply.data], expected, atol=TOLERANCE)
        assert [d.index for d in reply.data] == [0, 1, 2, 3] and reply.model == model
        assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0


def test_base64_decodes_to_the_floats(server):
    body = {"model": "embedder", "input": TEXTS[0]}
    floats = httpx.post(f"{server}/v1/embeddings", json=body).json()["data"][0]["embedding"]
    encoded = httpx.post(f"{server}/v1/embeddings", json=body | {"encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), "<f4")
    assert decoded.tolist() == np.asarray(floats, np.float32).tolist()


def test_token_ids_are_inputs_too(server, folder):
    llm = LLM(str(folder / "embedder"), max_model_len=256, num_pages=64)
    ids = llm.tokenizer.encode(TEXTS[1])
    one = client(server).embeddings.create(model="embedder", input=ids, encoding_format="float")
    two = client(server).embeddings.create(model="embedder", input=[ids, ids[:3]], encoding_format="float")
    expected = llm.embed([ids, ids[:3]])
    np.testing.assert_allclose(one.data[0].embedding, expected[0], atol=TOLERANCE)
    np.testing.assert_allclose([d.embedding for d in two.data], expected, atol=TOLERANCE)
    assert two.usage.prompt_tokens == len(ids) + 3


def test_dimensions_cut_where_the_checkpoint_allows(server, decoder_vectors):
    reply = client(server).embeddings.create(model="embedder", input=TEXTS[:2], dimensions=16)
    cut = decoder_vectors[:2, :16] / np.linalg.norm(decoder_vectors[:2, :16], axis=1, keepdims=True)
    np.testing.assert_allclose([d.embedding for d in reply.data], cut, atol=TOLERANCE)
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).embeddings.create(model="encoder", input="x", dimensions=16)
    assert refused.value.body["param"] == "dimensions"
    assert refused.value.body["message"] == "dimensions: this model makes vectors of 64 numbers, not 16"


def test_ollama_client_embeds(server, decoder_vectors, encoder_vectors):
    ollama_client = ollama.Client(host=server)
    reply = ollama_client.embed(model="embedder", input=TEXTS)
    np.testing.assert_allclose(reply.embeddings, decoder_vectors, atol=TOLERANCE)
    assert reply.prompt_eval_count > 0
    np.testing.assert_allclose(
        ollama_client.embed(model="encoder", input=TEXTS[2]).embeddings, encoder_vectors[2:3], atol=TOLERANCE
    )
    older = ollama_client.embeddings(model="embedder", prompt=TEXTS[3])
    np.testing.assert_allclose(older.embedding, decoder_vectors[3], atol=TOLERANCE)
    shown = ollama_client.show("encoder")
    assert shown.capabilities == ["embedding"]
    assert shown.modelinfo == {
        "general.architecture": "bert",
        "bert.context_length": 514,
        "bert.embedding_length": 64,
        "bert.pooling_type": "mean",
    }


def test_inputs_too_long_are_refused_or_cut_as_each_api_says(server, folder):
    long_text = " ".join(["word"] * 400)
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).embeddings.create(model="embedder", input=["fine", long_text])
    assert refused.value.body["param"] == "input"
    assert refused.value.body["message"].startswith("input 1 has ")
    assert refused.value.body["message"].endswith("tokens; this model takes at most 256")
    cut = ollama.Client(host=server).embed(model="embedder", input=long_text)  # Ollama truncates unless told
    ids = LLM(str(folder / "embedder"), max_model_len=256, num_pages=64).tokenizer.encode(long_text)[:256]
    assert cut.prompt_eval_count == 256
    refused_too = httpx.post(f"{server}/api/embed", json={"model": "embedder", "input": long_text, "truncate": False})
    assert refused_too.status_code == 400 and refused_too.json()["error"].startswith("input 0 has ")
    assert len(ids) == 256


def test_a_model_asked_for_what_it_does_not_do_is_a_400_naming_it(server):
    with pytest.raises(openai.BadRequestError) as chat_for_vectors:
        client(server).embeddings.create(model="chat", input="x")
    assert chat_for_vectors.value.body["param"] == "model"
    assert chat_for_vectors.value.body["message"].startswith("model 'chat' is not an embedding model")
    with pytest.raises(ollama.ResponseError) as ollama_refusal:
        ollama.Client(host=server).embed(model="chat", input="x")
    assert ollama_refusal.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as vectors_for_chat:
        client(server).chat.completions.create(model="encoder", messages=HI, max_tokens=2)
    assert vectors_for_chat.value.body["message"].startswith("model 'encoder' is an embedding model")
    for body in ({"model": "embedder", "input": []}, {"model": "embedder", "input": [[5, 99999]]}):
        refused = httpx.post(f"{server}/v1/embeddings", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
    mixed = httpx.post(f"{server}/v1/embeddings", json={"model": "embedder", "input": ["a", [1, 2]]})
    assert (mixed.status_code, mixed.json()["error"]) == (
        400,
        {
            "message": "input must be a text, a list of texts, a list of token ids, or a list of such lists",
            "type": "invalid_request_error",
            "param": "input",
            "code": None,
        },
    )
    number = httpx.post(f"{server}/api/embed", json={"model": "encoder", "input": 5})
    assert (number.status_code, number.json()) == (400, {"error": "input must be a text or a list of texts"})
    soon = httpx.post(f"{server}/api/embed", json={"model": "encoder", "input": "a", "keep_alive": "soon"})
    message = "keep_alive must be seconds or a duration such as '5m' or '1h', got 'soon'"
    assert (soon.status_code, soon.json()) == (400, {"error": message})


def test_an_embedding_batch_beside_streaming_chats(server, folder, decoder_vectors):
    llm = LLM(str(folder / "chat"), max_model_len=256, num_pages=64)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    solo = llm.generate([prompt_ids(llm.tokenizer, HI)], params, continuation=False)[0].text

    def chat(_):
        stream = client(server).chat.completions.create(
            model="chat", messages=HI, max_tokens=24, temperature=0, stream=True
        )
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    with ThreadPoolExecutor(5) as pool:
        chats = [pool.submit(chat, i) for i in range(4)]
        batch = pool.submit(client(server).embeddings.create, model="embedder", input=TEXTS * 16)
        assert [c.result() for c in chats] == [solo] * 4
        vectors = np.array([d.embedding for d in batch.result().data])
    np.testing.assert_allclose(vectors, np.tile(decoder_vectors, (16, 1)), atol=TOLERANCE)
    ps = sorted(m["name"] for m in httpx.get(f"{server}/api/ps").json()["models"])
    assert ps == ["chat", "embedder", "encoder"]
