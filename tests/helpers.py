"""Helpers the test modules share: caches filled as an engine would fill them."""

import importlib
import socket
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm import load as mlx_lm_load

from mlxkv import KVCacheManager
from mlxkv.engine.sampling import TokenSampler

mlx_lm_generate = importlib.import_module("mlx_lm.generate")
MAX_TOKENS = 20


def scramble_free_pages(cache, rng):
    """Leave the pool's free queue in random order: one page per owner, freed shuffled."""
    for page in range(cache.pool.capacity):
        cache.pool.alloc(("scramble", page), 1)
    for page in rng.permutation(cache.pool.capacity):
        cache.pool.free(("scramble", int(page)))


def packed_step(
    layout,
    page_size,
    kv_heads,
    head_dim,
    dtype,
    contexts,
    query_lens,
    seed=0,
    max_model_len=128,
    kv_bits=None,
    kv_group_size=64,
):
    """A cache filled in interleaved chunks (pages out of order), then one packed step."""
    rng = np.random.default_rng(seed)
    cache = KVCacheManager(
        1,
        kv_heads,
        head_dim,
        max_num_seqs=len(contexts) + 3,
        max_model_len=max_model_len,
        layout=layout,
        page_size=page_size,
        dtype=dtype,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
    )
    if layout == "paged":
        scramble_free_pages(cache, rng)
    ids = cache.claim(len(contexts))

    def add(seq_ids, counts):
        batch = cache.append(seq_ids, counts)
        shape = (sum(counts), kv_heads, head_dim)
        cache.write(0, batch, mx.array(rng.standard_normal(shape), dtype), mx.array(rng.standard_normal(shape), dtype))
        return batch

    left = {s: c - q for s, c, q in zip(ids, contexts, query_lens)}
    while any(left.values()):
        chunk = {s: min(n, int(rng.integers(1, 2 * page_size))) for s, n in left.items() if n}
        add(list(chunk), list(chunk.values()))
        left = {s: left[s] - chunk.get(s, 0) for s in left}
    return cache, add(ids, query_lens)


def mlx_lm_greedy(path, prompt, max_tokens=MAX_TOKENS):
    """mlx-lm's own greedy tokens for `prompt`, up to (not including) EOS."""
    model, tokenizer = mlx_lm_load(str(path))
    tokens = []
    for token, _ in mlx_lm_generate.generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        if int(token) in tokenizer.eos_token_ids:
            break
        tokens.append(int(token))
    return tokens


def mlx_lm_quantized_greedy(path, prompt, bits, max_tokens=MAX_TOKENS):
    """mlx-lm's own greedy tokens with its quantized KV cache from the first step, and at each
    step how far apart its top two log-probabilities are."""
    model, _ = mlx_lm_load(str(path))
    tokens, gaps = [], []
    for token, logprobs in mlx_lm_generate.generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=lambda x: mx.argmax(x, axis=-1),
        kv_bits=bits,
        kv_group_size=64,
        quantized_kv_start=0,
    ):
        second, first = mx.sort(logprobs)[-2:].tolist()
        tokens.append(int(token))
        gaps.append(first - second)
    return tokens, gaps


def mlx_lm_text(tokenizer, tokens):
    """The text mlx-lm's streaming detokenizer makes of `tokens` (what its own CLI prints)."""
    detokenizer = tokenizer.detokenizer
    for token in tokens:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def mutant_kernels(old: str, new: str):
    """A `metal_kernel` factory for the CPU simulator that replaces `old` by `new` in every
    kernel source holding it: a kernel with a planted bug."""
    from mlxkv.attention.simulator import metal_kernel

    def factory(**kw):
        return metal_kernel(**{**kw, "source": kw["source"].replace(old, new)})

    return factory


def uncompilable_kernels(**kw):
    """A `metal_kernel` factory whose kernels fail as Metal's compiler does on a bad source."""

    def launch(**_):
        raise RuntimeError(
            f"[metal::Device] Unable to build metal library from source\n"
            f"{kw['name']}:12:5: error: no matching function for call to 'attend_keys'"
        )

    return launch


class ExplodingSampler(TokenSampler):
    """A request's sampler that raises when used: a failure that belongs to one request."""

    def key(self, index):
        raise RuntimeError("sampler exploded")


def start_server(*flags: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """`mlxkv serve` with the demo model on 127.0.0.1 (a free port unless `port`), once /health answers."""
    import httpx

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxkv", "serve", "--port", str(port), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read())
    raise TimeoutError("the server did not come up")


def stop_server(proc: subprocess.Popen) -> str:
    """Stop the server; returns what it wrote to stderr."""
    proc.terminate()
    return proc.communicate(timeout=30)[1]
