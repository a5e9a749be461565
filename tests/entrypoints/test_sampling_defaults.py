"""One sampling for a conversation whose request says nothing: the model's recommended, else 0.7."""

import json

import httpx
import pytest
from helpers import start_server, stop_server

from mlxkv.entrypoints.sampling_defaults import CONVERSATION, conversation_sampling, recommended_sampling
from mlxkv.models.loading import DEMO_MODEL
from mlxkv.models.random_model import make_checkpoint

QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [1, 2]}


def with_generation_config(path, config):
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_the_model_s_recommendation_wins_over_the_default(tmp_path):
    assert conversation_sampling(DEMO_MODEL) == CONVERSATION == {"temperature": 0.7}
    with_generation_config(tmp_path, QWEN3)
    assert conversation_sampling(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    with_generation_config(tmp_path, {"do_sample": False, "temperature": 0.9})
    assert recommended_sampling(tmp_path) == {"temperature": 0.0}


def test_a_recommendation_sampling_refuses_or_a_broken_file_is_ignored(tmp_path, caplog):
    with_generation_config(tmp_path, {"temperature": -1, "top_p": 0.9})
    assert recommended_sampling(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert recommended_sampling(tmp_path) == {}
    assert caplog.text.count("ignoring") == 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = with_generation_config(make_checkpoint(tmp_path_factory.mktemp("gc") / "tiny"), QWEN3)
    proc, url = start_server("--model", str(path), "--max-model-len", "256")
    yield url, str(path)
    stop_server(proc)


def test_every_api_samples_as_the_model_recommends_where_a_request_says_nothing(served):
    url, model = served
    shown = httpx.post(f"{url}/api/show", json={"model": model}).json()
    assert shown["parameters"] == "temperature 0.6\ntop_p 0.95\ntop_k 20"

    def chat(**sampling):
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "seed": 7}
        return httpx.post(f"{url}/v1/chat/completions", json=body | sampling).json()["choices"][0]["message"]

    def ollama(**options):
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "stream": False}
        return httpx.post(f"{url}/api/chat", json=body | {"options": {"num_predict": 24, "seed": 7} | options}).json()

    recommended = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert chat() == chat(**recommended) != chat(temperature=0.7)
    assert ollama()["message"] == ollama(**recommended)["message"] != ollama(temperature=0.7)["message"]
