"""Which base backend runs a decode: `fast` (LLaMA-family static-KV backend) where it supports the architecture,
else `hf` (any transformers causal LM). The fast backend owns its own support check (fast.supports)."""

from __future__ import annotations


def choose_backend(kind: str, model) -> tuple[str, str]:
    """`backend=auto|fast|hf` -> (the backend that will run, why). auto = `fast` where the fast backend
    supports the architecture (eval.engine.backends.fast.supports owns that check), `hf` (any transformers causal
    LM) otherwise; an explicit choice is kept as asked."""
    if kind != "auto":
        return kind, f"backend={kind} was asked for"
    from eval.engine.backends.fast import supports

    ok, why = supports(model.config)
    return ("fast", f"auto: {why}") if ok else ("hf", f"auto: {why}, so the generic transformers backend")


def make_backend(kind: str, model):
    kind, _ = choose_backend(kind, model)
    if kind == "fast":
        from eval.engine.backends.fast import FastBackend

        return FastBackend(model)
    from eval.engine.backends.hf import HFBackend

    return HFBackend(model)
