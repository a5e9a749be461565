"""Embeddings: how fast mlxkv embeds short texts against the same libraries used directly, and what
an embedding batch does to chat streams running beside it. One process, every run side by side.

(a) `--texts` short texts (8 to 24 words) embedded, `--rounds` times with the engines alternating:
  - an encoder (BERT-style, MiniLM-L6's shape at `--size small`) through mlxkv's embedding path
    (tokenized, batched by length on the encoder's thread) and through mlx-embeddings directly
    (its tokenizer and model, `--batch` texts a call, in the order given, as a script would);
  - a decoder embedder (Qwen3-Embedding's recipe: last token, normalised) through mlxkv's engine,
    each text an embedding request batched by the scheduler, and through mlx-lm's model directly
    (padded batches of `--batch`, the last real token of each row taken).
  Texts per second, medians, and mlxkv's over the direct one's.
(b) `--streams` greedy chat streams of `--tokens` tokens on a chat model's engine, alone and while
  the decoder embedder's engine (then the encoder) embeds the `--texts` texts: the 99th percentile
  gap between a stream's tokens, medians over `--rounds`.

Prints `encoder_ratio=... decoder_ratio=... p99_gap_beside_decoder=...x p99_gap_beside_encoder=...x`
last. The models are random (their speed is their shape's); mlx-embeddings comes with the
`embeddings` extra, mlx-lm with mlxkv.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
from harness import blas_in_use
from mlx_embeddings import load as load_encoder
from mlx_lm import load as mlx_lm_load

from mlxkv import SamplingParams
from mlxkv.config import EngineConfig
from mlxkv.engine.async_encoder import AsyncEncoder
from mlxkv.engine.async_llm import AsyncLLM
from mlxkv.engine.llm_engine import LLMEngine
from mlxkv.entrypoints.embedder import Embedder, EngineEmbeddings
from mlxkv.models.encoder import Encoder
from mlxkv.models.loading import load
from mlxkv.models.pooling import pooling_of
from mlxkv.models.random_model import TEXT, make_checkpoint, make_embedder, make_encoder

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4),
    "small": dict(hidden_size=384, num_hidden_layers=6, intermediate_size=1536, num_attention_heads=12),
}


def texts(count: int, seed: int = 0) -> list[str]:
    """`count` short texts of 8 to 24 words drawn from the tokenizer's training text."""
    words, rng = TEXT.split(), random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.randint(8, 24))) for _ in range(count)]


def build(folder: Path, size: str) -> tuple[Path, Path, Path]:
    """(encoder, decoder embedder, chat model) checkpoints of `size` in `folder`."""
    shape = SHAPES[size] | {"vocab_size": 1000, "num_key_value_heads": 4}
    return (
        make_encoder(folder / "encoder", shape=shape),
        make_embedder(folder / "embedder", shape=shape),
        make_checkpoint(folder / "chat", "qwen3", shape=shape),
    )


def direct_encoder(folder: Path, batch: int) -> Callable[[list[str]], list[list[float]]]:
    """mlx-embeddings used directly: its tokenizer and model, `batch` texts a call."""
    model, wrapper = load_encoder(str(folder))
    tokenizer = wrapper._tokenizer

    def embed(inputs: list[str]) -> list[list[float]]:
        vectors: list[list[float]] = []
        for start in range(0, len(inputs), batch):
            encoded = tokenizer(inputs[start : start + batch], padding=True, return_tensors="np")
            out = model(mx.array(encoded["input_ids"]), attention_mask=mx.array(encoded["attention_mask"]))
            vectors += out.text_embeds.tolist()
        return vectors

    return embed


def direct_decoder(folder: Path, batch: int) -> Callable[[list[str]], list[list[float]]]:
    """mlx-lm's model used directly, as a script would embed with it: padded batches, the last real
    token's final hidden state of each row (causal attention: the padding after it changes nothing)."""
    model, tokenizer = mlx_lm_load(str(folder))

    def embed(inputs: list[str]) -> list[list[float]]:
        vectors: list[list[float]] = []
        for start in range(0, len(inputs), batch):
            ids = [tokenizer.encode(text) for text in inputs[start : start + batch]]
            lengths = np.array([len(one) for one in ids])
            padded = np.zeros((len(ids), lengths.max()), np.int32)
            for row, one in enumerate(ids):
                padded[row, : len(one)] = one
            hidden = model.model(mx.array(padded))
            last = hidden[mx.arange(len(ids)), mx.array(lengths - 1)].astype(mx.float32)
            vectors += (last / mx.linalg.norm(last, axis=-1, keepdims=True)).tolist()
        return vectors

    return embed


def through(embedder: Embedder) -> Callable[[list[str]], list[list[float]]]:
    """mlxkv's embedding path (what `/v1/embeddings` runs), called from an event loop of its own."""
    return lambda inputs: asyncio.run(embedder.embed(inputs)).vectors


def rate(embed: Callable[[list[str]], list[list[float]]], inputs: list[str]) -> float:
    started = time.perf_counter()
    vectors = embed(inputs)
    assert len(vectors) == len(inputs)
    return len(inputs) / (time.perf_counter() - started)


def compare(name: str, ours: Callable, theirs: Callable, inputs: list[str], rounds: int, library: str) -> float:
    """Texts per second of both, alternating which goes first each round; mlxkv's median over theirs."""
    rates: dict[str, list[float]] = {"mlxkv": [], library: []}
    ours(inputs[:32]), theirs(inputs[:32])  # warm up: compile and allocate once
    for round_number in range(rounds):
        order = [("mlxkv", ours), (library, theirs)]
        for label, embed in order if round_number % 2 == 0 else order[::-1]:
            rates[label].append(rate(embed, inputs))
    mine, other = statistics.median(rates["mlxkv"]), statistics.median(rates[library])
    print(f"{name}: mlxkv {mine:.1f} texts/s, {library} directly {other:.1f} texts/s: {mine / other:.2f}x")
    return mine / other


async def chat_gaps(chat: AsyncLLM, streams: int, tokens: int, beside: Awaitable[object] | None) -> float:
    """The 99th percentile gap (seconds) between the tokens of `streams` greedy streams, with `beside`
    running from when they start."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    gaps: list[float] = []

    async def one(seed: int) -> None:
        last = None
        prompt = [1 + (seed * 7 + i) % 900 for i in range(16)]
        async for output in chat.outputs(prompt, params):
            now = time.perf_counter()
            if last is not None and output.token_ids:
                gaps.append(now - last)
            last = now

    running = [one(seed) for seed in range(streams)]
    await asyncio.gather(*running, *([beside] if beside is not None else []))
    return float(np.percentile(gaps, 99))


def isolation(chat: AsyncLLM, embedders: dict[str, Embedder], inputs: list[str], args: argparse.Namespace) -> dict:
    """Each chat p99 gap (median over rounds) alone and beside each embedder's batch."""
    p99: dict[str, list[float]] = {"alone": []} | {name: [] for name in embedders}
    asyncio.run(chat_gaps(chat, 2, 4, None))  # warm up
    for _ in range(args.rounds):
        p99["alone"].append(asyncio.run(chat_gaps(chat, args.streams, args.tokens, None)))
        for name, embedder in embedders.items():
            beside = embedder.embed(inputs)
            p99[name].append(asyncio.run(chat_gaps(chat, args.streams, args.tokens, beside)))
    medians = {name: statistics.median(values) for name, values in p99.items()}
    alone = medians["alone"]
    for name, value in medians.items():
        print(f"chat p99 gap {name}: {value * 1e3:.1f} ms ({value / alone:.2f}x alone)")
    return {name: value / alone for name, value in medians.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="texts per call of the libraries used directly")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--size", choices=SHAPES, default="small")
    args = parser.parse_args(argv)
    print(f"BLAS: {blas_in_use()}\nMLX {mx.__version__}, device {mx.default_device()}, models {args.size}")
    inputs = texts(args.texts)
    with tempfile.TemporaryDirectory() as folder:
        encoder_path, embedder_path, chat_path = build(Path(folder), args.size)
        encoder = Embedder("encoder", AsyncEncoder(Encoder.load(encoder_path)))
        engine = LLMEngine(*load(embedder_path), EngineConfig(max_model_len=512), pooling=pooling_of(embedder_path))
        decoder = Embedder("decoder", EngineEmbeddings(AsyncLLM(engine)))
        encoder_ratio = compare(
            "encoder", through(encoder), direct_encoder(encoder_path, args.batch), inputs, args.rounds, "mlx-embeddings"
        )
        decoder_ratio = compare(
            "decoder", through(decoder), direct_decoder(embedder_path, args.batch), inputs, args.rounds, "mlx-lm"
        )
        chat = AsyncLLM(LLMEngine(*load(chat_path), EngineConfig(max_model_len=512)))
        ratios = isolation(chat, {"beside decoder": decoder, "beside encoder": encoder}, inputs, args)
    print(
        f"encoder_ratio={encoder_ratio:.2f} decoder_ratio={decoder_ratio:.2f} "
        f"p99_gap_beside_decoder={ratios['beside decoder']:.2f}x p99_gap_beside_encoder={ratios['beside encoder']:.2f}x"
    )


if __name__ == "__main__":
    main()
