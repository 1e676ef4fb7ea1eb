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

    def keys(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            yield from keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]

    listed = list(keys(TrainConfig()))
    assert "draft.eagle3.ttt_steps" in listed and "loss.ctc.token_weight" in listed
    for key in listed:
        assert f"| `{key}` |" in text, key
    assert "| `train.lr` | `float` | `0.001` |" in text
    assert "| `extra.beam_width` | `int | None` | `None` |" in text.replace("\\|", "|")


def test_each_familys_options_are_listed_under_the_family_with_its_own_comments():
    from models.registry import FAMILIES, config_key_owners

    text = generate()
    family_part = text[text.index("## Training options of each family"):text.index("## Evaluation")]
    training_part = text[:text.index("## Training options of each family")]
    for key, owner in config_key_owners().items():
        heading = f"### {FAMILIES[owner].title} (`{owner}`)"
        section = family_part[family_part.index(heading):]
        section = section[:section.find("\n### ", 1) if "\n### " in section[1:] else len(section)]
        assert f"| `{key}` |" in section, key  # under its own family's heading
        assert f"| `{key}` |" not in training_part, key  # not in the shared table
    assert "| `draft.eagle3.ttt_steps` | `int` | `3` | training-time-test unroll" in family_part
    assert "Old flat keys: `draft.ttt_steps`." in family_part
    assert "| `draft.dropout` | `float` | `0.0` | dropout inside the heads" in training_part  # base class comments


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
