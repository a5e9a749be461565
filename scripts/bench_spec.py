"""What speculative decoding buys: one stream's decode speed with prompt lookup and with a draft
model, against mlxkv without speculation and against mlx-lm's own speculative decoding on the same
pair, and 16 concurrent streams with and without. One process, every run side by side.

Two single-stream workloads, greedy, `--output-len` tokens each:
(a) a code edit: the model is given a Python function (from the standard library's source) and
asked to rewrite it with one name changed, so most of its answer copies the prompt;
(b) free text: the model is asked to write on its own, so little of its answer is in the prompt.
Each engine runs each workload `--repeats` times, the engines in turn (in rotated order), and the
medians of decode tokens per second (after the first token) are compared. Then `--batch` streams
(half of each workload) run at once with and without speculation, output tokens per second.

`--model` and `--draft-model` take any mlx-lm pair sharing a tokenizer (chat models are prompted
through their chat template), such as Qwen3-8B and Qwen3-0.6B on a Mac. By default the pair is the
random ~100M Llama the benchmarks share and a random 2-layer Llama on its tokenizer, built here:
random models copy nothing and agree on nothing, so the defaults measure what speculation costs
when drafts are seldom right (and how prompt lookup fares in the loops random models fall into),
not what a real pair gains.

Prints the tables and the final line `spec_single_stream_ratio_lookup=... spec_single_stream_ratio_draft=...
spec_vs_mlx_lm_draft=... spec_batch16_ratio=...` (the single-stream ratios on the code edit; the
batch ratio the lower of the two drafters').
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import textwrap
import time
from collections.abc import Callable

import mlx.core as mx
from harness import DEFAULT_MODEL
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import speculative_generate_step
from progress import OPENBLAS, bar, expect

from mlxkv import LLMEngine, SamplingParams
from mlxkv.config import EngineConfig
from mlxkv.models.loading import load
from mlxkv.models.random_model import LLAMA_100M, make_checkpoint

DEFAULTS_TAKE = 600  # seconds on progress.MACHINE (docs/benchmarks.md), beside a training job
EDITED = (textwrap.dedent, "lines", "rows")  # the function rewritten, and the name its rewrite changes
FREE_TEXT = "Write a short essay on how Python evaluates the for statement and what can go wrong."
SEPARATOR = "\n\nRewritten:\n"  # between the text and its rewrite, for a model without a chat template
DEFAULT_DRAFT = DEFAULT_MODEL.parent / "bench-llama-draft"
DRAFT_SHAPE = dict(LLAMA_100M, num_hidden_layers=2)  # the default target's tokenizer and width, 2 layers of 12


def default_pair() -> tuple[str, str]:
    """The default target and draft, built on first use."""
    for path, shape in ((DEFAULT_MODEL, LLAMA_100M), (DEFAULT_DRAFT, DRAFT_SHAPE)):
        if not (path / "config.json").exists():
            make_checkpoint(path, "llama", "float32", shape=shape, max_position_embeddings=32768)
    return str(DEFAULT_MODEL), str(DEFAULT_DRAFT)


def workloads(tokenizer, chat: bool) -> dict[str, list[int]]:
    """The prompts of (a) and (b) as token ids: through the chat template for a chat model, else as
    the trained pair expects a rewrite (the text, the separator, the rewrite's first line)."""
    function, old, new = EDITED
    source = inspect.getsource(function)
    if chat:
        edit = f"Rewrite this Python function, renaming `{old}` to `{new}`. Reply with the code only.\n\n{source}"
        return {
            name: tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            for name, text in (("code edit", edit), ("free text", FREE_TEXT))
        }
    first_line = source.replace(old, new).splitlines(keepends=True)[0]
    return {
        "code edit": tokenizer.encode(source + SEPARATOR + first_line),
        "free text": tokenizer.encode("The for statement is used to"),
    }


def mlxkv_stream(engine: LLMEngine, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Decode tokens per second of one greedy request alone, and its tokens."""
    request = engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert request.first_token_time is not None and request.finish_time is not None
    return (len(request.output_ids) - 1) / (request.finish_time - request.first_token_time), request.output_ids


def mlx_lm_stream(pair: tuple, prompt: list[int], tokens: int, draft_tokens: int) -> tuple[float, list[int]]:
    """The same with mlx-lm's speculative decoding (`speculative_generate_step`) on the pair."""
    target, draft = pair
    out, first = [], 0.0
    for token, _, _ in speculative_generate_step(
        mx.array(prompt), target, draft, num_draft_tokens=draft_tokens, max_tokens=tokens
    ):
        out.append(int(token))
        if len(out) == 1:
            first = time.perf_counter()
    return (len(out) - 1) / (time.perf_counter() - first), out


def batch_tps(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> float:
    """Output tokens per second of `prompts` all started at once, greedy, `tokens` each."""
    started = time.perf_counter()
    requests = [engine.add_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return sum(len(r.output_ids) for r in requests) / (time.perf_counter() - started)


def rotated(names: list[str], turn: int) -> list[str]:
    return names[turn % len(names) :] + names[: turn % len(names)]


def medians(runs: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in runs.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=f"target checkpoint [default: {DEFAULT_MODEL}]")
    parser.add_argument("--draft-model", default=None, help=f"draft checkpoint [default: {DEFAULT_DRAFT}]")
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batch-output-len", type=int, default=64)
    args = parser.parse_args(argv)
    if (args.model is None) != (args.draft_model is None):
        parser.error("give --model and --draft-model together, or neither")

    expect(DEFAULTS_TAKE, OPENBLAS)
    target_path, draft_path = (args.model, args.draft_model) if args.model else default_pair()
    print(f"target: {target_path}\ndraft: {draft_path}\nMLX {mx.__version__}, device {mx.default_device()}")
    model, tokenizer = load(target_path)
    prompts = workloads(tokenizer, chat=tokenizer.chat_template is not None)
    length = max(map(len, prompts.values())) + args.output_len + args.num_draft_tokens + 8
    drafting = {
        "mlxkv": {},
        "mlxkv, prompt lookup": dict(prompt_lookup=True),
        "mlxkv, draft model": dict(draft_model=draft_path),
    }
    common = dict(max_model_len=length, num_draft_tokens=args.num_draft_tokens)
    engines = {
        name: LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=1, **common, **extra))
        for name, extra in drafting.items()
    }
    pair = (mlx_lm_load(target_path)[0], mlx_lm_load(draft_path)[0])
    runners: dict[str, Callable[[list[int]], tuple[float, list[int]]]] = {
        name: (lambda p, e=engine: mlxkv_stream(e, p, args.output_len)) for name, engine in engines.items()
    }
    runners["mlx-lm, draft model"] = lambda p: mlx_lm_stream(pair, p, args.output_len, args.num_draft_tokens)
    progress = bar(args.repeats * len(prompts) * len(runners) + 2 * args.repeats, "single stream", unit="run")
    single: dict[str, dict[str, list[float]]] = {w: {n: [] for n in runners} for w in prompts}
    tokens: dict[str, dict[str, list[int]]] = {w: {} for w in prompts}
    for repeat in range(args.repeats):
        for workload, prompt in prompts.items():
            for name in rotated(list(runners), repeat):
                progress.set_description(f"{workload}: {name}")
                tps, tokens[workload][name] = runners[name](prompt)
                single[workload][name].append(tps)
                progress.update()
    accepted = {name: engine.stats().speculation for name, engine in engines.items()}

    batch_prompts = [prompts["code edit" if i % 2 else "free text"] for i in range(args.batch)]
    batched = {
        name: LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=args.batch, **common, **extra))
        for name, extra in drafting.items()
    }
    batch: dict[str, list[float]] = {name: [] for name in batched}
    for name, engine in batched.items():  # untimed: every timed run then finds the prompts cached alike
        progress.set_description(f"{args.batch} streams: warming {name}")
        batch_tps(engine, batch_prompts, 1)
    for repeat in range(args.repeats):
        for name in rotated(list(batched), repeat):
            progress.set_description(f"{args.batch} streams: {name}")
            batch[name].append(batch_tps(batched[name], batch_prompts, args.batch_output_len))
            progress.update()
    progress.close()
    report(single, tokens, accepted, batch, args)


def report(single, tokens, accepted, batch, args) -> None:
    """The tables and the final line."""
    print(f"\nsingle stream, greedy, {args.output_len} tokens, up to {args.num_draft_tokens} draft tokens a step")
    print(f"{'workload':<10} {'engine':<22} {'decode tok/s (median)':>22} {'runs':>24} {'same tokens as mlxkv':>21}")
    rates = {}
    for workload, runs in single.items():
        rates[workload] = medians(runs)
        for name, values in runs.items():
            same = "yes" if tokens[workload][name] == tokens[workload]["mlxkv"] else "no"
            print(
                f"{workload:<10} {name:<22} {rates[workload][name]:>22.1f} "
                f"{' '.join(f'{v:.1f}' for v in values):>24} {same:>21}"
            )
    for name, stats in accepted.items():
        if stats is not None:
            print(f"{name}: {stats.accepted} of {stats.drafted} draft tokens accepted ({stats.acceptance_rate:.0%})")
    print(f"\n{args.batch} streams at once (half code edits, half free text), {args.batch_output_len} tokens each")
    print(f"{'engine':<22} {'output tok/s (median)':>22} {'runs':>24}")
    for name, values in batch.items():
        print(f"{name:<22} {statistics.median(values):>22.1f} {' '.join(f'{v:.1f}' for v in values):>24}")
    edit, free, together = rates["code edit"], rates["free text"], medians(batch)
    ratios = {
        "spec_single_stream_ratio_lookup": edit["mlxkv, prompt lookup"] / edit["mlxkv"],
        "spec_single_stream_ratio_draft": edit["mlxkv, draft model"] / edit["mlxkv"],
        "spec_free_text_ratio_lookup": free["mlxkv, prompt lookup"] / free["mlxkv"],
        "spec_free_text_ratio_draft": free["mlxkv, draft model"] / free["mlxkv"],
        "spec_vs_mlx_lm_draft": edit["mlxkv, draft model"] / edit["mlx-lm, draft model"],
        "spec_batch16_ratio": min(
            together["mlxkv, prompt lookup"] / together["mlxkv"], together["mlxkv, draft model"] / together["mlxkv"]
        ),
    }
    print(" ".join(f"{name}={value:.3f}" for name, value in ratios.items()))


if __name__ == "__main__":
    main()
