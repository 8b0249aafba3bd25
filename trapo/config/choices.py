"""The configuration's named choices: each `Literal` is the one list of a key's allowed values that other
code names too (argparse, the algorithm's guards), and its tuple (MODES, BACKENDS, ...) is `typing.get_args`
of it; and the form a `reward.verifier` value must have.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

# Choices that other modules check or offer (argparse, the algorithm's guards): each Literal is the one list.
Mode = Literal["supervised", "unsupervised", "naive_semi", "trapo"]
Dtype = Literal["auto", "float32", "bfloat16"]
PromptTemplate = Literal["think", "cot", "chat", "dataset", "plain"]
Backend = Literal["auto", "vllm", "hf"]
Placement = Literal["colocated", "separate"]
Aggregation = Literal["dr_grpo", "token_mean", "seq_mean"]
AdvantageScale = Literal["none", "std"]
Objective = Literal["grpo", "gspo", "cispo"]
RolloutIsMode = Literal["truncate", "token_mask", "sequence_mask", "off"]
Reference = Literal["mean_trajectory", "mean_cosine", "max_cosine"]
Strategy = Literal["tcs", "random", "entropy", "self_certainty"]
EntropyAgg = Literal["loss", "token_mean"]
Curriculum = Literal["none", "trajectory"]
UnlabeledKind = Literal["majority", "cluster_share", "scrl", "self_certainty", "token_entropy", "sentence_entropy"]
Acquire = Literal["care", "tcs", "random"]
HfDecoding = Literal["auto", "eager", "static", "cuda_graph", "compile"]

# `reward.verifier`: one of these, or "module:name" (trapo/algorithm/rewards/verifiers.py)
VERIFIERS = ("math", "mcq", "exact")
_VERIFIER_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def verifier_problem(spec: str) -> str | None:
    """What is wrong with the form of a `reward.verifier` value, or None (nothing is imported here)."""
    if spec in VERIFIERS or _VERIFIER_SPEC.fullmatch(spec):
        return None
    return f"must be {', '.join(VERIFIERS)} or 'module:name' (an object in a module on PYTHONPATH), got {spec!r}"


MODES = get_args(Mode)
DTYPES = get_args(Dtype)
PROMPT_TEMPLATES = get_args(PromptTemplate)
BACKENDS = get_args(Backend)
AGGREGATIONS = get_args(Aggregation)
ADVANTAGE_SCALES = get_args(AdvantageScale)
OBJECTIVES = get_args(Objective)
ROLLOUT_IS_MODES = get_args(RolloutIsMode)
REFERENCES = get_args(Reference)
STRATEGIES = get_args(Strategy)
ENTROPY_AGGS = get_args(EntropyAgg)
CURRICULA = get_args(Curriculum)
UNLABELED_KINDS = get_args(UnlabeledKind)
ACQUIRERS = get_args(Acquire)
HF_DECODINGS = get_args(HfDecoding)
