"""mlx-lm models as mlxkv runs them.

`loading` loads checkpoints (local or from the hub) and refuses what mlxkv cannot run; `structure`
says how a model is put together (text model, decoder, which layers attend, which keep a recurrent
state); `adapters` turn each family's attention layer into per-token queries, keys and values;
`rotary` applies RoPE from tables shared by the layers; `sharding` splits a model across a
tensor-parallel group; `random_model` writes random checkpoints for tests and benchmarks.
"""

from .loading import DEMO_MODEL, SUPPORTED_MODEL_TYPES, load, model_context

__all__ = ["DEMO_MODEL", "SUPPORTED_MODEL_TYPES", "load", "model_context"]
