"""Config loading: every shipped experiment validates; bad keys and values fail with the key named."""

import glob
import os

import pytest

from trapo.config import ConfigError, load_config, parse_override

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_there_is_a_config_per_paper_experiment():
    names = {os.path.basename(p) for p in CONFIGS}
    for expected in (
        "toy.yaml",
        "toy_trap.yaml",
        "trapo_1k_3k.yaml",
        "trapo_4k_12k.yaml",
        "trapo_ood_1k_1k.yaml",
        "trapo_deepmath_2k_8k.yaml",
        "supervised_1k.yaml",
        "unsupervised_ttrl_45k.yaml",
        "naive_semi_1k_3k.yaml",
        "trapo_1k_3k_r1distill_1p5b.yaml",  # appendix "Extend TraPO to More Models"
        "trapo_1k_3k_llama31_8b.yaml",
    ):
        assert expected in names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert os.path.isfile(os.path.join(ROOT, cfg.train.deepspeed_config))
    assert not cfg.rollout.dynamic_sampling  # the paper trains on every rolled-out group
    if not os.path.basename(path).startswith("toy"):
        # the paper's hyper-parameters (appendix "Implementation Details")
        assert (cfg.train.lr, cfg.train.rollout_batch_size, cfg.train.update_batch_size) == (1e-6, 64, 64)
        assert (cfg.rollout.n, cfg.rollout.temperature) == (8, 1.0)
        assert (cfg.selection.top_p, cfg.selection.threshold) == (0.1, 0.4)
        assert cfg.selection.warmup_epochs == (10 if "ood" in path else 8)
        # The RoPE change is the paper's for Qwen2.5-Math (4K context); the other models keep theirs.
        qwen_math = cfg.model.path.endswith("Qwen2.5-Math-7B")
        rope = (40000, 16384) if qwen_math else (None, None)
        assert (cfg.model.rope_theta, cfg.model.max_position_embeddings) == rope
        assert cfg.data.prompt_template == ("cot" if "Llama" in cfg.model.path else "think")
        loss = (cfg.loss.agg, cfg.loss.advantage_scale, cfg.loss.beta, cfg.loss.entropy_coef)
        if path.endswith("_verl.yaml"):  # the authors' public veRL script; otherwise the paper's Dr.GRPO
            assert loss == ("token_mean", "std", 0.001, 0.0)
            paper = load_config(path.replace("_verl.yaml", ".yaml"))
            assert {**vars(cfg), "loss": None, "run_name": None} == {**vars(paper), "loss": None, "run_name": None}
        else:
            assert loss == ("dr_grpo", "none", 0.0, 0.01)


def test_overrides_are_typed_and_dotted():
    cfg = load_config(os.path.join(ROOT, "configs", "toy.yaml"), ["loss.clip_eps=0.28", "max_steps=5", "seed=3"])
    assert cfg.loss.clip_eps == 0.28 and cfg.max_steps == 5 and cfg.seed == 3
    assert parse_override("a.b.c=[1, 2]") == {"a": {"b": {"c": [1, 2]}}}


@pytest.mark.parametrize(
    "override, needle",
    [
        ("loss.clip_epsilon=0.2", "key 'loss.clip_epsilon' is not a known setting; did you mean 'loss.clip_eps'"),
        ("rollout.n=eight", "key 'rollout.n': got 'eight' (str); expected an integer"),
        ("mode=semi", "expected one of 'supervised', 'unsupervised', 'naive_semi', 'trapo'"),
        ("train.lr=true", "key 'train.lr': got True (bool); expected a number"),
        ("rollout.n=1", "key 'rollout.n': GRPO needs at least 2 rollouts"),
        ("train.update_batch_size=24", "must divide train.rollout_batch_size (64)"),
        ("model.path=/somewhere", "must be empty when toy.enabled"),
        ("max_steps", "expected dotted.key=value"),
        ("selection.top_p=1.5", "key 'selection.top_p': must be in [0, 1], got 1.5"),
        ("reward.step_budget=0", "key 'reward.step_budget': must be > 0 or null"),
        ("rollout.tensor_parallel_size=0", "key 'rollout.tensor_parallel_size': must be >= 1"),
        ("train.loss_chunk_tokens=0", "key 'train.loss_chunk_tokens': must be >= 1"),
        ("loss.rollout_is_cap=0", "key 'loss.rollout_is_cap': must be > 0"),
        ("logging.level=loud", "key 'logging.level'"),
        ("rollout.dynamic_sampling_max_rounds=-1", "key 'rollout.dynamic_sampling_max_rounds': must be >= 0"),
    ],
)
def test_bad_settings_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(os.path.join(ROOT, "configs", "toy.yaml"), [override])
    assert needle in str(err.value)


def test_bad_yaml_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: x\n  dtpye: float32\n")
    with pytest.raises(ConfigError, match=r"config file .*bad.yaml: key 'model.dtpye' is not a known setting"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.yaml"))
