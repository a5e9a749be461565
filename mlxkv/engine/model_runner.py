"""Runs an mlx-lm model over a packed batch, with every attention layer reading K/V through the cache."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..attention.backend import AttentionFn
from ..attention.reference import reference_attention
from ..cache.batch import KVBatch
from ..cache.manager import KVCacheManager
from ..cache.state_batch import state_batch
from ..models.adapters import Gemma4Adapter, LatentAdapter, ModuleAdapter, adapter_for
from ..models.rotary import Positions
from ..models.structure import (
    computes_logits,
    decoder,
    decoder_layers,
    final_norm,
    layer_roles,
    logits,
    mlx_lm_module,
    pads_exactly,
    position_embeddings,
    recurrent_module,
    run_decoder,
)
from .layers.attention import LatentAttention, PagedAttention, SharingAttention
from .layers.decoder_taps import FinalNorm, PositionEmbeddings
from .layers.module_attention import ModuleAttention
from .layers.recurrent import RecurrentLayer
from .layers.step_context import StepContext
from .scheduler import ScheduledBatch


class ModelRunner:
    """Owns the model and the KV cache; turns a scheduled batch into logits for the rows that sample."""

    def __init__(self, model: nn.Module, cache: KVCacheManager, attention: AttentionFn = reference_attention) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        roles, layers = layer_roles(model), decoder_layers(model)
        self.pads = pads_exactly(model, roles)  # else a step's prefill chunks run one by one
        # Always around mlx-lm's own module: a model handed to a second engine is wrapped afresh, alike.
        numbers = {index: number for number, index in enumerate(roles.attention)}
        for index, source in [(i, None) for i in roles.attention] + list(roles.shares):
            holder, name = roles.attention_slot(layers[index])
            attn = mlx_lm_module(holder, name)
            adapter, number = adapter_for(model, index, attn), numbers[index if source is None else source]
            wrapped: PagedAttention
            if isinstance(adapter, Gemma4Adapter):
                wrapped = SharingAttention(attn, number, adapter, source is not None)
            elif isinstance(adapter, LatentAdapter):
                wrapped = LatentAttention(attn, number, adapter)
            elif isinstance(adapter, ModuleAdapter):
                wrapped = ModuleAttention(attn, number, adapter)
            else:
                wrapped = PagedAttention(attn, number, adapter)
            setattr(holder, name, wrapped)
        _tap_decoder(model)
        for number, index in enumerate(roles.recurrent):
            recurrent = RecurrentLayer(recurrent_module(layers[index]), number)
            slot = roles.recurrent_module(layers[index])
            if slot is None:  # the layer runs whole, in its decoder's list
                layers[index] = recurrent
            else:
                setattr(layers[index], slot, recurrent)

    def logits(self, step: ScheduledBatch, hidden: mx.array) -> mx.array | None:
        """Logits for `step` from its final hidden states: a row for each row that samples, and one
        more for each of its draft tokens (`[rows, vocab]`); None if no row samples (lazy either way)."""
        if len(step.samples) == hidden.shape[0] and all(step.samples):  # all decode rows: every token samples
            return self.head(hidden)
        ends = np.cumsum(step.counts)
        rows = [np.arange(end - len(draft) - 1, end) for end, draft, s in zip(ends, step.drafts, step.samples) if s]
        return self.head(hidden[mx.array(np.concatenate(rows).astype(np.int32))]) if rows else None

    def hidden(self, token_ids: np.ndarray | mx.array, kv: KVBatch, own_kv: Sequence[int] | np.ndarray) -> mx.array:
        """The final hidden state `[tokens, hidden]` of a packed batch whose K/V slots `kv` holds,
        the first `own_kv[b]` tokens of row b attending their own K/V as computed (lazy)."""
        spans = np.asarray(own_kv, np.int32) if any(own_kv) else None  # a scan, not an array, in the common case
        states = state_batch(kv, self.pads) if self.cache.states is not None else None
        context = StepContext(self.cache, kv, Positions(mx.array(kv.positions)), self.attention, spans, states)
        with context.entered():
            out = run_decoder(self.model, mx.array(token_ids)[None], [context] * len(decoder_layers(self.model)))
        hidden = context.final[-1] if context.final else out  # else the decoder's own logits
        return hidden[0]

    def head(self, hidden: mx.array) -> mx.array:
        """Logits for final hidden states."""
        return logits(self.model, hidden)


def _tap_decoder(model: nn.Module) -> None:
    """Wrap the modules `model`'s decoder calls without a cache that a step reaches: its learned
    absolute position embeddings (GPT-2's), and the final norm of a decoder that computes the logits."""
    inner, name = decoder(model), position_embeddings(model)
    if name is not None:
        setattr(inner, name, PositionEmbeddings(mlx_lm_module(inner, name)))
    if computes_logits(model):
        name = final_norm(model)
        setattr(inner, name, FinalNorm(mlx_lm_module(inner, name)))
