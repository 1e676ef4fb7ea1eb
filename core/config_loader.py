"""Generic typed-config loading: dataclass defaults in code, YAML files as deltas, `key=value` overrides.

Why not plain `OmegaConf.merge`: its errors for a misspelt key ("Key 'lr_' not in 'TrainSection'") do not
say which file the key came from or what the valid names are. We check every key path against the
dataclass schema first, so an error reads e.g.

    configs/medusa.yaml: unknown key 'train.lr_' (did you mean 'train.lr'?)

Used by the train config (train/config.py) and the eval config (eval/harness/config.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override is wrong; the message says where and how to fix it."""


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _all_key_paths(cls, prefix: str = "") -> list[str]:
    """Every valid dotted key of a nested dataclass schema (for 'did you mean' suggestions)."""
    out = []
    for name, tp in _field_types(cls).items():
        path = f"{prefix}{name}"
        out.append(path)
        if dataclasses.is_dataclass(tp):
            out.extend(_all_key_paths(tp, path + "."))
    return out


def _is_free_dict(tp) -> bool:
    """dict-typed fields (e.g. `deepspeed.extra`) accept any keys: they are passed through verbatim."""
    return typing.get_origin(tp) is dict or tp is dict


def check_keys(cls, tree: dict, where: str, prefix: str = "") -> None:
    """Raise ConfigError for the first key in `tree` that the dataclass `cls` does not have."""
    types = _field_types(cls)
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if key not in types:
            valid = _all_key_paths(cls, prefix)
            close = difflib.get_close_matches(path, valid, n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            section = prefix.rstrip(".") or "the top level"
            names = ", ".join(sorted(types))
            raise ConfigError(f"{where}: unknown key '{path}'{hint}. Valid keys in {section}: {names}")
        tp = types[key]
        if dataclasses.is_dataclass(tp):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: '{path}' is a section; give it as a mapping of keys, not {value!r}")
            check_keys(tp, value, where, path + ".")
        elif _is_free_dict(tp) and value is not None and not isinstance(value, dict):
            raise ConfigError(f"{where}: '{path}' must be a mapping, got {value!r}")


def _dotlist_to_tree(item: str, where: str) -> dict:
    if "=" not in item:
        raise ConfigError(f"{where}: override {item!r} is not of the form key=value (e.g. train.lr=3e-4)")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"{where}: override {item!r} has an empty key")
    value = yaml.safe_load(raw) if raw.strip() != "" else ""
    tree: dict = {}
    node = tree
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return tree


Layers = list[tuple[str, dict]]  # (where it came from: a file or "override '...'", its key tree), in merge order


def read_layers(config_paths: list[str] | None = None, overrides: list[str] | None = None) -> Layers:
    """Each YAML file's tree, then each `key=value` override's, in the order they merge."""
    layers: Layers = []
    for path in config_paths or []:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {path} (pass an existing YAML, e.g. configs/medusa.yaml)")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(tree).__name__}")
        layers.append((str(path), tree))
    for item in overrides or []:
        layers.append((f"override '{item}'", _dotlist_to_tree(item, f"override '{item}'")))
    return layers


def load_typed(cls: type[T], config_paths: list[str] | None = None, overrides: list[str] | None = None,
               upgrade: Callable[[Layers], Layers] | None = None) -> T:
    """Build `cls()` defaults, merge each YAML in order, then each `key=value` override.

    upgrade: rewrites the layers before their keys are checked (a config's old keys read at their new place).
    Returns a plain dataclass instance (not an OmegaConf node), so components get ordinary objects.
    """
    merged = OmegaConf.structured(cls)
    layers = read_layers(config_paths, overrides)
    if upgrade is not None:
        layers = upgrade(layers)
    for where, tree in layers:
        check_keys(cls, tree, where)
        try:
            merged = OmegaConf.merge(merged, tree)
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or "?"
            raise ConfigError(f"{where}: bad value for '{key}': {exc.msg if hasattr(exc, 'msg') else exc}") from exc
    return OmegaConf.to_object(merged)


def to_yaml(cfg) -> str:
    """Fully resolved config as YAML (written to runs/<run>/config.yaml)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
