"""The layer rule (docs/architecture.md), checked on the source: every import, late ones inside functions
included, goes down the stack or stays inside its own package, and the module graph has no circles.

    core                      helpers with no project imports (config loading, atomic writes, paths, hardware)
    data, losses              the bottom: read and tokenize data; pure loss functions
    models                    the frozen base, the draft families, the export/load contract (models.export)
    train, eval.engine        the DeepSpeed loop; the speculative decoder (backends, drafters, trees, acceptance)
    eval.choice               a tuned choice: its statistics, the export's tuning.json, applying it where measured
    eval.harness              eval runner, baselines, reports, verdicts, compare, tree search, the set registry
    eval.field, eval.serving  the field benchmark (stored base answers, simulated acceptance); the only code that
                              knows a serving engine (vLLM, llama.cpp)
    eval.tune                 `specdraft tune`: the sweep over our decoder and the serving engines, its report
    cli                       the composition root: the only package that may import across

A family's package (models/families/<name>/) holds files of several layers: each takes the layer of the package its
role belongs to (ROLES, by module name), the rest (model, layers, export writers, the registration) the models one.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# layer of each package (longest prefix wins); a module may import its own package and any lower layer.
LAYERS = {
    "core": 0,
    "data": 1,
    "losses": 1,
    "models": 2,
    "train": 3,
    "eval.engine": 3,
    "eval.choice": 4,  # read by the harness, the field benchmark and serve-check: below them
    "eval.harness": 5,
    "eval.field": 6,  # reads the harness's sets and configs; compare gets its column from the CLI
    "eval.serving": 6,
    "eval.tune": 7,  # drives our decoder (harness) and the serving engines: above them
    "cli": 8,
}
# A family's role module -> the package whose layer it is on (the layers above models import it by its fixed name).
ROLES = {
    "models.families.*.drafter": "eval.engine",  # its Drafter and drafter declaration
    "models.families.*.tune": "eval.engine",  # more of the drafter declaration (tune's shapes)
    "models.families.*.lockstep": "eval.engine",  # a batched simulation of its drafter on stored answers
    "models.families.*.sweep": "eval.harness",  # a learning-free family's option sweep (eval --method X sweep_*)
    "models.families.*.gguf": "eval.serving",  # what llama.cpp's converter reads
}
PACKAGES = ("core", "data", "losses", "models", "train", "eval", "cli")


def package_of(module: str) -> str:
    for pattern, package in ROLES.items():
        if fnmatch.fnmatchcase(module, pattern):
            return package
    best = ""
    for pkg in LAYERS:
        if (module == pkg or module.startswith(pkg + ".")) and len(pkg) > len(best):
            best = pkg
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            out[module_name(path)] = path
    return out


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """Project modules `path` imports, anywhere in the file (late imports count). `from pkg import name` counts
    as an import of pkg.name when that is a module, else of pkg."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES:
                while name and name not in known:  # `import eval.engine.tree` names a module; trim attributes
                    name = name.rpartition(".")[0]
                if name:
                    found.add(name)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = project_modules(root)
    known = set(modules)
    return {m: imports_of(p, m, known) - {m} for m, p in modules.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, targets in graph.items():
        src = package_of(mod)
        for tgt in targets:
            dst = package_of(tgt)
            if src == dst or src == "cli":
                continue
            if not LAYERS[dst] < LAYERS[src]:
                bad.append(f"{mod} ({src}, layer {LAYERS[src]}) imports {tgt} ({dst}, layer {LAYERS[dst]})")
    return sorted(bad)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_belongs_to_a_layer():
    unplaced = [m for m in project_modules() if not package_of(m) and m != "eval"]
    assert not unplaced, f"modules outside every layer: {unplaced}; add their package to LAYERS"


def test_no_import_goes_up_or_across_the_layers():
    bad = upward_imports(import_graph())
    assert not bad, "imports against the layer rule (docs/architecture.md):\n" + "\n".join(bad)


def test_the_import_graph_has_no_circles():
    found = circles(import_graph())
    assert not found, f"import circles: {found}"


@pytest.mark.parametrize("source, expected", [
    ("from train.loop import train\n", "train.loop"),
    ("def f():\n    from eval.harness import runner\n", "eval.harness.runner"),
])
def test_the_checker_sees_late_and_from_imports(tmp_path, source, expected):
    """The checker itself: a data module importing upward, at top level or inside a function, is caught."""
    for pkg in ("data", "train", "eval", "eval/harness"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "train" / "loop.py").write_text("")
    (tmp_path / "eval" / "harness" / "runner.py").write_text("")
    (tmp_path / "data" / "bad.py").write_text(source)
    modules = {module_name_in(tmp_path, p): p for p in tmp_path.rglob("*.py")}
    graph = {m: imports_of(p, m, set(modules)) for m, p in modules.items()}
    assert expected in graph["data.bad"]
    assert any(line.startswith("data.bad") for line in upward_imports(graph))


def module_name_in(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_checker_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_familys_files_take_the_layer_of_their_role():
    """ROLES: a family's drafter is on eval.engine's layer, its gguf on eval.serving's, the rest on the models
    layer's; so its model importing its own drafter goes up, and its drafter importing its model goes down."""
    assert package_of("models.families.eagle3.drafter") == "eval.engine"
    assert package_of("models.families.eagle3.gguf") == "eval.serving"
    assert package_of("models.families.eagle3.model") == "models"
    graph = {"models.families.toy.model": {"models.families.toy.drafter"},
             "models.families.toy.drafter": {"models.families.toy.model", "eval.engine.tree"}}
    assert upward_imports(graph) == ["models.families.toy.model (models, layer 2) imports "
                                     "models.families.toy.drafter (eval.engine, layer 3)"]
