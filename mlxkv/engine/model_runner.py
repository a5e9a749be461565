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
    embeddings,
    final_norm,
    layer_roles,
    logits,
    mlx_lm_module,
    pads_exactly,
    position_embeddings,
    recurrent_module,
    run_decoder,
)
from ..models.vision import Vision
from .images import StepMedia
from .layers.attention import LatentAttention, PagedAttention, SharingAttention
from .layers.decoder_taps import AxisRope, Deepstack, FinalNorm, PositionEmbeddings
from .layers.module_attention import ModuleAttention
from .layers.recurrent import RecurrentLayer
from .layers.step_context import StepContext
from .scheduler import ScheduledBatch


class ModelRunner:
    """Owns the model and the KV cache; turns a scheduled batch into logits for the rows that sample.
    With `vision`, steps may carry images (`StepMedia`)."""

    def __init__(
        self,
        model: nn.Module,
        cache: KVCacheManager,
        attention: AttentionFn = reference_attention,
        vision: Vision | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        self.vision = vision
        layers = decoder_layers(model)
        for level, layer in enumerate(layers):  # an engine before wrapped them: the layers are wrapped afresh
            if isinstance(layer, Deepstack):
                layers[level] = layer.inner
        roles = layer_roles(model)
        self.pads = pads_exactly(model, roles)  # else a step's prefill chunks run one by one
        # Always around mlx-lm's own module: a model handed to a second engine is wrapped afresh, alike.
        numbers = {index: number for number, index in enumerate(roles.attention)}
        for index, source in [(i, None) for i in roles.attention] + list(roles.shares):
            holder, name = roles.attention_slot(layers[index])
            attn = mlx_lm_module(holder, name)
            adapter, number = adapter_for(model, index, attn), numbers[index if source is None else source]
            if vision is not None and vision.mrope is not None and hasattr(attn, "rope"):  # after the adapter took it
                attn.rope = AxisRope(mlx_lm_module(attn, "rope"))
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
        for level in range(vision.deepstack_layers if vision is not None else 0):
            layers[level] = Deepstack(layers[level], level)
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

    def pooled_rows(self, step: ScheduledBatch, hidden: mx.array) -> mx.array | None:
        """The last hidden state of each row that ends an embedding request's prompt (`[rows,
        hidden]`, lazy); None if no row does."""
        ends = np.cumsum(step.counts) - 1
        rows = [end for end, pools in zip(ends, step.pools) if pools]
        return hidden[mx.array(np.asarray(rows, np.int32))] if rows else None

    def hidden(
        self,
        token_ids: np.ndarray | mx.array,
        kv: KVBatch,
        own_kv: Sequence[int] | np.ndarray,
        media: StepMedia | None = None,
    ) -> mx.array:
        """The final hidden state `[tokens, hidden]` of a packed batch whose K/V slots `kv` holds,
        the first `own_kv[b]` tokens of row b attending their own K/V as computed, its images'
        features and positions as `media` has them (lazy)."""
        spans = np.asarray(own_kv, np.int32) if any(own_kv) else None  # a scan, not an array, in the common case
        kv = kv.with_blocks(media.blocks if media is not None else None)
        states = state_batch(kv, self.pads) if self.cache.states is not None else None
        positions = self._positions(kv, media)
        context = StepContext(self.cache, kv, positions, self.attention, spans, states, media=media)
        inputs = mx.array(token_ids)[None]
        if media is not None and media.rows.size and self.vision is not None and self.vision.blank_placeholders:
            inputs[:, media.rows] = 0
        with context.entered():
            caches = [context] * len(decoder_layers(self.model))
            out = run_decoder(self.model, inputs, caches, self._embedded(inputs, media))
        hidden = context.final[-1] if context.final else out  # else the decoder's own logits
        return hidden[0]

    def _positions(self, kv: KVBatch, media: StepMedia | None) -> Positions:
        """The step's token positions: the K/V positions, or its images' M-RoPE positions (as one
        position per token where each token's three are equal, as after an image)."""
        rope = media.positions if media is not None else None
        if rope is None:
            return Positions(mx.array(kv.positions))
        if (rope == rope[0]).all():
            return Positions(mx.array(rope[0]))
        assert self.vision is not None and self.vision.mrope is not None
        return Positions(mx.array(rope[0]), mx.array(rope), self.vision.mrope.axis)

    def _embedded(self, inputs: mx.array, media: StepMedia | None) -> mx.array | None:
        """The inputs' embeddings with the images' feature rows in place; None without any."""
        if media is None or not media.rows.size:
            return None
        embedded: mx.array = embeddings(self.model)(inputs)
        embedded[:, media.rows] = media.features[None].astype(embedded.dtype)
        return embedded

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
