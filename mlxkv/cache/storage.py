"""The KV tensors: per layer, K pages and V pages of `[pages, kv_heads, page_size, head_dim]`, as
floats or quantized along `head_dim` in `mx.quantize`'s format."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..deprecation import module_getattr
from ..settings import POSITIVE, one_of, optional, require

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)
KV_BITS = optional(one_of(*BITS))
KV_GROUP_SIZES = one_of(*GROUP_SIZES)


@dataclass(frozen=True)
class QuantizedPages:
    """One layer's quantized K (or V) pages: each token's row of `head_dim` values as `bits`-bit integers packed
    into uint32 words (lowest bits first), with a scale and a bias per `group_size` values, so
    value = scale * q + bias. The format `mx.quantize` ("affine") produces, token by token.

    `words` is `[pages, kv_heads, page_size, head_dim * bits / 32]`; `scales` and `biases` are
    `[pages, kv_heads, page_size, head_dim / group_size]` in the cache dtype. `shape` and
    `dtype` describe the float pages they stand for.
    """

    words: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    @classmethod
    def quantize(cls, pages: mx.array, bits: int, group_size: int) -> QuantizedPages:
        """Float pages `[pages, kv_heads, page_size, head_dim]` quantized whole."""
        return cls(*mx.quantize(pages, group_size=group_size, bits=bits), bits, group_size)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        pages, heads, page_size, words = self.words.shape
        return pages, heads, page_size, words * 32 // self.bits

    @property
    def dtype(self) -> mx.Dtype:
        return self.scales.dtype

    @property
    def parts(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.words, self.scales, self.biases

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def dequantize(self, parts: tuple[mx.array, ...] | None = None) -> mx.array:
        """`parts` (rows taken alike from the three arrays; default all of them) as floats.

        Equal to `mx.dequantize` bit for bit; the packed words are read as bytes (4-bit: split
        into nibbles) and each group is scaled and shifted by broadcasting, which is the faster
        on the CPU (docs/quantized-kv.md)."""
        words, scales, biases = parts or self.parts
        ints = words.view(mx.uint8)
        if self.bits == 4:
            ints = mx.stack([ints & 15, ints >> 4], axis=-1)
        *rows, groups = scales.shape
        values = ints.reshape(*rows, groups, self.group_size).astype(scales.dtype)
        return (values * scales[..., None] + biases[..., None]).reshape(*rows, groups * self.group_size)


Pages = mx.array | QuantizedPages
PerLayer = int | Sequence[int]  # one value for every layer, or each layer's own (Gemma 4's differ)


def per_layer(name: str, value: PerLayer, num_layers: int) -> tuple[int, ...]:
    """`value` (`num_kv_heads` or `head_dim`) for each of `num_layers` layers, checked positive."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        return (require(name, value, POSITIVE),) * num_layers
    values = list(value)
    if len(values) != num_layers:
        raise ValueError(f"{name} has {len(values)} entries for {num_layers} layers")
    for item in values:
        require(name, item, POSITIVE)
    return tuple(values)


def check_quantization(bits: int | None, group_size: int, head_dim: PerLayer) -> None:
    """Refuse a `kv_bits` / `kv_group_size` pair the quantized pages do not support for `head_dim`
    (every layer's, where they differ)."""
    require("kv_bits", bits, KV_BITS)
    require("kv_group_size", group_size, KV_GROUP_SIZES)
    for dim in sorted({head_dim} if isinstance(head_dim, int) else set(head_dim)):
        _check_groups(bits, group_size, dim)


def _check_groups(bits: int | None, group_size: int, head_dim: int) -> None:
    if bits is not None and head_dim % group_size:
        fits = [str(g) for g in GROUP_SIZES if head_dim % g == 0]
        if not fits:
            raise ValueError(
                f"the model's head_dim={head_dim} is not a multiple of {GROUP_SIZES[0]}, the smallest "
                "kv_group_size, so its KV cannot be quantized; use kv_bits=None"
            )
        raise ValueError(
            f"kv_group_size={group_size} must divide the model's head_dim={head_dim}; use {' or '.join(fits)}"
        )


def resolve_dtype(dtype: mx.Dtype | str) -> mx.Dtype:
    """`dtype` as an MLX dtype; only float16, bfloat16 and float32 are KV dtypes."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, mx.Dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def kv_bytes_per_token(
    num_layers: int,
    num_kv_heads: PerLayer,
    head_dim: PerLayer,
    dtype: mx.Dtype,
    bits: int | None = None,
    group_size: int = 64,
    keys_only: Sequence[int] = (),
) -> int:
    """K and V bytes one token takes across all layers (with `bits`: packed values plus the
    scale and bias of each group, in `dtype`); the layers in `keys_only` keep keys alone."""
    heads, dims = per_layer("num_kv_heads", num_kv_heads, num_layers), per_layer("head_dim", head_dim, num_layers)
    return sum(
        (1 if i in keys_only else 2) * h * _row_bytes(d, dtype, bits, group_size)
        for i, (h, d) in enumerate(zip(heads, dims))
    )


def _row_bytes(head_dim: int, dtype: mx.Dtype, bits: int | None, group_size: int) -> int:
    return head_dim * dtype.size if bits is None else head_dim * bits // 8 + 2 * (head_dim // group_size) * dtype.size


def dtype_name(dtype: mx.Dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def _scatter(pages: mx.array, slots: mx.array, new: mx.array) -> mx.array:
    """`pages` with `new`'s vectors written at `slots` (`KVBatch.head_slots`) of their flat
    `[pages * kv_heads * page_size, last]` view: one scatter, with no index arithmetic in the graph.
    The holder must drop the old array, so that the scatter writes into its buffer in place."""
    flat = pages.reshape(-1, pages.shape[-1])
    flat[slots] = new.reshape(-1, new.shape[-1])
    return flat.reshape(pages.shape)


def arrays_of(pages: Pages) -> tuple[mx.array, ...]:
    """The MLX arrays that hold `pages`: one for float pages, three for quantized ones."""
    return pages.parts if isinstance(pages, QuantizedPages) else (pages,)


class KVStorage:
    """Every layer's K and V pages, written by in-place scatter.

    One layer's K (or V) pages are one MLX array (three when quantized) that nothing else keeps
    alive, so a write, which replaces the array by its scattered successor, donates the old
    buffer and writes in place instead of copying it. Pages are head-major, so a kernel reads
    one KV head's tokens of a page as one contiguous run. The contiguous layout is the same
    storage with one page of `max_model_len` tokens per sequence. Layers share the page numbers
    but each has its own KV heads and head dim where the model's differ (`num_kv_heads`,
    `head_dim`: one int for all, or one per layer).

    With `bits` (8 or 4) a token's K and V rows are quantized once, when written, in groups of
    `group_size` along `head_dim`; attention reads the packed pages. The layers in `keys_only`
    (multi-head latent attention's: a token's one latent row is both its key and its value) keep
    K pages alone, which they hand out as their V pages too. The arguments are trusted as
    `KVCacheManager` checked them.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        num_kv_heads: PerLayer,
        page_size: int,
        head_dim: PerLayer,
        dtype: mx.Dtype | str,
        bits: int | None = None,
        group_size: int = 64,
        keys_only: Sequence[int] = (),
    ) -> None:
        self.dtype = resolve_dtype(dtype)
        self.keys_only = frozenset(keys_only)
        self.bits = bits
        self.group_size = group_size
        self.kv_heads = per_layer("num_kv_heads", num_kv_heads, num_layers)
        self.head_dims = per_layer("head_dim", head_dim, num_layers)
        self.page_size = page_size
        self.num_pages = num_pages
        self.keys, self.values = self._zeroed()
        self.bytes_per_token = kv_bytes_per_token(
            self.num_layers, self.kv_heads, self.head_dims, self.dtype, self.bits, self.group_size, keys_only
        )  # kept: the KV usage line reads it every step

    def reset(self) -> None:
        """Fresh zeroed pages, for when a failed step left the old ones unusable."""
        self.keys, self.values = self._zeroed()

    def _zeroed(self) -> tuple[list[Pages], list[Pages | None]]:
        layers = range(len(self.kv_heads))
        keys = [self._zeroed_pages(layer) for layer in layers]
        values = [None if layer in self.keys_only else self._zeroed_pages(layer) for layer in layers]
        mx.eval([arrays_of(pages) for pages in keys + values if pages is not None])
        return keys, values

    def _zeroed_pages(self, layer: int) -> Pages:
        rows, head_dim = (self.num_pages, self.kv_heads[layer], self.page_size), self.head_dims[layer]
        if self.bits is None:
            return mx.zeros((*rows, head_dim), self.dtype)
        words = mx.zeros((*rows, head_dim * self.bits // 32), mx.uint32)
        scales, biases = (mx.zeros((*rows, head_dim // self.group_size), self.dtype) for _ in range(2))
        return QuantizedPages(words, scales, biases, self.bits, self.group_size)

    @property
    def tensors(self) -> list[mx.array]:
        """Every MLX array of every layer's pages, to evaluate them at the end of a step."""
        return [part for pages in self.keys + self.values if pages is not None for part in arrays_of(pages)]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(pages.nbytes for pages in self.keys + self.values if pages is not None)

    def layer(self, layer: int) -> tuple[Pages, Pages]:
        """The K and V pages of `layer` (read them; don't keep them past the step)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer!r} is outside 0..{self.num_layers - 1}")
        values = self.values[layer]
        return self.keys[layer], self.keys[layer] if values is None else values

    def read(self, layer: int, pages: list[int], count: int) -> tuple[mx.array, mx.array]:
        """The first `count` tokens stored in `pages` of `layer`, as fresh `[count, kv_heads, head_dim]`
        K and V arrays (lazy copies: later writes do not change them; quantized pages are
        dequantized)."""
        k_pages, v_pages = self.layer(layer)
        heads, head_dim = self.kv_heads[layer], self.head_dims[layer]
        if count == 0:
            empty = mx.zeros((0, heads, head_dim), self.dtype)
            return empty, empty
        index, width = mx.array(pages, mx.int32), min(count, self.page_size)

        def tokens(stored: Pages) -> mx.array:
            if isinstance(stored, QuantizedPages):
                rows = stored.dequantize(tuple(part[index, :, :width] for part in stored.parts))
            else:
                rows = stored[index, :, :width]
            return rows.swapaxes(1, 2).reshape(-1, heads, head_dim)[:count]

        return tokens(k_pages), tokens(v_pages)

    def page_arrays(self, pages: list[int]) -> list[mx.array]:
        """Copies of `pages` of every array of every layer (`tensors`' order), `[len(pages), ...]`
        each (lazy): what the disk tier files for them."""
        index = mx.array(pages, mx.int32)
        return [mx.take(part, index, axis=0) for part in self.tensors]

    def put_pages(self, pages: list[int], arrays: list[mx.array]) -> None:
        """Write `arrays` (as `page_arrays` gives them) into `pages`, in place."""
        index, parts = mx.array(pages, mx.int32), iter(arrays)

        def put(stored: Pages) -> Pages:
            for part in arrays_of(stored):
                part[index] = next(parts)
            return stored

        self.keys = [put(pages_) for pages_ in self.keys]
        self.values = [None if pages_ is None else put(pages_) for pages_ in self.values]

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store one layer's new K/V (`[tokens, kv_heads, head_dim]`) at `slots` of its pages
        (`KVBatch.head_slots`), quantized once here when the pages are; a keys-only layer's
        `values` must be its `keys`."""
        for name, array in (("keys", keys), ("values", values)):
            self._check(layer, name, array, slots.size // self.kv_heads[layer])
        self.keys[layer] = self._scattered(self.keys[layer], slots, keys)
        stored = self.values[layer]
        if stored is None:
            if values is not keys:
                raise ValueError(f"layer {layer} keeps keys alone; its values must be its keys")
            return
        self.values[layer] = self._scattered(stored, slots, values)

    def _scattered(self, pages: Pages, slots: mx.array, new: mx.array) -> Pages:
        if isinstance(pages, QuantizedPages):
            parts = mx.quantize(new, group_size=pages.group_size, bits=pages.bits)
            words, scales, biases = (_scatter(part, slots, data) for part, data in zip(pages.parts, parts))
            return QuantizedPages(words, scales, biases, pages.bits, pages.group_size)
        return _scatter(pages, slots, new)

    def _check(self, layer: int, name: str, array: mx.array, tokens: int) -> None:
        heads, head_dim = self.kv_heads[layer], self.head_dims[layer]
        if not isinstance(array, mx.array):
            raise TypeError(f"{name} must be an mlx array, got {type(array).__name__}")
        if tuple(array.shape) != (tokens, heads, head_dim):
            raise ValueError(
                f"{name} must have shape (tokens={tokens}, num_kv_heads={heads}, "
                f"head_dim={head_dim}), got {tuple(array.shape)}"
            )
        if array.dtype != self.dtype:
            raise ValueError(f"{name} must have the cache dtype {dtype_name(self.dtype)}, got {array.dtype}")


__getattr__ = module_getattr(__name__, {"Pool": ("Pages", Pages)})
