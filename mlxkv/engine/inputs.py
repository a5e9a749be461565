"""What a request arrives as, normalised: its id, its prompt as token ids, its settings checked."""

from __future__ import annotations

import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..cache.pins import Pin
from ..cache.prefix_cache import check_salt
from ..errors import RequestTooLong, counted
from .recent_outputs import RecentOutputs
from .request import Request
from .sampling.params import SamplingParams
from .sampling.structured_output import StructuredOutput
from .sampling.text import ContinuingDetokenizer, TextStream


def request_key(request_id: object) -> str:
    """The id a request is stored under: a string, or an integer written as one."""
    if isinstance(request_id, str) or (isinstance(request_id, int) and not isinstance(request_id, bool)):
        return str(request_id)
    raise TypeError(f"request_id must be a string or an integer, got {type(request_id).__name__}")


def encode_text(
    tokenizer: TokenizerWrapper,
    text: str,
    recent: RecentOutputs | None = None,
    salt: str | None = None,
    templated: bool = False,
) -> list[int]:
    """Token ids of `text`, with the tokenizer's BOS unless the text starts with it (as mlx-lm does)
    or is `templated` (a chat template wrote its special tokens out); where it quotes an output
    in `recent`, that output's own ids. `verbose=False` silences transformers' warning on text
    longer than the model: the engine checks the length itself, and names the setting that limits it."""
    bos = tokenizer.bos_token
    add_bos = not templated and (bos is None or not text.startswith(bos))
    pieces = recent.split(salt, text) if recent is not None else [text]
    if len(pieces) == 1 and isinstance(pieces[0], str):
        return _encoded(tokenizer, text, add_bos)
    lead = _encoded(tokenizer, "", add_bos)
    if lead not in ([], [tokenizer.bos_token_id]):  # special tokens other than a BOS: keep the text whole
        return _encoded(tokenizer, text, add_bos)
    for piece in pieces:
        lead += piece if isinstance(piece, list) else _encoded(tokenizer, piece, False)
    return lead


def _encoded(tokenizer: TokenizerWrapper, text: str, special: bool) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=special, verbose=False)
    return ids


def token_ids(prompt: object) -> list[int]:
    """A prompt of token ids as a list of ints: a sequence or 1-D array of integers, numpy's included."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise TypeError(f"a prompt array must be 1-D integer token ids, got {prompt.ndim}-D {prompt.dtype}")
        ids: list[int] = prompt.tolist()
        return ids
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"prompt must be text or a list of token ids, got {type(prompt).__name__}")
    bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, (int, np.integer))), None)
    if bad is not None:
        raise TypeError(f"prompt token ids must be integers, got {bad!r}")
    return [int(t) for t in prompt]


def encode_prompt(
    tokenizer: TokenizerWrapper,
    prompt: object,
    vocab_size: int,
    recent: RecentOutputs | None = None,
    salt: str | None = None,
    templated: bool = False,
) -> list[int]:
    """Token ids for a prompt given as text (see `encode_text`) or ids; ids must lie in the
    vocabulary and the prompt must not be empty."""
    if isinstance(prompt, str):
        ids = encode_text(tokenizer, prompt, recent, salt, templated)
    else:
        ids = token_ids(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
    if not ids:
        raise ValueError("prompt is empty")
    return ids


def new_request(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams | None,
    cache_salt: str | None,
    pin: Pin | None,
    most_tokens: int,
    tokenizer: TokenizerWrapper,
    structured: StructuredOutput,
    continuation: bool = False,
) -> Request:
    """A request of `prompt_ids`, with its text stream (continuing the prompt's text exactly, or,
    without `continuation`, starting a reply as mlx-lm's detokenizer does) and its constraint; refused
    (`RequestTooLong`) if prompt and `max_tokens` make more than `most_tokens`, with TypeError for
    settings of the wrong kind and ValueError for a constraint that cannot be compiled."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    if pin is not None and not isinstance(pin, Pin):
        raise TypeError(f"pin must be a Pin or None, got {type(pin).__name__}")
    request = Request(request_id, prompt_ids, params, check_salt(cache_salt), pin)
    if request.max_length > most_tokens:
        raise RequestTooLong(
            f"prompt of {counted(len(prompt_ids), 'token')} plus max_tokens={params.max_tokens} makes "
            f"{counted(request.max_length, 'token')}; one request can have at most {most_tokens}"
        )
    detokenizer = ContinuingDetokenizer(tokenizer.decode, prompt_ids) if continuation else tokenizer.detokenizer
    request.stream = TextStream(detokenizer, params.stop)
    request.constraint = structured.constraint(params)
    return request


def embedding_request(
    request_id: str, prompt_ids: list[int], cache_salt: str | None, most_tokens: int, tokenizer: TokenizerWrapper
) -> Request:
    """An embedding request of `prompt_ids` (see `LLMEngine.add_embedding`); refused
    (`RequestTooLong`) if its prompt has more than `most_tokens`, ValueError if it has none."""
    if not prompt_ids:
        raise ValueError("input is empty")
    if len(prompt_ids) > most_tokens:
        raise RequestTooLong(
            f"input of {counted(len(prompt_ids), 'token')}; one embedding input can have at most {most_tokens}"
        )
    request = Request(request_id, prompt_ids, SamplingParams(max_tokens=1), check_salt(cache_salt), embeds=True)
    request.stream = TextStream(tokenizer.detokenizer, ())
    return request
