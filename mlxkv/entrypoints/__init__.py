"""What users call: the `LLM` API and the `mlxkv` command line."""

from .llm import LLM, Completion, Stream

__all__ = ["LLM", "Completion", "Stream"]
