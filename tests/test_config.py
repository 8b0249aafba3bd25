"""Config loading: every shipped experiment validates; bad keys and values fail with the key named."""

import dataclasses
import glob
import os
import typing

import pytest

import trapo.config as config
from trapo.config import ConfigError, SelectionConfig, load_config, parse_override

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
        "trapo_1k_3k_select30.yaml",  # tables "select_method" / "random_select": fixed 30%, four strategies
    ):
        assert expected in names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert os.path.isfile(os.path.join(ROOT, cfg.train.deepspeed_config))
    assert not cfg.rollout.dynamic_sampling  # the paper trains on every rolled-out group
    if not os.path.basename(path).startswith(("toy", "real")):  # real_*: its own settings (docs/real-model.md)
        # the paper's hyper-parameters (appendix "Implementation Details")
        lr = 1e-5 if cfg.model.lora.rank else 1e-6  # LoRA's is ours: 10x, adapters need a larger step
        assert (cfg.train.lr, cfg.train.rollout_batch_size, cfg.train.update_batch_size) == (lr, 64, 64)
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
    if not path.endswith("_select30.yaml"):  # the paper's rule, TCS: what every run did before the strategies
        assert (cfg.selection.strategy, cfg.selection.fixed_ratio) == ("tcs", None)


def test_selection_strategy_config_differs_from_the_table_1_run_only_in_selection():
    """configs/trapo_1k_3k_select30.yaml is configs/trapo_1k_3k.yaml at a fixed 30%; its header's overrides
    give the four strategies of the paper's table "select_method"."""
    path = os.path.join(ROOT, "configs", "trapo_1k_3k_select30.yaml")
    paper = load_config(os.path.join(ROOT, "configs", "trapo_1k_3k.yaml"))
    header = open(path).read().split("\nrun_name:")[0]
    for strategy in ("tcs", "random", "entropy", "self_certainty"):
        over = (
            [] if strategy == "tcs" else [f"selection.strategy={strategy}", f"run_name=trapo_1k_3k_select30_{strategy}"]
        )
        assert all(o in header for o in over)
        cfg = load_config(path, over)
        assert (cfg.selection.strategy, cfg.selection.fixed_ratio) == (strategy, 0.3)
        assert {**vars(cfg), "run_name": None, "selection": None} == {
            **vars(paper),
            "run_name": None,
            "selection": None,
        }
        assert {**vars(cfg.selection), "strategy": "tcs", "fixed_ratio": None} == vars(paper.selection)
        assert cfg.run_name != paper.run_name


def test_overrides_are_typed_and_dotted():
    cfg = load_config(os.path.join(ROOT, "configs", "toy.yaml"), ["loss.clip_eps=0.28", "max_steps=5", "seed=3"])
    assert cfg.loss.clip_eps == 0.28 and cfg.max_steps == 5 and cfg.seed == 3
    assert parse_override("a.b.c=[1, 2]") == {"a": {"b": {"c": [1, 2]}}}


def test_a_yaml_syntax_error_is_one_line_naming_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [1e-6, 2e-6\nloss:\n  clip_eps: 0.2\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(bad))
    assert str(err.value) == (
        f"config file {bad}:3:5: not valid YAML: expected ',' or ']', but got ':' "
        "(while parsing a flow sequence at 2:7); fix it there"
    )
    with pytest.raises(ConfigError) as err:  # an override's value: the same one line, without a place
        load_config(os.path.join(ROOT, "configs", "toy.yaml"), ["train.lr=[1"])
    assert str(err.value) == (
        "override 'train.lr=[1': value is not valid YAML: expected ',' or ']', but got '<stream end>' "
        "(while parsing a flow sequence at 1:1)"
    )


def test_a_setting_named_without_its_section_gets_the_dotted_key():
    toy = os.path.join(ROOT, "configs", "toy.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(toy, ["lr=1e-6"])
    assert str(err.value) == "override 'lr=1e-6': key 'lr' is not a known setting; did you mean 'train.lr'?"
    with pytest.raises(ConfigError) as err:  # in the wrong section: the same
        load_config(toy, ["rollout.clip_eps=0.2"])
    assert str(err.value).endswith("key 'rollout.clip_eps' is not a known setting; did you mean 'loss.clip_eps'?")


@pytest.mark.parametrize(
    "override, needle",
    [
        ("loss.clip_epsilon=0.2", "key 'loss.clip_epsilon' is not a known setting; did you mean 'loss.clip_eps'"),
        ("rollout.n=eight", "key 'rollout.n': got 'eight' (str); expected an integer"),
        ("mode=semi", "expected one of 'supervised', 'unsupervised', 'naive_semi', 'trapo'"),
        ("rollout.backend=tpu", "key 'rollout.backend': got 'tpu' (str); expected one of 'auto', 'vllm', 'hf'"),
        ("train.lr=true", "key 'train.lr': got True (bool); expected a number"),
        ("rollout.n=1", "key 'rollout.n': GRPO needs at least 2 rollouts"),
        ("train.update_batch_size=24", "must divide train.rollout_batch_size (64)"),
        ("model.path=/somewhere", "must be empty when toy.enabled"),
        ("max_steps", "expected dotted.key=value"),
        ("selection.top_p=1.5", "key 'selection.top_p': must be in [0, 1], got 1.5"),
        ("reward.step_budget=0", "key 'reward.step_budget': must be > 0 or null"),
        ("rollout.rambling.loop_truncated=1.5", "key 'rollout.rambling.loop_truncated': must be in (0, 1] or null"),
        ("rollout.rambling.loop_steps=0", "key 'rollout.rambling.loop_steps': must be >= 1, got 0"),
        ("rollout.rambling.loop_step=3", "did you mean 'rollout.rambling.loop_steps'"),
        ("rollout.tensor_parallel_size=0", "key 'rollout.tensor_parallel_size': must be >= 1"),
        ("train.loss_chunk_tokens=0", "key 'train.loss_chunk_tokens': must be >= 1"),
        ("loss.rollout_is_cap=0", "key 'loss.rollout_is_cap': must be > 0"),
        ("loss.rollout_is=seq", "key 'loss.rollout_is': got 'seq' (str); expected one of 'truncate', 'token_mask'"),
        ("loss.rollout_is_lower=0.5", "key 'loss.rollout_is_lower': only the mask modes use a lower bound"),
        ("loss.objective=ppo", "key 'loss.objective': got 'ppo' (str); expected one of 'grpo', 'gspo', 'cispo'"),
        ("loss.gspo_clip_eps=0", "key 'loss.gspo_clip_eps': must be > 0"),
        ("loss.overlong=cut", "expected one of 'none', 'mask', 'soft_penalty'"),
        ("loss.overlong_buffer=4", "key 'loss.overlong_buffer': only loss.overlong=soft_penalty uses it"),
        ("logging.level=loud", "key 'logging.level'"),
        ("selection.random=true", "key 'selection.random' was removed: replaced by selection.strategy=random"),
        ("selection.strategy=entropie", "key 'selection.strategy': got 'entropie' (str); expected one of 'tcs'"),
        ("selection.fixed_ratio=1.5", "key 'selection.fixed_ratio': must be in [0, 1] or null, got 1.5"),
        ("rollout.dynamic_sampling_max_rounds=-1", "key 'rollout.dynamic_sampling_max_rounds': must be >= 0"),
        (
            "sampling.curriculum=trajectories",
            "key 'sampling.curriculum': got 'trajectories' (str); expected one of 'none', 'trajectory'",
        ),
        ("sampling.curriculum_window=0", "key 'sampling.curriculum_window': must be >= 1"),
        ("sampling.curriculum_readmit_every=1", "key 'sampling.curriculum_readmit_every': must be >= 2"),
        # what a library would reject minutes later (vLLM's SamplingParams, torch's AdamW), refused now
        ("eval.temperature=-0.5", "override 'eval.temperature=-0.5': key 'eval.temperature': must be in [0, 2]"),
        ("rollout.temperature=2.5", "key 'rollout.temperature': must be in (0, 2]"),
        ("rollout.eval_temperature=-1", "key 'rollout.eval_temperature': must be in [0, 2]"),
        ("eval.max_tokens=0", "key 'eval.max_tokens': must be in [1, rollout.max_tokens=12]"),
        ("eval.heldout_k=-1", "key 'eval.heldout_k': must be >= 0 (0: greedy held-out accuracy only), got -1"),
        ("eval.temperature=0", "key 'eval.heldout_k': avg@8 samples at eval.temperature, which is 0 (greedy)"),
        ("toy.sft_noise=1", "key 'toy.sft_noise': must be in [0, 1) (a share of the warm start's answers), got 1"),
        ("toy.sft_lr=0", "key 'toy.sft_lr': must be > 0 (the warm start's learning rate), got 0"),
        ("toy.task=trap", "key 'toy.sft_noise': the teacher's slips (a+b+10) need task 'addition', got task 'trap'"),
        ("train.weight_decay=-0.1", "key 'train.weight_decay': must be >= 0"),
        ("train.adam_betas=[0.9,1.0]", "key 'train.adam_betas': each must be in [0, 1)"),
        ("model.rope_theta=0", "key 'model.rope_theta': must be > 0 or null"),
        ("data.max_prompt_tokens=0", "key 'data.max_prompt_tokens': must be >= 1"),
        ("run_name=..", "key 'run_name': must be a plain directory name"),
        ("resume_changes=[rollout.nn]", "key 'resume_changes': 'rollout.nn' is not a setting"),
        (
            "model.gradient_checkpointing=maybe",
            "key 'model.gradient_checkpointing': got 'maybe' (str); expected true or false or 'auto'",
        ),
        ("model.gradient_checkpointing=1", "key 'model.gradient_checkpointing': got 1 (int); expected true or false"),
        ("model.gradient_checkpointing=atuo", "expected true or false or 'auto'; did you mean 'auto'?"),
        ("selection.strategy=entropie", "expected one of 'tcs', 'random', 'entropy', 'self_certainty'; did you mean"),
    ],
)
def test_bad_settings_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(os.path.join(ROOT, "configs", "toy.yaml"), [override])
    assert needle in str(err.value)


def test_gradient_checkpointing_takes_auto_true_or_false_and_defaults_to_auto(tmp_path):
    toy = os.path.join(ROOT, "configs", "toy.yaml")
    assert load_config(toy).model.gradient_checkpointing == "auto"
    for text, value in (("auto", "auto"), ("true", True), ("false", False)):
        assert load_config(toy, [f"model.gradient_checkpointing={text}"]).model.gradient_checkpointing == value
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  gradient_checkpointing: sometimes\n")
    with pytest.raises(ConfigError, match=r"key 'model.gradient_checkpointing': got 'sometimes' \(str\)"):
        load_config(str(path))


def test_a_range_error_names_the_override_that_caused_it_and_the_file_otherwise(tmp_path):
    toy = os.path.join(ROOT, "configs", "toy.yaml")
    with pytest.raises(ConfigError, match=r"^override 'eval.n=4': key 'eval.n': greedy decoding"):
        load_config(toy, ["eval.temperature=0", "eval.n=4"])
    with pytest.raises(ConfigError, match=r"^override 'selection.top_p=3': key 'selection.top_p'"):
        load_config(toy, ["selection.top_p=3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("toy:\n  enabled: true\nrollout:\n  top_p: 2\n")
    with pytest.raises(ConfigError, match=rf"^config file {bad}: key 'rollout.top_p'"):
        load_config(str(bad), ["max_steps=3"])


def test_exponents_without_a_dot_are_numbers_as_people_type_them(tmp_path):
    """YAML 1.1 (PyYAML) reads 1e-6 as a string; the paper's learning rate is typed that way."""
    f = tmp_path / "lr.yaml"
    f.write_text("toy:\n  enabled: true\ntrain:\n  lr: 1e-6\n")
    assert load_config(str(f)).train.lr == 1e-6
    assert load_config(str(f), ["train.lr=5E-7"]).train.lr == 5e-7
    with pytest.raises(ConfigError, match="expected a number"):
        load_config(str(f), ["train.lr=1e-6x"])


def test_bad_yaml_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: x\n  dtpye: float32\n")
    with pytest.raises(ConfigError, match=r"config file .*bad.yaml: key 'model.dtpye' is not a known setting"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["loss.rollout_is=token_mask", "loss.rollout_is_lower=2.0"], "must be in [0, loss.rollout_is_cap=2.0)"),
        (["loss.overlong=soft_penalty", "loss.overlong_buffer=12"], "must be in [1, rollout.max_tokens=12)"),
        (["loss.overlong=soft_penalty", "rollout.max_tokens=4"], "for soft_penalty, got 0"),  # None: 4 // 5
        (["loss.overlong=soft_penalty", "loss.overlong_penalty=0"], "key 'loss.overlong_penalty': must be > 0"),
    ],
)
def test_loss_option_cross_checks(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(os.path.join(ROOT, "configs", "toy.yaml"), overrides)
    assert needle in str(err.value)


def test_loss_options_defaults_keep_todays_loss():
    """Every shipped config runs GRPO with the automatic rollout IS and no overlong shaping; the new keys load."""
    for path in CONFIGS:
        lo = load_config(path).loss
        assert (lo.objective, lo.rollout_is, lo.rollout_is_lower, lo.overlong) == ("grpo", None, None, "none")
    cfg = load_config(
        os.path.join(ROOT, "configs", "toy.yaml"),
        [
            "loss.objective=gspo",
            "loss.rollout_is=sequence_mask",
            "loss.rollout_is_lower=0.25",
            "loss.overlong=soft_penalty",
            "loss.overlong_buffer=4",
        ],
    )
    lo = cfg.loss
    assert (lo.objective, lo.rollout_is, lo.rollout_is_lower, lo.overlong) == (
        "gspo",
        "sequence_mask",
        0.25,
        "soft_penalty",
    )
    assert (lo.gspo_clip_eps, lo.gspo_clip_eps_high) == (3e-4, 4e-4)  # the GSPO paper's range
    # YAML 1.1 reads a bare `off` as false: accepted
    # (trapo.algorithm.importance.resolve_mode: false is off, true truncate)
    assert load_config(os.path.join(ROOT, "configs", "toy.yaml"), ["loss.rollout_is=off"]).loss.rollout_is is False
    assert lo.overlong_buffer_tokens(cfg.rollout.max_tokens) == 4
    assert cfg.loss.__class__().overlong_buffer_tokens(20480) == 4096  # DAPO's L_cache of L_max


def test_each_set_of_choices_has_one_source(capsys):
    """The tuples other modules check against or offer are `typing.get_args` of the schema's Literals."""
    from trapo.algorithm import importance, loss, passrate, selection
    from trapo.commands import eval as eval_command
    from trapo.engine import rollout

    def choices(section: type, key: str) -> tuple:  # the Literal of the annotation, alone or in a union
        tp = typing.get_type_hints(section)[key]
        return typing.get_args(next(a for a in (tp, *typing.get_args(tp)) if typing.get_origin(a) is typing.Literal))

    assert config.MODES == choices(config.Config, "mode")
    assert config.DTYPES == choices(config.ModelConfig, "dtype")
    assert config.PROMPT_TEMPLATES == choices(config.DataConfig, "prompt_template")
    assert config.BACKENDS == choices(config.RolloutConfig, "backend") == ("auto", "vllm", "hf")
    assert config.AGGREGATIONS == choices(config.LossConfig, "agg")
    assert config.ADVANTAGE_SCALES == choices(config.LossConfig, "advantage_scale")
    assert config.OBJECTIVES == choices(config.LossConfig, "objective")
    assert config.ROLLOUT_IS_MODES == choices(config.LossConfig, "rollout_is")
    assert config.REFERENCES == choices(config.SelectionConfig, "reference")
    assert config.STRATEGIES == choices(config.SelectionConfig, "strategy")
    assert rollout.BACKENDS is config.BACKENDS and importance.ROLLOUT_IS_MODES is config.ROLLOUT_IS_MODES
    assert passrate.REFERENCES is config.REFERENCES and selection.STRATEGIES is config.STRATEGIES
    assert loss.AGGREGATIONS is config.AGGREGATIONS and loss.OBJECTIVES is config.OBJECTIVES
    assert loss.ADVANTAGE_SCALES is config.ADVANTAGE_SCALES
    with pytest.raises(SystemExit):
        eval_command.main(["--help"])
    shown = capsys.readouterr().out
    for offered in (config.PROMPT_TEMPLATES, config.DTYPES, config.BACKENDS):  # trapo eval's argparse choices
        assert "{" + ",".join(offered) + "}" in shown


def test_selection_range_errors_carry_their_key_when_built_by_hand():
    """The tracker takes a SelectionConfig made in code; its checks are the ones validation runs."""
    with pytest.raises(ConfigError, match=r"^config: key 'selection.top_p': must be in \[0, 1\], got 2"):
        SelectionConfig(top_p=2)
    with pytest.raises(ConfigError, match=r"^config: key 'selection.warmup_epochs': must be >= 0"):
        dataclasses.replace(SelectionConfig(), warmup_epochs=-1)
    loaded = SelectionConfig()
    loaded.top_p, loaded.fixed_ratio = 3, 1.5  # as the loader sets values: no __post_init__
    assert loaded.problems() == [
        ("selection.top_p", "must be in [0, 1], got 3"),
        ("selection.fixed_ratio", "must be in [0, 1] or null, got 1.5"),
    ]
