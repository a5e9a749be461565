"""What a model's KV cache costs in mlxkv, and what Gemma 4's KV sharing saves.

The model is built from its config.json alone: no weights are read, its arrays stay lazy and are
never evaluated, so a 30B model's shapes cost nothing. mlxkv's cache for it is sized as the
engine sizes it (`--max-num-seqs` sequences of up to `--max-model-len` tokens) and allocated,
then allocated again with each KV-shared layer given pages of its own: the same model with
sharing ignored. For both it prints the layers that hold pages, the full-attention layers' K/V
bytes per token, the sliding-window layers' pools, a hybrid's recurrent state per sequence (and
how many tokens of K/V that equals), and the bytes the cache allocated, with their ratios; then a
final line `kv_cache_bytes_ratio=...`. Default: Gemma 4 E2B's shapes.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes
from progress import expect

from mlxkv.cache.storage import dtype_name, per_layer
from mlxkv.config import EngineConfig
from mlxkv.engine.memory.kv_budget import build_kv_cache, size_kv_cache
from mlxkv.engine.memory.memory_budget import device_memory
from mlxkv.engine.model_kv import ModelKV, model_kv
from mlxkv.models.structure import decoder, layer_roles, text_model

DEFAULTS_TAKE = 7  # seconds on progress.MACHINE (docs/benchmarks.md)
# Gemma 4 E2B: 35 layers, four sliding (window 512, head dim 256) to one global (head dim 512),
# one KV head, the last 20 layers reading the K/V of the last earlier layer of their kind.
GEMMA4_E2B = dict(
    model_type="gemma4_text",
    hidden_size=1536,
    num_hidden_layers=35,
    intermediate_size=6144,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    num_kv_shared_layers=20,
    sliding_window=512,
    sliding_window_pattern=5,
    hidden_size_per_layer_input=256,
    vocab_size=262144,
    vocab_size_per_layer_input=262144,
    max_position_embeddings=131072,
    torch_dtype="bfloat16",
)


def lazy_model(config: dict) -> nn.Module:
    """The text model `config` describes, in its dtype, with random weights that are never evaluated."""
    model_class, args_class = _get_classes(config)
    model = text_model(model_class(args_class.from_dict(config)))
    text = config.get("text_config") or {}
    dtype = config.get("torch_dtype") or config.get("dtype") or text.get("dtype") or "bfloat16"
    model.set_dtype(getattr(mx, dtype))
    return model


def sharing_ignored(model: nn.Module, kv: ModelKV) -> ModelKV:
    """`kv` with every KV-shared layer of `model` given pages of its own, shaped as the pages of
    the layer it reads."""
    roles = layer_roles(model)
    number = {index: n for n, index in enumerate(roles.attention)}
    sources = [number[source] for _, source in roles.shares]
    heads = per_layer("num_kv_heads", kv.num_kv_heads, kv.num_layers)
    dims = per_layer("head_dim", kv.head_dim, kv.num_layers)
    windows = list(kv.layer_windows or [None] * kv.num_layers)
    return replace(
        kv,
        num_layers=kv.num_layers + len(sources),
        num_kv_heads=heads + tuple(heads[n] for n in sources),
        head_dim=dims + tuple(dims[n] for n in sources),
        layer_windows=windows + [windows[n] for n in sources],
    )


@dataclass(frozen=True)
class Footprint:
    """One cache as allocated: layers holding pages, bytes per token of the full-attention layers,
    bytes of the sliding-window pools, recurrent state bytes per sequence, bytes in all."""

    layers: int
    full_per_token: int
    window_pools: int
    state_per_sequence: int
    allocated: int


def footprint(config: EngineConfig, kv: ModelKV) -> Footprint:
    cache = build_kv_cache(config, kv, size_kv_cache(config, kv, device_memory() - kv.weights_bytes))
    groups = cache.windowed.values()
    found = Footprint(
        cache.storage.num_layers + sum(len(group.layers) for group in groups),
        cache.storage.bytes_per_token,
        sum(group.storage.nbytes for group in groups),
        cache.states.bytes_per_sequence if cache.states is not None else 0,
        cache.nbytes,
    )
    del cache
    mx.clear_cache()
    return found


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint directory or its config.json [default: Gemma 4 E2B]")
    parser.add_argument("--kv-layout", choices=("paged", "contiguous"), default="paged")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-bits", type=int, choices=(8, 4), default=None)
    args = parser.parse_args(argv)

    expect(DEFAULTS_TAKE, "no model runs, so the BLAS plays no part")
    source = args.model / "config.json" if args.model is not None and args.model.is_dir() else args.model
    if source is not None and not source.is_file():
        parser.error(f"--model: {str(source)!r} is neither a checkpoint directory with a config.json nor a config.json")
    config = json.loads(source.read_text()) if source is not None else GEMMA4_E2B
    model = lazy_model(config)
    kv = replace(model_kv(model), weights_bytes=0)  # the cache alone, whatever memory the weights would take
    roles = layer_roles(model)
    windows = list(kv.layer_windows or [None] * kv.num_layers)
    engine = EngineConfig(
        kv_layout=args.kv_layout,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_bits=args.kv_bits,
    )
    print(
        f"model: {source or 'Gemma 4 E2B (built in)'}: {model.args.model_type}, "
        f"{len(decoder(model).layers)} layers: {windows.count(None)} full-attention and "
        f"{kv.num_layers - windows.count(None)} sliding-window layers with K/V of their own, "
        f"{len(roles.shares)} KV-shared, {len(roles.recurrent)} recurrent"
    )
    values = f"{args.kv_bits}-bit" if args.kv_bits else dtype_name(kv.dtype)
    print(
        f"cache: {args.kv_layout}, {args.max_num_seqs} sequences of up to {args.max_model_len} tokens, "
        f"pages of {args.page_size} tokens, {values} K/V\n"
    )
    shared, ignored = footprint(engine, kv), footprint(engine, sharing_ignored(model, kv))
    rows = [
        ("layers holding pages", shared.layers, ignored.layers, "{:.0f}"),
        (
            "K/V per token outside window pools (KiB)",
            shared.full_per_token / 2**10,
            ignored.full_per_token / 2**10,
            "{:.2f}",
        ),
        ("sliding-window pools (MiB)", shared.window_pools / 2**20, ignored.window_pools / 2**20, "{:.2f}"),
        (
            "recurrent state per sequence (KiB)",
            shared.state_per_sequence / 2**10,
            ignored.state_per_sequence / 2**10,
            "{:.2f}",
        ),
        ("KV cache allocated (MiB)", shared.allocated / 2**20, ignored.allocated / 2**20, "{:.2f}"),
    ]
    width = max(len(row[0]) for row in rows)
    print(f"{'':{width}} {'KV sharing':>12} {'sharing ignored':>16} {'ratio':>7}")
    for name, a, b, form in rows:
        print(f"{name:{width}} {form.format(a):>12} {form.format(b):>16} {_ratio(a, b):>7}")
    if shared.state_per_sequence and shared.full_per_token:
        tokens = shared.state_per_sequence / shared.full_per_token
        print(f"\none sequence's recurrent state takes as many bytes as {tokens:.0f} tokens of K/V")
    print(f"\nkv_cache_bytes_ratio={shared.allocated / ignored.allocated:.3f}")


if __name__ == "__main__":
    main()
