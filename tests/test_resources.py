"""The shipped configs and evaluation sets found by name from any directory (trapo/resources.py): a file in the
working directory wins, a shipped one stands in by name, a config naming another shipped file (the DeepSpeed
JSON) finds it the same way, and `trapo configs` lists and prints them. The installed wheel: tests/test_wheel.py."""

import json
import os
import subprocess
import sys

import pytest

from trapo import resources, runtime
from trapo.config import ConfigError, load_config

ROOT = runtime.ROOT


def test_in_a_clone_the_shipped_folders_are_the_repositorys_own():
    assert resources.shipped("configs") == ROOT / "configs"
    assert resources.shipped("benchmarks") == ROOT / "data" / "benchmarks"
    assert not (ROOT / "trapo" / "_shipped").exists()  # a build's copy never lands in the source tree


def test_a_shipped_config_by_name_from_any_directory_and_a_file_here_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("trapo_1k_3k", "trapo_1k_3k.yaml", "configs/trapo_1k_3k.yaml"):
        assert resources.find_config(name) == ROOT / "configs" / "trapo_1k_3k.yaml", name
    for name in ("toy", "configs/toy.yaml"):
        assert load_config(name).run_name == "toy"
    # the DeepSpeed JSON the config names, by the same rule
    ds = resources.config_path(load_config("toy").train.deepspeed_config)
    assert ds == ROOT / "configs" / "deepspeed_zero3.json" and json.loads(ds.read_text())["zero_optimization"]
    # a user's own file, relative to the working directory, wins over the shipped one of that name
    (tmp_path / "configs").mkdir()
    mine = (ROOT / "configs" / "toy.yaml").read_text().replace("run_name: toy", "run_name: mine")
    (tmp_path / "configs" / "toy.yaml").write_text(mine)
    assert load_config("configs/toy.yaml").run_name == "mine" and load_config("toy").run_name == "toy"
    assert resources.find_config("configs/deepspeed_zero3.json") == ROOT / "configs" / "deepspeed_zero3.json"
    (tmp_path / "configs" / "deepspeed_zero3.json").write_text("{}")
    assert (
        resources.find_config("configs/deepspeed_zero3.json").resolve() == tmp_path / "configs" / "deepspeed_zero3.json"
    )


@pytest.mark.parametrize("name", ["no_such_config", "../configs/toy.yaml", "/nonexistent/toy.yaml"])
def test_a_name_that_is_neither_here_nor_shipped_is_one_line_naming_it(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    assert resources.find_config(name) is None
    with pytest.raises(ConfigError, match=rf"config file {name}: cannot read it: no such file here.*trapo configs"):
        load_config(name)


def run(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "trapo", *args],
        cwd=cwd,
        env=runtime.subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_trapo_configs_lists_every_shipped_config_in_one_line_and_shows_one(tmp_path):
    out = run("configs", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")}
    shipped = {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert shipped <= listed and {"deepspeed_zero3.json", "slurm/train.sbatch", "studies/toy/top_p.yaml"} <= listed
    toy = next(line for line in out.stdout.splitlines() if line.split()[:1] == ["toy"])
    assert "tiny Qwen2" in toy  # its one line: the file's first comment line
    shown = run("configs", "show", "trapo_1k_3k", cwd=tmp_path)
    assert shown.returncode == 0 and shown.stdout == (ROOT / "configs" / "trapo_1k_3k.yaml").read_text()
    missing = run("configs", "show", "nope", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "trapo configs" in missing.stderr
    assert not os.listdir(tmp_path)  # nothing written where it ran
