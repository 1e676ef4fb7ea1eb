"""The prefix-attention layer (Hydra++, CTC drafter): incremental KV-cache path == full causal forward,
the same layer math as the base's own last layer, identity at init, no base reference, fp32 RoPE."""

import pytest
import torch

from models.prefix_attention import PrefixAttention
from models.tiny import tiny_llama

D = 64


@pytest.fixture(scope="module")
def base():
    return tiny_llama(0)


def _randomized(base, seed=0):
    """A prefix layer with every weight redrawn, so attention, RoPE and the MLP all matter."""
    layer = PrefixAttention(base)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.ndim == 2 else 1.0))
    return layer


def test_incremental_steps_equal_full_forward(base):
    layer = _randomized(base)
    hidden = torch.randn(2, 23, D)
    with torch.no_grad():
        full = layer(hidden)  # [2, 23, d]
        for b in range(2):
            cache = layer.new_cache(4, "cpu", torch.float32)  # small: the 9-row chunk forces a regrowth
            outs = [layer.step(cache, hidden[b, a:e]) for a, e in [(0, 3), (3, 4), (4, 13), (13, 14), (14, 23)]]
            assert cache.length == 23 and cache.capacity >= 23
            torch.testing.assert_close(torch.cat(outs), full[b], rtol=1e-4, atol=1e-4)


def test_forward_is_causal_and_right_padding_safe(base):
    layer = _randomized(base, seed=1)
    hidden = torch.randn(1, 12, D)
    padded = torch.cat([hidden, torch.randn(1, 5, D) * 50], dim=1)  # garbage pad rows after the real ones
    with torch.no_grad():
        torch.testing.assert_close(layer(padded)[:, :12], layer(hidden), rtol=1e-4, atol=1e-4)
        changed = hidden.clone()
        changed[0, 7] += 1.0
        out, out2 = layer(hidden), layer(changed)
    torch.testing.assert_close(out[:, :7], out2[:, :7])
    assert (out[0, 7:] - out2[0, 7:]).abs().amax(dim=-1).min() > 1e-4  # later rows do see row 7


def test_same_math_as_the_base_last_layer(base):
    """Without the zero init the layer IS the base's last layer (weights, RoPE, causal attention)."""
    layer = PrefixAttention(base, zero_init_output=False)
    hidden = torch.randn(1, 9, D)
    pos = torch.arange(9)[None]
    last = base.model.layers[-1]
    mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        want = last(hidden, attention_mask=mask, position_ids=pos,
                    position_embeddings=base.model.rotary_emb(hidden, pos))
        torch.testing.assert_close(layer(hidden), want, rtol=1e-5, atol=1e-5)


def test_zero_init_is_identity_and_copies_are_trainable_and_detached(base):
    layer = PrefixAttention(base)
    hidden = torch.randn(2, 6, D)
    torch.testing.assert_close(layer(hidden), hidden)  # o_proj = down_proj = 0: z_t == h_t at init
    assert all(p.requires_grad for p in layer.parameters())
    base_q = base.model.layers[-1].self_attn.q_proj.weight
    assert torch.equal(layer.layer.self_attn.q_proj.weight, base_q)
    assert layer.layer.self_attn.q_proj.weight.data_ptr() != base_q.data_ptr()
    assert not any(p.data_ptr() == q.data_ptr() for p in layer.parameters() for q in base.parameters())
    assert all(k.startswith("layer.") for k in layer.state_dict())  # no rotary buffers, no base weights
    # gradients reach the pretrained input weights once the output projections have moved
    layer.layer.self_attn.o_proj.weight.data.normal_(std=0.1)
    layer(hidden).sum().backward()
    assert layer.layer.self_attn.q_proj.weight.grad.abs().sum() > 0


def test_bf16_keeps_fp32_rope_and_steps_match(base):
    layer = _randomized(base, seed=2).to(torch.bfloat16)
    assert layer._inv_freq.dtype == torch.float32
    hidden = torch.randn(1, 10, D)
    with torch.no_grad():
        full = layer(hidden)[0].float()
        cache = layer.new_cache(16, "cpu", torch.bfloat16)
        inc = torch.cat([layer.step(cache, hidden[0, :6]), layer.step(cache, hidden[0, 6:])]).float()
    assert full.dtype == torch.float32 and inc.shape == (10, D)
    # bf16 rounding, not a wrong position or mask (those move most elements by O(1)): small on average, and no
    # element far off. The single-element bound is loose because CPUs without bf16 matrix instructions (AVX2)
    # emulate bf16 GEMMs and round differently for a 6- and a 10-row product (one element off by 0.2 seen there).
    assert (inc - full).abs().mean() < 0.02
    torch.testing.assert_close(inc, full, rtol=0.05, atol=0.3)


def test_bad_shapes_are_explained(base):
    layer = PrefixAttention(base)
    with pytest.raises(ValueError, match=r"\[B, T, d\]"):
        layer(torch.randn(5, D))
    with pytest.raises(ValueError, match=r"\[n, d\]"):
        layer.step(layer.new_cache(4, "cpu", torch.float32), torch.randn(1, 5, D))
