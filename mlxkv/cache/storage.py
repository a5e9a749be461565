"""The KV tensors: per layer, one K pool and one V pool of `[pages, kv_heads, page_size, head_dim]`."""

from __future__ import annotations

import mlx.core as mx

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def resolve_dtype(dtype: mx.Dtype | str) -> mx.Dtype:
    """`dtype` as an MLX dtype; only float16, bfloat16 and float32 are KV dtypes."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype) -> int:
    """K and V bytes one token takes across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.size


def dtype_name(dtype: mx.Dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


class KVStorage:
    """Flat per-layer pools written by in-place scatter.

    Each pool is one MLX array that nothing else keeps alive, so `pool[pages, :, offsets] = new`
    donates the old buffer and writes in place instead of copying the pool (see the design
    notes on buffer donation). Pages are head-major so a kernel reads one KV head's tokens
    of a page as one contiguous run. The contiguous layout is the same storage with one page
    of `max_seq_len` tokens per sequence.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype: mx.Dtype | str,
    ) -> None:
        self.dtype = resolve_dtype(dtype)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.shape = (num_pages, num_kv_heads, page_size, head_dim)
        self.keys, self.values = self._zeroed(num_layers)

    def reset(self) -> None:
        """Fresh zeroed pools, for when a failed step left the old ones unusable."""
        self.keys, self.values = self._zeroed(self.num_layers)

    def _zeroed(self, num_layers: int) -> tuple[list[mx.array], list[mx.array]]:
        keys, values = ([mx.zeros(self.shape, self.dtype) for _ in range(num_layers)] for _ in range(2))
        mx.eval(keys, values)
        return keys, values

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    def layer(self, layer: int) -> tuple[mx.array, mx.array]:
        """The K and V pools of `layer` (read them; don't keep them past the step)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer!r} is outside 0..{self.num_layers - 1}")
        return self.keys[layer], self.values[layer]

    def read(self, layer: int, pages: list[int], count: int) -> tuple[mx.array, mx.array]:
        """The first `count` tokens stored in `pages` of `layer`, as fresh `[count, kv_heads, head_dim]`
        K and V arrays (lazy copies: later writes to the pools do not change them)."""
        pools = self.layer(layer)
        if count == 0:
            empty = mx.zeros((0, self.num_kv_heads, self.head_dim), self.dtype)
            return empty, empty
        index, width = mx.array(pages, mx.int32), min(count, self.page_size)

        def tokens(pool: mx.array) -> mx.array:
            rows = pool[index, :, :width].swapaxes(1, 2)
            return rows.reshape(-1, self.num_kv_heads, self.head_dim)[:count]

        return tokens(pools[0]), tokens(pools[1])

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store one layer's new K/V (`[tokens, kv_heads, head_dim]`) at `slots`."""
        key_pool, value_pool = self.layer(layer)
        for name, array in (("keys", keys), ("values", values)):
            self._check(name, array, slots.size)
        pages = slots // self.page_size
        offsets = slots % self.page_size
        key_pool[pages, :, offsets] = keys
        value_pool[pages, :, offsets] = values

    def _check(self, name: str, array: mx.array, tokens: int) -> None:
        expected = (tokens, self.num_kv_heads, self.head_dim)
        if not isinstance(array, mx.array):
            raise TypeError(f"{name} must be an mlx array, got {type(array).__name__}")
        if tuple(array.shape) != expected:
            raise ValueError(
                f"{name} must have shape (tokens={tokens}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}), got {tuple(array.shape)}"
            )
        if array.dtype != self.dtype:
            raise ValueError(
                f"{name} must have the cache dtype {dtype_name(self.dtype)}, got {array.dtype}"
            )
