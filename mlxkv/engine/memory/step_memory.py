"""What a step holds in memory beyond the weights and the KV pages, by its shape.

A step's temporaries are the activations of its new tokens (a layer's hidden states, Q/K/V, MLP),
the logits of the rows that sample, and attention's own, which each attention path states per row
and layer (`temporary_bytes`: the reference path's scores of one query tile against one key tile,
the SDPA path's gathered context, the paged kernel's partials). The engine's reserve is the worst
step the scheduler may build; the scheduler cuts prefill chunks so that every step fits the reserve.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import mlx.nn as nn

from ...attention.backend import TemporaryBytes
from ...attention.heads import FLOAT32, Heads
from ...models.structure import hidden_size, model_args, vocab_size

SAMPLE_COPIES = 4  # vocabulary-sized float32 arrays a sampled row holds: logits, their softmax, noise, a mask


@dataclass(frozen=True)
class StepMemory:
    """Temporary bytes of a step: `per_token` for each new token, `per_sample` for each row that
    samples (a draft token samples too), and what `attention` states for each row."""

    per_token: int
    per_sample: int
    heads: Heads
    attention: TemporaryBytes

    @classmethod
    def of(cls, model: nn.Module, heads: Heads, attention: TemporaryBytes) -> StepMemory:
        """For an mlx-lm text model. A layer holds a token's residual, normed and projected hidden
        states, its queries, keys, values and attention output, and its MLP's gate, up and product
        (a mixture of experts' for each expert it routes to)."""
        args, hidden = model_args(model), hidden_size(model)
        experts = getattr(args, "num_experts_per_tok", 1) or 1
        routed = (getattr(args, "moe_intermediate_size", 0) or 0) * experts
        mlp = max(getattr(args, "intermediate_size", 0) or 0, routed)
        widths = 4 * hidden + 2 * (heads.q_heads + heads.kv_heads) * heads.head_dim + 3 * (mlp or 4 * hidden)
        return cls(widths * heads.itemsize, SAMPLE_COPIES * FLOAT32 * vocab_size(model), heads, attention)

    def bytes(self, tokens: int, samples: int, rows: Iterable[tuple[int, int]]) -> int:
        """A step of `tokens` new tokens, `samples` sampled rows, and `rows` of (new tokens, context)."""
        attention = sum(self.attention(self.heads, queries, context) for queries, context in rows)
        return self.per_token * tokens + self.per_sample * samples + attention

    def row(self, queries: int, context: int) -> int:
        """What a row of `queries` new tokens over `context` keys adds to a step (sampling once)."""
        return self.bytes(queries, 1, [(queries, context)])

    def worst(self, tokens: int, rows: int, context: int, samples: int, chunk_context: int | None = None) -> int:
        """The most a step of at most `tokens` tokens in `rows` rows, with `samples` sampled rows, can
        hold: every row but one decoding over `context` keys, the last a chunk of the rest over
        `chunk_context` keys (default: `context`)."""
        decodes = min(rows, tokens) - 1
        chunk = (tokens - decodes, context if chunk_context is None else chunk_context)
        return self.bytes(tokens, samples, [(1, context)] * decodes + [chunk])
