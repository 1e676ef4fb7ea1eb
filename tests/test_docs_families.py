"""The families tables of README.md and docs/families/README.md are generated from the families' declarations
(cli/docs_families.py, `specdraft docs-families`): the checked-in pages must match them."""

from __future__ import annotations

import dataclasses

import pytest

from cli import docs_families
from cli.docs_families import BEGIN, END, ROOT, expected, family_files, replace_part, run
from models.registry import FAMILIES


def test_the_checked_in_families_tables_match_the_declarations():
    for rel, text in expected().items():
        assert (ROOT / rel).read_text() == text, (
            f"{rel} lags behind the families' declarations (FamilyFacts): run `specdraft docs-families`"
        )


def test_every_family_has_a_row_and_a_link():
    readme = (ROOT / "README.md").read_text()
    for name, facts in FAMILIES.items():
        assert f"| {facts.title} | " in readme, name
        assert f"`models/families/{name}/`" in readme, name
        if (ROOT / "docs" / "families" / f"{name}.md").is_file():
            assert f"[{facts.title}](docs/families/{name}.md)" in readme, name
    assert "`models/families/hydra/` (+ `models/prefix_attention.py`)" in readme  # also_files
    assert "`configs/hydra.yaml`, `configs/hydra_pp.yaml`" in readme  # every recipe of the family


def test_a_changed_declaration_makes_the_check_fail(monkeypatch, capsys):
    assert run(check=True) == 0
    name = next(iter(FAMILIES))
    monkeypatch.setitem(FAMILIES, name, dataclasses.replace(FAMILIES[name], summary="a new one-line summary"))
    assert "a new one-line summary" in expected()["README.md"]
    assert run(check=True) == 1  # check only: nothing is written
    out = capsys.readouterr().out
    assert "README.md" in out and "docs/families/README.md" in out and "specdraft docs-families" in out


def test_the_files_of_a_family_are_its_folder_and_declared_extras():
    files = family_files("eagle3")
    assert files["folder"] == ["models/families/eagle3/"] and files["helpers"] == ["losses/ttt.py"]
    assert files["recipes"] == ["configs/eagle3.yaml"] and files["page"] == ["docs/families/eagle3.md"]


def test_a_page_without_its_markers_is_an_error_that_names_them():
    with pytest.raises(ValueError, match="generated region"):
        replace_part("no markers here", "x", 0, "README.md")
    text = f"a\n{BEGIN}\nold\n{END}\nb\n{BEGIN}\nold2\n{END}\n"
    assert replace_part(text, "new", 1) == f"a\n{BEGIN}\nold\n{END}\nb\n{BEGIN}\nnew\n{END}\n"
    assert docs_families.INDEX == "docs/families/README.md"
