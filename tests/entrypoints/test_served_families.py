"""Every supported family served by a real `mlxkv serve` process, its checkpoint as published ones are
(4-bit, the config fields of its family, a chat template, added-token markers): completions and chat,
streamed and whole, are the text `LLM` gives in this process."""

import openai
import pytest
from helpers import FAMILIES, family_checkpoint, start_server, stop_server

from mlxkv import LLM, SamplingParams
from mlxkv.entrypoints.prompts import prompt_ids
from mlxkv.models.random_model import TOOLS_CHAT_TEMPLATE

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paged attention keeps keys"}]
TOKENS = 12


def streamed(chunks):
    """The text of a completion's or a chat's stream."""
    pieces = [c.choices[0] for c in chunks]
    return "".join(p.text if hasattr(p, "text") else p.delta.content or "" for p in pieces)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_serve_answers_completions_and_chat_with_the_text_llm_gives(tmp_path, name):
    path = family_checkpoint(tmp_path / name, name, bits=4, chat_template=TOOLS_CHAT_TEMPLATE)
    llm = LLM(str(path), max_num_seqs=4)
    params = SamplingParams(max_tokens=TOKENS)
    completion = llm.generate(PROMPT, params)[0]
    chat = llm.generate(prompt_ids(llm.tokenizer, MESSAGES), params, continuation=False)[0].text  # a reply
    proc, url = start_server("--model", str(path), "--max-num-seqs", "4")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        (model,) = client.models.list().data
        ask = dict(model=model.id, max_tokens=TOKENS, temperature=0)
        whole = client.completions.create(prompt=PROMPT, **ask)
        assert (whole.choices[0].text, whole.choices[0].finish_reason) == (completion.text, completion.finish_reason)
        assert streamed(client.completions.create(prompt=PROMPT, stream=True, **ask)) == completion.text
        reply = client.chat.completions.create(messages=MESSAGES, **ask)
        assert reply.choices[0].message.content == chat
        assert streamed(client.chat.completions.create(messages=MESSAGES, stream=True, **ask)) == chat
    finally:
        stop_server(proc)
