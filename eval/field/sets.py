"""The field benchmark's prompt sets (`specdraft field-refs`, `specdraft field`), read from the one set registry:
each set of eval/harness/eval_sets.py names its field sets (`field_sets`), the builder of their prompts (`field`)
and which of them follows another's stored answers (`follows`); the stored answers (eval/field/refs.py) render the
prompts with the base's chat template once and keep the token ids, so a judge never needs the packages again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from eval.harness.eval_sets import EVAL_SETS, FieldPrompt


@dataclass(frozen=True)
class FieldSet:
    name: str  # the stored answers are keyed by it: never renamed
    source: str  # the set of eval/harness/eval_sets.py that declares it (whose package ships its prompts)
    build: Callable[..., list[FieldPrompt]]  # its set's `field`: one call builds every field set of that set
    answers_of: str | None = None  # the field set whose stored answers it follows (a second-turn set), else None


FIELD_SET_SPECS: tuple[FieldSet, ...] = tuple(FieldSet(name, s.name, s.field, dict(s.follows).get(name))
                                              for s in EVAL_SETS.values() for name in s.field_sets)
FIELD_SET = {fs.name: fs for fs in FIELD_SET_SPECS}
FIELD_SETS = tuple(FIELD_SET)
PACKAGES = {fs.name: EVAL_SETS[fs.source].package for fs in FIELD_SET_SPECS}  # set -> the package of its data
