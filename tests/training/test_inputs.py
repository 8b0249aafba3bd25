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


def fake_model(tmp_path, config: dict, weights: bytes | None = None):
    """A model directory with `config` as its config.json and, when given, one safetensors file."""
    import json

    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if weights is not None:
        (d / "model.safetensors").write_bytes(weights)
    return d


def safetensors_bytes(n_floats: int) -> bytes:
    import json
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [n_floats], "data_offsets": [0, 4 * n_floats]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * (4 * n_floats)


def test_a_response_budget_past_the_models_context_is_refused_before_any_load(tmp_path):
    d = fake_model(tmp_path, {"max_position_embeddings": 4096})
    paper = os.path.join(ROOT, "configs", "trapo_1k_3k.yaml")  # 1024 + 8192 tokens; its override gives 16384
    with pytest.raises(ConfigError, match=r"= 9216 tokens exceeds .*max_position_embeddings = 4096"):
        prepare_inputs(load_config(paper, [f"model.path={d}", "model.max_position_embeddings=null"]), world=1)
    rope = fake_model(tmp_path, {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4}})
    with pytest.raises(ConfigError, match="must be multiples"):  # 4096 x 4 serves 9216: on to the next check
        prepare_inputs(load_config(paper, [f"model.path={rope}", "model.max_position_embeddings=null"]), world=7)


def test_a_toy_runs_budget_past_its_models_context_is_refused_before_any_load(tmp_path):
    cfg = load_config(os.path.join(ROOT, "configs", "toy.yaml"), [f"toy.dir={tmp_path}", "rollout.max_tokens=2040"])
    root = cfg.toy.asset_dir  # as built: a manifest, and the model's config.json (2,048 positions)
    (root / "model").mkdir(parents=True)
    (root / "manifest.json").write_text("{}")
    (root / "model" / "config.json").write_text('{"max_position_embeddings": 2048}')
    needle = r"= 2056 tokens exceeds what the toy model serves \(max_position_emb.* lower rollout.max_tokens to 2032 "
    with pytest.raises(ConfigError, match=needle):
        prepare_inputs(cfg, world=1)


def test_a_truncated_weight_file_is_named_before_any_load(tmp_path):
    from trapo.hub import weight_problem

    whole = safetensors_bytes(16)
    assert weight_problem(fake_model(tmp_path, {}, whole)) is None
    d = fake_model(tmp_path, {}, whole[:-10])
    assert (
        weight_problem(d)
        == f"model.safetensors: truncated ({len(whole) - 10} of {len(whole)} bytes); copy or download it again"
    )
    paper = os.path.join(ROOT, "configs", "trapo_1k_3k.yaml")
    with pytest.raises(ConfigError, match="model.safetensors: truncated"):
        prepare_inputs(load_config(paper, [f"model.path={d}"]), world=1)
    (d / "model.safetensors").write_bytes(b"\x05")
    assert "not a readable safetensors file" in weight_problem(d)


def test_a_label_budget_without_hidden_golds_is_refused_before_any_load(tmp_path, capsys):
    import json

    from trapo.data import DataError

    d = fake_model(tmp_path, {"max_position_embeddings": 32768})
    rows = [{"question": f"{i}+1?", "answer": str(i + 1), "labeled": True} for i in range(4)]
    rows += [{"question": f"{i}+2?", "labeled": False} for i in range(4)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    paper = os.path.join(ROOT, "configs", "trapo_1k_3k.yaml")
    args = [f"model.path={d}", f"data.train_files=[{train}]", "train.rollout_batch_size=4", "train.update_batch_size=4"]
    args += ["labels.budget=2"]
    with pytest.raises(DataError, match=r"labels.budget 2: no unlabeled row of .*train.jsonl holds a gold answer"):
        prepare_inputs(load_config(paper, args), world=1)
    # one hidden gold: said, and the run goes on to its next input (here the tokenizer the fake model lacks)
    rows[4]["answer"] = "2"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(Exception) as err:
        prepare_inputs(load_config(paper, args), world=1)
    assert not isinstance(err.value, DataError)
    assert "labels.budget 2: only 1 unlabeled questions hold a gold; at most 1 are bought" in capsys.readouterr().err


def test_a_captured_decode_path_without_cuda_is_refused_before_anything_is_read(tmp_path):
    """rollout.hf_decoding=cuda_graph or compile on a machine without CUDA: refused ahead of the inputs (the model
    path below does not even exist), where the engine would otherwise say it after the policy loaded."""
    import torch

    from trapo.training.trainer import Trainer

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the captured paths run")
    for decoding in ("cuda_graph", "compile"):
        args = [f"model.path={tmp_path / 'absent'}", "rollout.backend=hf", f"rollout.hf_decoding={decoding}"]
        cfg = load_config(os.path.join(ROOT, "configs", "trapo_1k_3k.yaml"), args + [f"output_dir={tmp_path}"])
        with pytest.raises(ConfigError, match=f"rollout.hf_decoding={decoding} captures CUDA graphs and needs a CUDA"):
            Trainer(cfg)
