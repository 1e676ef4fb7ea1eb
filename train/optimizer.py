"""The draft's optimizer, handed to DeepSpeed as its client optimizer: AdamW (train.optimizer=adamw, the default) or
Muon for the hidden 2-D weight matrices plus AdamW for the rest (train.optimizer=muon).

Muon (torch.optim.Muon, Keller Jordan's momentum + Newton-Schulz orthogonalisation) updates 2-D matrices only. Which
parameters it gets follows the Muon authors and speculators (`speculators.train.optimizers`): a trainable weight
[out, in] with both dimensions > 1 that is no embedding and no output head; AdamW keeps the norms, biases, vectors,
other shapes (P-EAGLE's `mask_hidden` [1, 1, k·d]) and the vocabulary-sized matrices: the LM heads (`lm_head`, a
Medusa head's [N, d] output layer), embeddings and vocabulary factors, recognised by name (`lm_head`, `embed`) or by
their first dimension being a vocabulary size (the base's V or the draft vocabulary's N). For EAGLE-3 that puts fc
and the decoder layer's seven projections on Muon and lm_head and the four norms on AdamW.

The Muon step uses `adjust_lr_fn="match_rms_adamw"` (Moonshot's scaling, lr · 0.2 · sqrt(max(out, in))), which makes
an orthogonalised update about as large per element as an AdamW one, so one learning rate and one schedule serve
both groups (train.lr; train.muon_lr > 0 sets Muon's own peak, speculators' default is 0.02); momentum 0.95 with
Nesterov, 5 Newton-Schulz steps (torch's and speculators' defaults); weight decay train.weight_decay for both.

DeepSpeed: with ZeRO 0, fp32 steps this optimizer itself, and bf16 wraps it in FP16_UnfusedOptimizer, which keeps a
fp32 copy of each parameter in its own shape, so Muon still sees matrices. ZeRO 1-2 would hand it flat 1-D
partitions, which Muon cannot orthogonalise: train/config.py refuses muon with deepspeed.zero_stage > 0.
"""

from __future__ import annotations

import torch
from torch import nn

OPTIMIZERS = ("adamw", "muon")  # train.optimizer
MUON_MOMENTUM = 0.95
MUON_NS_STEPS = 5


def has_muon() -> bool:
    return hasattr(torch.optim, "Muon")


def split_for_muon(model: nn.Module, vocab_sizes: set[int]) -> tuple[list[tuple[str, nn.Parameter]],
                                                                       list[tuple[str, nn.Parameter]]]:
    """(Muon's, AdamW's) trainable (name, parameter) pairs of `model`; see the module docstring for the rule.
    vocab_sizes: the output vocabularies whose [V, d] matrices are heads or tables (the base's V, the draft's N)."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        table = "lm_head" in name or "embed" in name or p.shape[0] in vocab_sizes
        (muon if p.ndim == 2 and min(p.shape) > 1 and not table else adamw).append((name, p))
    return muon, adamw


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer (what DeepSpeed and the LR scheduler hold) over two groups: param_groups[0] stepped by
    torch.optim.Muon (`use_muon: True`), param_groups[1] by torch.optim.AdamW. The inner optimizers own no state:
    each step points them at this optimizer's groups and `state`, so load_state_dict (which replaces both) and
    DeepSpeed's bf16 wrapper (which swaps each group's params for fp32 copies) need nothing more."""

    def __init__(self, muon_params: list[nn.Parameter], adamw_params: list[nn.Parameter], *, lr: float,
                 muon_lr: float, betas: tuple[float, float], weight_decay: float):
        if not muon_params:
            raise ValueError("Muon got no 2-D weight matrix to optimize; use train.optimizer=adamw")
        self._muon = torch.optim.Muon(muon_params, lr=muon_lr, weight_decay=weight_decay, momentum=MUON_MOMENTUM,
                                      nesterov=True, ns_steps=MUON_NS_STEPS, adjust_lr_fn="match_rms_adamw")
        groups = [dict(self._muon.param_groups[0], use_muon=True)]
        self._adamw = None
        if adamw_params:
            self._adamw = torch.optim.AdamW(adamw_params, lr=lr, betas=betas, weight_decay=weight_decay,
                                            fused=fusable(adamw_params))
            groups.append(dict(self._adamw.param_groups[0], use_muon=False))
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner, use_muon in ((self._muon, True), (self._adamw, False)):
            if inner is not None:
                inner.param_groups = [g for g in self.param_groups if g["use_muon"] is use_muon]
                inner.state = self.state
                inner.step()
        return loss


def fusable(params: list[nn.Parameter]) -> bool:
    """Whether torch's fused AdamW kernel (one pass over each tensor: moments, bias correction and update together)
    can step these parameters: floating point, all on the CPU or all on one CUDA device. On a CPU it steps EAGLE-3's
    ~12M parameters about 11x faster than the default for-each kernels (docs/lab/train_step_cpu.md), the same
    update up to float rounding (tests/test_optimizer.py)."""
    devices = {p.device.type for p in params}
    return bool(params) and len(devices) == 1 and devices <= {"cpu", "cuda"} and all(p.is_floating_point()
                                                                                   for p in params)


def build_optimizer(t, model: nn.Module, vocab_sizes: set[int]) -> torch.optim.Optimizer:
    """The optimizer train.optimizer names (t = the config's train section), over `model`'s trainable parameters.
    Each param group's `lr` is its peak learning rate (the LR schedule's base)."""
    if t.optimizer == "muon":
        muon, adamw = split_for_muon(model, vocab_sizes)
        return MuonWithAdamW([p for _, p in muon], [p for _, p in adamw], lr=t.lr, muon_lr=t.muon_lr or t.lr,
                             betas=tuple(t.betas), weight_decay=t.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                             fused=fusable(params))
