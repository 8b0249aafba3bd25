"""Loading the configuration: defaults <- a YAML file <- dotted overrides, each value checked against its type.

An unknown key gets a did-you-mean hint (or what replaced it, for a removed one); a value of the
wrong type or outside the allowed choices names the key, the value and what was expected (and the
choice a misspelt one is closest to). Also the
way back: `to_dict` (what the loggers record) and `dump_config` (the run_dir/config.yaml a run writes).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from trapo import resources
from trapo.config.schema import REMOVED_KEYS, Config, ConfigError, flatten
from trapo.config.validation import validate

# A number in exponent notation that YAML 1.1 leaves a string (no dot in the mantissa, e.g. 1e-6, 5E3).
YAML11_EXPONENT = re.compile(r"[-+]?[0-9]+[eE][-+]?[0-9]+")


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        return repr(choices[0]) if len(choices) == 1 else "one of " + ", ".join(repr(a) for a in choices)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


# By hand, not pydantic: lax, it takes true for a number; strict, it refuses 1e-6 and a mapping for a dataclass.
def _coerce(tp: Any, value: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{where}: got {value!r} ({type(value).__name__}); expected {_describe(tp)}{_near(tp, value)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise bad
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise bad
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ConfigError:
                pass
        raise bad
    if origin is list:
        if not isinstance(value, list):
            raise bad
        (item,) = typing.get_args(tp)
        return [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, str) and YAML11_EXPONENT.fullmatch(value.strip()):
            return float(value)  # 1e-6: YAML 1.1 (PyYAML) reads an exponent without a dot as a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {where}")


def _near(tp: Any, value: Any) -> str:
    """'; did you mean X?' for a string close to one of the choices `tp` allows (a misspelt 'atuo'), else ''."""
    if not isinstance(value, str):
        return ""
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    choices = [c for m in members if typing.get_origin(m) is Literal for c in typing.get_args(m) if isinstance(c, str)]
    close = difflib.get_close_matches(value, choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _apply(obj: Any, values: dict, source: str, prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'top level'} must be a mapping, got {values!r}")
    for key, value in values.items():
        where = f"{source}: key '{prefix}{key}'"
        if key not in names:
            raise _unknown(key, names, prefix, where)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            _apply(getattr(obj, key), value, source, f"{prefix}{key}.")
        else:
            setattr(obj, key, _coerce(tp, value, where))


def _unknown(key: Any, names: list[str], prefix: str, where: str) -> ConfigError:
    """A key that is not among `names`: what replaced it (a removed key), the settings of that name in other
    sections (`lr`: train.lr), or the closest name."""
    if f"{prefix}{key}" in REMOVED_KEYS:
        return ConfigError(f"{where} was removed: {REMOVED_KEYS[f'{prefix}{key}']}")
    elsewhere = [dotted for dotted in _settings(Config()) if dotted.rsplit(".", 1)[-1] == str(key)]
    close = difflib.get_close_matches(str(key), names, n=1)
    if elsewhere:  # the setting's own name in another section: `lr` for train.lr
        hint = f"; did you mean {' or '.join(repr(k) for k in elsewhere)}?"
    elif close:
        hint = f"; did you mean '{prefix}{close[0]}'?"
    else:
        hint = f"; known keys: {', '.join(names)}"
    return ConfigError(f"{where} is not a known setting{hint}")


def _settings(obj: Any, prefix: str = "") -> list[str]:
    """The dotted key of every setting (not section) in the dataclass `obj`."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out += _settings(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]
    return out


def _yaml_problem(err: yaml.YAMLError) -> str:
    """What the YAML parser expected or found, in one line (where a construct it was reading began too)."""
    problem = " ".join(str(getattr(err, "problem", None) or err).split())
    context, opened = getattr(err, "context", None), getattr(err, "context_mark", None)
    return f"{problem} ({' '.join(context.split())}{_at(opened)})" if context else problem


def _at(mark) -> str:
    """' at line:column' (1-based, as editors count) of a YAML mark; empty without one."""
    return f" at {mark.line + 1}:{mark.column + 1}" if mark else ""


def check_key(dotted: str, source: str) -> None:
    """`dotted` names one setting (`selection.top_p`, not a section nor a path past a value); else the
    ConfigError a config file naming it would get (did you mean, or what replaced a removed key)."""
    obj: Any = Config()
    parts = str(dotted).split(".")
    for i, part in enumerate(parts):
        prefix, where = ".".join(parts[:i]) + "." if i else "", f"{source}: key '{dotted}'"
        if not dataclasses.is_dataclass(obj):
            raise ConfigError(f"{where}: '{prefix.rstrip('.')}' is a setting, not a section")
        names = [f.name for f in dataclasses.fields(obj)]
        if part not in names:
            raise _unknown(part, names, prefix, where)
        obj = getattr(obj, part)
    if dataclasses.is_dataclass(obj):
        keys = ", ".join(f"{dotted}.{f.name}" for f in dataclasses.fields(obj))
        raise ConfigError(f"{source}: key '{dotted}' is a section, not a setting; its keys: {keys}")


def parse_override(text: str) -> dict:
    """'loss.clip_eps=0.28' -> {'loss': {'clip_eps': 0.28}} (the value is read as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {_yaml_problem(err)}") from None
    out: dict = {}
    node = out
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- overrides, then type and cross-key checks. `path`: a file here, else a shipped
    config by name (trapo/resources.py: `trapo_1k_3k`, `configs/trapo_1k_3k.yaml`)."""
    cfg = Config()
    if path is not None:
        found = resources.find_config(str(path))  # here, else the shipped config of that name
        try:
            text = (found or Path(path)).read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file {path}: cannot read it: {resources.NOT_FOUND}") from None
        except OSError as err:
            raise ConfigError(f"config file {path}: cannot read it ({err.strerror})") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)  # editors count from 1, the parser from 0
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
            raise ConfigError(f"config file {where}: not valid YAML: {_yaml_problem(err)}; fix it there") from None
        _apply(cfg, data, f"config file {path}")
    origins = {}  # dotted key -> the override that set it, so a range error names the override
    for text in overrides:
        parsed = parse_override(text)
        _apply(cfg, parsed, f"override {text!r}")
        origins.update({key: f"override {text!r}" for key in flatten(parsed)})
    validate(cfg, f"config file {path}" if path else "config", origins)
    return cfg


def read_deepspeed_config(path: str) -> dict:
    """train.deepspeed_config's JSON: the file here, else the shipped one of that name (`configs/deepspeed_zero3.json`
    from any directory); a ConfigError naming the key, the file and the shipped ones otherwise."""
    try:
        data = json.loads(resources.config_path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"train.deepspeed_config {path}: cannot read JSON: {resources.NOT_FOUND} "
            "(configs/deepspeed_zero3.json, configs/deepspeed_zero2.json)"
        ) from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"train.deepspeed_config {path}: cannot read JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"train.deepspeed_config {path}: expected a JSON object, got {type(data).__name__}")
    return data


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
