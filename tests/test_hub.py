"""Hub ids (trapo/hub.py), offline against a hub cache built in a temp dir (the `hub_cache` fixture): names
resolve to snapshots and their commits through huggingface_hub itself, and every way a name cannot be had is
one HubError line that names it."""

import json

import pytest

from trapo import hub
from trapo.engine import dist

A, B = "a" * 40, "b" * 40


def model_files(tmp_path, weights=True):
    d = tmp_path / "files"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (d / "tokenizer.json").write_text("{}")
    if weights:
        (d / "model.safetensors").write_bytes(b"\0" * 16)
    return d


def test_a_cached_hub_id_resolves_to_its_snapshot_and_commit_offline(hub_cache, tmp_path):
    snapshot = hub_cache.add("toyorg/toy-adder", model_files(tmp_path), A)
    snap = hub.fetch("toyorg/toy-adder")
    assert snap.local_dir == snapshot and snap.commit == A and snap.label == f"toyorg/toy-adder@{A}"
    assert hub.fetch("toyorg/toy-adder", revision=A).commit == A  # a commit needs no ref
    hub_cache.add("toyorg/toy-adder", model_files(tmp_path), B, ref="v2")
    assert hub.fetch("toyorg/toy-adder", revision="v2").commit == B  # a tag or branch through refs/
    assert hub.fetch("toyorg/toy-adder").commit == A


def test_a_local_directory_is_used_as_it_is_and_takes_no_revision(tmp_path):
    d = model_files(tmp_path)
    snap = hub.fetch(str(d))
    assert snap.local_dir == d and snap.commit is None and snap.label == str(d)
    with pytest.raises(hub.HubError, match="a local directory has no revision"):
        hub.fetch(str(d), revision="main")
    with pytest.raises(hub.HubError, match="a file, not a directory"):
        hub.fetch(str(d / "config.json"))


@pytest.mark.parametrize("name", ["./models/qwen", "/no/such/dir", "../x", "a/b/c", "org/"])
def test_a_path_that_is_not_there_is_not_taken_for_a_hub_id(hub_cache, name):
    with pytest.raises(hub.HubError, match="no such directory, and not a Hugging Face hub id"):
        hub.fetch(name)


def test_offline_and_not_cached_is_one_line_naming_the_id_and_the_fix(hub_cache, tmp_path):
    hub_cache.add("toyorg/toy-adder", model_files(tmp_path), A)
    with pytest.raises(hub.HubError) as err:
        hub.fetch("nosuch/model", what="--model")
    line = str(err.value)
    assert "\n" not in line and line.startswith("--model nosuch/model: not a local directory")
    assert "HF_HUB_OFFLINE=1" in line and "hf download nosuch/model" in line and str(hub_cache.path) in line
    with pytest.raises(hub.HubError, match="toyorg/toy-adder at revision v9: not a local directory"):
        hub.fetch("toyorg/toy-adder", revision="v9")  # a ref never fetched


def test_a_model_snapshot_needs_a_config_and_safetensors(hub_cache, tmp_path):
    hub_cache.add("org/binonly", model_files(tmp_path, weights=False), A)
    with pytest.raises(hub.HubError, match="no .safetensors weights"):
        hub.fetch("org/binonly")
    assert hub.fetch("org/binonly", kind="tokenizer").commit == A  # a tokenizer needs no weights


def test_datasets_resolve_from_their_own_cache_folders(hub_cache, tmp_path):
    d = tmp_path / "rows"
    (d / "data").mkdir(parents=True)
    (d / "data" / "train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    hub_cache.add("org/rows", d, B, repo_type="dataset")
    snap = hub.fetch("org/rows", kind="dataset", what="prepare source")
    assert snap.commit == B and (snap.local_dir / "data" / "train.jsonl").is_file()
    with pytest.raises(hub.HubError, match="prepare source org/rows"):
        hub.fetch("org/rows", what="prepare source")  # the same id is no model repository


def test_the_cache_follows_hf_home_when_hf_hub_cache_is_unset(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.cache_dir() == tmp_path / "home" / "hub"


def test_once_per_node_runs_the_leader_first_and_carries_its_error(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    calls = []
    assert dist.once_per_node(lambda cached_only: calls.append(cached_only) or "dir") == "dir"
    assert calls == [False]  # alone on the node: the leader's download, no second pass
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dist.once_per_node(lambda cached_only: cached_only) is True  # a follower reads the cache only

    def fails(cached_only):
        raise hub.HubError("model.path x/y: gone")

    with pytest.raises(hub.HubError, match="x/y: gone"):
        dist.once_per_node(fails)
