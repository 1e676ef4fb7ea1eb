"""`specdraft ship` (cli/ship.py): a trained draft put into drafts/<name>/ in half precision with a model card, laid
out like a run, and still a working export (it decodes losslessly from there)."""

from __future__ import annotations

import argparse
import json

import pytest
from helpers.cli import smoke_cli_eval
from safetensors import safe_open

from cli.ship import cmd_ship


def _args(src, root, **kw):
    return argparse.Namespace(**{"export": src, "name": "tiny-medusa", "run": None,
                                 "train_command": "specdraft train x", "results": [], "dtype": "bf16",
                                 "max_mib": 32.0, "out_root": root, **kw})


def test_ship_writes_a_half_precision_export_with_a_card_that_still_decodes(smoke_run, tmp_path, clean_env):
    run_dir, _ = smoke_run
    results = tmp_path / "suite.md"
    results.write_text("| set | AL |\n|---|---|\n| mtbench | 1.23 |\n")
    assert cmd_ship(_args(run_dir / "export", tmp_path, results=[results])) == 0
    dest = tmp_path / "tiny-medusa"
    with safe_open(str(dest / "export" / "model.safetensors"), framework="pt") as f:
        kinds = {str(f.get_tensor(k).dtype) for k in f.keys()}
    assert kinds == {"torch.bfloat16"}  # no fp32 master weights, no optimizer state
    src_cfg = json.loads((run_dir / "export" / "config.json").read_text())
    cfg = json.loads((dest / "export" / "config.json").read_text())
    assert cfg["model_sha256"] != src_cfg["model_sha256"]  # the new file's hash, checked at load
    assert {k: v for k, v in cfg.items() if k != "model_sha256"} == \
        {k: v for k, v in src_cfg.items() if k != "model_sha256"}
    card = (dest / "README.md").read_text()
    assert src_cfg["base_fingerprint"] in card and "specdraft train x" in card and "| mtbench | 1.23 |" in card
    assert (dest / "config.yaml").is_file() and (dest / "metrics.jsonl").is_file()
    report = smoke_cli_eval(dest, "shipped", [], clean_env())  # drafts/<name> works where a run does
    assert report["lossless"] is True and report["acceptance_length"] >= 1.0


def test_ship_refuses_an_export_over_the_cap_and_leaves_nothing(smoke_run, tmp_path):
    run_dir, _ = smoke_run
    with pytest.raises(ValueError, match="over --max-mib 0.0001"):
        cmd_ship(_args(run_dir / "export", tmp_path, max_mib=0.0001))
    assert not (tmp_path / "tiny-medusa" / "export").exists()
    with pytest.raises(ValueError, match="not an export"):
        cmd_ship(_args(tmp_path, tmp_path))


def test_card_reads_an_older_runs_flat_keys_at_their_family_sections(tmp_path):
    """A run saved before the per-family sections (flat draft.ttt_steps, draft.rnn, ...): the card lists the run's
    own family's options under its section, and no option of another family."""
    import yaml

    from cli.ship import _draft_items, _training_facts

    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"draft": {
        "family": "eagle3", "num_heads": 5, "ttt_steps": 5, "rnn": True, "num_frames": 6, "block_size": 16}}))
    items = dict(_draft_items(_training_facts(tmp_path)["config"]["draft"], "eagle3"))
    assert items["eagle3.ttt_steps"] == 5 and items["num_heads"] == 5
    assert not {"ttt_steps", "rnn", "num_frames", "block_size"} & set(items)
    assert not any(k.startswith(("redrafter.", "ctc.", "dflash.")) for k in items)
