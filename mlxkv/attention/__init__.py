"""Attention over the paged KV cache: the pure-MLX reference path and the Metal kernels.

`reference` runs everywhere and is the kernels' oracle; `kernels` launches the sources in
the top-level `metal/` through `mx.fast.metal_kernel`; `simulator` runs those same kernel
bodies on a CPU for the tests. Imports only the cache layer.
"""

from .kernels import PagedAttentionKernels, select_attention
from .reference import gather_kv, reference_attention

__all__ = ["PagedAttentionKernels", "gather_kv", "reference_attention", "select_attention"]
