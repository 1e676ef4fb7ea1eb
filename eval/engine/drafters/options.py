"""Typed eval options of a drafter: the `extra` mapping of an eval config (`extra.beam_width=8`), read into the
family's own dataclass. Each option comes from `extra`, else from the export's config.json (a tree search or a
recipe may store one there), else the dataclass default; a key the family does not know is an error naming the
options it has, so a typo never silently falls back to a default."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, get_type_hints


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
    """extra (EvalConfig.extra) + the export's config.json -> an instance of `cls`, a frozen dataclass."""
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
        kind = types[name]
        base = next((t for t in getattr(kind, "__args__", ()) if t is not type(None)), kind)  # int | None -> int
        values[name] = _coerce(name, value, base, family)
    return cls(**values)


def option_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]
