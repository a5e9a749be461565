"""Model loading (mlx-lm checkpoints, local or from the hub) and random checkpoints for tests."""

from .loading import DEMO_MODEL, SUPPORTED_MODEL_TYPES, load, model_context

__all__ = ["DEMO_MODEL", "SUPPORTED_MODEL_TYPES", "load", "model_context"]
