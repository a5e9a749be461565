"""What prefix caching buys: time to first token over a long chat, and throughput when many
requests share a system prompt. One process, every run side by side.

(a) A chat of `--turns` turns, each adding a `--turn-len`-token user message and a
`--reply-len`-token reply (greedy, EOS ignored): time to first token per turn for mlxkv with
prefix caching on and off, and for mlx-lm keeping one prompt cache across turns
(`make_prompt_cache` passed to every `generate_step` call, which then prefills only the new
tokens). Each chat runs `--repeats` times, the three engines in turn (in rotated order);
the table gives each turn's median.
(b) `--num-requests` requests that share a `--system-len`-token system prompt, each with its
own `--question-len`-token question, all arriving at once: output throughput and mean time
to first token with prefix caching on and off.

(c) An agent of `--agent-turns` turns whose conversation grows from `--agent-start` to
`--agent-end` tokens, each turn resending all of it with a pin on it (what Anthropic's
`cache_control` asks for) and taking a reply of `--agent-reply-len` tokens, while `--traffic`
unrelated requests of `--traffic-len`-token prompts keep running and fill the pool: time to
first token and tokens computed per turn, medians of `--agent-repeats` runs.

Prints the tables and the final lines
`chat_ttft_turn8_over_turn1=... chat_turn8_ttft_vs_mlx_lm=... shared_prefix_speedup=...` and
`agent_turn_ttft_p50_ratio=...` (turn 20's TTFT over turn 2's).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from harness import MODEL_HELP, load_bench_model
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from progress import OPENBLAS, bar, expect
from tqdm import tqdm

from mlxkv import LLMEngine, Pin, SamplingParams
from mlxkv.config import EngineConfig

DEFAULTS_TAKE = 1320  # seconds on progress.MACHINE (docs/benchmarks.md)


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def mlxkv_chat(model, tokenizer, turns: list[list[int]], reply_len: int, caching: bool, progress: tqdm) -> dict:
    """TTFT per turn; each turn's prompt is the whole conversation so far plus the new message."""
    length = sum(map(len, turns)) + reply_len * len(turns)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=length, prefix_caching=caching))
    conversation, ttft, cached, replies = [], [], [], []
    for message in turns:
        request = engine.add_request(conversation + message, SamplingParams(max_tokens=reply_len, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        ttft.append(request.first_token_time - request.arrival_time)
        cached.append(request.num_cached_tokens)
        replies.append(request.output_ids)
        conversation = request.all_token_ids
        progress.update()
    return {"ttft": ttft, "cached": cached, "replies": replies}


def mlx_lm_chat(model, turns: list[list[int]], reply_len: int, progress: tqdm) -> dict:
    """The same chat through mlx-lm with one prompt cache: each call feeds only the new message
    (generate_step has fed every token it yielded, the last one included, into the cache)."""
    cache = make_prompt_cache(model)
    ttft, replies = [], []
    for message in turns:
        start, tokens = time.perf_counter(), []
        for token, _ in generate_step(
            mx.array(message), model, max_tokens=reply_len, sampler=greedy, prompt_cache=cache
        ):
            if not tokens:
                ttft.append(time.perf_counter() - start)
            tokens.append(int(token))
        replies.append(tokens)
        progress.update()
    return {"ttft": ttft, "replies": replies}


def shared_prefix(
    model, tokenizer, prompts: list[list[int]], output_len: int, caching: bool, max_num_seqs: int, progress: tqdm
) -> dict:
    """Every prompt at once; output throughput and mean TTFT from the common start (`progress`
    counts the tokens generated)."""
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(
            max_num_seqs=max_num_seqs, prefix_caching=caching, max_model_len=max(map(len, prompts)) + output_len
        ),
    )
    start = time.perf_counter()
    requests = [engine.add_request(p, SamplingParams(max_tokens=output_len, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        progress.update(len(engine.step()))
    wall = time.perf_counter() - start
    return {
        "tok/s": sum(len(r.output_ids) for r in requests) / wall,
        "TTFT mean s": float(np.mean([r.first_token_time - start for r in requests])),
        "wall s": wall,
        "prompt tokens reused": float(engine.stats().prefix_cache.cached_tokens),
        "outputs": [r.output_ids for r in requests],
    }


def agent(model, tokenizer, args, words, progress: tqdm) -> dict:
    """(c) One agent's turns, each its whole conversation so far with a pin on it, beside
    `args.traffic` unrelated requests that keep the pool full. TTFT and tokens computed per turn."""
    growth = (args.agent_end - args.agent_start) // max(1, args.agent_turns - 1) - args.agent_reply_len
    traffic_pages = 2 * args.traffic * -(-(args.traffic_len + args.output_len) // 16)
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(
            max_num_seqs=args.traffic + 1,
            max_model_len=args.agent_end + args.agent_reply_len + 16,
            num_pages=-(-(args.agent_end + args.agent_reply_len) // 16) + traffic_pages,
            pinned_fraction=0.9,  # room for the agent's whole conversation
        ),
    )
    conversation, others = words(args.agent_start), []
    ttft, computed = [], []
    for _ in range(args.agent_turns):
        params = SamplingParams(max_tokens=args.agent_reply_len, ignore_eos=True)
        request = engine.add_request(conversation, params, pin=Pin(len(conversation), ttl_s=600))
        while request.finish_reason is None:
            others = [r for r in others if r.finish_reason is None]
            while len(others) < args.traffic:
                others.append(engine.add_request(words(args.traffic_len), SamplingParams(max_tokens=args.output_len)))
            engine.step()
        ttft.append(request.first_token_time - request.arrival_time)
        computed.append(len(conversation) - (request.num_cached_tokens or 0))
        conversation = conversation + request.output_ids + words(growth)
        progress.update()
    for other in others:
        engine.abort(other.request_id, missing_ok=True)
    return {"ttft": ttft, "computed": computed, "evictions": engine.cache.pool.num_evictions}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help=MODEL_HELP)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-len", type=int, default=200)
    parser.add_argument("--reply-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--agent-turns", type=int, default=20)
    parser.add_argument("--agent-start", type=int, default=4096)
    parser.add_argument("--agent-end", type=int, default=16384)
    parser.add_argument("--agent-repeats", type=int, default=2)
    parser.add_argument("--agent-reply-len", type=int, default=8)
    parser.add_argument("--traffic", type=int, default=2)
    parser.add_argument("--traffic-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    expect(DEFAULTS_TAKE, OPENBLAS)
    model, tokenizer = load_bench_model(args.model)
    rng = np.random.default_rng(args.seed)

    def words(n: int) -> list[int]:
        return rng.integers(1, model.args.vocab_size, n).tolist()

    turns = [words(args.turn_len) for _ in range(args.turns)]
    progress = bar(3 * args.repeats * args.turns, "(a) chat", unit="turn")
    chats = {
        "on": lambda: mlxkv_chat(model, tokenizer, turns, args.reply_len, True, progress),
        "off": lambda: mlxkv_chat(model, tokenizer, turns, args.reply_len, False, progress),
        "mlx-lm": lambda: mlx_lm_chat(model, turns, args.reply_len, progress),
    }
    runs: dict[str, list[dict]] = {name: [] for name in chats}
    for repeat in range(args.repeats):
        order = list(chats)[repeat % 3 :] + list(chats)[: repeat % 3]  # no engine always goes first
        for name in order:
            engine = "mlx-lm" if name == "mlx-lm" else f"mlxkv, prefix caching {name}"
            progress.set_description(f"(a) chat, repeat {repeat + 1}/{args.repeats}: {engine}")
            runs[name].append(chats[name]())
    progress.close()
    ttft = {name: np.median([r["ttft"] for r in results], axis=0) for name, results in runs.items()}
    on, ref = runs["on"][0], runs["mlx-lm"][0]
    print(
        f"\n(a) {args.turns}-turn chat, {args.turn_len}-token messages, {args.reply_len}-token replies: "
        f"time to first token (s), median of {args.repeats}"
    )
    print(
        f"{'turn':>4} {'prompt':>7} {'reused':>7} {'computed':>9} {'mlxkv cache on':>15} {'mlxkv cache off':>16} "
        f"{'mlx-lm':>10}"
    )
    prompt = 0
    for i in range(args.turns):
        prompt += args.turn_len + (args.reply_len if i else 0)
        print(
            f"{i + 1:>4} {prompt:>7} {on['cached'][i]:>7} {prompt - on['cached'][i]:>9} {ttft['on'][i]:>15.3f} "
            f"{ttft['off'][i]:>16.3f} {ttft['mlx-lm'][i]:>10.3f}"
        )
    same = all(r["replies"] == on["replies"] for r in runs["on"] + runs["off"])
    print(f"replies identical with caching on and off: {same}; equal to mlx-lm's: {on['replies'] == ref['replies']}")

    system = words(args.system_len)
    prompts = [system + words(args.question_len) for _ in range(args.num_requests)]
    shared_prefix(model, tokenizer, prompts[:2], 2, True, args.max_num_seqs, tqdm(disable=True))  # warm-up
    progress = bar(2 * args.num_requests * args.output_len, "", unit="tok")
    shared = {}
    for caching in (True, False):
        name = f"prefix caching {'on' if caching else 'off'}"
        progress.set_description(f"(b) shared system prompt, {name}")
        shared[name] = shared_prefix(model, tokenizer, prompts, args.output_len, caching, args.max_num_seqs, progress)
    progress.close()
    print(
        f"\n(b) {args.num_requests} requests sharing a {args.system_len}-token system prompt, "
        f"{args.question_len}-token questions, {args.output_len} tokens out, {args.max_num_seqs} at once"
    )
    columns = ["tok/s", "TTFT mean s", "wall s", "prompt tokens reused"]
    print(f"{'':20}" + "".join(f"{c:>22}" for c in columns))
    for name, row in shared.items():
        print(f"{name:20}" + "".join(f"{row[c]:>22.3f}" for c in columns))
    same = shared["prefix caching on"]["outputs"] == shared["prefix caching off"]["outputs"]
    print(f"outputs identical with caching on and off: {same}")

    progress = bar(args.agent_repeats * args.agent_turns, "(c) agent", unit="turn")
    agents = [agent(model, tokenizer, args, words, progress) for _ in range(args.agent_repeats)]
    progress.close()
    agent_ttft = np.median([a["ttft"] for a in agents], axis=0)
    growth = (args.agent_end - args.agent_start) // max(1, args.agent_turns - 1)
    print(
        f"\n(c) an agent's {args.agent_turns} turns, {args.agent_start} to {args.agent_end} tokens, each pinned, "
        f"beside {args.traffic} requests of {args.traffic_len}-token prompts: median of {args.agent_repeats}"
    )
    print(f"{'turn':>4} {'prompt':>7} {'new':>5} {'computed':>9} {'TTFT s':>8}")
    for i in range(args.agent_turns):
        new = args.agent_start if i == 0 else growth
        print(
            f"{i + 1:>4} {args.agent_start + i * growth:>7} {new:>5} {agents[0]['computed'][i]:>9} "
            f"{agent_ttft[i]:>8.3f}"
        )
    print(f"pages evicted (by the traffic): {', '.join(str(a['evictions']) for a in agents)}")

    last = args.turns - 1
    speedup = shared["prefix caching on"]["tok/s"] / shared["prefix caching off"]["tok/s"]
    print(
        f"chat_ttft_turn{last + 1}_over_turn1={ttft['on'][last] / ttft['on'][0]:.3f} "
        f"chat_turn{last + 1}_ttft_vs_mlx_lm={ttft['on'][last] / ttft['mlx-lm'][last]:.3f} "
        f"shared_prefix_speedup={speedup:.3f}"
    )
    turn = min(1, args.agent_turns - 1)
    print(f"agent_turn_ttft_p50_ratio={agent_ttft[-1] / agent_ttft[turn]:.3f}")


if __name__ == "__main__":
    main()
