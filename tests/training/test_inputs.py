"""A run's inputs, checked before any model loads (trapo/training/inputs.py)."""

import os

import pytest

from trapo.config import ConfigError, load_config
from trapo.runtime import ROOT
from trapo.training.inputs import prepare_inputs


def test_toy_assets_are_built_by_the_entry_point_not_by_the_inputs(tmp_path):
    cfg = load_config(os.path.join(ROOT, "configs", "toy.yaml"), [f"toy.dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"no toy model and data in .*seed-0; `python -m trapo train` builds them"):
        prepare_inputs(cfg, world=1)
    assert os.listdir(tmp_path) == []  # nothing built here


def test_batch_sizes_must_divide_over_the_ranks(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    cfg = load_config(os.path.join(ROOT, "configs", "trapo_1k_3k.yaml"), [f"model.path={tmp_path / 'model'}"])
    with pytest.raises(ConfigError, match=r"must be multiples of the world size \(7\)"):
        prepare_inputs(cfg, world=7)
