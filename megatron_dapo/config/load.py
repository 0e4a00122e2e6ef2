"""YAML + `key.sub=value` overrides -> a typed, validated `DapoConfig`.

Every value is checked against the dataclass field's annotation, so a typo or a wrong type fails
here, with the full dotted key, before any process starts. Error messages are one line.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Union

import yaml

from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.schema import DapoConfig

# ---------------------------------------------------------------------------------------------- YAML

# Bounds on a parsed document: anchors and aliases are fine, an alias bomb (a few lines expanding
# to billions of nodes) or a recursive alias is not; nor is nesting deeper than any config needs.
MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys in a mapping (YAML says they are an error; PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _check_expanded_size(data: Any, where: str) -> None:
    """ConfigError when `data`, with every alias expanded, exceeds the node or depth bound."""
    count, stack = 0, [(data, 1)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_YAML_NODES:
            raise ConfigError(
                f"{where}: more than {MAX_YAML_NODES} values once aliases are expanded "
                f"(an alias bomb or a recursive alias?)"
            )
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(f"{where}: nested deeper than {MAX_YAML_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def parse_yaml(text: str, where: str) -> Any:
    """YAML text -> plain data, strictly (no duplicate keys, bounded size and depth); one-line ConfigError."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}{at}: invalid YAML: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{where}: invalid YAML: nested deeper than the parser can follow") from None
    _check_expanded_size(data, where)
    return data


# --------------------------------------------------------------------------------------------- types


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    if tp is Any:
        return "any"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _got(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _wrong_type(path: str, value: Any, tp: Any) -> ConfigError:
    return ConfigError(f"{path}: expected {_type_name(tp)}, got {_got(value)}")


def _convert(value: Any, tp: Any, path: str, current: Any = None) -> Any:
    """Check `value` against annotation `tp` and return it in canonical form.

    `current` is the existing value of a dataclass field, so that a mapping updates it field by field.
    """
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(value, tp, path, current)
    if origin in (Union, types.UnionType):
        return _convert_union(value, tp, path, current)
    if origin is Literal:
        return _convert_literal(value, tp, path)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _wrong_type(path, value, tp)
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _wrong_type(path, value, tp)
        key_tp, val_tp = typing.get_args(tp)
        return {_convert(k, key_tp, path): _convert(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if tp in _SCALARS:
        return _SCALARS[tp](value, tp, path)
    raise TypeError(f"{path}: unsupported annotation {tp!r} in the config schema")  # a schema bug


def _convert_dataclass(value: Any, tp: Any, path: str, current: Any) -> Any:
    if isinstance(value, tp):
        return value
    if not isinstance(value, dict):
        raise _wrong_type(path, value, tp)
    obj = current if isinstance(current, tp) else tp()
    return _merge(obj, value, path)


def _convert_union(value: Any, tp: Any, path: str, current: Any) -> Any:
    args = typing.get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        raise _wrong_type(path, value, tp)
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(value, arg, path, current)
        except ConfigError as e:
            errors.append(e)
    # An error about a nested element is more precise than "expected X | null"; keep it.
    nested = [e for e in errors if not str(e).startswith(f"{path}: expected")]
    if nested:
        raise nested[0]
    raise _wrong_type(path, value, tp)


def _convert_literal(value: Any, tp: Any, path: str) -> Any:
    choices = typing.get_args(tp)
    if value in choices and type(value) is type(choices[0]):
        return value
    hint = ""
    if isinstance(value, str):
        close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"{path}: expected one of {_type_name(tp)}, got {_got(value)}{hint}")


def _convert_bool(value: Any, tp: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    raise _wrong_type(path, value, tp)


def _convert_int(value: Any, tp: Any, path: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ConfigError(f"{path}: {_got(value)} is out of range (a 64-bit integer)")
        return value
    raise _wrong_type(path, value, tp)


def _convert_float(value: Any, tp: Any, path: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{path}: expected a finite float, got {_got(value)}")
        return number
    # PyYAML follows YAML 1.1, where `1e-6` (no dot) is a string; accept it as the number it means.
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise _wrong_type(path, value, tp) from None
        if math.isfinite(number):
            return number
    raise _wrong_type(path, value, tp)


def _convert_str(value: Any, tp: Any, path: str) -> str:
    if isinstance(value, str):
        return value
    raise _wrong_type(path, value, tp)


_SCALARS = {bool: _convert_bool, int: _convert_int, float: _convert_float, str: _convert_str}


def _field_paths(cls: type, prefix: str = "") -> list[str]:
    paths = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        paths.append(path)
        tp = _hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            paths += _field_paths(tp, path + ".")
    return paths


# Keys that were replaced: the error names the new key and how to translate the old values.
MOVED_KEYS = {
    "algo.rollout_is": (
        "algo.rollout_is was replaced by algo.rollout_correction: rollout_is.enable=true, cap=C is "
        "rollout_correction.mode=token_tis, upper=C; enable=false is rollout_correction.mode=none"
    ),
}


def _unknown_key(cls: type, path: str) -> ConfigError:
    """Error for an unknown dotted `path` inside the section `cls`, with the closest valid key."""
    for old, message in MOVED_KEYS.items():
        if path == old or path.startswith(old + "."):
            return ConfigError(f"key {path!r}: {message}")
    parent, _, name = path.rpartition(".")
    siblings = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)
    if close:
        suggestion = f"{parent}.{close[0]}" if parent else close[0]
    else:
        # Maybe the key exists in another section (e.g. `trainer.lr` for `optimizer.lr`).
        all_paths = _field_paths(DapoConfig)
        same_name = [p for p in all_paths if p.rpartition(".")[2] == name]
        candidates = same_name or difflib.get_close_matches(path, all_paths, n=1, cutoff=0.5)
        suggestion = candidates[0] if candidates else None
    if suggestion:
        return ConfigError(f"unknown key {path!r} (did you mean {suggestion!r}?)")
    valid = ", ".join(siblings)
    where = f"in {parent!r} " if parent else ""
    return ConfigError(f"unknown key {path!r}; valid keys {where}are: {valid}")


def _merge(obj: Any, data: dict, prefix: str) -> Any:
    """Apply mapping `data` onto dataclass instance `obj` (in place), checking every key and value."""
    cls = type(obj)
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if not isinstance(key, str) or key not in names:
            raise _unknown_key(cls, path)
        setattr(obj, key, _convert(value, hints[key], path, getattr(obj, key)))
    return obj


# ------------------------------------------------------------------------------------------ overrides


def _parse_override_value(raw: str, tp: Any) -> Any:
    """YAML-parse an override value; a str field keeps the text as written (`run_dir=007` stays "007")."""
    try:
        value = yaml.load(raw, Loader=_StrictLoader) if raw.strip() else ""  # noqa: S506 - a SafeLoader subclass
    except (yaml.YAMLError, RecursionError):
        value = raw
    accepts_str = tp is str or (typing.get_origin(tp) in (Union, types.UnionType) and str in typing.get_args(tp))
    if accepts_str and value is not None and not isinstance(value, str):
        return raw
    return value


def apply_override(cfg: DapoConfig, override: str) -> None:
    """Apply one `key.sub=value` override to `cfg` in place."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not of the form key.sub=value")
    path, raw = override.split("=", 1)
    path = path.strip()
    parts = path.split(".")
    obj: Any = cfg
    for i, name in enumerate(parts):
        cls = type(obj)
        sub_path = ".".join(parts[: i + 1])
        if not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(cls)}:
            if not dataclasses.is_dataclass(obj):
                prev = ".".join(parts[:i])
                raise ConfigError(f"override {path!r}: {prev!r} is a value, not a section")
            raise _unknown_key(cls, sub_path)
        tp = _hints(cls)[name]
        if i == len(parts) - 1:
            value = _parse_override_value(raw, tp)
            _check_expanded_size(value, f"override {path!r}")
            setattr(obj, name, _convert(value, tp, path, getattr(obj, name)))
        elif _is_mapping_type(tp):
            # Free-form mapping (model.hf_config, reward.kwargs): the rest of the path are its keys.
            current = getattr(obj, name)
            updated = dict(current) if isinstance(current, dict) else {}
            node = updated
            for key in parts[i + 1 : -1]:
                child = node.get(key)
                node[key] = dict(child) if isinstance(child, dict) else {}
                node = node[key]
            node[parts[-1]] = _parse_override_value(raw, Any)
            _check_expanded_size(updated, f"override {path!r}")
            setattr(obj, name, _convert(updated, tp, sub_path, current))
            return
        else:
            obj = getattr(obj, name)


def _is_mapping_type(tp: Any) -> bool:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return any(typing.get_origin(a) is dict for a in typing.get_args(tp))
    return typing.get_origin(tp) is dict


# ----------------------------------------------------------------------------------------- public API


def config_from_dict(data: dict | None, overrides: Iterable[str] = (), source: str = "") -> DapoConfig:
    """Build a config from a mapping (YAML content) and overrides, without cross-field validation."""
    cfg = DapoConfig()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        where = f"{source}: " if source else ""
        raise ConfigError(f"{where}top level must be a mapping of sections, got {_got(data)}")
    _merge(cfg, data, "")
    _apply_overrides(cfg, data, overrides)
    return cfg


def _apply_overrides(cfg: DapoConfig, data: dict, overrides: Iterable[str]) -> None:
    overrides = list(overrides)
    for override in overrides:
        apply_override(cfg, override)
    _apply_clip_ratio(cfg, data, overrides)


def _apply_clip_ratio(cfg: DapoConfig, data: dict, overrides: list[str]) -> None:
    """algo.clip_ratio (verl's symmetric shorthand) fills clip_ratio_low / _high where they are not
    given; one given with another value is left for validation to report as a conflict."""
    if cfg.algo.clip_ratio is None:
        return
    algo = data.get("algo")
    given = {f"algo.{k}" for k in algo} if isinstance(algo, dict) else set()
    given |= {o.split("=", 1)[0].strip() for o in overrides}
    for name in ("clip_ratio_low", "clip_ratio_high"):
        if f"algo.{name}" not in given:
            setattr(cfg.algo, name, cfg.algo.clip_ratio)


def load_config(path: str | os.PathLike, overrides: Iterable[str] = (), validate: bool = True) -> DapoConfig:
    """Load YAML file `path`, apply `key.sub=value` overrides, and validate the result.

    Raises ConfigError (one line, naming the key) for unknown keys, wrong types and broken
    cross-field rules. Validation notes (checks skipped for lack of a model config) are logged.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    data = parse_yaml(text, str(path))
    try:
        cfg = config_from_dict(data)
    except ConfigError as e:  # a key or value of the file: say which file
        raise ConfigError(f"{path}: {e}") from None
    _apply_overrides(cfg, data or {}, overrides)  # override errors name the key, not the file
    if validate:
        import logging

        from megatron_dapo.config.validate import validate_config

        for note in validate_config(cfg):
            logging.getLogger("megatron_dapo.config").warning(note)
    return cfg


def config_to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts / lists / scalars (YAML- and JSON-serialisable)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any, path: str | os.PathLike | None = None) -> str:
    """The config as YAML text; written atomically to `path` when given."""
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return text
