"""The census (`scripts/census.py`): every model_type of the installed mlx-lm runs with mlx-lm's greedy
tokens in both layouts, batched, or is refused at load, exactly as docs/families.md and the README say."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import census

from mlxkv.models.tiny_configs import MODEL_TYPES


def test_the_table_lists_every_model_type_of_the_installed_mlx_lm():
    assert list(census.documented()) == list(MODEL_TYPES)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_each_family_runs_with_mlx_lms_tokens_or_is_refused_as_the_table_says(model_type, tmp_path):
    assert census.examine(model_type, tmp_path) == census.documented()[model_type]


def test_the_readme_summary_and_refusals_are_the_tables():
    findings = list(census.documented().values())
    assert census.summary(findings) in census.README.read_text()
    assert sum(f.outcome == census.RUNS for f in findings) >= 100
