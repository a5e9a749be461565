"""Train the small demo model shipped in `mlxkv/demo_model/`, reproducibly, on this machine.

The corpus is the Python language reference that every CPython carries offline
(`pydoc_data.topics`, under the PSF licence). The tokenizer is a byte-level BPE trained
with `tokenizers`; the model is mlx-lm's own `llama` class, saved in the mlx-lm directory
format, so it loads through exactly the code path of any mlx-community checkpoint.

Fast only with a real BLAS under MLX's CPU build (docs/benchmarks.md, Speed on Linux).
"""

from __future__ import annotations

import argparse
import json
import math
import pydoc_data.topics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from progress import OPENBLAS, bar, expect, say
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DEFAULTS_TAKE = 26 * 60  # seconds on progress.MACHINE, OpenBLAS preloaded (docs/benchmarks.md)
EOS = "<|endoftext|>"
CONFIG = dict(
    model_type="llama",
    hidden_size=256,
    num_hidden_layers=3,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=2048,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)


def corpus() -> list[str]:
    """The language reference, one document per topic, in a fixed order."""
    topics = pydoc_data.topics.topics
    return [topics[name].strip() for name in sorted(topics)]


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer)
    return tokenizer


def token_stream(tokenizer: Tokenizer, docs: list[str]) -> np.ndarray:
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer.encode(doc).ids + [eos]
    return np.asarray(ids, np.int32)


def batches(tokens: np.ndarray, batch: int, length: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, tokens.size - length - 1, size=batch)
        window = np.stack([tokens[s : s + length + 1] for s in starts])
        yield mx.array(window[:, :-1]), mx.array(window[:, 1:])


def save(model: nn.Module, tokenizer: Tokenizer, out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(CONFIG | {"torch_dtype": "float16"}, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "mlxkv" / "demo_model")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be at least 2, got {args.steps}")

    expect(DEFAULTS_TAKE, OPENBLAS)
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    docs = corpus()
    tokenizer = train_tokenizer(docs, CONFIG["vocab_size"])
    tokens = token_stream(tokenizer, docs)
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs))} characters, {tokens.size} tokens")

    model = llama.Model(llama.ModelArgs(**CONFIG))
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"model: {params / 1e6:.2f}M parameters")
    warmup = min(100, args.steps // 10 + 1)  # 100 steps of the default 1,200
    schedule = optim.join_schedules(
        [optim.linear_schedule(0.0, args.lr, warmup), optim.cosine_decay(args.lr, args.steps - warmup, args.lr / 20)],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.1)

    def loss_fn(model, inputs, targets):
        return nn.losses.cross_entropy(model(inputs), targets).mean()

    step_fn = nn.value_and_grad(model, loss_fn)
    start = time.perf_counter()
    data = batches(tokens, args.batch, args.seq_len, rng)
    progress = bar(args.steps, "training", unit="step")
    for step in range(1, args.steps + 1):
        inputs, targets = next(data)
        loss, grads = step_fn(model, inputs, targets)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
        progress.update()
        if step % 100 == 0 or step == 1:
            progress.set_postfix(loss=f"{loss.item():.3f}")
            say(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f}s)")
    progress.close()
    meta = dict(
        vars(args),
        out=None,
        final_loss=round(loss.item(), 4),
        tokens=int(tokens.size),
        parameters=int(params),
        python=sys.version.split()[0],
        mlx=mx.__version__,
        seconds=round(time.perf_counter() - start),
        corpus="pydoc_data.topics (PSF licence)",
    )
    save(model, tokenizer, args.out, meta)
    print(f"saved to {args.out} (loss {loss.item():.3f}, perplexity {math.exp(loss.item()):.1f})")


if __name__ == "__main__":
    main()
