"""Hub ids end to end, offline, from a hub cache holding the toy model as `toyorg/toy-adder` (the `hub_cache`
fixture): a training run records the commit its revision resolved to and refuses to resume onto a moved
revision; `trapo eval` takes the id; an id that cannot be had is one line that names it."""

import json
import os
import sys

import pytest
import torch
import yaml
from toyrun import VLLM, metrics, overrides, run, train

A, B = "a" * 40, "b" * 40


def hub_run(toy_dir, out, **kv):
    train_file = os.path.join(toy_dir, "seed-0", "train.jsonl")
    extra = {"toy.enabled": "false", "model.path": "toyorg/toy-adder", "data.train_files": f"[{train_file}]", **VLLM}
    return overrides(toy_dir, out, run_name="hub", mode="trapo", save_steps=2, **extra, **kv)


@pytest.mark.toy_run
def test_a_hub_model_trains_records_its_commit_and_a_moved_revision_stops_the_resume(toy_dir, tmp_path, hub_cache):
    model = os.path.join(toy_dir, "seed-0", "model")
    hub_cache.add("toyorg/toy-adder", model, A)
    first = train(hub_run(toy_dir, tmp_path, max_steps=2))
    assert f"model.path toyorg/toy-adder: hub commit {A} (default branch)" in first.stderr
    run_dir = tmp_path / "hub"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["revision"] == A  # pinned: reproducible
    state = torch.load(run_dir / "checkpoints" / "step-2" / "trainer_state.pt", weights_only=False)
    assert state["model_commit"] == A

    hub_cache.add("toyorg/toy-adder", model, B)  # the branch moves on
    moved = train(hub_run(toy_dir, tmp_path, max_steps=4, resume_from="latest"), check=False)
    lines = [line for line in moved.stderr.splitlines() if "model.revision" in line]
    assert moved.returncode == 2 and "Traceback" not in moved.stderr, moved.stderr[-2000:]
    assert len(lines) == 1 and A in lines[0] and B in lines[0] and f"model.revision={A}" in lines[0]

    train(hub_run(toy_dir, tmp_path, max_steps=4, resume_from="latest", **{"model.revision": A}))
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]


@pytest.mark.toy_run
def test_eval_takes_a_hub_id_and_names_one_it_cannot_have(toy_dir, tmp_path, hub_cache):
    hub_cache.add("toyorg/toy-adder", os.path.join(toy_dir, "seed-0", "model"), A)
    test = os.path.join(toy_dir, "seed-0", "test.jsonl")
    common = [
        "--benchmarks",
        test,
        "--n",
        "1",
        "--temperature",
        "0",
        "--template",
        "plain",
        "--limit",
        "4",
        "--max-tokens",
        "12",
        "--max-prompt-tokens",
        "16",
        "--backend",
        "hf",
    ]
    out = run([sys.executable, "-m", "trapo", "eval", "--model", "toyorg/toy-adder", *common, "--out", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["model"] == f"toyorg/toy-adder@{A}" and results["results"]["test"]["questions"] == 4
    assert "| toyorg/toy-adder |" in out.stdout  # the table's row is the id

    bad = run([sys.executable, "-m", "trapo", "eval", "--model", "nosuch/model", *common, "--out", str(tmp_path / "x")])
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert "--model nosuch/model: not a local directory, and not in the hub cache" in lines[0]
