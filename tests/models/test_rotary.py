"""RoPE by per-step tables equals the rope module bit for bit, or is not used."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.models.smollm3 import NoPE

from mlxkv.models.rotary import Positions, Rotation

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
ROPES = {
    "half-split": lambda: nn.RoPE(64, base=10000.0),
    "adjacent pairs": lambda: nn.RoPE(64, traditional=True, base=1e6),
    "partial (GLM, Phi)": lambda: nn.RoPE(32, base=10000.0),
    "partial, adjacent pairs": lambda: nn.RoPE(16, traditional=True, base=500.0, scale=0.25),
    "llama3 frequencies": lambda: initialize_rope(64, 500000.0, False, LLAMA3, 131072),
}
POSITIONS = mx.array([0, 1, 2, 9, 4095, 4096, 70000, 3, 3])


def by_module(rope, x, positions):
    return rope(x[:, :, None], offset=positions)[:, :, 0]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("name", list(ROPES))
def test_tables_rotate_queries_and_keys_exactly_as_the_module(name, dtype):
    rope = ROPES[name]()
    rotation = Rotation.of(rope, 64, dtype)
    assert rotation is not None
    positions = Positions(POSITIONS)
    for heads, seed in ((8, 1), (2, 2)):  # queries, then keys: both from the step's one pair of tables
        x = mx.random.normal((POSITIONS.size, heads, 64), key=mx.random.key(seed)).astype(dtype)
        rotated = positions.rotate(rotation, x)
        assert rotated.dtype == dtype and mx.array_equal(rotated, by_module(rope, x, POSITIONS)).item()


def test_layers_with_the_same_rope_share_tables_and_others_do_not():
    first, second = (Rotation.of(nn.RoPE(64, base=1e4), 64, mx.float32) for _ in range(2))
    other_base = Rotation.of(nn.RoPE(64, base=1e6), 64, mx.float32)
    in_bfloat16 = Rotation.of(nn.RoPE(64, base=1e4), 64, mx.bfloat16)
    assert first.key == second.key
    assert len({first.key, other_base.key, in_bfloat16.key}) == 3


def test_a_rope_that_scales_its_input_first_keeps_its_module():
    """YaRN multiplies the rotated dims by its mscale before rotating, which tables cannot
    reproduce bit for bit, and identity (no RoPE, as SmolLM3's NoPE layers) gains nothing."""
    yarn = initialize_rope(64, 10000.0, False, YARN, 16384)
    assert yarn.mscale != 1.0
    assert Rotation.of(yarn, 64, mx.float32) is None
    assert Rotation.of(NoPE(), 64, mx.float32) is None
