"""No code outside a family's own files asks about the family by its name; what such code asked is a fact the family
declares (models/family.py: FamilyFacts; its drafter module, eval/engine/drafters/registry.py), read by the callers,
and the registries themselves are found in the families' modules, not listed.

The scan parses every .py file of the source packages with `ast` and collects, for each family name (the registry's
names and their aliases) and each family's model class:
  - branches: comparisons (==, !=, in, not in) and match-cases on a family-name string literal;
  - tables: a dict literal keyed by a family name, a tuple / list / set literal holding one (or a family's class);
  - isinstance / issubclass against a family's class.
A family's own files may do any of these (an exporter refusing another family's draft); any other file fails with
file:line, except the few listed in EXCEPTIONS with their reason (the export format `medusa` and llama.cpp's own
n-gram drafter share a family's name). The remaining tests pin the declarations that replaced the old branches and
tables to what those did.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

from models.registry import DRAFT_MODELS, FAMILIES

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("core", "data", "losses", "models", "train", "eval", "cli", "launch", "bench", "recipes")

# alias -> family: recipe names (configs/hydra_pp.yaml) and the results tables' target keys that name a variant.
ALIASES = {"hydra_pp": "hydra", "hydra++": "hydra", "eagle3-chain": "eagle3", "eagle3-tree": "eagle3"}
NAMES = {**{name: name for name in FAMILIES}, **ALIASES}
CLASSES = {cls.__name__: name for name, cls in DRAFT_MODELS.items()}  # MedusaDraft -> medusa

# (file, family name) -> (at most how many uses, why they stay). Keep this short: a new entry needs a reason a
# reader accepts, else move the fact into the family's declaration.
EXCEPTIONS = {
    ("bench/draft_vocab.py", "medusa"): (3, "the benchmark of docs/lab's draft-vocabulary table builds exactly "
                                            "the Medusa and Hydra++ shapes and recipes that table names"),
    ("models/family.py", "medusa"): (1, "EXPORT_FORMATS: `medusa` is also the name of the original Medusa layout, "
                                        "an export format"),
    ("models/export/formats.py", "medusa"): (1, "FORMAT_WRITERS is keyed by export format, `medusa` among them"),
    ("eval/serving/llamacpp_check.py", "ngram"): (1, "the report's section of llama.cpp's own n-gram drafter "
                                                     "(ngram-simple), not our family"),
    ("bench/llamacpp_serving.py", "ngram"): (3, "rows of llama.cpp's own n-gram drafter (ngram-simple)"),
}


def own_files(family: str) -> list[str]:
    """Glob patterns (relative to the checkout) of a family's own source files."""
    return [f"models/{family}.py", f"eval/engine/drafters/{family}.py", f"eval/engine/drafters/{family}_*.py",
            f"losses/{family}.py", f"models/export/*{family}*.py"]


def is_own(rel: str, family: str) -> bool:
    return any(Path(rel).match(pattern) and rel.count("/") == pattern.count("/") for pattern in own_files(family))


def _literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _literals(e)]
    return []


def _class_names(node: ast.AST) -> list[str]:
    """Family classes named by `node` (MedusaDraft, models.medusa.MedusaDraft, or a tuple of them)."""
    if isinstance(node, ast.Name) and node.id in CLASSES:
        return [node.id]
    if isinstance(node, ast.Attribute) and node.attr in CLASSES:
        return [node.attr]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [c for e in node.elts for c in _class_names(e)]
    return []


def family_uses(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, family, kind) of every branch, table and isinstance on a family, one per line and family."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            out += [(node.lineno, NAMES[s], "branches on") for side in sides for s in _literals(side) if s in NAMES]
        elif isinstance(node, ast.match_case):
            for pattern in ast.walk(node.pattern):
                if isinstance(pattern, ast.MatchValue):
                    out += [(pattern.lineno, NAMES[s], "branches on") for s in _literals(pattern.value) if s in NAMES]
        elif isinstance(node, ast.Dict):
            out += [(k.lineno, NAMES[k.value], "keys a table by") for k in node.keys
                    if isinstance(k, ast.Constant) and k.value in NAMES]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            out += [(e.lineno, NAMES[e.value], "lists") for e in node.elts
                    if isinstance(e, ast.Constant) and e.value in NAMES]
            out += [(e.lineno, CLASSES[c], "lists the class of") for e in node.elts for c in _class_names(e)
                    if not isinstance(e, (ast.Tuple, ast.List, ast.Set))]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass") \
                and len(node.args) == 2:
            out += [(node.lineno, CLASSES[c], f"{node.func.id}s on") for c in _class_names(node.args[1])]
    seen, unique = set(), []
    for line, family, kind in sorted(out):
        if (line, family) not in seen:
            seen.add((line, family))
            unique.append((line, family, kind))
    return unique


def family_branches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, family) of every use `family_uses` finds."""
    return [(line, family) for line, family, _ in family_uses(tree)]


def scan(root: Path = ROOT) -> dict[tuple[str, str], list[tuple[int, str]]]:
    """(file, family) -> (line, kind) of the uses outside that family's own files."""
    found: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for package in SCANNED:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for line, family, kind in family_uses(ast.parse(path.read_text(), filename=rel)):
                if not is_own(rel, family):
                    found.setdefault((rel, family), []).append((line, kind))
    return found


def unexpected_uses(found: dict[tuple[str, str], list[tuple[int, str]]]) -> list[str]:
    """The uses outside EXCEPTIONS, and the excepted files that use a family more often than allowed."""
    bad = [f"{rel}:{line}: {kind} family {family!r}" for (rel, family), uses in sorted(found.items())
           if (rel, family) not in EXCEPTIONS for line, kind in uses]
    bad += [f"{rel}: {len(found.get((rel, family), []))} uses of {family!r}, EXCEPTIONS allows {count}"
            for (rel, family), (count, _) in EXCEPTIONS.items() if len(found.get((rel, family), [])) > count]
    return bad


def test_no_branch_table_or_isinstance_on_a_family_outside_its_own_files():
    bad = unexpected_uses(scan())
    assert len(bad) == 0, ("move the fact into the family's declaration (FamilyFacts in models/<family>.py, or its "
                           "drafter module, eval/engine/drafters/<family>.py), and derive the table from the "
                           "registry (models/registry.py):\n" + "\n".join(bad))


def test_the_scan_finds_each_kind_of_use():
    src = ('if fam == "medusa": pass\n'
           'if x in ("hydra", "other"): pass\n'
           'if "dflash" != y: pass\n'
           'match m:\n    case "hydra_pp": pass\n'
           'd = {"eagle3": 1}\n'
           'T = ("redrafter", "ctc")\n'
           'M = [MedusaDraft, models.dspark.DSparkDraft]\n'
           'ok = isinstance(draft, (Eagle3Draft, object))\n'
           'f("ngram")\n'  # passing a name is not asking about the family
           'g = FAMILIES[name].title\n')
    assert family_uses(ast.parse(src)) == [
        (1, "medusa", "branches on"), (2, "hydra", "branches on"), (3, "dflash", "branches on"),
        (5, "hydra", "branches on"), (6, "eagle3", "keys a table by"), (7, "ctc", "lists"),
        (7, "redrafter", "lists"), (8, "dspark", "lists the class of"), (8, "medusa", "lists the class of"),
        (9, "eagle3", "isinstances on")]
    assert is_own("models/export/speculators_dflash.py", "dflash") and is_own("models/medusa.py", "medusa")
    assert is_own("eval/engine/drafters/eagle3_tune.py", "eagle3")
    assert not is_own("models/export/speculators.py", "eagle3") and not is_own("eval/tune/ours.py", "ctc")
    assert not is_own("bench/models/medusa.py", "medusa")


def test_a_table_put_back_fails_the_scan(tmp_path):
    """The scan of a tree with one of the removed tables in it (models/export/vllm.py's VLLM_EXPORTERS) reports it."""
    (tmp_path / "models" / "export").mkdir(parents=True)
    (tmp_path / "models" / "export" / "vllm.py").write_text('VLLM_EXPORTERS = {"medusa": f, "dspark": g}\n'
                                                           'SCHEDULE_METHODS = ("eagle3", "dflash")\n')
    assert sorted(unexpected_uses(scan(tmp_path))) == [
        "models/export/vllm.py:1: keys a table by family 'dspark'",
        "models/export/vllm.py:1: keys a table by family 'medusa'",
        "models/export/vllm.py:2: lists family 'dflash'", "models/export/vllm.py:2: lists family 'eagle3'"]


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


# -- the declarations that replaced the branches and tables do what those did --------------------------------------
# Each pins the families that existed when the table was replaced; a new family adds its own facts, no line here.

def test_tune_shapes_are_the_old_per_family_lists():
    from eval.engine.drafters.registry import DRAFTERS

    draft = SimpleNamespace(beam_length=5, num_heads=3, block_size=8)
    labels = {f: [label for label, _ in spec.tune_shapes(draft)] for f, spec in DRAFTERS.items()}
    static = ["wide2 (6 nodes)", "tree16 (15 nodes)", "medusa63 (63 nodes)"]  # drafted nodes, root not counted
    old = {
        "medusa": static, "hydra": static, "dflash": static,
        "eagle3": ["EAGLE-2 tree, 4 nodes, depth 2", "EAGLE-2 tree, 8 nodes", "EAGLE-2 tree, 16 nodes",
                   "EAGLE-2 tree, 32 nodes"],
        "redrafter": ["2 beams x 5", "4 beams x 5", "8 beams x 5"],
        "ctc": ["4 CTC paths", "8 CTC paths", "16 CTC paths", "24 CTC paths"],
        "ngram": [], "dspark": [],  # DSpark drafts chains only (its slots depend on the token before them)
    }
    assert {f: labels[f] for f in old} == old
    assert dict(DRAFTERS["redrafter"].tune_shapes(draft))["4 beams x 5"] == {"extra": {"beam_width": 4,
                                                                                      "beam_length": 5}}
    assert dict(DRAFTERS["eagle3"].tune_shapes(draft))["EAGLE-2 tree, 4 nodes, depth 2"] == {
        "extra": {"eagle3_mode": "tree", "tree_nodes": 4, "tree_depth": 2}}
    assert dict(DRAFTERS["medusa"].tune_shapes(draft))["tree16 (15 nodes)"] == {"tree": "tree16",
                                                                                "tree_choices": None}
    assert {f for f, spec in DRAFTERS.items() if spec.searched_trees} >= {"medusa", "hydra"}
    assert not any(DRAFTERS[f].searched_trees for f in old if f not in ("medusa", "hydra"))


def test_chain_caps_llamacpp_and_target_keys():
    from eval.engine.drafters.registry import DRAFTERS, chain_overrides
    from eval.harness.results_doc import family_key
    from eval.serving.llamacpp_gguf import spec_draft_n_max

    draft = SimpleNamespace(num_heads=3, block_size=8, ttt_steps=5)
    old = {"medusa": 3, "hydra": 3, "dflash": 7, "eagle3": None, "redrafter": None, "ctc": None, "ngram": None,
           "dspark": 8}  # DSpark: every slot of its block drafts, the root's included
    assert {f: DRAFTERS[f].max_chain(draft) for f in old} == old
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


def test_every_declared_writer_imports():
    """FamilyFacts.exporters names functions by "module:function"; each resolves to a callable (a typo fails here,
    not in the middle of an export)."""
    for name, facts in FAMILIES.items():
        for fmt in facts.exporters:
            assert callable(facts.writer(fmt)), f"{name}: {fmt} writer {facts.exporters[fmt]}"


def test_derived_tables_are_the_old_ones():
    """The tables kept by hand before the declarations, pinned to what they held."""
    from eval.harness.runner import LEARNING_FREE_METHODS
    from eval.serving.llamacpp_gguf import dflash_converter_input, eagle3_converter_input
    from models.export.vllm import (
        SCHEDULE_METHODS,
        export_vllm_dflash,
        export_vllm_dspark,
        export_vllm_eagle3,
        export_vllm_medusa,
        export_vllm_ngram,
    )
    from models.registry import learning_free_vllm_families
    from train.chain_estimate import CHAIN_FAMILIES

    # models/export/vllm.py VLLM_EXPORTERS (vLLM method -> exporter)
    vllm = {f.vllm_method: f.writer("vllm") for f in FAMILIES.values() if f.vllm_method}
    assert {m: vllm[m] for m in ("medusa", "eagle3", "dflash", "dspark", "ngram")} == {
        "medusa": export_vllm_medusa, "eagle3": export_vllm_eagle3, "dflash": export_vllm_dflash,
        "dspark": export_vllm_dspark, "ngram": export_vllm_ngram}
    # eval/serving/llamacpp_gguf.py CONVERTER_INPUTS
    assert FAMILIES["eagle3"].writer("gguf") is eagle3_converter_input
    assert FAMILIES["dflash"].writer("gguf") is dflash_converter_input
    assert set(SCHEDULE_METHODS) >= {"eagle3", "dflash"} and not {"medusa", "dspark", "ngram"} & set(SCHEDULE_METHODS)
    assert set(CHAIN_FAMILIES) >= {"medusa", "hydra", "eagle3", "redrafter"}
    assert not {"ctc", "dflash", "dspark", "ngram"} & set(CHAIN_FAMILIES)
    assert "ngram" in LEARNING_FREE_METHODS and not set(DRAFT_MODELS) & set(LEARNING_FREE_METHODS)
    assert "ngram" in learning_free_vllm_families()


def test_demo_names_a_hydra_pp_run():
    """cli/demo.py's {"hydra": "Hydra++" if prefix_layer else "Hydra"}: the family's run_title."""
    from cli.demo import _family
    from train.config import load_train_config

    hydra_pp = load_train_config([str(ROOT / "configs" / "hydra_pp.yaml")])
    assert _family(hydra_pp) == "Hydra++"
    assert _family(load_train_config([str(ROOT / "configs" / "hydra.yaml")])) == "Hydra"
    assert _family(load_train_config([str(ROOT / "configs" / "medusa.yaml")])) == "Medusa"


def test_the_registries_are_found_not_listed():
    """FAMILIES holds exactly the models/ modules that declare `facts`, DRAFTERS exactly the families with a drafter
    module (neither registry file lists one: the scan above would report it)."""
    from eval.engine.drafters.registry import DRAFTERS
    from models.registry import _declares_facts

    declaring = {p.stem for p in (ROOT / "models").glob("*.py") if _declares_facts(p)}
    assert set(FAMILIES) == declaring
    assert set(DRAFTERS) == {f for f in FAMILIES if (ROOT / "eval" / "engine" / "drafters" / f"{f}.py").is_file()}


def test_a_wrong_declaration_fails_naming_the_fix(tmp_path):
    from types import ModuleType

    from models.family import FamilyFacts
    from models.registry import _declaration

    module = ModuleType("models.other")
    module.facts = FamilyFacts("ngram2", "N-gram 2", ("specdraft",), trainable=False)
    try:
        _declaration(module)
        raise AssertionError("a module named other declaring ngram2 must fail")
    except ValueError as err:
        assert "models/ngram2.py" in str(err)
    try:
        FamilyFacts("x", "X", ("specdraft", "vllm"), vllm_method="x")
        raise AssertionError("a vLLM method without its writer must fail")
    except ValueError as err:
        assert "exporters" in str(err)
    try:
        FamilyFacts("x", "X", exporters={"vllm": "models.export.vllm:f"})
        raise AssertionError("a writer of a format the family does not have must fail")
    except ValueError as err:
        assert "vllm" in str(err)
