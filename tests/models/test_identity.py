"""A model's weights digest names its pages on disk: it must not change when an engine wraps the
model, and must change with the checkpoint."""

from mlxkv import LLM, load
from mlxkv.models.identity import weights_digest
from mlxkv.models.random_model import make_checkpoint


def test_the_digest_survives_wrapping_and_tells_checkpoints_apart(tmp_path):
    model, _ = load(make_checkpoint(tmp_path / "a", "llama", seed=0))
    before = weights_digest(model)
    LLM(load(tmp_path / "a")).generate([1, 2, 3])  # another copy, wrapped
    LLM((model, load(tmp_path / "a")[1])).generate([1, 2, 3])  # this one, wrapped
    assert weights_digest(model) == before
    other, _ = load(make_checkpoint(tmp_path / "b", "llama", seed=1))
    assert weights_digest(other) != before
    assert weights_digest(model, None) == before != weights_digest(model, other)  # a vision tower's count too
