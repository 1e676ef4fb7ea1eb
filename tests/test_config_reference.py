"""docs/reference/config.md is generated from the typed configs and must match them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cli.config_reference import field_comments, generate
from train.config import TrainConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "config.md"


def test_the_checked_in_reference_matches_the_code():
    assert PAGE.read_text() == generate(), ("docs/reference/config.md lags behind the typed configs: run "
                                            "`specdraft config-reference --out docs/reference/config.md`")


def test_every_training_key_is_listed_with_its_default():
    text = generate()
    for section in dataclasses.fields(TrainConfig):
        value = getattr(TrainConfig(), section.name)
        keys = ([f"{section.name}.{f.name}" for f in dataclasses.fields(value)] if dataclasses.is_dataclass(value)
                else [section.name])
        for key in keys:
            assert f"| `{key}` |" in text, key
    assert "| `train.lr` | `float` | `0.001` |" in text
    assert "| `extra.beam_width` | `int | None` | `None` |" in text.replace("\\|", "|")


def test_field_comments_follow_the_source_layout():
    @dataclasses.dataclass
    class Demo:
        a: int = 1  # first line
        # continues a (lower case after a commented field)
        b: int = 2  # b's own
        # Heading above c.
        c: int = 3
        d: int = 4

    notes = field_comments(Demo)
    assert notes == {"a": "first line continues a (lower case after a commented field)", "b": "b's own",
                     "c": "Heading above c.", "d": ""}
