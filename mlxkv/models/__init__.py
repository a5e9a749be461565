"""mlx-lm models as mlxkv runs them.

`loading` loads checkpoints (local or from the hub) and refuses what mlxkv cannot run; `structure`
says how a model is put together (text model, decoder, which layers attend, which keep a recurrent
state); `adapters` say how each attention layer meets the pages (its own module, through
`attention_hook`; multi-head latent attention; or a family's adapter); `rotary` applies RoPE from
tables shared by the layers; `vision` is a multimodal checkpoint's vision tower and processor
(mlx-vlm's), beside the text model; `identity` is a digest of a model's weights, which names its
pages on disk; `sharding` splits a model across a tensor-parallel group; `pooling` is how an
embedding checkpoint makes one vector of a text (its sentence-transformers files), and `encoder` an
encoder embedding model run by mlx-embeddings;
`random_model` writes random checkpoints for tests and benchmarks, `random_vision_model` random
multimodal ones (mlx-vlm's format, a tiny vision tower), and `tiny_configs` a tiny config for every
family mlx-lm has (the census's).
"""

from .loading import DEMO_MODEL, SUPPORTED_MODEL_TYPES, load, model_context

__all__ = ["DEMO_MODEL", "SUPPORTED_MODEL_TYPES", "load", "model_context"]
