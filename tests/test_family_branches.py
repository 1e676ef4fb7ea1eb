"""No code outside a family's own files asks about the family by its name; what such code asked is a fact the family
declares (models/family.py: FamilyFacts, FamilySpec; its drafter module, eval/engine/drafters/registry.py), read by
the callers, and every family is registered once (models/families/__init__.py).

The scan parses every .py file of the source packages with `ast` and collects, for each family name (the registry's
names and their aliases) and each family's model class:
  - branches: comparisons (==, !=, in, not in) and match-cases on a family-name string literal;
  - tables: a dict literal keyed by a family name, a tuple / list / set literal holding one (or a family's class);
  - isinstance / issubclass against a family's class.
A family's own files, its folder models/families/<name>/, may do any of these (an exporter refusing another family's
draft); any other file fails with
file:line, except the few listed in EXCEPTIONS with their reason (the export format `medusa` and llama.cpp's own
n-gram drafter share a family's name). The remaining tests pin the declarations that replaced the old branches and
tables to what those did.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

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
    ("eval/serving/llamacpp_check.py", "ngram"): (1, "the report's section of llama.cpp's own n-gram drafter "
                                                     "(ngram-simple), not our family"),
    ("bench/llamacpp_serving.py", "ngram"): (3, "rows of llama.cpp's own n-gram drafter (ngram-simple)"),
}


def own_files(family: str) -> list[str]:
    """Glob patterns (relative to the checkout) of a family's own source files: its folder, and its loss module (losses/
    sits below models, so a family's loss stays there)."""
    return [f"models/families/{family}/*.py", f"losses/{family}.py"]


def is_own(rel: str, family: str) -> bool:
    return any(Path(rel).match(pattern) and rel.count("/") == pattern.count("/") for pattern in own_files(family))


def _literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _literals(e)]
    return []


def _class_names(node: ast.AST) -> list[str]:
    """Family classes named by `node` (MedusaDraft, models.families.medusa.model.MedusaDraft, or a tuple of them)."""
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
    assert len(bad) == 0, ("move the fact into the family's declaration (FamilyFacts / FamilySpec in its folder "
                           "models/families/<family>/, or its drafter module there), and derive the table from the "
                           "registry (models/registry.py):\n" + "\n".join(bad))


def test_the_scan_finds_each_kind_of_use():
    src = ('if fam == "medusa": pass\n'
           'if x in ("hydra", "other"): pass\n'
           'if "dflash" != y: pass\n'
           'match m:\n    case "hydra_pp": pass\n'
           'd = {"eagle3": 1}\n'
           'T = ("redrafter", "ctc")\n'
           'M = [MedusaDraft, models.families.dspark.model.DSparkDraft]\n'
           'ok = isinstance(draft, (Eagle3Draft, object))\n'
           'f("ngram")\n'  # passing a name is not asking about the family
           'g = FAMILIES[name].title\n')
    assert family_uses(ast.parse(src)) == [
        (1, "medusa", "branches on"), (2, "hydra", "branches on"), (3, "dflash", "branches on"),
        (5, "hydra", "branches on"), (6, "eagle3", "keys a table by"), (7, "ctc", "lists"),
        (7, "redrafter", "lists"), (8, "dspark", "lists the class of"), (8, "medusa", "lists the class of"),
        (9, "eagle3", "isinstances on")]
    assert is_own("models/families/dflash/export_speculators.py", "dflash")
    assert is_own("models/families/medusa/model.py", "medusa") and is_own("models/families/eagle3/tune.py", "eagle3")
    assert not is_own("models/export/speculators.py", "eagle3") and not is_own("eval/tune/ours.py", "ctc")
    assert not is_own("models/families/eagle3/model.py", "medusa") and not is_own("models/families/__init__.py", "ctc")
    assert not is_own("bench/models/medusa.py", "medusa") and not is_own("models/eagle3.py", "eagle3")


def test_a_table_put_back_fails_the_scan(tmp_path):
    """The scan of a tree with one of the removed tables in it (models/export/vllm.py's VLLM_EXPORTERS) reports it."""
    (tmp_path / "models" / "export").mkdir(parents=True)
    (tmp_path / "models" / "export" / "vllm.py").write_text('VLLM_EXPORTERS = {"medusa": f, "dspark": g}\n'
                                                           'SCHEDULE_METHODS = ("eagle3", "dflash")\n')
    assert sorted(unexpected_uses(scan(tmp_path))) == [
        "models/export/vllm.py:1: keys a table by family 'dspark'",
        "models/export/vllm.py:1: keys a table by family 'medusa'",
        "models/export/vllm.py:2: lists family 'dflash'", "models/export/vllm.py:2: lists family 'eagle3'"]


# -- scripts and configs: hard-wired family lists -------------------------------------------------------------------
# A shell script's line, or a config's list or mapping, naming LIST_MIN or more families is a family list kept by
# hand: it goes stale when a family is added (a loop over "every family", an "unknown family (a b c)" message, a
# case per family restating its title). A script reads the registry instead (`specdraft docs-families`, the
# families tables); an experiment that runs a chosen few families keeps its list here with the reason.
SCRIPTS = ("recipes/*.sh", "launch/*.sh")
CONFIGS = ("configs/**/*.yaml",)
LIST_MIN = 3
# file -> (at most how many lists, why they stay). Keep this short.
LIST_EXCEPTIONS = {
    "recipes/best.sh": (2, "the experiment's own choice of the families it trains (FAMILIES=... and its message)"),
    "recipes/block_drafters_equal_data.sh": (3, "the block-drafter comparison's own runs, P-EAGLE among them"),
    "configs/compare.yaml": (1, "acceptance: the comparison's target per results-table key (data, not a fact)"),
    "configs/compare_best.yaml": (1, "acceptance: the comparison's target per results-table key"),
}
_SHELL_WORD = re.compile(r"[^\s|;()\"'=:{}\[\],*]+")


def _families_in(words) -> set[str]:
    return {NAMES[w] for w in words if isinstance(w, str) and w in NAMES}


def script_lists(text: str) -> list[tuple[int, set[str]]]:
    """(line, families) of every line of a shell script (comments aside) naming LIST_MIN or more families."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        code = "" if line.lstrip().startswith("#") else line.split(" #", 1)[0]
        if len(found := _families_in(_SHELL_WORD.findall(code))) >= LIST_MIN:
            out.append((n, found))
    return out


def config_lists(data, where: str = "") -> list[tuple[str, set[str]]]:
    """(key path, families) of every list (its string items) or mapping (its keys) of a loaded config naming
    LIST_MIN or more families."""
    out = []
    if isinstance(data, dict):
        if len(found := _families_in(data)) >= LIST_MIN:
            out.append((where or "/", found))
        for k, v in data.items():
            out += config_lists(v, f"{where}/{k}")
    elif isinstance(data, list):
        if len(found := _families_in(data)) >= LIST_MIN:
            out.append((where or "/", found))
        for i, v in enumerate(data):
            out += config_lists(v, f"{where}[{i}]")
    return out


def scan_lists(root: Path = ROOT) -> dict[str, list[str]]:
    """file -> 'where: families' of each hard-wired family list in its scripts and configs."""
    import yaml

    found: dict[str, list[str]] = {}
    for pattern in SCRIPTS + CONFIGS:
        for path in sorted(root.glob(pattern)):
            rel = path.relative_to(root).as_posix()
            lists = (script_lists(path.read_text()) if path.suffix == ".sh" else
                     config_lists(yaml.safe_load(path.read_text())))
            found.update({rel: [f"{where}: {', '.join(sorted(fams))}" for where, fams in lists]} if lists else {})
    return found


def unexpected_lists(found: dict[str, list[str]]) -> list[str]:
    return [f"{rel}:{entry}" for rel, entries in sorted(found.items()) if rel not in LIST_EXCEPTIONS
            for entry in entries] + \
           [f"{rel}: {len(found.get(rel, []))} family lists, LIST_EXCEPTIONS allows {count}"
            for rel, (count, _) in LIST_EXCEPTIONS.items() if len(found.get(rel, [])) > count]


def test_no_hard_wired_family_list_in_scripts_or_configs():
    bad = unexpected_lists(scan_lists())
    assert not bad, ("read the families from the registry (models/registry.py; `specdraft docs-families` for tables) "
                     "instead of listing them by hand:\n" + "\n".join(bad))


def test_the_list_scan_finds_a_planted_list(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "configs" / "eval").mkdir(parents=True)
    (tmp_path / "recipes" / "x.sh").write_text('# for f in medusa hydra eagle3: a comment is no list\n'
                                               'for f in medusa hydra_pp eagle3; do echo "$f"; done\n'
                                               'train cmp-medusa cmp-hydra draft.eagle3.ttt_steps=1\n'
                                               'case $f in medusa | hydra | ctc) ;; esac\n')
    (tmp_path / "configs" / "eval" / "y.yaml").write_text("a: {families: [dflash, dspark, domino]}\n"
                                                          "b: {medusa: 1, ctc: 2}\n")
    assert sorted(unexpected_lists(scan_lists(tmp_path))) == [
        "configs/eval/y.yaml:/a/families: dflash, domino, dspark",
        "recipes/x.sh:2: eagle3, hydra, medusa", "recipes/x.sh:4: ctc, hydra, medusa"]


# A shell script's branch on ONE family (`[ "$fam" = ctc ]`, a `case` arm `eagle3)`) is a fact of that family kept
# outside its folder: the script asks recipes/field_plan.py (the families' FieldRun declarations) instead. An
# experiment that trains a chosen few families by hand keeps its arms here with the reason.
_SHELL_TEST = re.compile(r"(?:!=|==|=)\s*\"?([\w+]+)\"?\s*(?=\]|&&|\|\||;|$)")
_CASE_ARM = re.compile(r"^\s*([\w+]+(?:\s*\|\s*[\w+]+)*)\s*\)")
BRANCH_EXCEPTIONS = {
    "recipes/best.sh": (6, "the best-per-family experiment's own recipe per family (one arm each)"),
    "recipes/block_drafters_equal_data.sh": (4, "the block-drafter comparison's own runs: EAGLE-3 and the block "
                                                "families (one arm)"),
    "recipes/eagle3_levers_field.sh": (1, "the EAGLE-3 levers experiment's P-EAGLE arm"),
    "launch/gpu_check.sh": (2, "its stage `eagle3` (the payoff window's EAGLE-3 training) is a stage's name"),
}


def script_branches(text: str) -> list[tuple[int, str]]:
    """(line, family) of every test against, or case arm on, a family name in a shell script (comments aside)."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        code = "" if line.lstrip().startswith("#") else line.split(" #", 1)[0]
        words = _SHELL_TEST.findall(code) + [w.strip() for m in _CASE_ARM.findall(code) for w in m.split("|")]
        out += [(n, NAMES[w]) for w in words if w in NAMES]
    return out


def unexpected_branches(root: Path = ROOT) -> list[str]:
    bad = []
    for pattern in SCRIPTS:
        for path in sorted(root.glob(pattern)):
            rel = path.relative_to(root).as_posix()
            found = script_branches(path.read_text())
            allowed = BRANCH_EXCEPTIONS.get(rel, (0, ""))[0]
            if len(found) > allowed:
                bad += [f"{rel}:{n}: {fam}" for n, fam in found] + ([f"{rel}: BRANCH_EXCEPTIONS allows {allowed}"]
                                                                   if allowed else [])
    return bad


def test_no_script_branches_on_one_family():
    bad = unexpected_branches()
    assert not bad, ("declare the fact in the family's FieldRun (models/family.py) and read it through "
                     "recipes/field_plan.py instead of branching on its name:\n" + "\n".join(bad))


def test_the_branch_scan_finds_a_planted_branch(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "x.sh").write_text('# [ "$fam" = ctc ] in a comment is no branch\n'
                                               '[ "$fam" = ctc ] && echo diag\n'
                                               'if [ "$fam" != eagle3 ]; then :; fi\n'
                                               'case $f in\n  hydra_pp | medusa) echo x ;;\n  *) ;;\nesac\n'
                                               '[ "$FIELD" = 1 ] && [ "$x" = ctcs ]\n')
    assert unexpected_branches(tmp_path) == ["recipes/x.sh:2: ctc", "recipes/x.sh:3: eagle3",
                                             "recipes/x.sh:5: hydra", "recipes/x.sh:5: medusa"]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_no_family_module_imports_another_familys_module():
    """Shared blocks live in models/components.py (and models/prefix_attention.py), not in one family's folder."""
    bad = []
    for family in FAMILIES:
        for path in sorted((ROOT / "models" / "families" / family).glob("*.py")) + [ROOT / "losses" / f"{family}.py"]:
            if not path.is_file():
                continue
            for other in set(FAMILIES) - {family}:
                bad += [f"{path.relative_to(ROOT)} imports {m}" for m in _imports(path)
                        if re.fullmatch(rf"(models\.families|losses)\.{other}(\..*)?", m)]
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
    assert {f: DRAFTERS[f].max_speculative_tokens(draft) for f in old} == old
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


def test_every_family_format_has_the_familys_writer():
    """Each format whose files differ per family has its family's writer (FamilySpec checks it when built), and each
    family llama.cpp serves has its role module gguf with `converter_input` (found by name by eval/serving)."""
    import importlib

    from models.family import OWN_FORMATS
    from models.registry import SPECS

    for name, spec in SPECS.items():
        assert set(spec.writers) == set(spec.facts.export_formats) & set(OWN_FORMATS), name
        assert all(callable(w) for w in spec.writers.values()), name
        if spec.facts.llamacpp_spec_type:
            assert callable(importlib.import_module(f"{spec.package}.gguf").converter_input), name


def test_derived_tables_are_the_old_ones():
    import importlib

    """The tables kept by hand before the declarations, pinned to what they held."""
    from eval.harness.runner import LEARNING_FREE_METHODS
    from models.families.dflash.export_vllm import export_vllm_dflash
    from models.families.dflash.gguf import converter_input as dflash_converter_input
    from models.families.dspark.export_vllm import export_vllm_dspark
    from models.families.eagle3.export_vllm import export_vllm_eagle3
    from models.families.eagle3.gguf import converter_input as eagle3_converter_input
    from models.families.medusa.export_vllm import export_vllm_medusa
    from models.families.ngram.export_vllm import export_vllm_ngram
    from models.registry import SPECS, learning_free_vllm_families, vllm_schedule_methods
    from train.chain_estimate import CHAIN_FAMILIES

    # models/export/vllm.py VLLM_EXPORTERS (vLLM method -> exporter)
    vllm = {s.facts.vllm_method: s.writers["vllm"] for s in SPECS.values() if s.facts.vllm_method}
    assert {m: vllm[m] for m in ("medusa", "eagle3", "dflash", "dspark", "ngram")} == {
        "medusa": export_vllm_medusa, "eagle3": export_vllm_eagle3, "dflash": export_vllm_dflash,
        "dspark": export_vllm_dspark, "ngram": export_vllm_ngram}
    # eval/serving/llamacpp_gguf.py CONVERTER_INPUTS
    gguf = {n: importlib.import_module(f"{s.package}.gguf").converter_input for n, s in SPECS.items()
            if s.facts.llamacpp_spec_type}
    assert gguf == {"eagle3": eagle3_converter_input, "dflash": dflash_converter_input}
    schedule = vllm_schedule_methods()
    assert set(schedule) >= {"eagle3", "dflash"} and not {"medusa", "dspark", "ngram"} & set(schedule)
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


def test_the_registries_are_the_one_registration():
    """FAMILIES holds exactly the packages of models/families/ (each registered once, in BUILT_IN), DRAFTERS exactly
    the families whose package has a drafter module (neither registry file lists one: the scan above would report
    it)."""
    from eval.engine.drafters.registry import DRAFTERS
    from models.families import BUILT_IN
    from models.registry import SPECS

    folders = {p.parent.name for p in (ROOT / "models" / "families").glob("*/__init__.py")}
    assert set(FAMILIES) == folders == {package.spec.name for package in BUILT_IN}
    assert all(SPECS[p.spec.name].package == p.__name__ == f"models.families.{p.spec.name}" for p in BUILT_IN)
    assert set(DRAFTERS) == {f for f in FAMILIES if (ROOT / "models" / "families" / f / "drafter.py").is_file()}


def test_a_wrong_registration_fails_naming_the_fix():
    from models.families import register_family
    from models.family import FamilyFacts, FamilySpec

    with pytest.raises(ValueError, match="writers"):  # a vLLM format without its writer
        FamilySpec("x", FamilyFacts("x", "X", ("vllm",), vllm_method="x", trainable=False))
    with pytest.raises(ValueError, match="writers"):  # a writer of a format the family does not have
        FamilySpec("x", FamilyFacts("x", "X", trainable=False), writers={"vllm": print})
    with pytest.raises(ValueError, match="learning-free"):  # a trainable family without its model class
        FamilySpec("x", FamilyFacts("x", "X"))
    with pytest.raises(ValueError, match="registered already"):  # another family under a taken name
        register_family(FamilySpec("x", FamilyFacts("medusa", "M", trainable=False)))
