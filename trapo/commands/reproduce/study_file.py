"""A study file's fields checked when it is read, before any run or launch: each problem is one line that names
the file, the field and the fix (a misspelled knob would otherwise pass `--print` and end the analysis in an
IndexError after every run had finished).

What is checked: the fields themselves (unknown ones get a did-you-mean, missing ones are named), each field's
type, `base` exists, `knob` is a setting of the config schema (trapo.config's did-you-mean) that every
condition sets to a number, the conditions are named lists of overrides, the seeds are distinct integers, and
every claim has its keys (name, better, worse, split, means), names two conditions and one of SPLITS, the
untrained conditions are conditions of a study whose runs are scored on split files. The
overrides' keys and values are then checked by loading every condition's config (study.load_study).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from trapo.config import ConfigError, check_key

SPLITS = ("validation", "test", "test_ood")
REQUIRED = ("name", "title", "scale", "base", "conditions", "seeds", "claims")
OPTIONAL = (
    "knob",
    "common",
    "quick_seeds",
    "steps",
    "eval_every",
    "report",
    "toy_assets",
    "splits",
    "untrained",
    "scope",
)
# Where a study runs: toy (the toy's model and splits, here), cpu (the base config's own model, here, scored on
# the study's `splits` files), gpu (the paper's configs, launched on a cluster: --print).
SCALES = ("toy", "cpu", "gpu")
CLAIM_KEYS = ("name", "better", "worse", "split", "means", "metric")
# A claim's metric (absent: test accuracy at the best validation step); the others are read by the long-run
# report (long_runs.py): truncated and entropy over the last steps (lower is better), held-out accuracy after
# the run and the selected pseudo-labels' precision at the last epoch end.
# The efficiency report (efficiency.py) reads tokens_to_reference_best (generated tokens until validation reaches
# the worse condition's best) and zero_advantage (the mean share of zero-advantage groups per step).
REPORT_METRICS = {
    "long_runs": ("truncated", "entropy", "accuracy", "precision"),
    "efficiency": ("tokens_to_reference_best", "zero_advantage"),
    "comparison": (),  # comparison.py: test accuracy at the best validation step, with labels bought (labels.*)
}
METRICS = tuple(m for names in REPORT_METRICS.values() for m in names)
REPORTS = tuple(REPORT_METRICS)
# toy scale: "trap", the reproduction's base model and splits (validation, ID and OOD test); "base", the base
# config's own toy section (e.g. configs/toy.yaml's additions: the trainer's greedy held-out check only).
TOY_ASSETS = ("trap", "base")
CLAIM_REQUIRED = ("name", "better", "worse", "split")


def _hint(word: Any, names: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(word), [str(n) for n in names], n=1)
    return f"did you mean '{close[0]}'?" if close else f"expected one of {', '.join(map(str, names))}"


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _overrides(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def check_fields(raw: Any, path: Path, root: Path) -> None:
    """Raise ConfigError, one line naming the file, the field and the fix, for the first bad field of `raw`
    (the knob's value in each condition: check_knob, once the conditions' configs have loaded)."""

    def bad(field: str, problem: str) -> ConfigError:
        return ConfigError(f"study {path}: {field}: {problem}")

    if not isinstance(raw, dict):
        raise ConfigError(f"study {path}: not a mapping of fields; a study has {', '.join(REQUIRED + OPTIONAL)}")
    for key in raw:
        if key not in REQUIRED + OPTIONAL:
            raise bad(str(key), f"not a study field; {_hint(key, REQUIRED + OPTIONAL)}")
    for key in REQUIRED:
        if key not in raw:
            raise bad(key, "missing; every study has " + ", ".join(REQUIRED))
    for key in ("name", "title", "base"):
        if not isinstance(raw[key], str) or not raw[key].strip():
            raise bad(key, f"got {raw[key]!r}; expected a non-empty string")
    if "/" in raw["name"] or raw["name"] in (".", ".."):
        raise bad("name", f"got {raw['name']!r}; expected a plain name (it names the study's output folder)")
    if raw["scale"] not in SCALES:
        raise bad("scale", f"got {raw['scale']!r}; {_hint(raw['scale'], SCALES)}")
    splits = raw.get("splits")
    if (raw["scale"] == "cpu") != (splits is not None):
        raise bad("splits", "a cpu study, and only a cpu study, names its split files (validation, test, test_ood)")
    if splits is not None and (
        not isinstance(splits, dict)
        or sorted(splits) != sorted(SPLITS)
        or not all(isinstance(v, str) for v in splits.values())
    ):
        raise bad("splits", f"got {splits!r}; expected a file for each of {', '.join(SPLITS)}")
    if not (root / raw["base"]).is_file():
        raise bad("base", f"no config file {raw['base']} (a path from the repository root, e.g. configs/toy_trap.yaml)")
    for key in ("steps", "eval_every"):
        value = raw.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad(key, f"got {value!r}; expected a whole number of steps")
    for key in ("seeds", "quick_seeds"):
        value = raw.get(key, [])
        if not _int_list(value) or len(set(value)) != len(value) or (key == "seeds" and not value):
            raise bad(key, f"got {value!r}; expected a list of distinct integer seeds, e.g. [0, 1, 2]")
    if raw.get("toy_assets", "trap") not in TOY_ASSETS:
        raise bad("toy_assets", f"got {raw['toy_assets']!r}; {_hint(raw['toy_assets'], TOY_ASSETS)}")
    if raw.get("toy_assets") == "base" and any("metric" not in c for c in raw["claims"] if isinstance(c, dict)):
        raise bad("toy_assets", "base has no validation split: every claim needs a metric (and report: long_runs)")
    if raw.get("report") is not None and raw["report"] not in REPORTS:
        raise bad("report", f"got {raw['report']!r}; {_hint(raw['report'], REPORTS)}")
    if not _overrides(raw.get("common", [])):
        raise bad("common", f"got {raw.get('common')!r}; expected a list of overrides (key=value strings)")
    conditions = raw["conditions"]
    if not isinstance(conditions, dict) or not conditions:
        raise bad("conditions", f"got {conditions!r}; expected a mapping of condition names to lists of overrides")
    for name, overrides in conditions.items():
        if not isinstance(name, str):
            raise bad("conditions", f"the name {name!r} is not a string; quote it ('{name}':)")
        if not _overrides(overrides):
            raise bad(f"conditions.{name}", f"got {overrides!r}; expected a list of overrides (key=value), [] for none")
    untrained = raw.get("untrained", [])
    if not isinstance(untrained, list) or not all(isinstance(n, str) for n in untrained):
        raise bad("untrained", f"got {untrained!r}; expected a list of condition names, e.g. [base]")
    for name in untrained:
        if name not in conditions:
            raise bad("untrained", f"{name!r} is not a condition of this study; {_hint(name, list(conditions))}")
    if untrained and not scored_on_splits(raw["scale"], raw.get("toy_assets", "trap")):
        raise bad(
            "untrained", "only a study whose runs are scored on split files (scale cpu, or toy) evaluates a model"
        )
    if not isinstance(raw.get("scope", ""), str):
        raise bad("scope", f"got {raw['scope']!r}; expected text (what this scale can and cannot show)")
    knob = raw.get("knob")
    if knob is not None and not isinstance(knob, str):
        raise bad("knob", f"got {knob!r}; expected a dotted config key or null")
    if knob is not None:
        check_key(knob, f"study {path}: knob")
    check_claims(raw["claims"], conditions, path, report=raw.get("report"))


def scored_on_splits(scale: str, toy_assets: str) -> bool:
    """Whether a study's runs are scored here on validation, test and OOD split files (the trap toy's, or a cpu
    study's own): the studies whose conditions may be a model evaluated untrained."""
    return scale == "cpu" or (scale == "toy" and toy_assets == "trap")


def knob_setting(overrides: list[str], knob: str) -> str | None:
    """The value a condition's overrides give the knob (the last one wins, as in the config), or None."""
    values = [o.split("=", 1)[1] for o in overrides if "=" in o and o.split("=", 1)[0].strip() == knob]
    return values[-1].strip() if values else None


def check_knob(knob: str | None, conditions: dict, path: Path) -> None:
    """A knob (a setting of the schema: check_fields) is set to a number by every condition (the results' x axis).
    Called after the conditions' configs load, so that a misspelled override is named as such first."""
    if knob is None:
        return
    for name, overrides in conditions.items():
        value = knob_setting(overrides, knob)
        if value is None:
            raise ConfigError(
                f"study {path}: knob: condition {name} does not set {knob}; give every condition {knob}=<value>, "
                "or set knob: null"
            )
        try:
            float(value)
        except ValueError:
            raise ConfigError(
                f"study {path}: knob: condition {name} sets {knob}={value}, not a number (the results' x axis); "
                "set knob: null for a study whose conditions are not points on a scale"
            ) from None


def check_claims(claims: Any, conditions: dict, path: Path, report: str | None = None) -> None:
    """Every claim: a mapping of CLAIM_KEYS with a name, two distinct conditions and one of SPLITS; a metric
    (one of METRICS) only in a study with a report that reads it."""
    if not isinstance(claims, list):
        raise ConfigError(f"study {path}: claims: got {claims!r}; expected a list of claims ({', '.join(CLAIM_KEYS)})")
    seen = set()
    for i, claim in enumerate(claims):
        where = f"study {path}: claims[{i}]"
        if not isinstance(claim, dict):
            raise ConfigError(f"{where}: got {claim!r}; expected a mapping with {', '.join(CLAIM_KEYS)}")
        where += f" ({claim['name']})" if isinstance(claim.get("name"), str) else ""
        for key in claim:
            if key not in CLAIM_KEYS:
                raise ConfigError(f"{where}: '{key}' is not a claim key; {_hint(key, CLAIM_KEYS)}")
        for key in CLAIM_REQUIRED:
            if key not in claim:
                raise ConfigError(f"{where}: '{key}' is missing; every claim has {', '.join(CLAIM_REQUIRED)}")
        for key in ("name", "means"):
            if key in claim and not isinstance(claim[key], str):
                raise ConfigError(f"{where}: {key}: got {claim[key]!r}; expected a string")
        if claim["name"] in seen:
            raise ConfigError(f"{where}: name: a second claim named {claim['name']}; give each claim its own name")
        seen.add(claim["name"])
        for key in ("better", "worse"):
            if claim[key] not in conditions:
                hint = _hint(claim[key], list(conditions))
                raise ConfigError(f"{where}: {key}: {claim[key]!r} is not a condition of this study; {hint}")
        if claim["better"] == claim["worse"]:
            raise ConfigError(f"{where}: better and worse are both {claim['better']}; name two conditions")
        if "metric" in claim and claim["metric"] not in METRICS:
            raise ConfigError(f"{where}: metric: got {claim['metric']!r}; {_hint(claim['metric'], METRICS)}")
        if "metric" in claim and claim["metric"] not in REPORT_METRICS.get(report, ()):
            readers = [r for r, names in REPORT_METRICS.items() if claim["metric"] in names]
            raise ConfigError(f"{where}: metric: only a study with report: {readers[0]} reads it")
        if claim["split"] not in SPLITS:
            raise ConfigError(f"{where}: split: got {claim['split']!r}; {_hint(claim['split'], SPLITS)}")
