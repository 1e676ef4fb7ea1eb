"""eval/tune/ is one package with a public surface: every name its __init__.py lists resolves to the module that
defines it, importing its lower half (eval.tune.choice, which the harness and serve-check read) loads nothing of
its upper half or of the layers between, and no module of it imports another module's private helper."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import eval.tune

ROOT = Path(__file__).resolve().parents[1]
TUNE = ROOT / "eval" / "tune"


def test_every_public_name_resolves_to_its_defining_module():
    for name in eval.tune.__all__:
        value = getattr(eval.tune, name)
        module = importlib.import_module(eval.tune._WHERE[name])
        assert getattr(module, name) is value, name
    assert "sweep_engine" in dir(eval.tune)


def test_an_unknown_name_is_an_attribute_error():
    try:
        eval.tune.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("eval.tune.no_such_name resolved")


def test_importing_the_choice_loads_nothing_above_it():
    """The harness imports eval.tune.choice: the package's __init__ must not pull in the sweep's engines (which
    import the harness and the serving layer)."""
    code = ("import json, sys, eval.tune.choice; print(json.dumps(sorted(m for m in sys.modules "
            "if m.startswith(('eval.tune.', 'eval.harness', 'eval.serving')))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    assert loaded == ["eval.tune.choice", "eval.tune.choice.apply", "eval.tune.choice.record",
                      "eval.tune.choice.stats"], loaded


def private_imports(root: Path = TUNE) -> list[str]:
    """`from eval.x import _helper` anywhere in the package (late imports included)."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("eval", "core",
                                                                                                  "models"):
                bad += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return bad


def test_no_module_of_the_package_imports_a_private_helper():
    assert private_imports() == []


def test_the_check_sees_a_private_import(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text("def f():\n    from eval.tune.sweep import _run\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert private_imports(tmp_path) == ["m.py: eval.tune.sweep._run"]
