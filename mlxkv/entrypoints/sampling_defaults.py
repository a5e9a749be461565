"""How a conversation samples where its request does not say: as the model's authors recommend in
its `generation_config.json` (Qwen3's, say: temperature 0.6, top_p 0.95, top_k 20), else at
temperature 0.7. The same for `mlxkv chat`, the chat page and every API `mlxkv serve` speaks."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..engine.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

CONVERSATION: dict[str, Any] = {"temperature": 0.7}
# The thinking budget a reasoning effort (OpenAI's `reasoning_effort`, Ollama's `think` level)
# stands for where a request gives none; None: unbounded.
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": None}
GPT_OSS_EFFORTS = ("low", "medium", "high")  # the levels gpt-oss's template writes into its system message


def effort_kwargs(effort: str) -> dict[str, Any]:
    """What a chat template reads of a reasoning effort: `enable_thinking`, off for "none", and
    `reasoning_effort` itself where gpt-oss's template knows the level."""
    kwargs: dict[str, Any] = {"enable_thinking": effort != "none"}
    if effort in GPT_OSS_EFFORTS:
        kwargs["reasoning_effort"] = effort
    return kwargs


def effort_fields(effort: str | None) -> dict[str, Any]:
    """The thinking budget a reasoning effort stands for (`EFFORT_BUDGETS`), as a default."""
    return {} if effort is None else {"thinking_token_budget": EFFORT_BUDGETS[effort]}


FIELDS = ("temperature", "top_p", "top_k", "min_p")  # what generation_config.json may recommend


def recommended_sampling(path: Path) -> dict[str, Any]:
    """The sampling fields `path`'s `generation_config.json` sets (`do_sample: false` is greedy);
    none where there is no such file, or it holds values `SamplingParams` refuses (logged)."""
    try:
        config = json.loads((path / "generation_config.json").read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s/generation_config.json: %s", path, exc)
        return {}
    if not isinstance(config, dict):
        return {}
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    given = {
        k: config[k] for k in FIELDS if isinstance(config.get(k), (int, float)) and not isinstance(config[k], bool)
    }
    try:
        SamplingParams(**given)
    except ValueError as exc:
        logger.warning("ignoring the sampling %s/generation_config.json recommends: %s", path, exc)
        return {}
    return given


def conversation_sampling(path: Path) -> dict[str, Any]:
    """The sampling fields a conversation with the model at `path` uses where its request gives none."""
    return CONVERSATION | recommended_sampling(path)
