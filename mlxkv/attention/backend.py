"""Which attention the engine runs: the Metal kernels where they pass a start-up check, else the reference path."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..cache.storage import PerLayer, dtype_name, per_layer
from .heads import Heads
from .kernels import PagedAttentionKernels, kernel_temporary_bytes
from .reference import reference_attention
from .reference import temporary_bytes as reference_temporary_bytes
from .variant import Variant

ENV_VAR = "MLXKV_ATTENTION"
BACKENDS = ("metal", "reference")
logger = logging.getLogger(__name__)

AttentionFn = Callable[..., mx.array]
TemporaryBytes = Callable[[Heads, int, int], int]  # (heads, new tokens of a row, its context) -> bytes per layer


@dataclass(frozen=True)
class AttentionSpec:
    """What one model's attention reads: its heads and dtype, the cache's pages, its layers' variants
    (one per layer), and their KV heads and head dims (one for all layers, or each layer's)."""

    dtype: mx.Dtype
    q_heads: int
    kv_heads: PerLayer
    head_dim: PerLayer
    page_size: int
    kv_bits: int | None
    kv_group_size: int
    variants: Sequence[Variant]

    def geometries(self) -> dict[tuple[int, int], list[Variant]]:
        """The variants of the layers of each (KV heads, head dim) the model has."""
        layers = len(self.variants)
        found: dict[tuple[int, int], list[Variant]] = {}
        heads, dims = per_layer("kv_heads", self.kv_heads, layers), per_layer("head_dim", self.head_dim, layers)
        for geometry, variant in zip(zip(heads, dims), self.variants):
            found.setdefault(geometry, []).append(variant)
        return found


def choose_attention(
    choice: str | None, spec: AttentionSpec, kernels: PagedAttentionKernels | None = None
) -> AttentionFn:
    """The attention for `spec`: `choice` ('metal' or 'reference'), else `MLXKV_ATTENTION`, else
    Metal where available. Kernels (`kernels`, else MLX's) are first checked against the reference
    path at each head shape the model's layers have; if they fail, the reference path runs and one
    warning says which kernel failed and why, so a kernel problem costs speed, never a crash or
    wrong text."""
    if kernels is None:
        if _backend(choice) == "reference":
            return reference_attention
        kernels = PagedAttentionKernels()
    for (kv_heads, head_dim), variants in spec.geometries().items():
        problem = kernels.warm(
            spec.dtype, head_dim, spec.page_size, spec.q_heads, kv_heads, spec.kv_bits, spec.kv_group_size, variants
        )
        if problem is not None:
            logger.warning(
                "mlxkv's Metal kernels fail their start-up check for this model (%s, head_dim %d, pages of %d, "
                "GQA %d): %s; attention runs on the reference path instead",
                dtype_name(spec.dtype),
                head_dim,
                spec.page_size,
                spec.q_heads // kv_heads,
                problem,
            )
            return reference_attention
    return kernels


def temporary_bytes_of(attention: AttentionFn) -> TemporaryBytes:
    """The temporary bytes `attention` states it holds per row and layer: the Metal kernels' own
    statement, else the reference path's."""
    stated: TemporaryBytes = getattr(attention, "temporary_bytes", reference_temporary_bytes)
    return stated


def expected_temporary_bytes(choice: str | None, kernels: PagedAttentionKernels | None = None) -> TemporaryBytes:
    """The temporary bytes of the attention `choose_attention` is expected to pick (before the
    cache it checks kernels against exists): `kernels`' if given, else the reference path's or
    the Metal kernels', as `choice`, the environment and the machine say."""
    if kernels is not None:
        return kernels.temporary_bytes
    return reference_temporary_bytes if _backend(choice) == "reference" else kernel_temporary_bytes


def _backend(choice: str | None) -> str:
    """'metal' or 'reference': `choice` (an `EngineConfig.attention`, checked there), else the
    environment, else Metal where available; Metal where there is none is an error."""
    source, value = ("attention", choice) if choice is not None else (ENV_VAR, os.environ.get(ENV_VAR))
    value = (value or ("metal" if mx.metal.is_available() else "reference")).strip().lower()
    if value not in BACKENDS:  # only an environment variable can be anything
        raise ValueError(f"{source}={value!r} is not an attention backend; expected 'metal' or 'reference'")
    if value == "metal" and not mx.metal.is_available():
        raise ValueError(
            f"{source}='metal' but Metal is not available on this machine "
            "(mx.metal.is_available() is False); use 'reference'"
        )
    return value
