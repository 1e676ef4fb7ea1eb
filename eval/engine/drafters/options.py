"""Typed eval options of a drafter: the `extra` mapping of an eval config (`extra.beam_width=8`), read into the
family's own dataclass, the one declaration of each option. When the config loads, `check_extra` types `extra`
against every family's declarations (a key no family declares fails there, before any model loads); once the
export names the family, `parse_options` reads each option from `extra`, else from the export's config.json (a
tree search or a recipe may store one there), else the dataclass default; a key the family does not know is an
error naming the options it has, so a typo never silently falls back to a default. Which shape a run decodes when
the export also holds a tuned one (tuning.json): eval/choice/apply.py `decide`."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, get_type_hints

from models.export.schema import upgrade_keys


class OptionsError(ValueError):
    """An `extra` key or value a drafter cannot use; the message names the key and the fix."""


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """Families whose drafting has no options beyond the eval config's own keys (tree, tree_choices)."""


def _coerce(name: str, value: Any, kind: Any, family: str) -> Any:
    """Values from YAML or `key=value` overrides into the field's type (ints stay ints: 8, not 8.0)."""
    if value is None:
        return None
    try:
        if kind in (int, "int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind in (float, "float"):
            return float(value)
        if kind in (str, "str"):
            if not isinstance(value, str):
                raise ValueError
            return value
        if kind in (bool, "bool"):
            if not isinstance(value, bool):
                raise ValueError
            return value
    except (TypeError, ValueError):
        what = getattr(kind, "__name__", kind)
        raise OptionsError(f"eval extra.{name}={value!r}: the {family} drafter needs a {what}") from None
    return value  # lists and other structured options are checked by the family


def parse_options(cls: type, family: str, extra: dict, export_cfg: dict | None = None):
    """extra (EvalConfig.extra) + the export's config.json -> an instance of `cls`, a frozen dataclass. Old key
    names in either are read under today's, with a note (models/export/schema.py: upgrade_keys)."""
    extra, export_cfg = upgrade_keys(extra, "eval extra"), upgrade_keys(export_cfg, "the export's config.json")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(extra) - set(fields))
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, fields, n=1)
            if close:
                hints.append(f"{key}: did you mean {close[0]}?")
        have = ", ".join(fields) if fields else "none"
        raise OptionsError(f"unknown {family} option(s) {unknown} in eval extra" + (f" ({'; '.join(hints)})" if hints
                           else "") + f"; the {family} drafter's options: {have}")
    types = get_type_hints(cls)
    values = {}
    for name in fields:
        if name in extra:
            value = extra[name]
        elif export_cfg and name in export_cfg:
            value = export_cfg[name]
        else:
            continue
        values[name] = _coerce(name, value, _declared_type(types[name]), family)
    return cls(**values)


def _declared_type(kind: Any) -> Any:
    """int | None -> int: the type a value is coerced to."""
    return next((t for t in getattr(kind, "__args__", ()) if t is not type(None)), kind)


def check_extra(extra: dict, declarations: dict[str, type]) -> dict:
    """An eval config's `extra` against every family's declared options (`declarations`: family -> its Options
    dataclass), before any export names the family: a key no family declares is an error naming the closest ones,
    and each value is coerced to the type its families declare (8, not 8.0; a type they disagree on is left to the
    family's own check). Old key names are read under today's, with a note (upgrade_keys). Returns the typed mapping;
    `parse_options` checks it again against the export's family."""
    extra = upgrade_keys(extra, "eval extra")
    owners: dict[str, list[tuple[str, Any]]] = {}
    for family, cls in declarations.items():
        types = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, []).append((family, _declared_type(types[f.name])))
    unknown = sorted(set(extra) - set(owners))
    if unknown:
        hints = [f"{key}: did you mean {close[0]}?" for key in unknown
                 if (close := difflib.get_close_matches(key, owners, n=1))]
        by_family = "; ".join(f"{family}: {', '.join(option_names(cls)) or 'none'}"
                              for family, cls in declarations.items())
        raise OptionsError(f"unknown drafter option(s) {unknown} in eval extra"
                           + (f" ({'; '.join(hints)})" if hints else "") + f"; the options by family: {by_family}")
    out = {}
    for key, value in extra.items():
        kinds = {kind for _, kind in owners[key]}
        family = " / ".join(f for f, _ in owners[key])
        out[key] = _coerce(key, value, kinds.pop(), family) if len(kinds) == 1 else value
    return out


def option_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]
