"""The draft's optimizer: the fused AdamW kernel it picks on a CPU steps like the for-each reference."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from train.optimizer import build_optimizer, fusable


def _config(**kw):
    t = dict(optimizer="adamw", lr=1e-2, betas=[0.9, 0.999], weight_decay=0.01, muon_lr=0.0)
    t.update(kw)
    return SimpleNamespace(**t)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 32))


def _run(opt_of, steps: int = 5) -> list[torch.Tensor]:
    model = _model(0)
    opt = opt_of(model)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_the_cpu_optimizer_is_the_fused_kernel_and_steps_like_the_reference():
    opt = build_optimizer(_config(), _model(0), vocab_sizes=set())
    assert opt.param_groups[0]["fused"] is True
    fast = _run(lambda m: build_optimizer(_config(), m, vocab_sizes=set()))
    slow = _run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01,
                                            foreach=False))  # the per-tensor reference
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any((a != b).any() for a, b in zip(fast, _model(0).parameters())), "no step was taken"


def test_fusable_needs_one_device_and_floating_parameters():
    assert fusable([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    assert not fusable([])
    assert not fusable([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, device="meta"))])


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
def test_muons_adamw_group_is_fused_too():
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
    opt = build_optimizer(_config(optimizer="muon"), model, vocab_sizes=set())
    assert opt._adamw.param_groups[0]["fused"] is True
