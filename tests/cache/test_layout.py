import pytest

from mlxkv import KVLayout, resolve_layout


def test_default_is_paged(monkeypatch):
    monkeypatch.delenv("MLXKV_KV_LAYOUT", raising=False)
    assert resolve_layout() is KVLayout.PAGED


def test_environment_chooses(monkeypatch):
    monkeypatch.setenv("MLXKV_KV_LAYOUT", "contiguous")
    assert resolve_layout() is KVLayout.CONTIGUOUS


def test_argument_wins_over_environment(monkeypatch):
    monkeypatch.setenv("MLXKV_KV_LAYOUT", "contiguous")
    assert resolve_layout("paged") is KVLayout.PAGED
    assert resolve_layout(KVLayout.PAGED) is KVLayout.PAGED


def test_unknown_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("MLXKV_KV_LAYOUT", "ragged")
    with pytest.raises(ValueError, match=r"MLXKV_KV_LAYOUT must be 'paged' or 'contiguous', got 'ragged'"):
        resolve_layout()


def test_unknown_argument_names_the_argument():
    with pytest.raises(ValueError, match=r"kv_layout must be 'paged' or 'contiguous', got 'dense'"):
        resolve_layout("dense")
