"""Reference paged attention in pure MLX: the path on machines without Metal, and the kernels' oracle."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..cache.manager import KVBatch
from ..cache.storage import Pool, QuantizedPages

QUERY_TILE = 512
LOG2_E = math.log2(math.e)


def gather_kv(pool: Pool, block_tables: np.ndarray, length: int) -> mx.array:
    """The first `length` tokens of each row's pages as `[rows, kv_heads, tokens, head_dim]`.

    Tokens past a row's own context are whatever the pages hold; callers mask them.
    Quantized pages are gathered packed and dequantized after the gather. Measured on the
    CPU against `mx.quantized_matmul` over the gathered packed rows: ten times as fast in
    float16 and bfloat16, whose quantized matmul has no fast CPU path; in float32 from
    twice as fast (one sequence, 8-bit) to half as fast (16 sequences, 4-bit).
    """
    return _gather_with(pool, _Gather.of(block_tables, length, pool.shape[1], pool.shape[2]))


@dataclass(frozen=True)
class _Gather:
    """Which pages `gather_kv` takes: one page sliced (no whole-slot read for the contiguous
    layout) or several gathered head-major in one `take` (which yields the head-major result
    directly instead of gathering and then transposing)."""

    rows: int
    length: int
    page: mx.array | None      # one page: each row's page
    indices: mx.array | None   # several: `[rows, kv_heads, pages]` into `[pages * kv_heads, ...]`

    @classmethod
    def of(cls, block_tables: np.ndarray, length: int, kv_heads: int, page_size: int) -> _Gather:
        pages = -(-length // page_size)
        if pages == 1:
            return cls(len(block_tables), length, mx.array(block_tables[:, 0]), None)
        rows = block_tables[:, None, :pages] * kv_heads + np.arange(kv_heads, dtype=np.int32)[None, :, None]
        return cls(len(block_tables), length, None, mx.array(rows))


def _gather_with(pool: Pool, where: _Gather) -> mx.array:
    if isinstance(pool, QuantizedPages):
        return pool.dequantize(tuple(_take(part, where) for part in pool.parts))
    return _take(pool, where)


def _take(pool: mx.array, where: _Gather) -> mx.array:
    num_pages, kv_heads, page_size, row = pool.shape
    if where.page is not None:
        return mx.take(pool[:, :, :where.length], where.page, axis=0)
    gathered = mx.take(pool.reshape(num_pages * kv_heads, page_size, row), where.indices, axis=0)
    return gathered.reshape(where.rows, kv_heads, where.indices.shape[-1] * page_size, row)


def _softmax(scores: mx.array, sinks: mx.array | None = None) -> mx.array:
    """`mx.softmax` over the last axis, with `exp(x)` computed as `2 ** (x * log2(e))`;
    `sinks` (broadcast against `scores[..., :1]`) are extra logits that take their share of
    the weight and give nothing back (GPT-OSS's attention sinks).

    Equal up to rounding, and the same trick as flash attention's exp2: on the CPU, MLX's
    `power(2, x)` runs about three times as fast as its `exp`, which is most of the cost
    of attending over a long context there."""
    top = mx.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        top = mx.maximum(top, sinks)
    weights = mx.power(2.0, (scores - top) * LOG2_E)
    total = mx.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + mx.power(2.0, (sinks - top) * LOG2_E)
    return weights / total


@dataclass(frozen=True)
class Variant:
    """How one layer's attention departs from plain causal softmax attention.

    `window`: a query at position p sees keys p - window < j <= p (sliding-window layers);
    `softcap`: scores become softcap * tanh(score / softcap) (Gemma 2); `sinks`: one logit
    per query head that joins every softmax (GPT-OSS)."""

    window: int | None = None
    softcap: float | None = None
    sinks: mx.array | None = None


PLAIN = Variant()


def visible(query_pos: np.ndarray, key_pos: np.ndarray, window: int | None) -> np.ndarray:
    """Which keys each query sees (broadcast): causally, and within `window` positions when given."""
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    return allowed


@dataclass(frozen=True)
class _Group:
    """Rows of a batch attended together, `width` queries each: which queries, which pages,
    which keys each query may see. Built once per batch, shared by every layer."""

    width: int
    token_ids: np.ndarray
    queries: mx.array | None   # `token_ids` as an index; None when they are all the batch's tokens in order
    gather: _Gather
    allowed: mx.array          # `[rows, 1, 1, width, keys]`


@lru_cache(maxsize=16)
def _plan(batch: KVBatch, kv_heads: int, page_size: int, window: int | None) -> tuple[list[_Group], mx.array | None]:
    """How `reference_attention` splits `batch`, and the permutation back to packed order.

    Decode rows go together in buckets of similar length (page counts within a power of two),
    so a short context does not copy the batch's longest; each prefill chunk goes on its own in
    tiles of at most `QUERY_TILE` queries, which bounds the score matrix whatever its length."""
    q_lens, ctx, tables, starts = batch.query_lens, batch.context_lens, batch.block_tables, batch.query_starts
    pieces = []
    decode = np.flatnonzero(q_lens == 1)
    buckets = np.frexp(-(-ctx[decode] // page_size))[1]  # the page count's bit length
    for bucket in sorted(set(buckets.tolist())):
        rows = decode[buckets == bucket]
        pieces.append((starts[rows], 1, ctx[rows], tables[rows]))
    for row in np.flatnonzero(q_lens > 1):
        for lo in range(0, int(q_lens[row]), QUERY_TILE):
            n = min(QUERY_TILE, int(q_lens[row]) - lo)
            pieces.append((starts[row:row + 1] + lo, n, np.array([ctx[row] - q_lens[row] + lo + n]),
                           tables[row:row + 1]))
    groups = [_group(*piece, kv_heads, page_size, window, batch.num_tokens) for piece in pieces]
    return groups, _unpermutation(np.concatenate([g.token_ids for g in groups]) if groups else np.zeros(0, np.int64))


def _group(starts: np.ndarray, width: int, ctx: np.ndarray, tables: np.ndarray, kv_heads: int, page_size: int,
           window: int | None, total: int) -> _Group:
    """Rows of `width` queries each, from token `starts[i]`, the last one at position `ctx[i] - 1`,
    in a batch of `total` tokens."""
    token_ids = (starts[:, None] + np.arange(width)[None, :]).reshape(-1)
    query_pos = (ctx - width)[:, None] + np.arange(width)[None, :]
    first_page = 0 if window is None else max(0, int(query_pos.min()) - window + 1) // page_size
    length = int(ctx.max()) - first_page * page_size
    gather = _Gather.of(tables[:, first_page:], length, kv_heads, page_size)
    keys = length if gather.page is not None else gather.indices.shape[-1] * page_size
    allowed = visible(query_pos[:, :, None], first_page * page_size + np.arange(keys)[None, None, :], window)
    everything = token_ids.size == total and np.array_equal(token_ids, np.arange(total))
    queries = None if everything else mx.array(token_ids.astype(np.int32))
    return _Group(width, token_ids, queries, gather, mx.array(allowed[:, None, None]))


def _attend(queries: mx.array, k_pool: Pool, v_pool: Pool, group: _Group, scale: float, variant: Variant) -> mx.array:
    """Attention for one group of rows (its queries in packed order), written out rather than
    through MLX's SDPA: with `_softmax`'s `power(2, x)` it is the faster on the CPU (SDPA,
    which uses `exp`, took 12% longer to prefill 2,000 tokens of the ~100M Llama and decoded
    14% slower at that context, though it builds a dozen fewer graph nodes per layer)."""
    n, width = group.gather.rows, group.width
    q_heads, head_dim = queries.shape[1], queries.shape[2]
    kv_heads = k_pool.shape[1]
    grouped = q_heads // kv_heads
    q = queries if group.queries is None else queries[group.queries]
    if width > 1:
        q = q.reshape(n, width, kv_heads, grouped, head_dim).transpose(0, 2, 3, 1, 4)
    q = q.reshape(n, kv_heads, grouped * width, head_dim)
    keys, values = _gather_with(k_pool, group.gather), _gather_with(v_pool, group.gather)
    scores = ((q * scale) @ keys.swapaxes(-1, -2)).reshape(n, kv_heads, grouped, width, -1)
    if variant.softcap is not None:
        scores = mx.tanh(scores / variant.softcap) * variant.softcap
    scores = mx.where(group.allowed, scores, -math.inf)
    sinks = None if variant.sinks is None else variant.sinks.astype(mx.float32).reshape(1, kv_heads, grouped, 1, 1)
    probs = _softmax(_as(scores, mx.float32), sinks)
    out = _as(probs, values.dtype).reshape(n, kv_heads, grouped * width, -1) @ values
    if width > 1:
        out = out.reshape(n, kv_heads, grouped, width, head_dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(n * width, q_heads, head_dim)


def _as(array: mx.array, dtype: mx.Dtype) -> mx.array:
    """`array` in `dtype`, without a copy when it already is (`astype` always makes one)."""
    return array if array.dtype == dtype else array.astype(dtype)


def reference_attention(queries: mx.array, k_pool: Pool, v_pool: Pool, batch: KVBatch,
                        scale: float | None = None, variant: Variant = PLAIN) -> mx.array:
    """Attention for a packed batch of decode rows and prefill chunks, with GQA.

    `queries` is `[tokens, q_heads, head_dim]`, packed row after row as in `batch`; each
    new token attends causally to its sequence's cached tokens and the chunk's earlier
    tokens, which must already be written to the pools (float or quantized), as `variant`
    says (a sliding window reads only the pages the window reaches). Rows are split as
    `_plan` says, once per batch for all layers. Returns `[tokens, q_heads, head_dim]`.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(queries.shape[-1])
    groups, unpermute = _plan(batch, k_pool.shape[1], k_pool.shape[2], variant.window)
    return _joined([_attend(queries, k_pool, v_pool, group, scale, variant) for group in groups], unpermute)


def in_packed_order(parts: list[tuple[mx.array, np.ndarray]]) -> mx.array:
    """Outputs computed for groups of a batch's tokens, `(out, the token ids of its rows)`, as
    one array in the packed order of the tokens."""
    return _joined([p[0] for p in parts], _unpermutation(np.concatenate([p[1] for p in parts])))


def _joined(outs: list[mx.array], unpermute: mx.array | None) -> mx.array:
    """`outs` concatenated, then put back in packed order by `unpermute` (None: they are)."""
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs)
    return out if unpermute is None else out[unpermute]


def _unpermutation(order: np.ndarray) -> mx.array | None:
    """The index that puts rows computed in `order` (token ids) back in packed order; None if they are."""
    return None if np.array_equal(order, np.arange(order.size)) else mx.array(np.argsort(order).astype(np.int32))
