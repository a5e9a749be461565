"""An embedding checkpoint's pooling, from its sentence-transformers files: each mode against a
direct numpy computation, normalised where a Normalize module says, and refused where the files
cannot be read or ask for what mlxkv does not compute."""

import json
import re

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.models.pooling import Pooling, pooling_of

RNG = np.random.default_rng(0)
HIDDEN = RNG.standard_normal((3, 5, 4)).astype(np.float32)
LENGTHS = np.array([5, 2, 3])


def write(folder, flags, normalize=True, modules=None):
    listed = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ] + (
        [{"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
        if normalize
        else []
    )
    (folder / "modules.json").write_text(json.dumps(modules if modules is not None else listed))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    config = {"word_embedding_dimension": 4, "include_prompt": True} | {flag: True for flag in flags}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return folder


def expected(mode):
    rows = [HIDDEN[i, : LENGTHS[i]] for i in range(3)]
    return np.stack(
        {
            "cls": [r[0] for r in rows],
            "last": [r[-1] for r in rows],
            "max": [r.max(axis=0) for r in rows],
            "mean": [r.mean(axis=0) for r in rows],
            "mean_sqrt_len": [r.sum(axis=0) / np.sqrt(len(r)) for r in rows],
        }[mode]
    )


@pytest.mark.parametrize(
    "flag, mode",
    [
        ("pooling_mode_cls_token", "cls"),
        ("pooling_mode_lasttoken", "last"),
        ("pooling_mode_max_tokens", "max"),
        ("pooling_mode_mean_tokens", "mean"),
        ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
    ],
)
@pytest.mark.parametrize("normalize", [True, False])
def test_each_mode_pools_the_texts_own_tokens_and_normalises_where_the_files_say(tmp_path, flag, mode, normalize):
    pooling = pooling_of(write(tmp_path, [flag], normalize))
    assert pooling == Pooling(mode, normalize, 4)
    want = expected(mode)
    if normalize:
        want = want / np.linalg.norm(want, axis=-1, keepdims=True)
    got = np.array(pooling(mx.array(HIDDEN), mx.array(LENGTHS)))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_checkpoint_without_a_pooling_module_is_not_an_embedder(tmp_path):
    assert pooling_of(tmp_path) is None
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    assert pooling_of(write(tmp_path, [], modules=modules)) is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (["pooling_mode_weightedmean_tokens"], "asks for pooling pooling_mode_weightedmean_tokens; mlxkv computes"),
        (
            ["pooling_mode_cls_token", "pooling_mode_mean_tokens"],
            "asks for pooling pooling_mode_cls_token, pooling_mode_mean",
        ),
        ([], "asks for pooling none; mlxkv computes exactly one of"),
    ],
)
def test_a_pooling_mlxkv_does_not_compute_is_refused_naming_the_file(tmp_path, flags, message):
    write(tmp_path, flags)
    with pytest.raises(ValueError, match=re.escape("1_Pooling/config.json' " + message)):
        pooling_of(tmp_path)


def test_files_that_are_not_json_are_refused_naming_them(tmp_path):
    (tmp_path / "modules.json").write_text("[{")
    with pytest.raises(ValueError, match=r"modules\.json' is not valid JSON"):
        pooling_of(tmp_path)
    (tmp_path / "modules.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match=r"modules\.json' must hold a list of modules"):
        pooling_of(tmp_path)


@pytest.mark.parametrize(
    "config, sizes",
    [({}, ()), ({"is_matryoshka": True}, range(1, 5)), ({"matryoshka_dimensions": [4, 2]}, (4, 2))],
)
def test_what_a_vector_may_be_cut_to_comes_from_the_checkpoints_config(tmp_path, config, sizes):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert pooling_of(write(tmp_path, ["pooling_mode_lasttoken"])).sizes == sizes


def test_cutting_keeps_the_first_numbers_and_normalises_again_where_the_model_does():
    vectors = [[3.0, 4.0, 12.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    normalising, plain = Pooling("last", True, 4, (2, 4)), Pooling("mean", False, 4, range(1, 5))
    assert normalising.cut(vectors, 2) == [[0.6000000238418579, 0.800000011920929], [1.0, 0.0]]
    assert plain.cut(vectors, 3) == [[3.0, 4.0, 12.0], [1.0, 0.0, 0.0]]
    assert normalising.cut(vectors, 4) is vectors
    with pytest.raises(
        ValueError, match=r"^dimensions: this model makes vectors of 4 numbers; it may be cut to 2, 4, not 3$"
    ):
        normalising.cut(vectors, 3)
    with pytest.raises(
        ValueError, match=r"^dimensions: this model makes vectors of 4 numbers; it may be cut to 1 to 4, not 9$"
    ):
        plain.cut(vectors, 9)
    with pytest.raises(ValueError, match=r"^dimensions: this model makes vectors of 4 numbers, not 2$"):
        Pooling("cls", True, 4).cut(vectors, 2)
