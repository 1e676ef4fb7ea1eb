"""Medusa: K independent heads on the base's last hidden state h_t (docs/families/medusa.md).

Head k (k = 1..K, stored at index k-1) = `num_layers` distinct ResBlocks, then an LM head Linear(d -> V)
copied from the base lm_head (or, with share_lm_head, the frozen base lm_head itself). It predicts
x_{t+1+k}: the base's own next token x_{t+1} is the tree root, so depth-k nodes are head k's top-k.

Loss = sum_k lambda0 * decay**k * CE_k, optionally mixed with soft CE to the base's distribution at
t+k (its own prediction of x_{t+1+k} on the same text).

Draft vocabulary (draft.vocab_size = N > 0, models/vocab_map.py): every LM head has N rows, the base rows
W[d2t] (own heads: initialised from them; shared: the frozen rows themselves); labels outside the map are
ignored by the loss and scored as misses (DepthStats.oov); forward returns [K, ..., N] logits over draft
ids, which drafting maps back to base ids with `to_base`.

Parameter names follow the original Medusa layout so `specdraft export --format medusa` only strips
the `heads.` prefix: `heads.{k-1}.{i}.linear.{weight,bias}` for ResBlock i and `heads.{k-1}.{L}.weight`
for the LM head.
"""

from __future__ import annotations

import torch
from torch import nn

from data.targets import offset_labels
from losses.fused_linear_ce import fused_linear_cross_entropy, linear_cross_entropy_reference
from losses.weighted_ce import head_weights
from models.components import stack_resblocks
from models.draft import BaseView, DraftBatch, DraftLossOutput, DraftModel, add_depth_loss
from models.family import FamilyFacts
from models.vocab_map import DraftVocabMixin, placeholder_map


class MedusaDraft(DraftVocabMixin, DraftModel):
    facts = FamilyFacts("medusa", "Medusa", ("specdraft", "medusa", "vllm"), vllm_method="medusa", chain_estimate=True,
                        export_keys=("num_heads", "num_layers"),
                        summary="K independent ResBlock heads on `h_t`, weighted CE; static trees")

    def __init__(self, num_heads: int, num_layers: int, base: BaseView, share_lm_head: bool = False,
                 dropout: float = 0.0, d2t: torch.Tensor | None = None):
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size = base.hidden_size, base.vocab_size
        self.share_lm_head = share_lm_head
        d = base.hidden_size
        rows = self._init_vocab(base, d2t)  # N draft tokens (or V): LM-head rows
        heads = []
        for _ in range(num_heads):
            layers = stack_resblocks(num_layers, d, dropout)
            if not share_lm_head:
                lm_head = nn.Linear(d, rows, bias=False)
                with torch.no_grad():
                    lm_head.weight.copy_(self.base_rows())  # W[d2t] (or W): a fresh head predicts what the base does
                layers.append(lm_head)
            heads.append(nn.Sequential(*layers))
        self.heads = nn.ModuleList(heads)

    @property
    def shared_lm_head(self) -> torch.Tensor | None:
        """The frozen base rows every head uses when shared ([N or V, d]; never exported)."""
        return self.base_rows() if self.share_lm_head else None

    @classmethod
    def from_config(cls, draft_cfg, base: BaseView) -> MedusaDraft:
        return cls(draft_cfg.num_heads, draft_cfg.num_layers, base, draft_cfg.share_lm_head, draft_cfg.dropout)

    @classmethod
    def from_export_config(cls, cfg: dict, base: BaseView) -> MedusaDraft:
        return cls(cfg["num_heads"], cfg["num_layers"], base, cfg.get("share_lm_head", False),
                   d2t=placeholder_map(cfg, base))

    def export_config(self) -> dict:
        return {"family": self.family, "num_heads": self.num_heads, "num_layers": self.num_layers,
                "share_lm_head": self.share_lm_head, "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size}

    def head_trunk(self, k: int, h: torch.Tensor) -> torch.Tensor:
        """ResBlocks of head k (1-based): [n, d] -> [n, d], the LM head's input."""
        head = self.heads[k - 1]
        blocks = head if self.share_lm_head else head[:-1]
        return blocks(h)

    def head_weight(self, k: int) -> torch.Tensor:
        """LM head weight [N or V, d] of head k (1-based)."""
        return self.shared_lm_head if self.share_lm_head else self.heads[k - 1][-1].weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Inference: hidden [..., d] -> logits [K, ..., N or V] over draft ids (head k at index k-1)."""
        ks = range(1, self.num_heads + 1)
        if self.share_lm_head:
            # One [K*n, d] @ [d, V] matmul: the shared 49152 x d matrix is read once per step, not K times
            # (decoding on a CPU is memory-bound, so this is most of the drafting cost).
            trunks = torch.stack([self.head_trunk(k, hidden) for k in ks])  # [K, ..., d]
            return trunks @ self.shared_lm_head.T
        return torch.stack([self.head_trunk(k, hidden) @ self.head_weight(k).T for k in ks])

    def loss(self, batch: DraftBatch, base: BaseView, loss_cfg) -> DraftLossOutput:
        """Weighted CE over heads on a batch of base hidden states.

        Only positions with a valid target for head k go through its trunk and LM head (ResBlocks act
        per position, so this is exact and skips user turns and padding).
        """
        weights = head_weights(self.num_heads, loss_cfg.lambda0, loss_cfg.decay)
        ce = fused_linear_cross_entropy if loss_cfg.chunked else linear_cross_entropy_reference
        alpha = loss_cfg.teacher_weight
        hidden = batch.hidden
        total = hidden.new_zeros((), dtype=torch.float32)
        per_depth = []
        for k in range(1, self.num_heads + 1):
            labels = offset_labels(batch.input_ids, batch.loss_mask, 1 + k)  # [B, T]: x_{t+1+k} or -100
            sel = labels != -100
            # Draft ids; out-of-map targets -> -100 (no loss) and counted as misses (oov).
            draft_labels, oov = self.draft_labels(labels[sel])
            z = self.head_trunk(k, hidden[sel])  # [n, d]
            teacher = {}
            if alpha > 0:
                # The base's distribution at t+k predicts x_{t+1+k}: its hidden state at t+k, frozen lm_head.
                # A valid label at t implies t+1+k < T, so t+k is always in range. [n, d], rows as hidden[sel].
                rows, cols = sel.nonzero(as_tuple=True)
                # Teacher rows W[d2t]: the base distribution restricted to the map and renormalised.
                teacher = {"teacher_hidden": hidden[rows, cols + k], "teacher_weight": self.base_rows(),
                           "soft_weight": alpha}
            loss_sum, stats = ce(z, self.head_weight(k), draft_labels, chunk_size=loss_cfg.chunk_size, **teacher)
            total = add_depth_loss(total, weights[k - 1], loss_sum, stats, per_depth, oov)
        return DraftLossOutput(total, per_depth)
