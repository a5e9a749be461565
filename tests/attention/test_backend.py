import mlx.core as mx
import pytest

from mlxkv import reference_attention
from mlxkv.attention import PLAIN, AttentionSpec, choose_attention

SPEC = AttentionSpec(
    mx.float32, q_heads=4, kv_heads=2, head_dim=64, page_size=16, kv_bits=None, kv_group_size=64, variants=[PLAIN]
)


def test_the_choice_then_the_environment_then_metal_where_available(monkeypatch):
    monkeypatch.delenv("MLXKV_ATTENTION", raising=False)
    assert choose_attention(None, SPEC) is reference_attention  # no Metal on this machine
    monkeypatch.setenv("MLXKV_ATTENTION", "reference")
    assert choose_attention(None, SPEC) is reference_attention
    monkeypatch.setenv("MLXKV_ATTENTION", "metal")
    assert choose_attention("reference", SPEC) is reference_attention
    with pytest.raises(ValueError, match="MLXKV_ATTENTION='metal' but Metal is not available"):
        choose_attention(None, SPEC)
    with pytest.raises(ValueError, match="attention='metal' but Metal is not available"):
        choose_attention("metal", SPEC)
    monkeypatch.setenv("MLXKV_ATTENTION", "cuda")
    with pytest.raises(ValueError, match="MLXKV_ATTENTION='cuda' is not an attention backend"):
        choose_attention(None, SPEC)
