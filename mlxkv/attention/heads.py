"""The head shape attention paths state their temporary bytes by."""

from __future__ import annotations

from dataclasses import dataclass

FLOAT32 = 4  # bytes of a float32 score or accumulator


@dataclass(frozen=True)
class Heads:
    """Query heads, KV heads and head dim of a model's widest attention layer, and the bytes of one
    K/V value as attention reads it (the model's dtype: quantized pages are dequantized to it)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    itemsize: int

    def kv_bytes(self, keys: int) -> int:
        """Bytes of the K and V of `keys` tokens, gathered out of the pages."""
        return 2 * keys * self.kv_heads * self.head_dim * self.itemsize

    def score_bytes(self, queries: int, keys: int) -> int:
        """Bytes of float32 scores of `queries` queries of every head against `keys` keys."""
        return queries * self.q_heads * keys * FLOAT32
