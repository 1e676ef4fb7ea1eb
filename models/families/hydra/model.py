"""Hydra and Hydra++: sequentially dependent draft heads (the Hydra paper, docs/families/hydra.md).

Head k (k = 1..K, stored at index k-1) predicts x_{t+1+k} from

    input_k = [z_t; e(x_{t+1}); ...; e(x_{t+k})]          [(k+1)·d]

where e is the FROZEN base input embedding and x_{t+1} is the base's own next token (the tree root at
inference). Training feeds the data tokens (teacher forcing); at inference each tree node feeds its own
path, so unlike Medusa a node's token depends on its ancestors, not only on (depth, rank).

    block 1   y = R x + SiLU(W x + b)      (k+1)d -> d; R is the linear residual (the authors' code:
                                           `res_connection(x) + act(linear(x))`), W starts at zero and
                                           R at [I 0 ... 0], so a fresh head reads z_t like a fresh
                                           Medusa head reads h_t
    blocks 2..L  ResBlock(d)               y = x + SiLU(W x + b), distinct modules (models/components.py)
    LM head   Linear(d -> V)               own copy of the base lm_head, or the frozen shared one

`num_layers` L counts the MLP blocks per head (Hydra 1, Hydra++ 4). Dropout (draft.dropout, Hydra++
0.2) drops the input of every block and of the LM head, as in the authors' recipe: the big linear
residual R would go unregularised by a dropout inside the SiLU branch alone.

z_t = h_t (the base's last hidden state), or with `prefix_layer` (Hydra++) the output of one extra
decoder layer run causally over h_1..h_t (models/prefix_attention.py).

Loss per head: hard CE to x_{t+1+k}, or with loss.teacher_weight = α > 0 mixed with the soft CE to the
base's distribution at t+k (its own prediction of x_{t+1+k} on the same text; Hydra++ uses α = 1),
weighted λ_k = λ0·decay^k over heads; the fused chunked CE by default, the plain one as its twin.

Draft vocabulary (draft.vocab_size = N > 0, models/vocab_map.py): LM heads over N rows W[d2t], teacher
restricted to the map, out-of-map targets ignored by the loss and scored as misses (oov). Path
embeddings stay base ids (the tree holds base ids): head_logits returns draft ids' logits, drafting maps
the picks back with `to_base` before they become a child's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from data.targets import offset_labels
from losses.fused_linear_ce import fused_linear_cross_entropy, linear_cross_entropy_reference
from losses.weighted_ce import head_weights
from models.components import stack_resblocks
from models.draft import BaseView, DraftBatch, DraftLossOutput, DraftModel, add_depth_loss
from models.family import FamilyFacts
from models.prefix_attention import PrefixAttention
from models.vocab_map import DraftVocabMixin, placeholder_map


class HydraInputBlock(nn.Module):
    """y = R x + SiLU(W x + b): [n, (k+1)d] -> [n, d]. R (no bias) carries the residual across the width
    change; at init R = [I 0 ... 0] (passes z_t through) and W = 0, so y = z_t + SiLU(b)."""

    def __init__(self, in_features: int, hidden_size: int):
        super().__init__()
        self.res = nn.Linear(in_features, hidden_size, bias=False)
        self.linear = nn.Linear(in_features, hidden_size)
        with torch.no_grad():
            self.res.weight.zero_()
            self.res.weight[:, :hidden_size].copy_(torch.eye(hidden_size))
            self.linear.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res(x) + F.silu(self.linear(x))


class HydraHead(nn.Module):
    """One head: input block, `num_layers - 1` ResBlocks, optional own LM head (None = shared base head)."""

    def __init__(self, depth: int, num_layers: int, base: BaseView, own_lm_head: bool, dropout: float,
                 init_rows: torch.Tensor | None = None):
        """init_rows: [N or V, d] the base LM-head rows of the draft vocabulary (own heads copy them)."""
        super().__init__()
        d = base.hidden_size
        init_rows = base.lm_head_weight if init_rows is None else init_rows
        v = init_rows.shape[0]
        self.inp = HydraInputBlock((depth + 1) * d, d)
        self.blocks = nn.ModuleList(stack_resblocks(num_layers - 1, d))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()  # no weights: one module is fine
        self.lm_head = None
        if own_lm_head:
            self.lm_head = nn.Linear(d, v, bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(init_rows)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        """[n, (k+1)d] -> [n, d], the LM head's input (dropout on every block's input and on the output)."""
        x = self.inp(self.dropout(x))
        for block in self.blocks:
            x = block(self.dropout(x))
        return self.dropout(x)


@dataclass
class HydraOptions:
    """Hydra's training options (draft.hydra.*)."""

    prefix_layer: bool = False  # Hydra++: a trainable decoder layer over the base hidden states feeds all heads


class HydraDraft(DraftVocabMixin, DraftModel):
    facts = FamilyFacts("hydra", "Hydra", ("specdraft",), chain_estimate=True,
                        export_keys=("num_heads", "num_layers"), draft_options=HydraOptions,
                        flat_keys=("draft.prefix_layer",),
                        summary="sequentially dependent heads: head k reads `[h_t; e(x_{t+1}); ...; e(x_{t+k})]`; "
                        "Hydra++ (`configs/hydra_pp.yaml`): 4-block heads, a prefix-attention layer, teacher loss",
                        also_files=("models/prefix_attention.py",))
    sequence_parallel = True  # train.sequence_parallel: the prefix layer's attention over the Ulysses all-to-all

    @classmethod
    def run_title(cls, draft_cfg) -> str:
        return "Hydra++" if cls.options(draft_cfg).prefix_layer else "Hydra"

    @classmethod
    def check_config(cls, cfg, fail) -> None:
        if cfg.draft.num_layers < 1:
            fail("draft.num_layers", cfg.draft.num_layers, "a Hydra head needs its first block (it maps the (k+1)·d "
                 "input to d); use 1 (Hydra) or 4 (Hydra++)")

    def __init__(self, num_heads: int, num_layers: int, base: BaseView, share_lm_head: bool = False,
                 dropout: float = 0.0, prefix_layer: bool = False, d2t: torch.Tensor | None = None):
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads={num_heads}: a Hydra draft needs at least one head (default 4)")
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers}: a Hydra head needs its first block, which maps the "
                             "(k+1)·d input to d; use draft.num_layers=1 (Hydra) or 4 (Hydra++)")
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size = base.hidden_size, base.vocab_size
        self.share_lm_head, self.has_prefix_layer = share_lm_head, prefix_layer
        self._init_vocab(base, d2t)  # d2t / t2d / vocab_rows = W[d2t] buffers
        self.heads = nn.ModuleList(HydraHead(k, num_layers, base, not share_lm_head, dropout, self.base_rows())
                                   for k in range(1, num_heads + 1))
        self.prefix = None
        if prefix_layer:
            if base.model is None:
                raise ValueError("draft.hydra.prefix_layer=true builds a decoder layer of the base's architecture, "
                                 "but this BaseView has no `.model`; build it with BaseView.from_model(base_model)")
            self.prefix = PrefixAttention(base.model)
        # Frozen base tensors, non-persistent: never trained, never exported. e = input embedding [V, d].
        self.register_buffer("embed", base.embed_weight, persistent=False)

    @property
    def shared_lm_head(self) -> torch.Tensor | None:
        """The frozen base rows (W[d2t], or W) every head uses when shared; never exported."""
        return self.base_rows() if self.share_lm_head else None

    @classmethod
    def from_config(cls, draft_cfg, base: BaseView) -> HydraDraft:
        return cls(draft_cfg.num_heads, draft_cfg.num_layers, base, draft_cfg.share_lm_head, draft_cfg.dropout,
                   cls.options(draft_cfg).prefix_layer)

    @classmethod
    def from_export_config(cls, cfg: dict, base: BaseView) -> HydraDraft:
        if (cfg.get("hidden_size"), cfg.get("vocab_size")) != (base.hidden_size, base.vocab_size):
            raise ValueError(f"the Hydra export has d={cfg.get('hidden_size')}, V={cfg.get('vocab_size')} but the "
                             f"base has d={base.hidden_size}, V={base.vocab_size}; load the base it was trained on")
        return cls(cfg["num_heads"], cfg["num_layers"], base, cfg.get("share_lm_head", False),
                   prefix_layer=cfg.get("prefix_layer", False), d2t=placeholder_map(cfg, base))

    def export_config(self) -> dict:
        return {"family": self.family, "num_heads": self.num_heads, "num_layers": self.num_layers,
                "share_lm_head": self.share_lm_head, "prefix_layer": self.has_prefix_layer,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size}

    # -- pieces shared by training and inference -------------------------------------------------------

    def context(self, hidden: torch.Tensor, shard=None) -> torch.Tensor:
        """z for every position: hidden [B, T, d] -> [B, T, d] (prefix layer, causal; or h itself). shard (sequence
        parallelism): hidden holds this rank's rows, which the prefix layer places and attends from."""
        if shard is not None:
            return self.prefix(hidden, shard) if self.prefix is not None else hidden
        return self.prefix(hidden) if self.prefix is not None else hidden

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Frozen base input embedding: ids [...] long -> [..., d]."""
        return F.embedding(ids, self.embed)

    def head_input(self, z: torch.Tensor, path_emb: torch.Tensor) -> torch.Tensor:
        """z [n, d], path_emb [n, k, d] (e(x_{t+1}) .. e(x_{t+k})) -> [n, (k+1)d]."""
        return torch.cat([z, path_emb.to(z.dtype).flatten(1)], dim=-1)

    def head_trunk(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """Blocks of head k (1-based): [n, (k+1)d] -> [n, d], the LM head's input."""
        return self.heads[k - 1].trunk(x)

    def head_weight(self, k: int) -> torch.Tensor:
        """LM head weight [N or V, d] of head k (1-based)."""
        return self.shared_lm_head if self.share_lm_head else self.heads[k - 1].lm_head.weight

    def head_logits(self, k: int, z: torch.Tensor, path_emb: torch.Tensor, matmul=None) -> torch.Tensor:
        """Inference: head k on n nodes at once. z [n, d], path_emb [n, k, d] -> logits [n, N or V] over draft
        ids (map picks to base ids with `to_base`). matmul(x [n, d], w_t [d, N or V]) -> [n, N or V] computes
        the LM-head product (default x @ w_t; a decoder passes its machine's fastest layout of the same product)."""
        if path_emb.shape[1] != k:
            raise ValueError(f"head {k} reads the root and its k-1 ancestors ({k} embeddings), got path_emb "
                             f"{tuple(path_emb.shape)}; pass [n, {k}, d]")
        x = self.head_trunk(k, self.head_input(z, path_emb))
        w_t = self.head_weight(k).T  # [d, N or V], a transposed view of the [N or V, d] rows
        return x @ w_t if matmul is None else matmul(x, w_t)

    # -- training ---------------------------------------------------------------------------------------

    def loss(self, batch: DraftBatch, base: BaseView, loss_cfg) -> DraftLossOutput:
        """Weighted per-head CE on teacher-forced paths.

        Only positions t with a valid target x_{t+1+k} go through head k; a valid target implies the whole
        window t+1 .. t+1+k lies inside the sequence and one assistant run, so the path tokens
        input_ids[t+1 .. t+k] are always in range.
        """
        weights = head_weights(self.num_heads, loss_cfg.lambda0, loss_cfg.decay)
        ce = fused_linear_cross_entropy if loss_cfg.chunked else linear_cross_entropy_reference
        alpha = loss_cfg.teacher_weight
        hidden, ids, shard = batch.hidden, batch.input_ids, batch.shard
        if shard is None:
            z_all = self.context(hidden)  # [B, T, d]: one causal pass over the whole batch, shared by all heads
            start = 0
        else:  # sequence parallelism: this rank's rows; hidden[:, c] is h at shard.start + c (a halo past them)
            if shard.halo < self.num_heads:
                raise ValueError(f"Hydra's teacher of head k reads h at t+k: the shard needs a halo of "
                                 f"{self.num_heads} rows (draft.num_heads), got {shard.halo}")
            z_all = self.context(hidden[:, :shard.stop - shard.start], shard)  # [B, n, d]
            start = shard.start
        total = hidden.new_zeros((), dtype=torch.float32)
        per_depth = []
        for k in range(1, self.num_heads + 1):
            labels = offset_labels(ids, batch.loss_mask, 1 + k)  # [B, T]: x_{t+1+k} or -100
            if shard is not None:
                labels = labels[:, shard.start:shard.stop]
            rows, cols = (labels != -100).nonzero(as_tuple=True)  # [n] each, row-major (= labels[sel] order)
            steps = torch.arange(1, k + 1, device=ids.device)
            path = ids[rows[:, None], start + cols[:, None] + steps]  # [n, k]: x_{t+1} .. x_{t+k}
            x = self.head_input(z_all[rows, cols], self.embed_tokens(path))  # [n, (k+1)d]
            trunk = self.head_trunk(k, x)  # [n, d]
            draft_labels, oov = self.draft_labels(labels[rows, cols])  # draft ids; outside the map -> -100
            teacher = {}
            if alpha > 0:
                # The base at t+k predicts x_{t+1+k}: its hidden state there through the frozen lm_head rows of
                # the draft vocabulary (W[d2t]: restricted and renormalised). [n, d]
                teacher = {"teacher_hidden": hidden[rows, cols + k], "teacher_weight": self.base_rows(),
                           "soft_weight": alpha}
            loss_sum, stats = ce(trunk, self.head_weight(k), draft_labels, chunk_size=loss_cfg.chunk_size,
                                 **teacher)
            if shard is None:
                total = add_depth_loss(total, weights[k - 1], loss_sum, stats, per_depth, oov)
            else:  # every rank divides by the whole sequence's count of this depth
                total = add_depth_loss(total, weights[k - 1], loss_sum, stats, per_depth, oov,
                                       group_count=shard.total(torch.as_tensor(stats.count).reshape(1)).item())
        return DraftLossOutput(total, per_depth)
