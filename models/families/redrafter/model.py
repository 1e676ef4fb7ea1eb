"""ReDrafter: one recurrent draft head shared by every depth (docs/families/redrafter.md, the ReDrafter paper).

    s_0 = 0
    s_i = SiLU(W·e(x_{t+i}) + U·s_{i-1} + b)        (rnn=False ablation: s_i = s_{i-1} + e(x_{t+i}))
    logits_i = LMHead(ResBlocks([h_t; s_i]))        predicts x_{t+1+i}, depth i = 1..K

e = the frozen base input embedding, h_t = the base's last hidden state (post final norm). At inference
x_{t+1} is the root (the base's own token), so depth i's RNN input is the root for i = 1 and the beam's
own previous draft after that; in training the data tokens are fed (teacher forcing).

Layout (Apple's reference drafter, which TensorRT-LLM's converter reads; see docs/families/redrafter.md):
- `rnn_w` Linear(d, d, no bias) = W and `rnn_u` Linear(d, d, bias) = U and b (absent with rnn=False);
- ResBlocks of width exit_dim = 2d over [h_t; s_i] (`layers.{i}.linear`), then `lm_head` Linear(2d, V,
  no bias). The paper does not say how the head is initialised; the reference initialises it randomly.
  We copy the base lm_head into the h_t half and zero the s half, so a fresh draft predicts the base's
  own next-token distribution (a far better start than uniform, like Medusa's heads here);
- share_lm_head: the frozen base lm_head [V, d] needs a d-wide input, so `input_proj` Linear(2d, d)
  (initialised to pick h_t) comes first and the ResBlocks run at width d: exactly the reference's
  `exit_dim != 2d` layout, so it exports to TensorRT-LLM too.
One parameter set serves every depth: the number of parameters does not grow with K.

Draft vocabulary (draft.vocab_size = N > 0, models/vocab_map.py): the LM head has N rows (own head: the
h_t half initialised from W[d2t]; shared: the frozen rows W[d2t]); logits are over draft ids, beam search
maps its picks to base ids (the RNN embeds base ids); out-of-map targets are ignored and scored as misses.
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
from models.vocab_map import DraftVocabMixin, placeholder_map

# Beam search defaults stored in the export (eval's extra.beam_width / extra.beam_length override them).
# CPU-sized: 4 beams of 4 drafts = at most 17 tree nodes before prefix sharing (fewer after), about
# the 16-token tree a bf16 SmolLM2 verifies for the price of one token on this project's CPU
# (docs/lab/benchmarks.md), and 4 sequential drafter steps of one [4, 2d] x [2d, V] matmul each.
DEFAULT_BEAM_WIDTH = 4
DEFAULT_BEAM_LENGTH = 5  # counts the root: 4 draft tokens per beam


@dataclass
class ReDrafterOptions:
    """ReDrafter's training options (draft.redrafter.*)."""

    rnn: bool = True  # False = the no-RNN ablation s_i = s_{i-1} + e(x_{t+i})


class ReDrafterDraft(DraftVocabMixin, DraftModel):
    # ReDrafter's only context is h_t (no prefix-attention layer: draft.hydra.prefix_layer on a ReDrafter run fails
    # at load as another family's option); share_lm_head there means input_proj(2d->d) + the frozen base head.
    facts = FamilyFacts("redrafter", "ReDrafter", ("specdraft", "redrafter-trtllm"), chain_estimate=True,
                        export_keys=("num_heads", "num_layers"), draft_options=ReDrafterOptions,
                        flat_keys=("draft.rnn",),
                        summary="one recurrent draft head (RNN + ResBlocks) shared by every depth, beam search, "
                        "dynamic tree attention",
                        also_files=("eval/engine/beam_search.py",))

    def __init__(self, num_heads: int, num_layers: int, base: BaseView, share_lm_head: bool = False,
                 dropout: float = 0.0, rnn: bool = True, beam_width: int = DEFAULT_BEAM_WIDTH,
                 beam_length: int = DEFAULT_BEAM_LENGTH, d2t: torch.Tensor | None = None):
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"ReDrafter needs num_heads >= 1 draft depths to train on, got {num_heads}")
        if beam_width < 1 or beam_length < 1:
            raise ValueError(f"beam_width={beam_width} and beam_length={beam_length} must be >= 1 "
                             "(beam_length counts the root token)")
        d, v = base.hidden_size, base.vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size = d, v
        self.share_lm_head, self.rnn = share_lm_head, rnn
        self.beam_width, self.beam_length = beam_width, beam_length
        self.exit_dim = d if share_lm_head else 2 * d
        v = self._init_vocab(base, d2t)  # LM-head rows: N draft tokens (or V); buffers d2t / t2d / vocab_rows
        if rnn:
            self.rnn_w = nn.Linear(d, d, bias=False)  # W (the paper's b lives in rnn_u, as in the reference)
            self.rnn_u = nn.Linear(d, d, bias=True)  # U and b
        if share_lm_head:
            self.input_proj = nn.Linear(2 * d, d)
            with torch.no_grad():  # [h; s] -> h: the frozen head then sees h_t, i.e. the base's prediction
                self.input_proj.weight.zero_()
                self.input_proj.weight[:, :d].copy_(torch.eye(d))
                self.input_proj.bias.zero_()
        self.layers = nn.ModuleList(stack_resblocks(num_layers, self.exit_dim, dropout))
        if not share_lm_head:
            self.lm_head = nn.Linear(self.exit_dim, v, bias=False)
            with torch.no_grad():
                self.lm_head.weight.zero_()
                self.lm_head.weight[:, :d].copy_(self.base_rows())
        # Frozen base tensors, never trained or exported (non-persistent buffers follow .to() for eval).
        self.register_buffer("embed", base.embed_weight, persistent=False)  # [V, d]

    @property
    def shared_lm_head(self) -> torch.Tensor | None:
        """The frozen base rows (W[d2t], or W) of the shared head; never exported."""
        return self.base_rows() if self.share_lm_head else None

    @classmethod
    def from_config(cls, draft_cfg, base: BaseView) -> ReDrafterDraft:
        return cls(draft_cfg.num_heads, draft_cfg.num_layers, base, draft_cfg.share_lm_head, draft_cfg.dropout,
                   cls.options(draft_cfg).rnn)

    @classmethod
    def from_export_config(cls, cfg: dict, base: BaseView) -> ReDrafterDraft:
        for key, have in (("hidden_size", base.hidden_size), ("vocab_size", base.vocab_size)):
            if key in cfg and cfg[key] != have:
                raise ValueError(f"this ReDrafter export has {key}={cfg[key]} but the base has {have}; load "
                                 "the base it was trained on")
        return cls(cfg["num_heads"], cfg["num_layers"], base, cfg.get("share_lm_head", False),
                   rnn=cfg.get("rnn", True), beam_width=cfg.get("beam_width", DEFAULT_BEAM_WIDTH),
                   beam_length=cfg.get("beam_length", DEFAULT_BEAM_LENGTH), d2t=placeholder_map(cfg, base))

    def export_config(self) -> dict:
        return {"family": self.family, "num_heads": self.num_heads, "num_layers": self.num_layers,
                "share_lm_head": self.share_lm_head, "rnn": self.rnn, "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, "exit_dim": self.exit_dim, "beam_width": self.beam_width,
                "beam_length": self.beam_length, "draft_vocab_size": self.draft_vocab_size}

    # -- building blocks (shared by training, the slow twin and beam search) --------------------------

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> e(ids) [..., d] in the draft's dtype (the base embedding is frozen)."""
        return F.embedding(ids, self.embed).to(self.param_dtype)

    @property
    def param_dtype(self) -> torch.dtype:
        # Always at least one parameter: lm_head, or input_proj with share_lm_head.
        return next(self.parameters()).dtype

    def rnn_step(self, prev: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """s_{i-1} [n, d], e(x_{t+i}) [n, d] -> s_i [n, d]. Pass zeros for s_0."""
        if self.rnn:
            return F.silu(self.rnn_w(emb) + self.rnn_u(prev))
        return prev + emb

    def trunk(self, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """h_t [n, d], s_i [n, d] -> the LM head's input [n, exit_dim]."""
        x = torch.cat([h.to(s.dtype), s], dim=-1)  # [n, 2d], context first as in the reference
        if self.share_lm_head:
            x = self.input_proj(x)  # [n, d]
        for block in self.layers:
            x = block(x)
        return x

    def head_weight(self) -> torch.Tensor:
        """LM head weight [N or V, exit_dim] (the frozen base rows when shared)."""
        return self.shared_lm_head if self.share_lm_head else self.lm_head.weight

    def logits(self, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """h_t [n, d], s_i [n, d] -> logits [n, N or V] over draft ids for x_{t+1+i}."""
        return self.trunk(h, s) @ self.head_weight().to(s.dtype).T

    def teacher_forced_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Slow twin of the training path: every position, every depth, all logits materialised.

        hidden [B, T, d], input_ids [B, T] -> logits [K, B, T, V]; [i-1, b, t] predicts x_{t+1+i} from
        h_t and the data tokens x_{t+1..t+i}. Positions whose inputs run past T read token 0 (their
        labels are -100 under offset_labels, so they never count). Tiny models only.
        """
        b, t = input_ids.shape
        padded = F.pad(input_ids, (0, self.num_heads))  # [B, T+K]
        s = hidden.new_zeros(b, t, self.hidden_size, dtype=self.param_dtype)
        out = []
        for i in range(1, self.num_heads + 1):
            s = self.rnn_step(s, self.embed_tokens(padded[:, i:i + t]))  # [B, T, d]
            out.append(self.logits(hidden.reshape(b * t, -1), s.reshape(b * t, -1)).reshape(b, t, -1))
        return torch.stack(out)

    # -- training -------------------------------------------------------------------------------------

    def loss(self, batch: DraftBatch, base: BaseView, loss_cfg) -> DraftLossOutput:
        """Σ_i w_i·CE_i over depths i = 1..K with teacher forcing (data tokens feed the RNN).

        Only positions with a valid depth-i label go through the RNN step i, the ResBlocks and the LM
        head. Validity shrinks with depth (offset_labels' window t+1..t+1+i grows), so the row set is
        filtered once per depth and the RNN state rides along: s_i at a row is computed from that
        row's s_{i-1}, and every input x_{t+i} is inside the sequence (t+1+i < T).
        """
        weights = head_weights(self.num_heads, loss_cfg.lambda0, loss_cfg.decay)
        ce = fused_linear_cross_entropy if loss_cfg.chunked else linear_cross_entropy_reference
        alpha = loss_cfg.teacher_weight
        hidden, ids = batch.hidden, batch.input_ids
        total = hidden.new_zeros((), dtype=torch.float32)
        per_depth = []
        rows, cols = torch.ones_like(ids, dtype=torch.bool).nonzero(as_tuple=True)  # [B*T] each
        s = None  # [n, d] RNN state of the current rows
        for i in range(1, self.num_heads + 1):
            labels = offset_labels(ids, batch.loss_mask, 1 + i)[rows, cols]  # [n_prev]: x_{t+1+i} or -100
            keep = labels != -100
            rows, cols, labels = rows[keep], cols[keep], labels[keep]  # [n]
            emb = self.embed_tokens(ids[rows, cols + i])  # [n, d] = e(x_{t+i})
            s = self.rnn_step(emb.new_zeros(emb.shape) if s is None else s[keep], emb)
            z = self.trunk(hidden[rows, cols], s)  # [n, exit_dim]
            draft_labels, oov = self.draft_labels(labels)  # draft ids; outside the map -> -100 (a miss)
            teacher = {}
            if alpha > 0:
                # The base at t+i predicts x_{t+1+i}: its hidden state there, frozen rows W[d2t]. [n, d]
                teacher = {"teacher_hidden": hidden[rows, cols + i], "teacher_weight": self.base_rows(),
                           "soft_weight": alpha}
            loss_sum, stats = ce(z, self.head_weight(), draft_labels, chunk_size=loss_cfg.chunk_size, **teacher)
            total = add_depth_loss(total, weights[i - 1], loss_sum, stats, per_depth, oov)
        return DraftLossOutput(total, per_depth)
