"""Helpers the test modules share: caches filled as an engine would fill them."""

import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load as mlx_lm_load

from mlxkv import KVCacheManager
from mlxkv.engine.sampling.sampler import TokenSampler
from mlxkv.models.random_model import make_checkpoint

mlx_lm_generate = importlib.import_module("mlx_lm.generate")
MAX_TOKENS = 20


def scramble_free_pages(cache, rng):
    """Leave the pool's free queue in random order: one page per owner, freed shuffled."""
    for page in range(cache.pool.capacity):
        cache.pool.alloc(("scramble", page), 1)
    for page in rng.permutation(cache.pool.capacity):
        cache.pool.free(("scramble", int(page)))


def packed_step(
    layout,
    page_size,
    kv_heads,
    head_dim,
    dtype,
    contexts,
    query_lens,
    seed=0,
    max_model_len=128,
    kv_bits=None,
    kv_group_size=64,
):
    """A cache filled in interleaved chunks (pages out of order), then one packed step."""
    rng = np.random.default_rng(seed)
    cache = KVCacheManager(
        1,
        kv_heads,
        head_dim,
        max_num_seqs=len(contexts) + 3,
        max_model_len=max_model_len,
        layout=layout,
        page_size=page_size,
        dtype=dtype,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
    )
    if layout == "paged":
        scramble_free_pages(cache, rng)
    ids = cache.claim(len(contexts))

    def add(seq_ids, counts):
        batch = cache.append(seq_ids, counts)
        shape = (sum(counts), kv_heads, head_dim)
        cache.write(0, batch, mx.array(rng.standard_normal(shape), dtype), mx.array(rng.standard_normal(shape), dtype))
        return batch

    left = {s: c - q for s, c, q in zip(ids, contexts, query_lens)}
    while any(left.values()):
        chunk = {s: min(n, int(rng.integers(1, 2 * page_size))) for s, n in left.items() if n}
        add(list(chunk), list(chunk.values()))
        left = {s: left[s] - chunk.get(s, 0) for s in left}
    return cache, add(ids, query_lens)


def with_row_blocks(batch, blocks_by_row):
    """`batch` in which the tokens of each block `(first, end)` of row r (`blocks_by_row[r]`, positions
    among its new tokens) see the whole block (`KVBatch.with_blocks`)."""
    blocks = np.zeros((batch.num_tokens, 2), np.int32)
    for row, runs in blocks_by_row.items():
        start = batch.query_starts[row] - (batch.context_lens[row] - batch.query_lens[row])
        for first, end in runs:
            blocks[start + first : start + end] = first, end
    return batch.with_blocks(blocks)


def mlx_lm_greedy(path, prompt, max_tokens=MAX_TOKENS):
    """mlx-lm's own greedy tokens for `prompt`, up to (not including) EOS."""
    model, tokenizer = mlx_lm_load(str(path))
    tokens = []
    for token, _ in mlx_lm_generate.generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        if int(token) in tokenizer.eos_token_ids:
            break
        tokens.append(int(token))
    return tokens


def mlx_lm_quantized_greedy(path, prompt, bits, max_tokens=MAX_TOKENS):
    """mlx-lm's own greedy tokens with its quantized KV cache from the first step, and at each
    step how far apart its top two log-probabilities are."""
    model, _ = mlx_lm_load(str(path))
    tokens, gaps = [], []
    for token, logprobs in mlx_lm_generate.generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=lambda x: mx.argmax(x, axis=-1),
        kv_bits=bits,
        kv_group_size=64,
        quantized_kv_start=0,
    ):
        second, first = mx.sort(logprobs)[-2:].tolist()
        tokens.append(int(token))
        gaps.append(first - second)
    return tokens, gaps


def mlx_lm_text(tokenizer, tokens):
    """The text mlx-lm's streaming detokenizer makes of `tokens` (what its own CLI prints)."""
    detokenizer = tokenizer.detokenizer
    for token in tokens:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def mutant_kernels(old: str, new: str):
    """A `metal_kernel` factory for the CPU simulator that replaces `old` by `new` in every
    kernel source holding it: a kernel with a planted bug."""
    from mlxkv.attention.lab.simulator import metal_kernel

    def factory(**kw):
        return metal_kernel(**{**kw, "source": kw["source"].replace(old, new)})

    return factory


def uncompilable_kernels(**kw):
    """A `metal_kernel` factory whose kernels fail as Metal's compiler does on a bad source."""

    def launch(**_):
        raise RuntimeError(
            f"[metal::Device] Unable to build metal library from source\n"
            f"{kw['name']}:12:5: error: no matching function for call to 'attend_keys'"
        )

    return launch


class ExplodingSampler(TokenSampler):
    """A request's sampler that raises when used: a failure that belongs to one request."""

    def key(self, index):
        raise RuntimeError("sampler exploded")


def launched(ranks: int, *command: str) -> list[str]:
    """`command` run by `mlx.launch` as `ranks` processes on 127.0.0.1 over the ring backend, on
    ports of their own (its default ports would join two launches running at once)."""
    launcher = str(Path(sys.executable).parent / "mlx.launch")
    return [launcher, "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_ports(ranks)), "--", *command]


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports free on 127.0.0.1 (now)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count > 65535:
            continue
        sockets = [socket.socket() for _ in range(count - 1)]
        try:
            for offset, other in enumerate(sockets, 1):
                other.bind(("127.0.0.1", first + offset))
            return first
        except OSError:
            continue
        finally:
            for other in sockets:
                other.close()


def start_server(*flags: str, port: int | None = None, cwd=None, ranks: int = 1) -> tuple[subprocess.Popen, str]:
    """`mlxkv serve` with the demo model on 127.0.0.1 (a free port unless `port`), once /health
    answers; run in `cwd` if given, as `ranks` tensor-parallel processes under `mlx.launch` if more
    than one. Its disk tier (on by default) is a folder of its own unless `flags` name one, so that
    no server reads what another test's wrote, nor the user's cache."""
    import tempfile

    import httpx

    if "--disk-cache" not in flags:
        flags = (*flags, "--disk-cache", tempfile.mkdtemp(prefix="mlxkv-disk-"))
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    command = [sys.executable, "-m", "mlxkv", "serve", "--port", str(port), *flags]
    proc = subprocess.Popen(
        launched(ranks, *command) if ranks > 1 else command,
        start_new_session=ranks > 1,  # so that stopping it stops every rank
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read())
    raise TimeoutError("the server did not come up")


def stop_server(proc: subprocess.Popen) -> str:
    """Stop the server (every rank of a launched one); returns what it wrote to stderr."""
    if os.getpgid(proc.pid) == proc.pid:  # a launcher in a session of its own
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.terminate()
    return proc.communicate(timeout=30)[1]


# Tiny checkpoints' shapes: BASE for every family, and what each hybrid family adds to it.
BASE = dict(
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=320,
)
GATED_DELTA = dict(
    num_hidden_layers=4,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
)
QWEN3_5_ROPE = {  # as Qwen3.5's configs have it: multimodal RoPE sections, interleaved, a quarter of each head rotated
    "rope_type": "default",
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
WINDOW = 8  # the sliding window of the windowed families' tiny checkpoints
QWEN3_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    moe_intermediate_size=64,
    norm_topk_prob=True,
    rope_theta=1e6,
)
GPT_OSS = dict(  # sliding-window layers beside full ones (the model alternates them itself), sinks, experts
    intermediate_size=128,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    rope_theta=150000,
)
LFM2 = dict(num_hidden_layers=4, conv_bias=False, conv_L_cache=3, full_attn_idxs=[1, 3], norm_eps=1e-5)
QWEN3_5_LAYERS = ["linear_attention", "full_attention"] * 2
QWEN3_5_VISION = {"depth": 2, "hidden_size": 64, "out_hidden_size": 128, "patch_size": 16, "spatial_merge_size": 2}
HYBRIDS = {  # attention layers beside recurrent ones: a recurrent state per sequence beside the pages
    "qwen3_5": dict(  # the multimodal checkpoint, as published: its text model's settings in text_config
        text_config=dict(
            BASE,
            **GATED_DELTA,
            model_type="qwen3_5_text",
            layer_types=QWEN3_5_LAYERS,
            attn_output_gate=True,
            rope_parameters=QWEN3_5_ROPE,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        ),
        vision_config=QWEN3_5_VISION,
        image_token_id=4,
        tie_word_embeddings=True,
    ),
    "qwen3_5_moe": dict(
        text_config=dict(
            BASE,
            **GATED_DELTA,
            **MOE,
            model_type="qwen3_5_moe_text",
            shared_expert_intermediate_size=128,
            layer_types=QWEN3_5_LAYERS,
            rope_parameters=QWEN3_5_ROPE,
            max_position_embeddings=1024,
        ),
        vision_config=QWEN3_5_VISION,
    ),
    "qwen3_next": dict(
        GATED_DELTA,
        **MOE,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=128,
        mlp_only_layers=[],
        rope_theta=1e6,
        partial_rotary_factor=0.25,
    ),
    "lfm2": dict(
        LFM2,
        block_dim=128,
        block_ff_dim=256,
        block_multiple_of=32,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
    ),
    "lfm2_moe": dict(LFM2, **MOE, norm_topk_prob=True, use_expert_bias=True, num_dense_layers=1),
    "granitemoehybrid": dict(
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        attention_bias=False,
        embedding_multiplier=12.0,
        attention_multiplier=0.015625,
        logits_scaling=4.0,
        residual_multiplier=0.22,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=128,
        mamba_n_heads=8,  # times mamba_d_head: twice the hidden size, as the config's check wants
        mamba_d_head=32,
        mamba_proj_bias=False,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_n_groups=1,
        mamba_conv_bias=True,
        tie_word_embeddings=False,
    ),
    "nemotron_h": dict(  # Mamba, attention and MLP blocks; its Mamba state is not exact under padding
        num_hidden_layers=6,
        hybrid_override_pattern=["M", "*", "-", "M", "*", "-"],
        attention_bias=False,
        mamba_num_heads=8,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=16,
        conv_kernel=4,
        n_groups=1,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
    ),
}
# Gemma 4, tiny: E2B's arrangement (sliding and global layers of different head dims, per-layer
# inputs, the last two layers reading the K/V of the last sliding and global layers before them)
# and the 26B's (a global layer's keys double as its values, one KV head, experts beside the MLP).
GEMMA4 = dict(
    num_hidden_layers=6,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    sliding_window=8,
    global_head_dim=128,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=320,
)
GEMMA4_K_EQ_V = dict(
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention"] * 2,
    sliding_window=8,
    global_head_dim=128,
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    attention_k_eq_v=True,
    num_global_key_value_heads=1,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=64,
)


# Every supported family, with the fields its published configs carry (RoPE variants and scaling,
# layer types, sliding windows, soft-caps, tied embeddings), on the tiny shape of BASE.
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0, original_max_position_embeddings=64
)  # Llama 3.2's, its original context shrunk below the tests' (1,024) so that the scaling matters
YARN = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=64)
FAMILIES = {
    "llama": dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True, mlp_bias=False),
    "llama-windowed": dict(
        model_type="llama", layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW
    ),
    "mistral": dict(rope_theta=1e6, sliding_window=None),
    "ministral3": dict(  # Ministral 3's: YaRN with Llama 4's attention scaling
        rope_parameters={
            **YARN,
            "type": "yarn",
            "rope_theta": 1e9,
            "factor": 16.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        }
    ),
    "qwen2": dict(  # Qwen 2.5's: a window it does not use, tied embeddings
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_theta=1e6,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=2,
        tie_word_embeddings=True,
    ),
    "qwen2_moe": dict(
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        rope_theta=1e6,
    ),
    "qwen3": dict(rope_theta=1e6, rope_scaling=None, tie_word_embeddings=True, attention_bias=False),
    "qwen3_moe": dict(QWEN3_MOE, rope_scaling=dict(YARN, factor=4.0)),
    "mixtral": dict(
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6
    ),
    "phi3": dict(  # Phi-4-mini's: three quarters of each head rotated, LongRoPE
        num_attention_heads=2,
        num_key_value_heads=1,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=64,
        rope_scaling=dict(type="longrope", short_factor=[1.0] * 24, long_factor=[1.0 + i / 8 for i in range(24)]),
        tie_word_embeddings=True,
    ),
    "gemma2": dict(
        query_pre_attn_scalar=64, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096
    ),
    "gemma3_text": dict(  # Gemma 3 4B's: linear RoPE scaling on the global layers
        num_hidden_layers=4,
        query_pre_attn_scalar=64,
        sliding_window=WINDOW,
        sliding_window_pattern=2,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling=dict(rope_type="linear", factor=8.0),
        final_logit_softcapping=None,
    ),
    "granite": dict(
        num_attention_heads=2,
        num_key_value_heads=1,
        logits_scaling=4.0,
        attention_multiplier=0.015625,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_bias=False,
        mlp_bias=False,
        rope_theta=1e4,
        tie_word_embeddings=True,
    ),
    "smollm3": dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0], no_rope_layer_interval=4, rope_theta=5e6),
    "olmo2": dict(num_key_value_heads=4, rope_theta=500000.0),
    "glm4": dict(attention_bias=True, partial_rotary_factor=0.5, rope_theta=1e4),
    "gpt_oss": dict(GPT_OSS, layer_types=["sliding_attention", "full_attention"], rope_scaling=YARN),
    "gpt_oss-default-layers": dict(GPT_OSS, model_type="gpt_oss", num_hidden_layers=4),
    "gemma4_text": dict(GEMMA4, final_logit_softcapping=30.0),
    "gemma4_text-k-eq-v": dict(GEMMA4_K_EQ_V, model_type="gemma4_text"),
    "gemma4": dict(  # the multimodal checkpoint: its text model inside
        text_config=dict(
            BASE,
            **GEMMA4,
            model_type="gemma4_text",
            tie_word_embeddings=False,
            max_position_embeddings=1024,
            rope_parameters={
                "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    ),
    **HYBRIDS,
}


def family_checkpoint(path: Path, name: str, bits: int | None = None, **kw) -> Path:
    """The tiny checkpoint of `FAMILIES[name]` (float32, or quantized to `bits`), 1,024 tokens of context."""
    spec = {**BASE, **FAMILIES[name]}
    model_type = spec.pop("model_type", name)
    return make_checkpoint(path, model_type, "float32", bits=bits, shape=spec, max_position_embeddings=1024, **kw)


def perturbed_copy(source, dest, scale: float, seed: int = 0):
    """A copy of the checkpoint in `source` with every weight moved by Gaussian noise of `scale`
    times its own spread: a model that mostly agrees with the original (a draft model's stand-in)."""
    dest.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (dest / file.name).write_bytes(file.read_bytes())
    rng = np.random.default_rng(seed)
    for file in source.glob("*.safetensors"):
        weights = {}
        for name, array in mx.load(str(file)).items():
            values = np.array(array.astype(mx.float32))
            noise = rng.standard_normal(values.shape) * scale * values.std()
            weights[name] = mx.array(values + noise).astype(array.dtype)
        mx.save_safetensors(str(dest / file.name), weights, metadata={"format": "mlx"})
    return dest


def drafts_always_pay(engine) -> None:
    """Give `engine`'s speculator a step-time fit nothing is recorded into, so that every draft
    token pays whatever the clock measures: what it drafts no longer depends on the machine's load."""
    from mlxkv.engine.memory.step_time import StepTime

    if engine.speculator is not None:
        engine.speculator.step_time = StepTime()
