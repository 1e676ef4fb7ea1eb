"""The parts of `specdraft compare`: headline rows (tree + chain per family), the vLLM columns
(eval/serving/compare_vllm.py), the new targets and plots, and the `fast` dtype the CPU recipes use.

The vLLM end-to-end test (marker `vllm`) runs the real engine from .venv-vllm on a tiny servable base."""

import json

import pytest
import torch
import yaml

from core.config_loader import ConfigError
from eval.engine.tree import STATIC_TREES, StaticTree
from eval.harness.compare_config import draft_entries, load_compare_config, setting_configs, vllm_setting_names
from eval.harness.results_doc import Targets, headline_table, target_table, vllm_table
from eval.serving.compare_vllm import num_speculative_tokens, vllm_columns

PROJECT_TARGETS = Targets.from_config(yaml.safe_load(open("configs/compare.yaml").read())["targets"])


class _Tree:  # what num_speculative_tokens reads of a static-tree drafter: its tree
    def __init__(self, choices):
        self.tree = StaticTree([tuple(c) for c in choices])


def test_num_speculative_tokens_accepts_only_vllms_draft_shapes():
    assert num_speculative_tokens("medusa", {}, _Tree(STATIC_TREES["chain4"])) == 4
    assert num_speculative_tokens("medusa", {}, _Tree([[0], [0, 0]])) == 2
    with pytest.raises(ValueError, match="tree: chain4"):
        num_speculative_tokens("medusa", {}, _Tree(STATIC_TREES["tree16"]))
    assert num_speculative_tokens("eagle3", {"eagle3_mode": "chain", "num_speculative_tokens": 3}, None) == 3
    with pytest.raises(ValueError, match="eagle3_mode: chain"):
        num_speculative_tokens("eagle3", {"eagle3_mode": "tree"}, None)
    assert num_speculative_tokens("ngram", {"k": 1, "strategy": "longest_match", "w": 4}, None) == 4
    with pytest.raises(ValueError, match="longest_match"):
        num_speculative_tokens("ngram", {"k": 4, "strategy": "mixed", "w": 4}, None)
    with pytest.raises(ValueError, match="no method for a hydra draft"):
        num_speculative_tokens("hydra", {}, _Tree(STATIC_TREES["chain4"]))


def _cfg(tmp_path, drafts, **extra):
    cfg = {"out_dir": str(tmp_path / "cmp"), "base_path": "tiny", "eval": {"dataset": "mtbench"},
           "settings": [{"name": "g"}, {"name": "t", "acceptance": "rejection", "temperature": 0.7}],
           "drafts": drafts, **extra}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_compare_config([str(path)])


@pytest.mark.parametrize("draft, message", [
    ({"label": "a", "method": "ngram", "headline": "N-gram"}, "headline"),
    ({"label": "a", "method": "ngram", "headline": {"family": "N", "draft": "wide"}}, "tree|chain"),
    ({"label": "a", "method": "ngram", "vllm": "yes"}, "`vllm` must be true or false"),
])
def test_headline_and_vllm_keys_are_checked(tmp_path, draft, message):
    cfg = _cfg(tmp_path, [draft])
    with pytest.raises(ConfigError, match=message):
        draft_entries(cfg, list(setting_configs(cfg)))


def test_vllm_settings_must_be_known_and_greedy(tmp_path):
    drafts = [{"label": "a", "method": "ngram", "vllm": True, "headline": {"family": "N-gram", "draft": "chain"}}]
    cfg = _cfg(tmp_path, drafts, vllm_settings=["g"])
    entries = draft_entries(cfg, list(setting_configs(cfg)))
    assert entries[0].vllm and entries[0].headline == ("N-gram", "chain")
    assert vllm_setting_names(cfg, setting_configs(cfg)) == ["g"]
    for bad, message in ((["nope"], "unknown setting"), (["t"], "not greedy")):
        cfg = _cfg(tmp_path, drafts, vllm_settings=bad)
        with pytest.raises(ConfigError, match=message):
            vllm_setting_names(cfg, setting_configs(cfg))


def _rep(method, label, al, speed, hf, head=None, rates=(0.5, 0.2), **extra):
    ex = {"label": label, "tree_nodes_per_step": 5.0, "lossless_identical": 3, "lossless_ties": 1,
          "lossless_mismatches": 0, **({"headline": list(head)} if head else {}), **extra}
    return {"method": method, "acceptance_length": al, "speedup": speed, "speedup_vs_hf": hf,
            "accept_rate_per_position": list(rates), "lossless_fraction": 0.75, "extra": ex}


def _settings():
    mt = {"config": {"temperature": 0.0, "dataset": "mtbench"}, "reports": {
        "Medusa": _rep("medusa", "Medusa", 1.6, 0.8, 1.1, ("Medusa", "tree")),
        "Medusa-chain": _rep("medusa", "Medusa-chain", 1.4, 1.2, 1.6, ("Medusa", "chain")),
        "EAGLE-3-chain": _rep("eagle3", "EAGLE-3-chain", 2.3, 1.6, 2.1, ("EAGLE-3", "chain"), eagle3_mode="chain"),
        "EAGLE-3": _rep("eagle3", "EAGLE-3", 2.9, 0.9, 1.2, ("EAGLE-3", "tree"), eagle3_mode="tree")}}
    mt["vllm"] = {"num_prompts": 3, "dtype": "float32", "vllm_version": "0.32.0", "tolerance": 0.03,
                  "ar": {"tokens_per_second": 50.0, "agreement_with_our_ar": {"identical_prompts": 1.0,
                                                                              "common_prefix_fraction": 1.0}},
                  "drafts": {"Medusa-chain": {
                      "depth": 4, "acceptance_length": 1.45, "accept_rate_per_position": [0.4, 0.05, 0.0, 0.0],
                      "ours_acceptance_length": 1.4, "ours_accept_rate_per_position": [0.41, 0.04, 0.0, 0.0],
                      "tokens_per_second": 80.0, "speedup_vs_vllm_ar": 1.6,
                      "acceptance_check": {"ok": True, "max_abs_diff": 0.01},
                      "agreement_with_vllm_ar": {"identical_prompts": 2 / 3}}}}
    sg = {"config": {"temperature": 0.0, "dataset": "sharegpt"}, "reports": {
        "Medusa": _rep("medusa", "Medusa", 1.7, 0.8, 1.1, ("Medusa", "tree"))}}
    return {"mtbench-greedy": mt, "sharegpt-greedy": sg}


def test_headline_vllm_and_target_tables():
    settings = _settings()
    rows = "\n".join(headline_table(settings))
    # Medusa: tree 1.60 / chain 1.40, speeds, the verdict, vLLM's chain numbers, the hidden set's tree only
    assert "| Medusa | 0 (learning-free) |" in rows  # no export in these reports: nothing to describe
    assert "**1.60** / **1.40** | 0.80× / 1.20× | 1.10× / 1.60× | lossless (3/4 identical, 1 ties); lossless " \
           "(3/4 identical, 1 ties) | 1.45 | 1.60× | 1.70 / — |" in rows
    assert "| EAGLE-3 |" in rows and "**2.90** / **2.30**" in rows
    v = "\n".join(vllm_table("mtbench-greedy", settings["mtbench-greedy"]["vllm"]))
    assert "vLLM AR 50.0 tok/s" in v and "| Medusa-chain | 4 | **1.45** (ours 1.40) | 0.400 / 0.050 / 0.000 / 0.000 " \
           "| 0.410 / 0.040 / 0.000 / 0.000 | yes (max diff 0.010) | 80.0 | 1.60× | 67% |" in v
    assert "could not run: no venv" in "\n".join(vllm_table("x", {"error": "no venv"}))
    # one draft vLLM could not load: its row says why, the others and the targets are unaffected
    settings["mtbench-greedy"]["vllm"]["drafts"]["EAGLE-3-chain"] = {"depth": 4, "error": "weights not initialized"}
    assert "| EAGLE-3-chain | 4 | vLLM could not load it: weights not initialized |" in "\n".join(
        vllm_table("mtbench-greedy", settings["mtbench-greedy"]["vllm"]))
    assert "| EAGLE-3 |" in "\n".join(headline_table(settings))
    t = "\n".join(target_table(settings["mtbench-greedy"], PROJECT_TARGETS))
    assert "| eagle3-chain | ≥ 2.2 | 2.30 (EAGLE-3-chain) | yes |" in t  # the tree's 2.90 does not count
    assert "| best speedup vs own AR | ≥ 1.5× | 1.60× (EAGLE-3-chain) | yes |" in t
    assert "| vLLM + best draft vs vLLM AR | ≥ 1.5× | 1.60× (Medusa-chain) | yes |" in t
    assert "| medusa | ≥ 2.0 | 1.60 (Medusa) | no |" in t


def test_fast_dtype_follows_the_cpu_flags(monkeypatch):
    from core import hardware as base
    from train.ds_config import resolve_precision

    assert base.cpu_has_fast_bf16("flags : fpu avx2 avx512f avx512_bf16 amx_tile") is True
    assert base.cpu_has_fast_bf16("flags : fpu avx2 fma amx_bf16") is True
    assert base.cpu_has_fast_bf16("flags : fpu sse avx2 fma avx512f") is False  # AVX-512 without bf16
    cpu = torch.device("cpu")
    for has, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(base, "cpu_has_fast_bf16", lambda *a, has=has: has)
        assert base.resolve_dtype("fast", cpu) == want
        assert resolve_precision("fast", cpu) == ("bf16" if has else "fp32")
        assert base.resolve_dtype("auto", cpu) == torch.float32  # auto stays exact on CPU either way


@pytest.mark.vllm
def test_compare_with_vllm_columns_end_to_end(tmp_path, capsys):
    """The real engine serves a Medusa chain and the prompt-lookup n-gram beside our decoder in one compare run:
    fp32, so vLLM's per-position acceptance must agree with ours; a second run reuses every engine result."""
    from test_serve_check import _have_vllm

    if not _have_vllm():
        pytest.skip("no vLLM venv: `make vllm` (or set SPECDRAFT_VLLM_VENV)")
    from vllm_fixtures import medusa_export_on_servable_base

    from eval.harness.compare import run_compare
    from eval.harness.results_doc import write_results

    # with a draft vocabulary (token_map): vLLM 0.32 loads it only with the export's engine_args.json
    export = medusa_export_on_servable_base(tmp_path / "m", draft_vocab=160)
    cfg = {"out_dir": str(tmp_path / "cmp"), "base_path": str(tmp_path / "m" / "base"),
           "eval": {"dataset": "tests/fixtures/eval_prompts.jsonl", "num_prompts": 3, "max_new_tokens": 24,
                    "dtype": "fp32", "backend": "hf", "warmup_tokens": 2},
           "settings": [{"name": "greedy"}], "vllm_settings": ["greedy"], "vllm_enforce_eager": True,
           "drafts": [{"label": "Medusa-chain", "export": str(export),
                       "eval": {"tree_choices": [[0], [0, 0], [0, 0, 0]]}, "vllm": True,
                       "headline": {"family": "Medusa", "draft": "chain"}},
                      {"label": "N-gram-chain", "method": "ngram", "vllm": True,
                       "eval": {"extra": {"k": 1, "w": 3, "q": 2, "q_min": 1, "strategy": "longest_match"}},
                       "headline": {"family": "N-gram", "draft": "chain"}}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    summary = run_compare(load_compare_config([str(path)]), vllm_columns)
    v = summary["settings"]["greedy"]["vllm"]
    assert set(v["drafts"]) == {"Medusa-chain", "N-gram-chain"}
    assert v["ar"]["agreement_with_our_ar"]["identical_prompts"] == 1.0  # fp32 greedy: the same tokens
    med = v["drafts"]["Medusa-chain"]
    assert med["depth"] == 3 and med["speculative_config"]["num_speculative_tokens"] == 3
    assert med["acceptance_check"]["ok"] and med["num_drafts"] > 0
    assert med["engine_args"] == {"model_loader_extra_config": {"enable_weights_track": False}}
    assert v["drafts"]["N-gram-chain"]["acceptance_check"]["ok"]
    work = tmp_path / "cmp" / "greedy" / "vllm"
    results = sorted(p.name for p in work.glob("*.result.json"))
    assert results == ["vllm-Medusa-chain.result.json", "vllm-N-gram-chain.result.json", "vllm_ar.result.json"]
    stamps = {p: p.stat().st_mtime_ns for p in work.glob("*.result.json")}
    again = run_compare(load_compare_config([str(path)]), vllm_columns)["settings"]["greedy"]["vllm"]
    assert {p: p.stat().st_mtime_ns for p in work.glob("*.result.json")} == stamps  # nothing re-run
    assert again["drafts"]["Medusa-chain"]["acceptance_length"] == med["acceptance_length"]
    md = tmp_path / "results.md"
    write_results(tmp_path / "cmp", md, tmp_path / "img" / "results", str(path))
    text = md.read_text()
    assert "### vLLM on `greedy`" in text and "| Medusa-chain | 3 |" in text and "| N-gram |" in text
    assert json.loads((work / "vllm.json").read_text())["drafts"]["Medusa-chain"]["depth"] == 3


def test_vllm_draft_engines_run_later_are_timed_against_their_own_vllm_ar(tmp_path, monkeypatch):
    """No vLLM needed: a fake engine whose speed changes between passes (another session's machine). A draft
    engine run in a later pass is divided by the vLLM AR timed in that pass; one run earlier keeps its own."""
    import types

    import eval.engine.decoder
    import eval.serving.serve_check
    from eval.harness.compare import Method
    from eval.harness.compare_config import DraftEntry
    from eval.serving.compare_vllm import run_vllm_setting

    speed = {"s": 10.0}  # seconds per token of the current "machine"; AR is 1x, a draft 0.5x of it

    def fake_engine(job, workdir, timeout):
        draft = job["speculative_config"] is not None
        per = speed["s"] * (0.5 if draft else 1.0)
        res = {"label": job["label"], "vllm_version": "fake",
               "results": [{"id": p["id"], "tokens": [1, 2, 3], "decode_seconds": 2 * per} for p in job["prompts"]],
               "spec_decode": {"vllm:spec_decode_num_drafts": 4, "vllm:spec_decode_num_accepted_tokens": 2,
                               "vllm:spec_decode_num_accepted_tokens_per_pos": [2, 0]} if draft else None,
               **({"paired_ar": job["paired_ar"]} if job.get("paired_ar") else {})}  # as eval/serving/vllm_runner.py
        (workdir / f"{job['label']}.result.json").write_text(json.dumps(res))
        return res

    monkeypatch.setattr(eval.serving.serve_check, "run_engine", fake_engine)
    monkeypatch.setattr(eval.serving.serve_check, "vllm_python", lambda: tmp_path)
    monkeypatch.setattr(eval.serving.serve_check, "base_hf_dir", lambda base, workdir: tmp_path)
    monkeypatch.setattr(eval.engine.decoder, "eos_ids", lambda model, tok: [0])
    base = types.SimpleNamespace(model=torch.nn.Linear(1, 1), tokenizer=None)
    prompts = [types.SimpleNamespace(id=f"p{i}", input_ids=[5, 6]) for i in range(2)]
    ecfg = types.SimpleNamespace(max_new_tokens=2, warmup_tokens=0, seed=0)
    info = {"k": 1, "strategy": "longest_match", "w": 2, "q": 2, "q_min": 1}
    rows = ("A", "B")
    methods = {lab: Method(lab, "ngram", None, info) for lab in rows}
    entries = {lab: DraftEntry(lab, None, "ngram", None, None, {}, vllm=True) for lab in rows}
    report = {"new_tokens": 4, "tokens_per_second": 1.0, "accept_rate_per_position": [0.5, 0.0],
              "acceptance_length": 1.5, "extra": {}}
    done = {(p.id, lab): {"tokens": [1, 2, 3]} for p in prompts for lab in ("ar", *rows)}

    def run(labels, **kw):
        return run_vllm_setting("s", ecfg, [methods[x] for x in labels], [entries[x] for x in labels],
                                {x: report for x in labels}, done, prompts, base, tmp_path / "out", timeout=1,
                                tolerance=0.03, **kw)

    first = run(["A"], this_pass="20261124T100000-one")
    assert first["drafts"]["A"]["speedup_vs_vllm_ar"] == pytest.approx(2.0)
    assert first["drafts"]["A"]["vllm_ar_run"] == "vllm_ar"
    speed["s"] = 30.0  # a slower machine: B and its AR are timed on it, A's numbers stay what they were
    second = run(["A", "B"], this_pass="20261124T110000-two")
    work = tmp_path / "out" / "s" / "vllm"
    assert sorted(p.name for p in work.glob("*.result.json")) == [
        "vllm-A.result.json", "vllm-B.result.json", "vllm_ar-20261124T110000-two.result.json", "vllm_ar.result.json"]
    a, b = second["drafts"]["A"], second["drafts"]["B"]
    assert b["vllm_ar_run"] == "vllm_ar-20261124T110000-two" and a["vllm_ar_run"] == "vllm_ar"
    assert a["speedup_vs_vllm_ar"] == pytest.approx(2.0) and b["speedup_vs_vllm_ar"] == pytest.approx(2.0)
    assert b["vllm_ar_tokens_per_second"] == pytest.approx(a["vllm_ar_tokens_per_second"] / 3)
    assert second["ar"]["tokens_per_second"] == pytest.approx(b["vllm_ar_tokens_per_second"])  # the latest
    table = vllm_table("s", second)
    assert "its own pass" in table[2] and table[6].endswith(f" {a['vllm_ar_tokens_per_second']:.1f} |")
    speed["s"] = 20.0  # redo A: it and a fresh AR run again in this pass
    third = run(["A", "B"], this_pass="20261124T120000-three", redo=("A",))
    assert third["drafts"]["A"]["vllm_ar_run"] == "vllm_ar-20261124T120000-three"
    assert third["drafts"]["B"]["vllm_ar_run"] == "vllm_ar-20261124T110000-two"
    assert third["drafts"]["A"]["vllm_ar_tokens_per_second"] == pytest.approx(1 / 20.0)
    nothing = run(["A", "B"], this_pass="20261124T130000-four")  # everything stored: no engine runs, no new AR
    assert not (work / "vllm_ar-20261124T130000-four.result.json").exists()
    assert nothing["drafts"]["A"]["vllm_ar_run"] == "vllm_ar-20261124T120000-three"
    assert nothing["ar"]["run"] == "vllm_ar-20261124T120000-three"
    assert nothing["ar"]["tokens_per_second"] == pytest.approx(1 / 20.0)  # the setting's figure: the latest AR


def test_a_tuned_schedule_does_not_change_the_compared_chain(tmp_path):
    """An export whose config.json carries tune's vLLM count and per-batch-size schedule (as the shipped draft's does)
    is compared as the row's own chain: vLLM's speculative_config drafts `depth` tokens, with no schedule."""
    from types import SimpleNamespace

    from vllm_fixtures import servable_tiny_base

    from eval.serving.compare_vllm import speculative_config
    from models.base import load_base
    from models.draft import BaseView
    from models.export.specdraft import export_specdraft
    from models.export.vllm import TUNED_SCHEDULE_KEY, TUNED_TOKENS_KEY
    from models.families.eagle3.model import Eagle3Draft

    base_dir = servable_tiny_base(tmp_path / "base", num_layers=8)
    base = load_base(str(base_dir), dtype="fp32")
    draft = Eagle3Draft(BaseView.from_model(base.model)).eval()
    config = {**draft.export_config(), TUNED_TOKENS_KEY: 2, TUNED_SCHEDULE_KEY: [[1, 1, 2], [2, 8, 0]]}
    export = export_specdraft(draft, tmp_path / "run" / "export", base.name, base.fingerprint, config)
    spec, _ = speculative_config(SimpleNamespace(label="d", export=export), "eagle3", {}, 4, base, base_dir,
                                 tmp_path / "work")
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 4
    assert "num_speculative_tokens_per_batch_size" not in spec
    written = json.loads((tmp_path / "work" / "export-d" / "speculative_config.json").read_text())
    assert "num_speculative_tokens_per_batch_size" not in written
