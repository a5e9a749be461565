"""Perplexity with float and quantized KV pages, on text the model was not trained on and on text it was.

The text is the docstrings of standard-library modules (the shipped demo model learnt only
the language reference, `pydoc_data.topics`), cut into windows. Each window runs through
mlxkv's own paged cache and attention in chunks, and every token attends the K/V as the
pages hold them: the condition of generated tokens, and the worst case for quantized pages
(a new prompt's first chunk attends its own unquantized K/V instead, see
`mlxkv.attention.first_chunk`). Prints one line per KV format and a summary line of ratios
to the float pages.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import platform
import pydoc_data.topics
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from harness import blas_in_use, runnable
from mlx_lm import load as mlx_lm_load
from progress import FLOAT16, bar, expect, say
from tqdm import tqdm

from mlxkv import KVCacheManager
from mlxkv.attention import AttentionSpec, choose_attention
from mlxkv.config import EngineConfig
from mlxkv.engine.model_kv import kv_shape, layer_variants
from mlxkv.engine.model_runner import ModelRunner
from mlxkv.models.loading import DEMO_MODEL

DEFAULTS_TAKE = 140  # seconds on progress.MACHINE (docs/benchmarks.md)

MODULES = (
    "argparse",
    "bisect",
    "csv",
    "datetime",
    "difflib",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "json",
    "pathlib",
    "random",
    "shlex",
    "statistics",
    "string",
    "textwrap",
)


def held_out_text(modules: tuple[str, ...] = MODULES) -> str:
    """The docstrings of `modules` and of their public classes and functions, in a fixed order."""
    docs = []
    for name in modules:
        module = importlib.import_module(name)
        members = [getattr(module, m) for m in sorted(vars(module)) if not m.startswith("_")]
        for obj in [module] + [m for m in members if inspect.isclass(m) or inspect.isfunction(m)]:
            doc = inspect.getdoc(obj)
            if doc and getattr(obj, "__module__", name) in (name, None):
                docs.append(doc)
    return "\n\n".join(dict.fromkeys(docs))


FORMATS = (None, 8, 4)  # float pages (the model's dtype), 8-bit and 4-bit pages


@dataclass
class Scores:
    """Per KV format: summed negative log-likelihood, summed KL divergence from the float
    pages' next-token distribution, and how many tokens' argmax agrees with theirs."""

    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    count: int = 0


def score(
    model, windows: list[np.ndarray], formats: list, group_size: int, page_size: int, chunk: int, progress: tqdm
) -> dict:
    """Run every window through one paged cache per KV format (bits, None for floats) in step;
    compare each format's next-token distributions with the float pages' at every position
    (`progress` counts the tokens scored)."""
    layers, kv_heads, head_dim, dtype = kv_shape(model)

    def runner(bits: int | None) -> ModelRunner:
        spec = AttentionSpec(
            dtype,
            model.args.num_attention_heads,
            kv_heads,
            head_dim,
            page_size,
            bits,
            group_size,
            layer_variants(model),
        )
        cache = KVCacheManager(
            layers,
            kv_heads,
            head_dim,
            max_num_seqs=1,
            max_model_len=max(map(len, windows)),
            page_size=page_size,
            dtype=dtype,
            prefix_caching=False,
            kv_bits=bits,
            kv_group_size=group_size,
        )
        return ModelRunner(model, cache, choose_attention(None, spec))

    runners = {bits: runner(bits) for bits in formats}
    scores = {bits: Scores() for bits in formats}
    for tokens in windows:
        seqs = {bits: runner.cache.claim(1)[0] for bits, runner in runners.items()}
        for lo in range(0, len(tokens) - 1, chunk):
            ids = tokens[lo : min(lo + chunk, len(tokens) - 1)]
            targets = mx.array(tokens[lo + 1 : lo + 1 + len(ids)])
            logprobs = {}
            for bits, runner in runners.items():
                logits = runner.head(
                    runner.hidden(ids, runner.cache.append([seqs[bits]], [len(ids)]), np.zeros(1, np.int32))
                ).astype(mx.float32)
                logprobs[bits] = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            reference = logprobs[None]
            for bits, lp in logprobs.items():
                got = scores[bits]
                got.nll -= mx.take_along_axis(lp, targets[:, None], axis=-1).sum().item()
                got.kl += (mx.exp(reference) * (reference - lp)).sum().item()
                got.agree += (mx.argmax(lp, axis=-1) == mx.argmax(reference, axis=-1)).sum().item()
                got.count += len(ids)
            mx.eval([runner.cache.tensors for runner in runners.values()])
            progress.update(len(ids))
        for bits, runner in runners.items():
            runner.cache.release(seqs[bits])
    return scores


def windows_of(tokenizer, text: str, window: int, limit: int) -> list[np.ndarray]:
    """The text's first `limit` tokens in windows of `window` (the whole text is encoded at once,
    longer than the model's context, hence `verbose=False` against transformers' warning)."""
    ids = np.asarray(tokenizer.encode(text, verbose=False), np.int32)[:limit]
    return [ids[lo : lo + window] for lo in range(0, len(ids), window) if len(ids) - lo > 1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL, help="mlx-lm checkpoint [default: the demo model]")
    parser.add_argument(
        "--window",
        type=int,
        default=128,
        help="tokens per window [default: 128, the context the demo model was trained on]",
    )
    parser.add_argument("--max-tokens", type=int, default=16384, help="most tokens of each text to score")
    parser.add_argument("--chunk", type=int, default=128, help="tokens computed per step")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-group-size", type=int, default=64, choices=[32, 64, 128])
    args = parser.parse_args(argv)

    expect(DEFAULTS_TAKE, FLOAT16)
    model, tokenizer = mlx_lm_load(str(args.model))
    dtype = str(kv_shape(model)[3]).split(".")[-1]
    print(
        f"model {args.model.name}; every token attends its K/V as the pages hold them; {platform.machine()} "
        f"{sys.platform}, Python {platform.python_version()}, MLX {mx.__version__} on {mx.default_device()}, "
        f"BLAS: {blas_in_use()}"
    )
    texts = {
        "held-out": held_out_text(),
        "training": "\n\n".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics)),
    }
    formats = [
        bits
        for bits in FORMATS
        if bits is None or runnable(model, EngineConfig(kv_bits=bits, kv_group_size=args.kv_group_size), f"{bits}-bit")
    ]
    windows = {name: windows_of(tokenizer, text, args.window, args.max_tokens) for name, text in texts.items()}
    progress = bar(sum(len(w) - 1 for ws in windows.values() for w in ws), "", unit="tok")
    ratios = {}
    for name, cut in windows.items():
        progress.set_description(f"{name} text, {len(formats)} KV formats")
        scores = score(model, cut, formats, args.kv_group_size, args.page_size, args.chunk, progress)
        say(
            f"\n{name} text: {sum(map(len, cut))} tokens in {len(cut)} windows of up to {args.window}"
            + (
                f" (docstrings of {len(MODULES)} standard-library modules)"
                if name == "held-out"
                else " (the language reference the demo model learnt)"
            )
        )
        say(f"{'KV pages':>26} {'perplexity':>11} {'vs float':>9} {'KL nats/token':>14} {'same top-1':>11}")
        base = math.exp(scores[None].nll / scores[None].count)
        for bits, got in scores.items():
            ppl = math.exp(got.nll / got.count)
            label = dtype if bits is None else f"{bits}-bit, groups of {args.kv_group_size}"
            say(
                f"{label:>26} {ppl:>11.3f} {100 * (ppl / base - 1):>+8.2f}% {got.kl / got.count:>14.5f} "
                f"{100 * got.agree / got.count:>10.2f}%"
            )
            ratios[(name, bits)] = ppl / base
    progress.close()
    print(
        "\n"
        + " ".join(
            f"ppl_ratio_{bits}bit_{name.replace('-', '_')}={ratios[(name, bits)]:.4f}"
            for name in texts
            for bits in formats
            if bits is not None
        )
    )


if __name__ == "__main__":
    main()
