"""Attention over the paged KV cache: the pure-MLX reference path and the Metal kernels.

The runtime path: `variant` says how a layer attends (window, soft-cap, sinks) and `heads` its head
shape; `reference` runs everywhere and is the kernels' oracle; `prefill` runs long chunks on MLX's
SDPA and `first_chunk` a prompt's own-K/V span; `kernels` launches the sources in the top-level
`metal/` through `mx.fast.metal_kernel`; `backend` picks one for a model. The kernel lab (`lab/`:
the CPU simulator, the cost model, the timings) is apart. Imports only the cache layer.
"""

from .backend import AttentionSpec, choose_attention
from .kernels import PagedAttentionKernels
from .reference import gather_kv, reference_attention
from .variant import PLAIN, Variant

__all__ = [
    "PLAIN",
    "AttentionSpec",
    "PagedAttentionKernels",
    "Variant",
    "choose_attention",
    "gather_kv",
    "reference_attention",
]
