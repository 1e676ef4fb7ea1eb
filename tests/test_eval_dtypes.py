"""`specdraft eval dtype=fast` on a one-head Hydra export of the tiny base: it decodes in the dtype the decode probe
picked (scripted here, on a CPU said to have bf16 instructions), and its summary and report say which dtype each
phase used and why; an explicit dtype is decoded as asked, unprobed."""

from __future__ import annotations

import pytest
from helpers.reports import fake_hydra_report

from eval.harness.config import load_eval_config
from eval.harness.runner import eval_export, format_summary

pytestmark = pytest.mark.usefixtures("one_thread")

SMOKE_EVAL = ["configs/eval/smoke.yaml"]


def _ms(bf16, fp32):
    return {"bf16": {"1": bf16[0], "4": bf16[1]}, "fp32": {"1": fp32[0], "4": fp32[1]}}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from helpers.drafts import tiny_hydra_export

    return tiny_hydra_export(tmp_path_factory.mktemp("run"))


@pytest.fixture
def bf16_cpu(monkeypatch, tmp_path):
    """A CPU with bf16 matrix instructions, a fresh probe cache, and a probe scripted by `set(bf16, fp32)`."""
    from core.dtype_phases import PROBE_FORMAT

    monkeypatch.setattr("core.dtype_phases.cpu_has_fast_bf16", lambda cpuinfo=None: True)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    state = {}

    def probe(model, kind):
        state["calls"] = state.get("calls", 0) + 1
        return {"format": PROBE_FORMAT, "backend": kind, "prefix": 128, "width": 4, "repeats": 7, "ms": state["ms"],
                "load": {"start": [0.1], "end": [0.1], "cores": 2, "loaded": False}}

    monkeypatch.setattr("eval.engine.dtype_probe.probe_decode_speed", probe)
    return state


def run(export, overrides):
    cfg = load_eval_config(SMOKE_EVAL, ["hf_baseline=false", *overrides])
    report, out_dir = eval_export(export, cfg)
    return report, out_dir, format_summary(report, out_dir)


def test_fast_decodes_in_the_probed_dtype_and_says_why(export, bf16_cpu):
    bf16_cpu["ms"] = _ms(bf16=(43.7, 47.0), fp32=(32.3, 41.0))  # fp32 decodes faster on this "CPU"
    report, out_dir, summary = run(export, ["dtype=fast", "name=fast-fp32"])
    ex = report["extra"]
    assert ex["dtype"] == "float32" and (ex["dtypes"]["decode"], ex["dtypes"]["bulk"]) == ("fp32", "bf16")
    assert report["lossless"] is True and "fp32_redecode" not in ex  # an fp32 decode is its own exact verdict
    line = next(s for s in summary.splitlines() if "dtypes:" in s)
    assert "decoding fp32" in line and "bulk phases bf16" in line and "1 token bf16 43.7 / fp32 32.3 ms" in line
    assert "decoding fp32" in (out_dir / "report.md").read_text()

    bf16_cpu["ms"] = _ms(bf16=(22.0, 24.0), fp32=(33.0, 37.0))  # the cached record still says fp32: no new probe
    report, _, _ = run(export, ["dtype=fast", "name=fast-cached"])
    assert bf16_cpu["calls"] == 1 and report["extra"]["dtype"] == "float32"


def test_fast_decodes_bf16_where_the_probe_says_so(export, bf16_cpu):
    bf16_cpu["ms"] = _ms(bf16=(22.0, 24.0), fp32=(33.0, 37.0))
    report, _, summary = run(export, ["dtype=fast", "name=fast-bf16"])
    assert report["extra"]["dtype"] == "bfloat16" and report["extra"]["dtypes"]["decode"] == "bf16"
    assert "decoding bf16" in summary


def test_an_explicit_dtype_is_decoded_as_asked_without_a_probe(export, bf16_cpu):
    report, _, summary = run(export, ["dtype=bf16", "name=bf16"])
    assert report["extra"]["dtype"] == "bfloat16" and "calls" not in bf16_cpu
    assert "every phase bf16: dtype=bf16 asked for (no probe)" in summary


def test_tune_of_our_decoder_alone_resolves_fast_as_eval_does(export, bf16_cpu):
    from eval.tune.command import decode_dtype

    bf16_cpu["ms"] = _ms(bf16=(43.7, 47.0), fp32=(32.3, 41.0))
    cfg = load_eval_config(SMOKE_EVAL, ["dtype=fast"])
    assert decode_dtype(cfg, ("ours",), export).dtype == "fp32"  # the dtype `specdraft eval dtype=fast` decodes in
    # beside a serving engine the base is shared: fast keeps its plain meaning (fast_dtype), as serve-check reads it
    assert decode_dtype(cfg, ("ours", "vllm"), export).dtype == "fast"


def test_the_demo_decodes_in_the_probed_dtype_and_skips_the_fp32_check_when_that_is_fp32(export, bf16_cpu,
                                                                                        monkeypatch, capsys):
    import cli.demo as demo
    import eval.harness.runner as runner

    seen = []

    def fake_eval_export(export_dir, cfg):
        seen.append(cfg)
        return fake_hydra_report(cfg, {"dtype": cfg.dtype}), export_dir

    monkeypatch.setattr(runner, "eval_export", fake_eval_export)
    bf16_cpu["ms"] = _ms(bf16=(43.7, 47.0), fp32=(32.3, 41.0))
    demo.evaluate_demo_run(export.parent, ["dtype=fast", "num_prompts=2"])
    assert [c.dtype for c in seen] == ["fp32"]  # decoded in fp32: that run is the exact check, no second one
    assert "its verdict is the exact losslessness check" in capsys.readouterr().out
    seen.clear()
    bf16_cpu["ms"] = _ms(bf16=(22.0, 24.0), fp32=(33.0, 37.0))
    monkeypatch.setenv("SPECDRAFT_CACHE", str(export.parent / "other-cache"))  # a fresh probe
    demo.evaluate_demo_run(export.parent, ["dtype=fast", "num_prompts=2"])
    assert [c.dtype for c in seen] == ["bf16", "fp32"]  # bf16 decoding, then the exact fp32 check
