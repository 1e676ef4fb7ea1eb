"""Stand-in eval reports for tests that replace `eval.harness.runner.eval_export` (the demo's decoding steps)."""

from __future__ import annotations


def fake_hydra_report(cfg, extra: dict) -> dict:
    """The report `eval_export` returns for a one-head Hydra on MT-bench, every speed 1.0 and lossless; `extra` is its
    extra dict (the dtype decoded, the verdict's counts)."""
    return {"method": "hydra", "dataset": "mtbench", "num_prompts": cfg.num_prompts, "device": "cpu",
            "acceptance_length": 1.5, "tokens_per_second": 1.0, "ar_tokens_per_second": 1.0,
            "hf_tokens_per_second": 1.0, "speedup": 1.0, "speedup_vs_hf": 1.0, "lossless": True, "extra": extra}
