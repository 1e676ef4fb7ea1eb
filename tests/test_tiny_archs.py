"""The tiny architectures of models/tiny.py load through load_base and keep what makes each family distinct."""

from __future__ import annotations

import pytest
import torch

from models.base import last_hidden_and_logits, load_base
from models.tiny import TINY_ARCHS, tiny_model


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_arch_loads_by_name(arch):
    base = load_base(f"tiny-{arch}")
    assert base.name == f"tiny-{arch}" and base.vocab_size == 320 and base.hidden_size == 64
    assert base.model.config.model_type == ("gemma3_text" if arch == "gemma3" else arch)
    assert not any(p.requires_grad for p in base.model.parameters())
    assert base.tokenizer.chat_template  # the tiny ChatML tokenizer
    ids = torch.randint(3, 320, (1, 40), generator=torch.Generator().manual_seed(0))
    h, logits = last_hidden_and_logits(base.model, ids, compute_logits=True)
    want = base.model(ids).logits
    if arch == "gemma3":  # final soft-capping happens after lm_head: lm_head(h) is the raw logits
        cap = base.model.config.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    assert load_base(f"tiny-{arch}").fingerprint == base.fingerprint


def test_tiny_archs_have_their_family_features():
    q2, q3, mi, g3 = (tiny_model(a) for a in ("qwen2", "qwen3", "mistral", "gemma3"))
    assert q2.model.layers[0].self_attn.q_proj.bias is not None
    assert hasattr(q3.model.layers[0].self_attn, "q_norm") and q3.config.head_dim * 4 != 64
    assert mi.config.sliding_window == 16
    assert set(g3.config.layer_types) == {"sliding_attention", "full_attention"}
    assert g3.config.final_logit_softcapping == 30.0
    assert len({load_base(f"tiny-{a}").fingerprint for a in TINY_ARCHS}) == len(TINY_ARCHS)


@pytest.mark.parametrize(("arch", "extra"), [("mistral", {}), ("gemma3", {}),
                                            ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}),
                                            ("qwen3", {"use_sliding_window": True, "max_window_layers": 1})])
def test_window_changes_outputs(arch, extra):
    # Past the window, a sliding-window model must differ from the same weights attending everywhere
    # (else a test using it would not exercise any window logic).
    ids = torch.randint(3, 320, (1, 40), generator=torch.Generator().manual_seed(1))
    windowed = tiny_model(arch, diverse=True, sliding_window=8, **extra)
    full = tiny_model(arch, diverse=True, sliding_window=64, **extra)
    a, b = windowed(ids).logits, full(ids).logits
    torch.testing.assert_close(a[:, :8], b[:, :8])  # inside the first window they agree
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-3
