"""Which bases the `fast` backend (eval/engine/backends/fast.py) runs: a check on the transformers config alone,
so `backend=auto` can choose before any weights are read, and the per-layer sliding windows it applies."""

from __future__ import annotations

# RoPE variants whose frequencies change with the sequence length; a static cos/sin table cannot
# reproduce them.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


# model_type -> what differs from LLaMA (documentation; the loader reads the modules themselves).
FAST_ARCHITECTURES = {
    "llama": "the reference layout",
    "qwen2": "q/k/v biases; sliding-window layers where use_sliding_window is set",
    "qwen3": "per-head RMSNorm on q and k before RoPE; head_dim not d / heads",
    "mistral": "sliding window on every layer",
    "gemma3_text": "sliding/global layers with their own RoPE bases, sqrt(d) embedding scale, (1 + w) RMSNorms "
                   "before and after attention and MLP, q/k norms, GELU-tanh, query_pre_attn_scalar, final "
                   "logit soft-capping",
}


def supports(config) -> tuple[bool, str]:
    """Whether the fast backend can run a base with this transformers config, and if not, why (a
    sentence naming the field and saying to use backend=hf). Config-level checks only; the loader
    still rejects what only the weights reveal (partial RoPE)."""
    from eval.engine.backends.hf import cache_layer_types

    cfg = config
    kind = getattr(cfg, "model_type", None)  # the top level: a multimodal wrapper is not a text LM here
    if kind not in FAST_ARCHITECTURES:
        return False, (f"fast backend supports {', '.join(FAST_ARCHITECTURES)} (model_type), not {kind!r}; "
                       "use backend=hf for this model")
    gemma = kind == "gemma3_text"
    act = getattr(cfg, "hidden_activation" if gemma else "hidden_act", "silu")
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        return False, (f"fast backend: hidden_act={act!r} is not implemented (only 'silu', and "
                       "'gelu_pytorch_tanh' for Gemma); use backend=hf")
    if gemma and getattr(cfg, "attn_logit_softcapping", None) is not None:
        return False, ("fast backend: attn_logit_softcapping (attention-score soft-capping) is not "
                       "implemented; use backend=hf")
    if gemma and getattr(cfg, "use_bidirectional_attention", False):
        return False, "fast backend: use_bidirectional_attention=True is not causal decoding; use backend=hf"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    # One dict, or (Gemma-3) one per layer type.
    ropes = list(rope.values()) if isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values()) \
        else [rope]
    for r in ropes:
        rope_type = r.get("rope_type", r.get("type", "default")) if isinstance(r, dict) else "default"
        if rope_type in DYNAMIC_ROPE_TYPES:
            return False, (f"fast backend: rope_type={rope_type!r} rescales frequencies with the sequence "
                           "length, which a static cos/sin table cannot follow; use backend=hf")
    try:
        types = cache_layer_types(cfg)
    except (AttributeError, KeyError, TypeError) as err:
        return False, f"fast backend: cannot read the layer types of this config ({err}); use backend=hf"
    other = sorted(set(types) - {"full_attention", "sliding_attention"})
    if other:
        return False, f"fast backend: {', '.join(other)} layers are not implemented; use backend=hf"
    if "sliding_attention" in types and not getattr(cfg, "sliding_window", None):
        return False, "fast backend: sliding_attention layers without a sliding_window size; use backend=hf"
    return True, f"model_type={kind!r} is one of the fast backend's architectures ({', '.join(FAST_ARCHITECTURES)})"


def layer_windows(config) -> list[int | None]:
    """Per decoder layer: None (full attention) or its sliding window W."""
    from eval.engine.backends.hf import cache_layer_types

    window = getattr(config, "sliding_window", None)
    return [int(window) if t == "sliding_attention" else None for t in cache_layer_types(config)]
