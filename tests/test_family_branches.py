"""No code outside a family's own files branches on the family's name; what such a branch asked is a fact the family
declares (models/family.py: FamilyFacts; its drafter module, eval/engine/drafters/registry.py), read by the callers.

The scan parses every .py file of the source packages with `ast` and collects the comparisons (==, !=, in, not in)
and match-cases whose string literal is a family name (the registry's names and their aliases). A family's own
files may branch on its name (e.g. an exporter refusing another family's draft); any other file fails with
file:line, except the few listed in EXCEPTIONS with their reason. The remaining tests pin the declarations that
replaced the old branches to what those branches did.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

from models.registry import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("core", "data", "losses", "models", "train", "eval", "cli", "launch", "bench", "recipes")

# alias -> family: recipe names (configs/hydra_pp.yaml) and the results tables' target keys that name a variant.
ALIASES = {"hydra_pp": "hydra", "hydra++": "hydra", "eagle3-chain": "eagle3", "eagle3-tree": "eagle3"}
NAMES = {**{name: name for name in FAMILIES}, **ALIASES}

# (file, family name) -> (at most how many branches, why they stay). Keep this short: a new entry needs a reason a
# reader accepts, else move the fact into the family's declaration.
EXCEPTIONS = {
    ("bench/draft_vocab.py", "medusa"): (3, "the benchmark of docs/lab's draft-vocabulary table builds exactly "
                                            "the Medusa and Hydra++ shapes and recipes that table names"),
}


def own_files(family: str) -> list[str]:
    """Glob patterns (relative to the checkout) of a family's own source files."""
    return [f"models/{family}.py", f"eval/engine/drafters/{family}.py", f"losses/{family}.py",
            f"models/export/*{family}*.py"]


def is_own(rel: str, family: str) -> bool:
    return any(Path(rel).match(pattern) and rel.count("/") == pattern.count("/") for pattern in own_files(family))


def _literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _literals(e)]
    return []


def family_branches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, family) of every comparison / membership test / match-case on a family-name string literal."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            out += [(node.lineno, NAMES[s]) for side in sides for s in _literals(side) if s in NAMES]
        elif isinstance(node, ast.match_case):
            for pattern in ast.walk(node.pattern):
                if isinstance(pattern, ast.MatchValue):
                    out += [(pattern.lineno, NAMES[s]) for s in _literals(pattern.value) if s in NAMES]
    return out


def scan(root: Path = ROOT) -> dict[tuple[str, str], list[int]]:
    """(file, family) -> lines of the branches outside that family's own files."""
    found: dict[tuple[str, str], list[int]] = {}
    for package in SCANNED:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for line, family in family_branches(ast.parse(path.read_text(), filename=rel)):
                if not is_own(rel, family):
                    found.setdefault((rel, family), []).append(line)
    return found


def test_no_branch_on_a_family_name_outside_its_own_files():
    found = scan()
    unexpected = [f"{rel}:{line}: branches on family {family!r}"
                  for (rel, family), lines in sorted(found.items()) if (rel, family) not in EXCEPTIONS
                  for line in sorted(lines)]
    assert not unexpected, ("move the fact into the family's declaration (FamilyFacts in models/<family>.py, or its "
                            "drafter module, eval/engine/drafters/<family>.py):\n" + "\n".join(unexpected))
    over = [f"{rel}: {len(found.get((rel, family), []))} branches on {family!r}, EXCEPTIONS allows {count}"
            for (rel, family), (count, _) in EXCEPTIONS.items() if len(found.get((rel, family), [])) > count]
    assert not over, "\n".join(over)


def test_the_scan_finds_each_kind_of_branch():
    src = ('if fam == "medusa": pass\n'
           'if x in ("hydra", "other"): pass\n'
           'if "dflash" != y: pass\n'
           'match m:\n    case "hydra_pp": pass\n'
           'd = {"eagle3": 1}\n'  # a table keyed by name is not a branch
           'f("ctc")\n')
    assert family_branches(ast.parse(src)) == [(1, "medusa"), (2, "hydra"), (3, "dflash"), (5, "hydra")]
    assert is_own("models/export/speculators_dflash.py", "dflash") and is_own("models/medusa.py", "medusa")
    assert not is_own("models/export/speculators.py", "eagle3") and not is_own("eval/harness/tune_ours.py", "ctc")
    assert not is_own("bench/models/medusa.py", "medusa")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_no_family_module_imports_another_familys_module():
    """Shared blocks live in models/components.py (and models/prefix_attention.py), not in one family's module."""
    packages = ("models", "eval.engine.drafters", "losses")
    bad = []
    for family in FAMILIES:
        for package in packages:
            path = ROOT / (package.replace(".", "/") + f"/{family}.py")
            if not path.is_file():
                continue
            for other in set(FAMILIES) - {family}:
                bad += [f"{path.relative_to(ROOT)} imports {m}" for m in _imports(path)
                        if any(re.fullmatch(rf"{re.escape(p)}\.{other}(\..*)?", m) for p in packages)]
    assert not bad, "\n".join(bad)


# -- the declarations that replaced the branches do what the branches did --------------------------------------

def test_tune_shapes_are_the_old_per_family_lists():
    from eval.engine.drafters.registry import DRAFTERS

    draft = SimpleNamespace(beam_length=5, num_heads=3, block_size=8)
    labels = {f: [label for label, _ in spec.tune_shapes(draft)] for f, spec in DRAFTERS.items()}
    static = ["wide2 (6 nodes)", "tree16 (15 nodes)", "medusa63 (63 nodes)"]  # drafted nodes, root not counted
    assert labels == {
        "medusa": static, "hydra": static, "dflash": static,
        "eagle3": ["EAGLE-2 tree, 4 nodes, depth 2", "EAGLE-2 tree, 8 nodes", "EAGLE-2 tree, 16 nodes",
                   "EAGLE-2 tree, 32 nodes"],
        "redrafter": ["2 beams x 5", "4 beams x 5", "8 beams x 5"],
        "ctc": ["4 CTC paths", "8 CTC paths", "16 CTC paths", "24 CTC paths"],
        "ngram": [], "dspark": [],  # DSpark drafts chains only (its slots depend on the token before them)
    }
    assert dict(DRAFTERS["redrafter"].tune_shapes(draft))["4 beams x 5"] == {"extra": {"beam_width": 4,
                                                                                      "beam_length": 5}}
    assert dict(DRAFTERS["eagle3"].tune_shapes(draft))["EAGLE-2 tree, 4 nodes, depth 2"] == {
        "extra": {"eagle3_mode": "tree", "tree_nodes": 4, "tree_depth": 2}}
    assert dict(DRAFTERS["medusa"].tune_shapes(draft))["tree16 (15 nodes)"] == {"tree": "tree16",
                                                                                "tree_choices": None}
    assert [f for f, spec in DRAFTERS.items() if spec.searched_trees] == ["medusa", "hydra"]


def test_chain_caps_llamacpp_and_target_keys():
    from eval.engine.drafters.registry import DRAFTERS, chain_overrides
    from eval.harness.results_doc import family_key
    from eval.serving.llamacpp_gguf import spec_draft_n_max

    draft = SimpleNamespace(num_heads=3, block_size=8, ttt_steps=5)
    assert {f: spec.max_chain(draft) for f, spec in DRAFTERS.items()} == {
        "medusa": 3, "hydra": 3, "dflash": 7, "eagle3": None, "redrafter": None, "ctc": None, "ngram": None,
        "dspark": 8}  # DSpark: every slot of its block drafts, the root's included
    assert [f for f, facts in FAMILIES.items() if facts.llamacpp_whole_block] == ["dflash"]
    assert spec_draft_n_max(draft, "dflash", chain=2) == 7 and spec_draft_n_max(draft, "eagle3") == 5
    try:
        chain_overrides("ctc", 1)
        raise AssertionError("CTC has no chain: tune sweeps none")
    except ValueError:
        pass
    key = lambda method, **extra: family_key({"method": method, "extra": extra})  # noqa: E731
    assert key("hydra", label="Hydra++ tree") == "hydra++" and key("hydra", label="Hydra tree") == "hydra"
    assert key("eagle3", eagle3_mode="chain") == "eagle3-chain" and key("eagle3") == "eagle3-tree"
    assert key("medusa") == "medusa" and key("ar") == "ar"


def test_every_export_format_has_a_writer():
    from models.export.formats import FORMAT_WRITERS
    from models.family import EXPORT_FORMATS

    # gguf goes through llama.cpp's converter, composed by the command (cli/main.py: _export_gguf)
    assert set(FORMAT_WRITERS) | {"gguf"} == set(EXPORT_FORMATS)


def test_learning_free_methods_vllm_serves():
    from models.registry import learning_free_vllm_families

    assert learning_free_vllm_families() == ("ngram",)
