"""recipes/field_plan.py: the field-families experiment's runs, read from each family's registration
(FamilySpec.field_runs), print exactly what recipes/field_families.sh's hand-kept case tables printed before."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from test_family_folder import toy_family  # noqa: F401  (the fixture: a toy family in a temporary folder)

ROOT = Path(__file__).resolve().parents[1]

# The script's tables before the declarations, copied: its default FAMILIES, family_args, label_of, shapes (and
# judge_ngram's `lookup4:chain4 mixed10x10:tree`, N-gram's shapes and the --shape of recipes/field_ngram.py).
OLD_FAMILIES = "medusa ctc redrafter hydra_pp eagle3 hydra dflash dspark domino ngram"
OLD_ARGS = {
    "medusa": "configs/medusa.yaml train.lr=5e-3",
    "hydra": "configs/hydra.yaml train.lr=5e-3",
    "hydra_pp": "configs/hydra_pp.yaml train.lr=2e-3",
    "redrafter": "configs/redrafter.yaml train.lr=5e-3",
    "ctc": "configs/ctc.yaml train.lr=2e-3",
    "eagle3": "configs/eagle3.yaml draft.share_lm_head=false train.lr=2e-3",
    "peagle": "configs/eagle3.yaml draft.share_lm_head=false train.lr=2e-3 draft.eagle3.parallel_drafting=true "
              "draft.eagle3.ttt_steps=4",
    "dflash": "configs/dflash.yaml draft.share_lm_head=false train.lr=6e-4 draft.dflash.num_anchors=32 "
              "draft.dflash.block_size=8 draft.num_heads=7",
    "dspark": "configs/dspark.yaml draft.share_lm_head=false train.lr=6e-4 draft.dspark.num_anchors=32",
    "domino": "configs/domino.yaml draft.share_lm_head=false train.lr=6e-4 draft.domino.num_anchors=32",
    "ngram": "recipes/field_ngram.py",  # judge_ngram's script (it had no family_args)
}
OLD_LABELS = {"medusa": "Medusa", "hydra": "Hydra", "hydra_pp": "Hydra++", "redrafter": "ReDrafter", "ctc": "CTC",
              "eagle3": "EAGLE-3", "peagle": "P-EAGLE", "dflash": "DFlash", "dspark": "DSpark", "domino": "Domino",
              "ngram": "N-gram"}  # N-gram's row had its family's title
_HEADS = ["chain4 tree=chain4", "tree16 tree=tree16"]
_EAGLE3 = ["chain4 extra.eagle3_mode=chain extra.num_speculative_tokens=4",
           "tree16 extra.eagle3_mode=tree extra.tree_nodes=16"]
OLD_SHAPES = {
    "medusa": _HEADS, "hydra": _HEADS, "hydra_pp": _HEADS,
    "redrafter": ["chain extra.beam_width=1 extra.beam_length=5", "beam8x3 extra.beam_width=8 extra.beam_length=3"],
    "ctc": ["chain extra.ctc_num_paths=1", "paths8 extra.ctc_num_paths=8"],
    "eagle3": _EAGLE3, "peagle": _EAGLE3,
    "dflash": ["chain"], "dspark": ["chain"], "domino": ["chain"],
    "ngram": ["lookup4 --shape chain4", "mixed10x10 --shape tree", "mixed4x4 --shape rows4x4"],
}


def _plan():
    spec = importlib.util.spec_from_file_location("field_plan", ROOT / "recipes" / "field_plan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _out(capsys, *argv) -> tuple[int, str, str]:
    rc = _plan().main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("run", sorted(OLD_ARGS))
def test_every_run_prints_the_old_tables(capsys, run):
    assert _out(capsys, "args", run) == (0, OLD_ARGS[run] + "\n", "")
    assert _out(capsys, "label", run) == (0, OLD_LABELS[run] + "\n", "")
    assert _out(capsys, "shapes", run) == (0, "".join(line + "\n" for line in OLD_SHAPES[run]), "")


def test_the_default_runs_are_the_old_list_and_every_run_is_known(capsys):
    from models.registry import field_runs

    assert _out(capsys, "runs") == (0, OLD_FAMILIES + "\n", "")
    assert set(field_runs()) == set(OLD_ARGS)
    rc, out, err = _out(capsys, "args", "nope")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "unknown run nope" in err
    assert all(run in err.split("known: ")[1] for run in OLD_ARGS)


def test_the_command_line_prints_the_default_runs():
    got = subprocess.run([sys.executable, "recipes/field_plan.py", "runs"], cwd=ROOT, capture_output=True, text=True)
    assert (got.returncode, got.stdout) == (0, OLD_FAMILIES + "\n"), got.stderr


def test_a_family_without_a_declaration_runs_once_as_itself(toy_family, monkeypatch):  # noqa: F811
    from models import families
    from models.family import FamilyFacts, FamilySpec, FieldRun
    from models.registry import field_runs

    runs = field_runs()
    assert list(runs)[-1] == "toyfam" and runs["toyfam"] == FieldRun("toyfam", "Toy", "configs/toyfam.yaml")
    assert runs["toyfam"].shapes == ("default",) and runs["toyfam"].default
    # learning-free and undeclared: nothing to train, no script to judge it
    monkeypatch.setitem(families.SPECS, "free", FamilySpec("free", FamilyFacts("free", "Free", trainable=False)))
    assert "free" not in field_runs()
    # a run name two families declare fails
    monkeypatch.setitem(families.SPECS, "twice", FamilySpec("twice", FamilyFacts("twice", "T", trainable=False),
                                                            field_runs=(FieldRun("medusa", "M", "x.py"),)))
    with pytest.raises(ValueError, match="declared already"):
        field_runs()


# What the recipe's single-name branches did before the declarations (against_of, the probe skip, the CTC step):
# chains against EAGLE-3's chain4, trees / beams / paths against its tree16; EAGLE-3 itself against nothing.
OLD_AGAINST = {"tree16": "eagle3 tree16", "beam8x3": "eagle3 tree16", "paths8": "eagle3 tree16"}
# Judged on the batched (lockstep) path: no one-prompt probe first. EAGLE-3 / P-EAGLE from the start; Hydra,
# Hydra++ and Medusa since their families have one too (models/families/{hydra,medusa}/lockstep.py); DFlash, DSpark
# and Domino since theirs (models/families/{dflash,dspark,domino}/lockstep.py).
OLD_BATCHED = {"eagle3", "peagle", "hydra", "hydra_pp", "medusa", "dflash", "dspark", "domino"}
OLD_DIAGNOSTICS = {"ctc": "recipes/ctc_diagnostics.py"}


def _dump(capsys) -> dict[tuple[str, str], list[str]]:
    rc, out, err = _out(capsys, "dump")
    assert rc == 0 and err == ""
    got: dict[tuple[str, str], list[str]] = {}
    for line in out.splitlines():
        run, key, value = line.split("\t")
        got.setdefault((run, key), []).append(value)
    return got


def test_the_dump_holds_every_answer_and_the_old_branches(capsys):
    got = _dump(capsys)
    assert got[("-", "runs")] == [OLD_FAMILIES] and got[("-", "reference")] == ["eagle3"]
    for run in OLD_ARGS:
        assert got[(run, "args")] == [OLD_ARGS[run]] and got[(run, "label")] == [OLD_LABELS[run]]
        assert got[(run, "shape")] == OLD_SHAPES[run]
        assert got[(run, "batched")] == [str(int(run in OLD_BATCHED))]
        assert got[(run, "diagnostics")] == [OLD_DIAGNOSTICS.get(run, "")]
        if run == "ngram":  # learning-free: judged by its own script, never paired
            continue
        for line in OLD_SHAPES[run]:
            shape = line.split()[0]
            want = "" if run == "eagle3" else OLD_AGAINST.get(shape, "eagle3 chain4")
            assert got[(run, f"against:{shape}")] == [want], (run, shape)


def test_two_references_fail(monkeypatch):
    from models import families
    from models.family import FamilyFacts, FamilySpec, FieldRun
    from models.registry import field_runs

    monkeypatch.setitem(families.SPECS, "other", FamilySpec("other", FamilyFacts("other", "O", trainable=False),
                                                            field_runs=(FieldRun("o", "O", "o.py", reference=True),)))
    with pytest.raises(ValueError, match="each declared the reference"):
        field_runs()
