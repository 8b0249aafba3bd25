"""Experiment configuration: plain dataclasses, loaded from YAML, checked at start-up.

    cfg = load_config("configs/trapo_1k_3k.yaml", ["loss.clip_eps=0.28", "max_steps=10"])

Every key has a type and a default here; a YAML file or a dotted override
that names an unknown key, or gives a value of the wrong type or outside the
allowed choices, raises `ConfigError` naming the file, the key, the value and
what was expected, before anything expensive starts.

The package holds the schema (`schema`: the dataclasses, their choices and
constants, `ConfigError`), the loading (`loading`: YAML, dotted overrides,
type checks, `load_config`, `dump_config`) and the cross-key checks
(`validation`). It is the shared vocabulary at the bottom of the layers:
every layer imports it, and it imports nothing from trapo but its own
modules. Import from the package (`from trapo.config import Config`), not
from its modules.
"""

from trapo.config.choices import (
    ACQUIRERS,
    ADVANTAGE_SCALES,
    AGGREGATIONS,
    BACKENDS,
    CURRICULA,
    DTYPES,
    ENTROPY_AGGS,
    HF_DECODINGS,
    MODES,
    OBJECTIVES,
    PROMPT_TEMPLATES,
    REFERENCES,
    ROLLOUT_IS_MODES,
    STRATEGIES,
    UNLABELED_KINDS,
)
from trapo.config.loading import check_key, dump_config, load_config, parse_override, read_deepspeed_config, to_dict
from trapo.config.schema import (
    LORA_TARGETS,
    REMOVED_KEYS,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    HealthConfig,
    LabelsConfig,
    LoggingConfig,
    LoraConfig,
    LossConfig,
    MlflowConfig,
    ModelConfig,
    RamblingConfig,
    RewardConfig,
    RolloutConfig,
    SamplingConfig,
    ScrlConfig,
    SelectionConfig,
    ToyConfig,
    TrainConfig,
    WandbConfig,
    flatten,
)
from trapo.config.validation import validate

__all__ = [
    "ACQUIRERS",
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "BACKENDS",
    "CURRICULA",
    "DTYPES",
    "ENTROPY_AGGS",
    "HF_DECODINGS",
    "LORA_TARGETS",
    "MODES",
    "OBJECTIVES",
    "PROMPT_TEMPLATES",
    "REFERENCES",
    "REMOVED_KEYS",
    "ROLLOUT_IS_MODES",
    "STRATEGIES",
    "UNLABELED_KINDS",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LabelsConfig",
    "LoggingConfig",
    "LoraConfig",
    "LossConfig",
    "MlflowConfig",
    "ModelConfig",
    "RewardConfig",
    "HealthConfig",
    "RamblingConfig",
    "RolloutConfig",
    "SamplingConfig",
    "ScrlConfig",
    "SelectionConfig",
    "ToyConfig",
    "TrainConfig",
    "WandbConfig",
    "flatten",
    "check_key",
    "dump_config",
    "load_config",
    "parse_override",
    "read_deepspeed_config",
    "to_dict",
    "validate",
]
