"""The catalogue: what a server may serve, from `--model`, a folder of checkpoints and a models file,
found by any of its names; anything it cannot take is one error naming where and what."""

import pytest

from mlxkv.config import EngineConfig
from mlxkv.entrypoints.hosting import Catalogue, ListedModel, catalogue_of, read_models_file

MODELS_FILE = """
[models.chat]
path = "/models/chat"
aliases = ["assistant", "qwen3"]
keep_alive = "30m"
max_model_len = 256
num_pages = 64

[models."mlx-community/Some-Model-4bit"]
"""


def test_models_given_twice_are_served_under_the_names_given_and_the_first_is_the_default():
    catalogue = catalogue_of(["/models/a", "org/b"])
    assert [m.name for m in catalogue] == ["/models/a", "org/b"] and catalogue.default.path == "/models/a"
    assert catalogue.find(None).name == "/models/a" and catalogue.find("org/b:latest").name == "org/b"
    assert catalogue.find("org/c") is None


def test_a_folder_of_checkpoint_folders_lists_each_under_its_folders_name(tmp_path):
    for name in ("zeta", "alpha"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()  # no config.json: not a checkpoint
    catalogue = catalogue_of([str(tmp_path)])
    assert [(m.name, m.path) for m in catalogue] == [
        ("alpha", str(tmp_path / "alpha")),
        ("zeta", str(tmp_path / "zeta")),
    ]


def test_a_models_file_gives_names_aliases_keep_alive_and_settings(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(MODELS_FILE)
    chat, other = read_models_file(path)
    assert chat == ListedModel(
        "chat", "/models/chat", ("assistant", "qwen3"), {"max_model_len": 256, "num_pages": 64}, 1800.0
    )
    assert other == ListedModel("mlx-community/Some-Model-4bit", "mlx-community/Some-Model-4bit")
    config = chat.config(EngineConfig(max_num_seqs=3))
    assert (config.max_model_len, config.num_pages, config.max_num_seqs) == (256, 64, 3)
    catalogue = catalogue_of(["/models/a"], path)
    assert [m.name for m in catalogue] == ["/models/a", "chat", "mlx-community/Some-Model-4bit"]
    assert catalogue.find("qwen3") == chat


def test_no_model_given_serves_the_demo_model_as_mlxkv_demo():
    (demo,) = catalogue_of([])
    assert (demo.name, demo.path) == ("mlxkv-demo", None)
    (named,) = catalogue_of(["/models/a"], names=["mine", "also-mine"])
    assert named.names == ("mine", "also-mine") and named.path == "/models/a"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[models.chat]\npath = 3\n", "model 'chat': path must be a checkpoint folder or a repo id"),
        ("[models.chat]\ncolour = 'red'\n", "model 'chat': 'colour' is not a setting (expected path, aliases"),
        ("[models.chat]\naliases = 'x'\n", "model 'chat': aliases must be a list of names"),
        ("[models.chat]\nkeep_alive = 'soon'\n", "model 'chat': keep_alive must be seconds or a duration"),
        ("[models]\n", "must hold [models.<name>] tables, one per model"),
        ("[model.chat]\n", "must hold [models.<name>] tables, one per model"),
        ("[models.chat\n", "is not valid TOML"),
    ],
)
def test_a_models_file_it_cannot_take_is_one_error_naming_the_file_the_model_and_the_key(tmp_path, text, message):
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as caught:
        read_models_file(path)
    assert f"models file {str(path)!r}" in str(caught.value) and message in str(caught.value)


def test_bad_settings_names_and_option_mixes_are_refused_before_anything_loads(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text("[models.chat]\npath = '/m'\nmax_num_seqs = 0\n")
    with pytest.raises(ValueError, match=r"^model 'chat': max_num_seqs must be"):
        catalogue_of([], path, server=EngineConfig())
    with pytest.raises(ValueError, match="two models answer to the name '/m'"):
        catalogue_of(["/m", "/m"])
    with pytest.raises(ValueError, match="--served-model-name names one model"):
        catalogue_of(["/a", "/b"], names=["x"])
    with pytest.raises(ValueError, match="cannot be read"):
        read_models_file(tmp_path / "missing.toml")


def test_models_without_a_memory_limit_share_the_budget_in_proportion_to_their_weights():
    listed = catalogue_of(["/big", "/small", "/unknown"]).models + [
        ListedModel("/own", "/own", settings={"memory_limit": 5})
    ]
    shared = Catalogue(listed).shared(1000, {"/big": 600, "/small": 200, "/unknown": 0, "/own": 100})
    assert [m.settings["memory_limit"] for m in shared] == [545, 181, 272, 5]  # /unknown counts as the mean, 300
    (alone,) = catalogue_of(["/only"]).shared(1000, {"/only": 10})
    assert "memory_limit" not in alone.settings
