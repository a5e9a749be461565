"""Reference paged attention in pure MLX: the path on machines without Metal, and the kernels' oracle."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..cache.batch import KVBatch
from ..cache.storage import Pages, QuantizedPages
from .heads import FLOAT32, Heads
from .variant import PLAIN, Variant, key_range, visible

QUERY_TILE = 512  # most queries of one chunk attended at once
KEY_TILE = 1024  # most keys attended at once: with QUERY_TILE, what bounds a step's scores
SCORE_COPIES = 3  # score-sized float32 arrays alive at once: scores, their exponentials, and a cast
NOTHING_SEEN = -1e30  # the running softmax's top score before a query has seen a key (finite: no inf - inf)
LOG2_E = math.log2(math.e)


def gather_kv(pages: Pages, page_tables: np.ndarray, length: int) -> mx.array:
    """The first `length` tokens of each row's pages as `[rows, kv_heads, tokens, head_dim]`.

    Tokens past a row's own context are whatever the pages hold; callers mask them. Quantized
    pages are gathered packed and dequantized after the gather, which on the CPU is faster than
    `mx.quantized_matmul` in half precision (docs/quantized-kv.md).
    """
    return _gather_with(pages, _Gather.of(page_tables, length, pages.shape[1], pages.shape[2]))


@dataclass(frozen=True)
class _Gather:
    """Which pages `gather_kv` takes: one page sliced (the contiguous layout's page is read only
    as far as the context goes) or several gathered head-major in one `take` (which yields the
    head-major result directly instead of gathering and then transposing)."""

    rows: int
    length: int
    one_page: bool
    index: mx.array  # one page: each row's page; several: `[rows, kv_heads, pages]` into `[pages * kv_heads, ...]`
    keys: int  # keys per row in the gathered result: `length`, or whole pages

    @classmethod
    def of(cls, page_tables: np.ndarray, length: int, kv_heads: int, page_size: int) -> _Gather:
        pages = -(-length // page_size)
        if pages == 1:
            return cls(len(page_tables), length, True, mx.array(page_tables[:, 0]), length)
        rows = page_tables[:, None, :pages] * kv_heads + np.arange(kv_heads, dtype=np.int32)[None, :, None]
        return cls(len(page_tables), length, False, mx.array(rows), pages * page_size)


def _gather_with(pages: Pages, where: _Gather) -> mx.array:
    if isinstance(pages, QuantizedPages):
        return pages.dequantize(tuple(_take(part, where) for part in pages.parts))
    return _take(pages, where)


def _take(pages: mx.array, where: _Gather) -> mx.array:
    num_pages, kv_heads, page_size, row = pages.shape
    if where.one_page:
        return mx.take(pages[:, :, : where.length], where.index, axis=0)
    gathered = mx.take(pages.reshape(num_pages * kv_heads, page_size, row), where.index, axis=0)
    return gathered.reshape(where.rows, kv_heads, where.keys, row)


def _exp(x: mx.array) -> mx.array:
    """`exp(x)` as `2 ** (x * log2(e))`."""
    # why: on the CPU MLX's power(2, x) is several times as fast as its exp (docs/benchmarks.md)
    return mx.power(2.0, x * LOG2_E)


def _softmax(scores: mx.array, sinks: mx.array | None = None) -> mx.array:
    """`mx.softmax` over the last axis (with `_exp`); `sinks` (broadcast against `scores[..., :1]`)
    are extra logits that take their share of the weight and give nothing back (GPT-OSS's
    attention sinks)."""
    top = mx.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        top = mx.maximum(top, sinks)
    weights = _exp(scores - top)
    total = mx.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + _exp(sinks - top)
    return weights / total


@dataclass(frozen=True)
class _KeyTile:
    """Some of a group's keys, attended together: which pages, and which of their keys each query
    may see (None: all of them)."""

    gather: _Gather
    allowed: mx.array | None  # `[rows, 1, 1, width, keys]`


@dataclass(frozen=True)
class _Group:
    """Rows of a batch attended together, `width` queries each: which queries, and their keys in
    tiles. Built once per batch, shared by every layer."""

    width: int
    token_ids: np.ndarray
    queries: mx.array | None  # `token_ids` as an index; None when they are all the batch's tokens in order
    tiles: list[_KeyTile]


@lru_cache(maxsize=16)
def _split(
    batch: KVBatch, kv_heads: int, page_size: int, window: int | None, chunk: int | None
) -> tuple[list[_Group], mx.array | None]:
    """How `reference_attention` splits `batch`, and the permutation back to packed order.

    Decode rows go together in buckets of similar length (page counts within a power of two),
    so a short context does not copy the batch's longest; each prefill chunk goes on its own in
    tiles of at most `QUERY_TILE` queries (with the blocks its tokens see whole); and every group
    reads its keys `KEY_TILE` at a time.
    So the scores and gathered K/V a layer holds at once are bounded, whatever the context."""
    q_lens, ctx, tables, starts = batch.query_lens, batch.context_lens, batch.page_tables, batch.query_starts
    pieces: list[tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray | None]] = []
    decode = np.flatnonzero(q_lens == 1)
    buckets = np.frexp(-(-ctx[decode] // page_size))[1]  # the page count's bit length
    for bucket in sorted(set(buckets.tolist())):
        rows = decode[buckets == bucket]
        pieces.append((starts[rows], 1, ctx[rows], tables[rows], None))
    for row in np.flatnonzero(q_lens > 1):
        for lo in range(0, int(q_lens[row]), QUERY_TILE):
            n = min(QUERY_TILE, int(q_lens[row]) - lo)
            first = int(starts[row]) + lo
            blocks = None if batch.blocks is None else batch.blocks[first : first + n]
            last = np.array([ctx[row] - q_lens[row] + lo + n])
            pieces.append((starts[row : row + 1] + lo, n, last, tables[row : row + 1], blocks))
    groups = [_group(*piece, kv_heads, page_size, window, chunk, batch.num_tokens) for piece in pieces]
    return groups, _unpermutation(np.concatenate([g.token_ids for g in groups]) if groups else np.zeros(0, np.int64))


def _group(
    starts: np.ndarray,
    width: int,
    ctx: np.ndarray,
    tables: np.ndarray,
    blocks: np.ndarray | None,
    kv_heads: int,
    page_size: int,
    window: int | None,
    chunk: int | None,
    total: int,
) -> _Group:
    """Rows of `width` queries each, from token `starts[i]`, the last one at position `ctx[i] - 1`,
    in a batch of `total` tokens; `blocks`: a single row's queries' blocks (`KVBatch.blocks`)."""
    token_ids = (starts[:, None] + np.arange(width)[None, :]).reshape(-1)
    query_pos = ((ctx - width)[:, None] + np.arange(width)[None, :])[:, :, None]
    first, end = key_range(query_pos, window, chunk, blocks)
    shaped = None if blocks is None else blocks.reshape(1, width, 1, 2)
    per_tile = max(1, KEY_TILE // page_size)  # pages
    tiles = []
    for page in range(first // page_size, -(-end // page_size), per_tile):
        length = min(end - page * page_size, per_tile * page_size)
        gather = _Gather.of(tables[:, page : page + per_tile], length, kv_heads, page_size)
        key_pos = page * page_size + np.arange(gather.keys)[None, None, :]
        allowed = visible(query_pos, key_pos, window, chunk, shaped)
        tiles.append(_KeyTile(gather, None if allowed.all() else mx.array(allowed[:, None, None])))
    everything = token_ids.size == total and np.array_equal(token_ids, np.arange(total))
    queries = None if everything else mx.array(token_ids.astype(np.int32))
    return _Group(width, token_ids, queries, tiles)


def _attend(
    queries: mx.array, k_pages: Pages, v_pages: Pages, group: _Group, scale: float, variant: Variant
) -> mx.array:
    """Attention for one group of rows (its queries in packed order): a plain softmax over one key
    tile, a running one over several."""
    # why: written out rather than through MLX's SDPA, whose exp is the slower on the CPU (docs/benchmarks.md)
    n, width = group.tiles[0].gather.rows, group.width
    q_heads, head_dim = queries.shape[1], queries.shape[2]
    kv_heads = k_pages.shape[1]
    grouped = q_heads // kv_heads
    q = queries if group.queries is None else queries[group.queries]
    if width > 1:
        q = q.reshape(n, width, kv_heads, grouped, head_dim).transpose(0, 2, 3, 1, 4)
    q = q.reshape(n, kv_heads, grouped * width, head_dim)
    sinks = None if variant.sinks is None else variant.sinks.astype(mx.float32).reshape(1, kv_heads, grouped, 1, 1)
    if len(group.tiles) == 1:
        tile = group.tiles[0]
        probs = _softmax(_scores(q * scale, k_pages, tile, variant, (n, kv_heads, grouped, width)), sinks)
        values = _gather_with(v_pages, tile.gather)
        out = _as(probs, values.dtype).reshape(n, kv_heads, grouped * width, -1) @ values
    else:
        out = _running_softmax(q * scale, k_pages, v_pages, group.tiles, variant, sinks, (n, kv_heads, grouped, width))
    if width > 1:
        out = out.reshape(n, kv_heads, grouped, width, head_dim).transpose(0, 3, 1, 2, 4)
    return _as(out.reshape(n * width, q_heads, head_dim), queries.dtype)


def _scores(q: mx.array, k_pages: Pages, tile: _KeyTile, variant: Variant, shape: tuple[int, ...]) -> mx.array:
    """`[rows, kv_heads, grouped, width, keys]` float32 scores of the scaled queries `q` against
    one tile's keys, soft-capped, the keys a query may not see at -inf."""
    scores = (q @ _gather_with(k_pages, tile.gather).swapaxes(-1, -2)).reshape(*shape, -1)
    if variant.softcap is not None:
        scores = mx.tanh(scores / variant.softcap) * variant.softcap
    if tile.allowed is not None:
        scores = mx.where(tile.allowed, scores, -math.inf)
    return _as(scores, mx.float32)


def _running_softmax(
    q: mx.array,
    k_pages: Pages,
    v_pages: Pages,
    tiles: list[_KeyTile],
    variant: Variant,
    sinks: mx.array | None,
    shape: tuple[int, ...],
) -> mx.array:
    """Softmax attention over `tiles` one after another (FlashAttention's running softmax): each
    tile's weights are taken against the highest score so far, and what the tiles before summed is
    scaled down when a later tile raises it."""
    rows, kv_heads, grouped, width = shape
    sums = (rows, kv_heads, grouped * width, 1)

    def tile_sums(tile: _KeyTile, queries: mx.array, floor: mx.array | float) -> tuple[mx.array, ...]:
        """A tile's top score (at least `floor`), and its weights' sum and weighted values against it."""
        scores = _scores(queries, k_pages, tile, variant, shape)
        top = mx.maximum(mx.max(scores, axis=-1, keepdims=True), floor)
        weights = _exp(scores - top)
        values = _gather_with(v_pages, tile.gather)
        part = _as(weights, values.dtype).reshape(rows, kv_heads, grouped * width, -1) @ values
        return top, mx.sum(weights, axis=-1, keepdims=True).reshape(sums), _as(part, mx.float32)

    top, total, out = tile_sums(tiles[0], q, NOTHING_SEEN)
    for tile in tiles[1:]:
        # why: without the dependency MLX computes every tile's scores before the first is summed
        highest, summed, part = tile_sums(tile, mx.depends(q, out), top)
        kept = _exp(top - highest).reshape(sums)  # what the tiles before weigh against the new top
        top, total, out = highest, total * kept + summed, out * kept + part
    if sinks is not None:
        total = total + _exp(sinks - top).reshape(sums)
    return out / total


def _as(array: mx.array, dtype: mx.Dtype) -> mx.array:
    """`array` in `dtype`, without a copy when it already is (`astype` always makes one)."""
    return array if array.dtype == dtype else array.astype(dtype)


def reference_attention(
    queries: mx.array,
    k_pages: Pages,
    v_pages: Pages,
    batch: KVBatch,
    scale: float | None = None,
    variant: Variant = PLAIN,
) -> mx.array:
    """Attention for a packed batch of decode rows and prefill chunks, with GQA.

    `queries` is `[tokens, q_heads, head_dim]`, packed row after row as in `batch`; each
    new token attends causally to its sequence's cached tokens and the chunk's earlier
    tokens, which must already be written to the pages (float or quantized), as `variant`
    says (a sliding window reads only the pages the window reaches). Rows are split as
    `_split` says, once per batch for all layers. Returns `[tokens, q_heads, head_dim]`.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(queries.shape[-1])
    groups, unpermute = _split(batch, k_pages.shape[1], k_pages.shape[2], variant.window, variant.chunk)
    return _joined([_attend(queries, k_pages, v_pages, group, scale, variant) for group in groups], unpermute)


def temporary_bytes(heads: Heads, queries: int, context: int) -> int:
    """Most bytes `reference_attention` holds at once, in one layer, for a row of `queries` new
    tokens over `context` keys: a few score tiles of one query tile against one key tile, their
    key tile's gathered K/V and the running output, and one score of every query against every key
    besides: MLX's CPU backend allocates ahead of what it has computed, so the tiles of a row do not
    free their scores before the next tiles allocate theirs (measured: docs/memory.md)."""
    width, keys = min(queries, QUERY_TILE), min(context, KEY_TILE)
    running = 2 * width * heads.q_heads * (heads.head_dim + 2) * FLOAT32
    tiles = (SCORE_COPIES - 1) * heads.score_bytes(width, keys) + heads.kv_bytes(keys) + running
    return heads.score_bytes(queries, context) + tiles


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
