import mlx.core as mx
import pytest

from mlxkv import reference_attention
from mlxkv.attention import PLAIN, AttentionSpec, Variant, choose_attention

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


def test_a_spec_groups_its_layers_by_head_shape():
    """Gemma 4: sliding layers of head dim 256 and two KV heads, global ones of 512 and one; the
    start-up check runs once per shape with the variants of its layers."""
    window = Variant(window=512)
    spec = AttentionSpec(
        mx.bfloat16, 8, [2, 2, 1, 2], [256, 256, 512, 256], 16, None, 64, [window, window, PLAIN, window]
    )
    assert spec.geometries() == {(2, 256): [window] * 3, (1, 512): [PLAIN]}
    assert SPEC.geometries() == {(2, 64): [PLAIN]}


def test_kernels_failing_at_one_head_shape_put_the_model_on_the_reference_path(caplog):
    checked = []

    class Kernels:
        def warm(self, dtype, head_dim, *args):
            checked.append(head_dim)
            return "too wide" if head_dim == 512 else None

    spec = AttentionSpec(mx.float16, 8, 1, [256, 512], 16, None, 64, [PLAIN, PLAIN])
    assert choose_attention(None, spec, Kernels()) is reference_attention
    assert checked == [256, 512] and "head_dim 512, pages of 16, GQA 8): too wide" in caplog.text
