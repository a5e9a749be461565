"""What a request arrives as, normalised: its id, and its prompt as token ids."""

from __future__ import annotations

import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper


def request_key(request_id: object) -> str:
    """The id a request is stored under: a string, or an integer written as one."""
    if isinstance(request_id, str) or (isinstance(request_id, int) and not isinstance(request_id, bool)):
        return str(request_id)
    raise TypeError(f"request_id must be a string or an integer, got {type(request_id).__name__}")


def encode_text(tokenizer: TokenizerWrapper, text: str) -> list[int]:
    """Token ids of `text`, with the tokenizer's BOS unless the text starts with it (as mlx-lm does).
    `verbose=False` silences transformers' warning on text longer than the model: the engine
    checks the length itself, and names the setting that limits it."""
    bos = tokenizer.bos_token
    add_bos = bos is None or not text.startswith(bos)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=add_bos, verbose=False)
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


def encode_prompt(tokenizer: TokenizerWrapper, prompt: object, vocab_size: int) -> list[int]:
    """Token ids for a prompt given as text or ids (text gets the tokenizer's BOS, as in mlx-lm); ids
    must lie in the vocabulary and the prompt must not be empty."""
    if isinstance(prompt, str):
        ids = encode_text(tokenizer, prompt)
    else:
        ids = token_ids(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
    if not ids:
        raise ValueError("prompt is empty")
    return ids
