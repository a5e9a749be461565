"""Images beside text: text streams decoding while image requests arrive, and mlxkv against
mlx-vlm's `generate` on the same checkpoint, in one process.

The model is a random float32 Qwen3-VL checkpoint: the tiny vision tower of
`models/random_vision_model.py` beside a text model of `--width` (the default, about 77M
parameters, is the other benchmarks' width).

Part one: `--streams` text requests decode (greedy, EOS ignored, `--tokens` each) while other
requests arrive, one every `--every` steps, 16 tokens of answer each: none; text prompts as long
as the image prompts; image prompts (a new random picture of `--image-size` pixels and a
question). The arrivals' prefill shares the text rows' steps either way: what the images add is
their encoding and nothing after it. The three runs alternate `--runs` times; per run, the text
rows' tokens per second (from their first token to their last) and the 99th percentile of their
inter-token gaps. Prints `text_tps_ratio=<image arrivals / text arrivals>` and
`text_itl_p99_ratio=<image arrivals / text arrivals>`, then both against no arrivals.

Part two: `--requests` image requests, one picture each, `--tokens` tokens of answer: mlx-vlm's
`generate` one after the other (it serves one request at a time) against mlxkv's batch, alternating
`--runs` times. Prints the medians and `vs_mlx_vlm_ratio=<mlxkv / mlx-vlm tokens per second>`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from progress import OPENBLAS, bar, expect, say
from tqdm import tqdm

from mlxkv import ImagePrompt, LLMEngine, SamplingParams, load
from mlxkv.config import EngineConfig
from mlxkv.models.random_model import LLAMA_100M
from mlxkv.models.random_vision_model import make_vision_checkpoint

DEFAULTS_TAKE = 420  # seconds on progress.MACHINE (docs/benchmarks.md)
QUESTION = "What is in this picture?"
WIDTH = {k: LLAMA_100M[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size")} | {
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


def picture(seed: int, size: int):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_prompt(tokenizer, image) -> ImagePrompt:
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    return ImagePrompt(tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True), [image])


ARRIVALS = ("none", "text", "images")


def arrival(engine: LLMEngine, args, kind: str, seed: int) -> None:
    """One arriving request of `kind` (a text prompt as long as an image prompt, or an image prompt)."""
    prompt = image_prompt(engine.tokenizer, picture(seed, args.image_size))
    if kind == "text":
        length = len(engine.place_images(prompt))
        prompt = np.random.default_rng(seed).integers(10, 300, length).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=16, ignore_eos=True))


def text_run(engine: LLMEngine, args, arrivals: str, seed: int, progress: tqdm) -> tuple[float, float]:
    """The text rows' tokens/s and inter-token p99 (ms) over one run, with `arrivals`."""
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    rng = np.random.default_rng(seed)
    texts = [
        engine.add_request(rng.integers(10, 300, args.prompt_tokens).tolist(), params) for _ in range(args.streams)
    ]
    stamps: list[list[float]] = [[] for _ in texts]
    step = 0
    while any(r.finish_reason is None for r in texts):
        if arrivals != "none" and step % args.every == 0:
            arrival(engine, args, arrivals, seed * 1000 + step)
        engine.step()
        now, step = time.perf_counter(), step + 1
        for request, times in zip(texts, stamps):
            times.extend([now] * (request.num_outputs - len(times)))
        progress.update()
    while engine.has_unfinished():  # image requests still running: not timed
        engine.step()
    gaps = np.concatenate([np.diff(times[1:]) for times in stamps])  # after each first token
    spans = [times[-1] - times[1] for times in stamps]
    return (args.tokens - 2) * len(texts) / max(spans), float(np.percentile(gaps, 99)) * 1000


def text_beside_images(path: Path, args, progress: tqdm) -> None:
    config = EngineConfig(max_num_seqs=args.streams + 8, max_num_batched_tokens=512, max_model_len=1024)
    engine = LLMEngine(*load(str(path)), config)
    text_run(engine, argparse.Namespace(**{**vars(args), "tokens": 4}), "images", 0, tqdm(disable=True))  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {kind: [] for kind in ARRIVALS}
    for run in range(args.runs):
        for kind in ARRIVALS:
            progress.set_description(f"text streams, {kind} arriving, run {run + 1}")
            runs[kind].append(text_run(engine, args, kind, run + 1, progress))
    for kind, measured in runs.items():
        say(
            f"{args.streams} text streams, {kind} arriving: "
            + ", ".join(f"{tps:.1f} tok/s (p99 {p99:.0f} ms)" for tps, p99 in measured)
        )
    tps = {k: statistics.median(t for t, _ in v) for k, v in runs.items()}
    p99 = {k: statistics.median(p for _, p in v) for k, v in runs.items()}
    say(f"text_tps_ratio={tps['images'] / tps['text']:.3f} text_itl_p99_ratio={p99['images'] / p99['text']:.3f}")
    say(f"against no arrivals: tps {tps['images'] / tps['none']:.3f}, itl p99 {p99['images'] / p99['none']:.3f}")


def against_mlx_vlm(path: Path, args, progress: tqdm) -> None:
    import mlx_vlm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, processor = mlx_vlm.load(str(path))
    engine = LLMEngine(*load(str(path)), EngineConfig(max_num_seqs=args.requests, max_model_len=1024))
    pictures = [picture(500 + i, args.image_size) for i in range(args.requests)]
    prompts = [image_prompt(engine.tokenizer, p) for p in pictures]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    theirs, ours = [], []
    for run in range(args.runs):
        progress.set_description(f"{args.requests} image requests, mlx-vlm then mlxkv, run {run + 1}")
        started = time.perf_counter()
        for prompt, image in zip(prompts, pictures):
            out = mlx_vlm.generate(
                model, processor, prompt.text, image=[image], max_tokens=args.tokens, temperature=0.0, verbose=False
            )
            assert out.generation_tokens == args.tokens, out.generation_tokens
        theirs.append(args.requests * args.tokens / (time.perf_counter() - started))
        started = time.perf_counter()
        requests = [engine.add_request(prompt, params) for prompt in prompts]
        while engine.has_unfinished():
            engine.step()
        assert all(len(r.output_ids) == args.tokens for r in requests)
        ours.append(args.requests * args.tokens / (time.perf_counter() - started))
        progress.update(2 * args.requests * args.tokens)
    say(
        f"{args.requests} image requests of {args.tokens} tokens: mlx-vlm generate "
        f"{statistics.median(theirs):.1f} tok/s, mlxkv {statistics.median(ours):.1f} tok/s"
    )
    say(f"vs_mlx_vlm_ratio={statistics.median(ours) / statistics.median(theirs):.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16, help="text requests decoding")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each text prompt")
    parser.add_argument("--every", type=int, default=8, help="steps between image requests")
    parser.add_argument("--image-size", type=int, default=128, help="pixels a side of each picture")
    parser.add_argument("--requests", type=int, default=8, help="image requests against mlx-vlm")
    parser.add_argument("--runs", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--tiny", action="store_true", help="the tiny text model, not the benchmark width")
    args = parser.parse_args(argv)
    expect(DEFAULTS_TAKE, OPENBLAS)
    path = make_vision_checkpoint(Path(tempfile.mkdtemp()) / "qwen3-vl", "qwen3_vl", shape=None if args.tiny else WIDTH)
    steps = args.runs * len(ARRIVALS) * args.tokens + 2 * args.runs * args.requests * args.tokens
    with bar(steps, "loading") as progress:
        text_beside_images(path, args, progress)
        against_mlx_vlm(path, args, progress)


if __name__ == "__main__":
    main()
