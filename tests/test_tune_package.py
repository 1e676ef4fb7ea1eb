"""eval/tune/ and the choice it makes (eval/choice/): their __init__.py files hold no names (callers import from the
modules), importing the choice (which the harness, the field benchmark and serve-check read) loads nothing above
it, and no module of eval/tune/ imports another module's private helper."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUNE = ROOT / "eval" / "tune"


def test_the_package_inits_hold_no_names():
    """eval/tune/ and eval/choice/ have no public surface of their own: callers import from the modules
    (`from eval.tune.sweep import sweep_engine`), so an __init__.py holds its docstring and nothing else."""
    for init in (TUNE / "__init__.py", ROOT / "eval" / "choice" / "__init__.py"):
        body = ast.parse(init.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), init


def test_importing_the_choice_loads_nothing_above_it():
    """The harness, the field benchmark and serve-check import eval.choice: it must not pull in the sweep's engines
    (which import the harness and the serving layer) or any layer above it."""
    code = ("import json, sys, eval.choice.apply; print(json.dumps(sorted(m for m in sys.modules "
            "if m.startswith(('eval.tune', 'eval.harness', 'eval.field', 'eval.serving', 'eval.choice')))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    assert loaded == ["eval.choice", "eval.choice.apply", "eval.choice.record", "eval.choice.stats"], loaded


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
