"""CTC drafter (the CTC drafter paper; docs/families/ctc.md): an attention draft module over the
base hidden states, M frames over V+1 classes (class V = blank), trained with CTC on distilled labels.

    z_t      = PrefixAttention(h_1..h_t)              one decoder layer of the base's architecture, causal
                                                      (models/prefix_attention.py; z_t == h_t at init)
    f_{t,m}  = ResBlocks_m(z_t), m = 1..M             distinct blocks per frame (draft.num_layers each)
    logits   = f_{t,m} @ W^T, W [V+1, d]              one projection shared by the frames

Why this frame read-out: the paper's module is a transformer layer followed by per-position LM-head
projections (Medusa-style heads on the layer's output). Per-frame ResBlocks with zero-initialised W
keep that shape at Medusa's cost (M x (d^2 + d) parameters), and a fresh draft starts from what the base
itself would predict from z_t; the per-frame biases already make the frames differ, and the CTC loss
(frame 1 must open the label, the last frame must close it) separates them further. A single Linear
d -> M*d would cost M*d^2 and start from noise.

Projection: W rows 0..V-1 are copied from the base lm_head and row V (the blank, a dedicated class,
never a real token) starts at zero, i.e. blank logit 0: the blank starts improbable and is learnt. One
W for all frames (the frames only differ in their input), trainable by default; with share_lm_head the
rows 0..V-1 ARE the frozen base lm_head (a non-persistent buffer, never exported) and only the blank
row [1, d] is trained, much cheaper in optimizer state.

Labels (distilled, paper eq. 3-5): at start t, y_j = argmax lm_head(h_{t+j}) for j = 1..N (N =
draft.num_heads), the base's greedy predictions of x_{t+2}..x_{t+1+N} on the same text. A start is valid
only if every x_{t+1+j} (j = 1..N) is a supervised target of the one offset rule
(data/targets.offset_labels), so a label run never crosses a user turn, a pad or the end.

Draft vocabulary (draft.vocab_size = N > 0, models/vocab_map.py): the projection has N+1 classes (the N
map tokens as draft ids 0..N-1, then the blank N), its real rows W[d2t]. The distilled labels are the
base's greedy tokens over its full vocabulary; each label is mapped to draft ids and cut before its first
out-of-map token (losses/ctc.py `max_lengths`); a start whose first label is outside the map carries no
loss. Those depths are misses: DepthStats.oov of depth j counts the starts whose y_1..y_j leaves the map.
The map is built from the data targets, not from these greedy labels (data/draft_vocab.py says why).

Loss: losses/ctc.py (chunked fused Linear -> CTC, clamped infeasible labels, optional token term),
averaged over the valid starts of the micro-batch. per_depth[j-1] reports depth j: the frame-j CE as
its loss, greedy-collapse prefix accuracy as top1, top-5-reachable prefix as top5 (see losses/ctc.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from data.targets import IGNORE_INDEX, offset_labels
from losses.ctc import fused_linear_ctc, linear_ctc_reference
from models.components import stack_resblocks
from models.draft import BaseView, DepthStats, DraftBatch, DraftLossOutput, DraftModel
from models.family import FamilyFacts
from models.prefix_attention import PrefixAttention
from models.vocab_map import DraftVocabMixin, placeholder_map

# ---------------------------------------------------------------------------------------------------
# Distilled labels
# ---------------------------------------------------------------------------------------------------


def valid_starts(input_ids: torch.Tensor, loss_mask: torch.Tensor, label_length: int) -> torch.Tensor:
    """[B, T] bool: start t is valid iff x_{t+1+j} is a supervised target for every j = 1..N (the one
    offset rule: the window t+1 .. t+1+N stays in one assistant run and inside the sequence)."""
    valid = torch.ones_like(input_ids, dtype=torch.bool)
    for j in range(1, label_length + 1):
        valid &= offset_labels(input_ids, loss_mask, 1 + j) != IGNORE_INDEX
    return valid


def distilled_labels(hidden: torch.Tensor, lm_head_weight: torch.Tensor, input_ids: torch.Tensor,
                     loss_mask: torch.Tensor, label_length: int, chunk_size: int = 1024) -> torch.Tensor:
    """The base's greedy predictions as CTC labels.

    hidden [B, T, d] base h_t; lm_head_weight [V, d] frozen; input_ids, loss_mask [B, T].
    Returns labels [B, T, N] long: labels[b, t, j-1] = argmax(h[b, t+j] @ W^T) (the base's prediction of
    x_{t+1+j}) at valid starts, IGNORE_INDEX (-100) everywhere on invalid starts.

    The greedy token is computed only on supervised positions (a valid start's window is all supervised),
    `chunk_size` rows at a time: never more than [chunk_size, V] logits, in the base's own dtype.
    """
    b, t, _ = hidden.shape
    valid = valid_starts(input_ids, loss_mask, label_length)  # [B, T]
    greedy = torch.zeros(b, t, dtype=torch.long, device=hidden.device)
    rows = (loss_mask != 0).nonzero(as_tuple=True)  # supervised positions, ([R], [R])
    with torch.no_grad():
        h = hidden.detach()[rows]  # [R, d]
        picks = [(h[i:i + chunk_size].to(lm_head_weight.dtype) @ lm_head_weight.T).argmax(-1)
                 for i in range(0, h.shape[0], chunk_size)]
        if picks:
            greedy[rows] = torch.cat(picks)
    labels = torch.full((b, t, label_length), IGNORE_INDEX, dtype=torch.long, device=hidden.device)
    for j in range(1, min(label_length, t - 1) + 1):
        # labels[:, s, j-1] = greedy[:, s + j]; positions past the end stay -100 (invalid anyway).
        labels[:, : t - j, j - 1] = greedy[:, j:]
    return labels.masked_fill(~valid[:, :, None], IGNORE_INDEX)


def distilled_labels_reference(hidden: torch.Tensor, lm_head_weight: torch.Tensor, input_ids: torch.Tensor,
                               loss_mask: torch.Tensor, label_length: int) -> torch.Tensor:
    """Slow twin of `distilled_labels`: full [B, T, V] logits, Python loops over starts and depths, and
    validity written out from the mask (every position t+1 .. t+1+N supervised and < T)."""
    b, t, _ = hidden.shape
    greedy = (hidden.to(lm_head_weight.dtype) @ lm_head_weight.T).argmax(-1)  # [B, T]
    labels = torch.full((b, t, label_length), IGNORE_INDEX, dtype=torch.long)
    for i in range(b):
        for s in range(t):
            window = range(s + 1, s + 2 + label_length)
            if all(p < t and bool(loss_mask[i, p] != 0) for p in window):
                labels[i, s] = greedy[i, s + 1: s + 1 + label_length]
    return labels.to(hidden.device)


# ---------------------------------------------------------------------------------------------------
# The draft
# ---------------------------------------------------------------------------------------------------


@dataclass
class CTCOptions:
    """The CTC drafter's training options (draft.ctc.*)."""

    num_frames: int = 6  # M frames, each over V+1 classes (the extra one is the blank); draft.num_heads N <= M


@dataclass
class CTCLossOptions:
    """The CTC drafter's loss options (loss.ctc.*)."""

    token_weight: float = 0.0  # weight of an extra token-level CE term next to the CTC loss


class CTCDraft(DraftVocabMixin, DraftModel):
    facts = FamilyFacts("ctc", "CTC drafter", ("specdraft",),
                        export_keys=("num_frames", "num_heads", "num_layers"),
                        draft_options=CTCOptions, loss_options=CTCLossOptions,
                        flat_keys=("draft.num_frames", "loss.token_weight"),
                        summary="an attention module, M frames over V+1 classes, CTC loss on the base's own greedy "
                        "labels, collapsed candidate trees",
                        also_files=("models/prefix_attention.py",))
    sequence_parallel = True  # train.sequence_parallel: the attention module over the Ulysses all-to-all

    @classmethod
    def check_config(cls, cfg, fail) -> None:
        d, num_frames = cfg.draft, cls.options(cfg.draft).num_frames
        if num_frames < 1 or d.num_heads > num_frames:
            fail("draft.ctc.num_frames", num_frames, f"the CTC drafter needs num_frames M >= 1 and the label length "
                 f"draft.num_heads={d.num_heads} <= M (the paper uses N=3-4 with M=6)")
        token_weight = cls.options(cfg.loss).token_weight
        if token_weight < 0:
            fail("loss.ctc.token_weight", token_weight, "use 0 (CTC only) or a positive weight, e.g. 0.1")
    prefix_accuracy = True  # per-depth top1 = prefix accuracy of the collapsed greedy draft

    def __init__(self, num_frames: int, label_length: int, num_layers: int, base: BaseView,
                 share_lm_head: bool = False, dropout: float = 0.0, d2t: torch.Tensor | None = None):
        super().__init__()
        if not 1 <= label_length <= num_frames:
            raise ValueError(f"CTC needs 1 <= N <= M: label length draft.num_heads={label_length}, "
                             f"frames draft.ctc.num_frames={num_frames}; raise num_frames or lower num_heads")
        if base.model is None:
            raise ValueError("the CTC drafter builds its attention module from the base model's last decoder "
                             "layer; pass BaseView.from_model(model) (BaseView.model is None)")
        self.num_frames, self.num_heads, self.num_layers = num_frames, label_length, num_layers
        self.hidden_size, self.vocab_size = base.hidden_size, base.vocab_size
        self.share_lm_head = share_lm_head
        v = self._init_vocab(base, d2t)  # real classes: N draft tokens (or V); buffers d2t / t2d / vocab_rows
        self.blank = v  # the extra last class (V, or N with a draft vocabulary)
        d = base.hidden_size
        self.attn = PrefixAttention(base.model)
        # M distinct frame trunks (never `[block] * M`: that would be one block M times).
        self.frames = nn.ModuleList([nn.Sequential(*stack_resblocks(num_layers, d, dropout))
                                     for _ in range(num_frames)])
        lm_head = self.base_rows().detach()  # [v, d]: W[d2t] or W
        if share_lm_head:
            # The frozen rows are vocab_rows (a non-persistent buffer, never exported): see shared_lm_head.
            self.blank_row = nn.Parameter(torch.zeros(1, d, dtype=lm_head.dtype, device=lm_head.device))
            self.proj = None
        else:
            self.proj = nn.Linear(d, v + 1, bias=False)
            with torch.no_grad():
                self.proj.weight[:v].copy_(lm_head)
                self.proj.weight[v].zero_()

    @classmethod
    def from_config(cls, draft_cfg, base: BaseView) -> CTCDraft:
        return cls(cls.options(draft_cfg).num_frames, draft_cfg.num_heads, draft_cfg.num_layers, base,
                   draft_cfg.share_lm_head, draft_cfg.dropout)

    @classmethod
    def from_export_config(cls, cfg: dict, base: BaseView) -> CTCDraft:
        return cls(cfg["num_frames"], cfg["num_heads"], cfg["num_layers"], base, cfg.get("share_lm_head", False),
                   d2t=placeholder_map(cfg, base))

    def export_config(self) -> dict:
        return {"family": self.family, "num_frames": self.num_frames, "num_heads": self.num_heads,
                "num_layers": self.num_layers, "share_lm_head": self.share_lm_head, "blank": self.blank,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size}

    @property
    def shared_lm_head(self) -> torch.Tensor | None:
        """The frozen real-token rows (W[d2t], or W) of a shared projection; never exported."""
        return self.base_rows() if self.share_lm_head else None

    def projection_blocks(self) -> list[torch.Tensor]:
        """Row blocks of the [V+1, d] projection (rows 0..V-1 real tokens, row V the blank): the own
        trainable weight, or [frozen base lm_head, trainable blank row] (no [V+1, d] copy, and the loss
        skips the frozen block's weight gradient)."""
        if self.proj is not None:
            return [self.proj.weight]
        return [self.shared_lm_head.to(self.blank_row.dtype), self.blank_row]

    def frame_features(self, z: torch.Tensor) -> torch.Tensor:
        """z [n, d] -> frame features [n, M, d]."""
        return torch.stack([trunk(z) for trunk in self.frames], dim=1)

    def frame_logits(self, z: torch.Tensor) -> torch.Tensor:
        """Inference: z [n, d] -> logits [n, M, V+1] (small n only: this materializes every class)."""
        f = self.frame_features(z)
        if self.proj is not None:
            return f @ self.proj.weight.T
        # Shared head: two matmuls instead of concatenating a [V+1, d] copy of the base lm_head per step.
        return torch.cat([f @ self.shared_lm_head.T.to(f.dtype), f @ self.blank_row.T], dim=-1)

    def loss(self, batch: DraftBatch, base: BaseView, loss_cfg) -> DraftLossOutput:
        """CTC over the M frames at every valid start, mean over starts (+ optional token term).

        Memory: the attention layer runs over [B, T, d]; only valid starts go through the frame trunks
        ([n, M, d]); the [n, M, V+1] logits exist one chunk of loss_cfg.chunk_size rows at a time
        (fused path) or all at once (loss.chunked=false, the reference: tiny runs only).
        """
        shard = batch.shard
        if shard is not None:  # sequence parallelism: this rank's starts (hidden: rows [start, stop + halo))
            labels, z = self._shard_labels_and_context(batch, base, loss_cfg)
        else:
            labels = distilled_labels(batch.hidden, base.lm_head_weight, batch.input_ids, batch.loss_mask,
                                      self.num_heads, loss_cfg.chunk_size)  # [B, T, N] base ids (full-vocab greedy)
            z = None
        valid = labels[:, :, 0] != IGNORE_INDEX  # [B, T]
        if z is None:
            z = self.attn(batch.hidden)  # [B, T, d]: attention over the whole context, user turns included
        starts = labels[valid]  # [n, N] base ids
        max_lengths, oov = None, [0] * self.num_heads
        if self.t2d is not None:
            starts, max_lengths, oov = self._map_labels(starts)
            rows = valid.nonzero(as_tuple=True)
            valid = torch.zeros_like(valid)
            keep = max_lengths > 0  # first label inside the map: the start carries a loss
            valid[rows[0][keep], rows[1][keep]] = True
            starts, max_lengths = starts[keep], max_lengths[keep]
        frames = self.frame_features(z[valid])  # [n, M, d]
        ctc = fused_linear_ctc if loss_cfg.chunked else linear_ctc_reference
        loss_sum, stats = ctc(frames, self.projection_blocks(), starts, blank=self.blank,
                              chunk_size=loss_cfg.chunk_size, token_weight=self.options(loss_cfg).token_weight,
                              max_lengths=max_lengths)
        count = int(stats.count)
        # No valid start (all-user micro-batch): 0 * loss keeps every parameter in the graph for DeepSpeed.
        if shard is not None:  # the mean over the whole sequence's starts
            group = int(shard.total(torch.as_tensor(stats.count).reshape(1)).item())
            total = loss_sum / group if group else 0.0 * loss_sum
        else:
            total = loss_sum / count if count else 0.0 * loss_sum
        token_ce, top1, topk = stats.token_ce.tolist(), stats.top1.tolist(), stats.topk.tolist()
        dropped = oov[0]  # starts without any in-map label: misses at every depth
        per_depth = [DepthStats(token_ce[j], count + dropped, int(top1[j]), int(topk[j]), oov[j])
                     for j in range(self.num_heads)]
        return DraftLossOutput(total, per_depth)

    def _shard_labels_and_context(self, batch: DraftBatch, base: BaseView, loss_cfg
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence parallelism: (labels [B, n, N], z [B, n, d]) of this rank's starts. A start's labels and validity
        read h, ids and the mask up to N + 1 positions past it: the shard's halo rows (its ids and mask from the whole
        ones, padded); z from the attention module on this rank's rows against every earlier row."""
        shard = batch.shard
        n = shard.stop - shard.start
        if shard.halo < self.num_heads + 1:
            raise ValueError(f"CTC's labels of a start read N + 1 = {self.num_heads + 1} positions past it: the "
                             f"shard needs that halo, got {shard.halo}")
        end = shard.stop + shard.halo
        ids, mask = (F.pad(t, (0, max(0, end - t.shape[1])))[:, shard.start:end]
                     for t in (batch.input_ids, batch.loss_mask))
        labels = distilled_labels(batch.hidden, base.lm_head_weight, ids, mask, self.num_heads,
                                  loss_cfg.chunk_size)[:, :n]
        return labels, self.attn(batch.hidden[:, :n], shard)

    def _map_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Base-id labels [n, N] -> (draft-id labels [n, N] (0 past the cut, never read), max_lengths [n] =
        leading in-map labels, oov [N]: starts whose labels y_1..y_j are not all in the map)."""
        mapped = self.t2d[labels]  # [n, N], -1 outside the map
        inside = (mapped >= 0).long().cumprod(dim=1)  # [n, N]: 1 while every label so far is in the map
        max_lengths = inside.sum(dim=1)  # [n]
        oov = (inside == 0).sum(dim=0).tolist()  # [N]
        return mapped.clamp(min=0) * inside, max_lengths, [int(x) for x in oov]
