"""What every draft family shares: the view of the frozen base it may read, the batch it trains on,
and the per-depth statistics its loss reports. Single-device code: the training loop wraps it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from models.family import FamilyFacts


@dataclass
class BaseView:
    """Frozen tensors of the base a draft may read (never trained, never exported)."""

    lm_head_weight: torch.Tensor  # [V, d]
    embed_weight: torch.Tensor  # [V, d] input embeddings
    hidden_size: int
    vocab_size: int
    # The frozen base itself, for families that build a layer of the base's architecture (Hydra++ prefix
    # layer, CTC attention module: read model.config / copy a decoder layer's weights). Never register it
    # as a submodule of a draft (deep-copy what you need), or the base would be trained and exported.
    model: nn.Module | None = None
    # Draft vocabulary d2t [N] int64 base ids (models/vocab_map.py), or None for the full vocabulary. Set by the
    # training loop from draft.vocab_size; families size their LM heads from it and keep it as a buffer.
    draft_vocab: torch.Tensor | None = None

    @classmethod
    def from_model(cls, model) -> BaseView:
        head = model.get_output_embeddings().weight
        emb = model.get_input_embeddings().weight
        return cls(head.detach(), emb.detach(), head.shape[1], head.shape[0], model)


@dataclass
class SequenceShard:
    """Sequence parallelism (`train.sequence_parallel` = N > 1): this rank's part of every sequence of the batch.

    The N ranks of a group hold the same conversations; rank r drafts rows [start, stop) of each (stop - start
    the same on every rank, the sequence right-padded to N times that). The batch's input_ids / loss_mask stay
    whole (integers, cheap); hidden holds the base's h at positions [start, stop + halo) (the teacher rows past
    the slice, zeros past the end) and aux_hidden at [start, stop). Built by the training loop
    (train/sequence_parallel.py, DeepSpeed's Ulysses all-to-all); model code only calls these two functions:

    attend(local, q, k, v): q / k / v [B, H, n, hd] of this rank's rows (n = stop - start, RoPE at the rows' true
        positions, GQA keys already expanded) -> [B, H, n, hd]. Inside, the group trades rows for heads, calls
        local(q', k', v') on the whole sequence and H/N heads ([B, H/N, N·n, hd] -> the same shape) and trades back.
    total(t): t summed over the group, no gradient (a loss's target counts, so every rank divides by the same
        number and the group's gradients add up to one rank's).
    gather(t): t of every rank of the group (the same shape on each), stacked in rank order [N, ...], no gradient.
    """

    start: int
    stop: int
    halo: int
    attend: Callable[[Callable, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    total: Callable[[torch.Tensor], torch.Tensor]
    gather: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class DraftBatch:
    hidden: torch.Tensor  # [B, T, d] base last hidden state after the final norm (h_t), no grad
    input_ids: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] 1 on assistant tokens
    # [B, T, k*d] the base's residual stream after the layers a family asks for (EAGLE-3's draft.aux_layers,
    # HF output_hidden_states[l]), side by side in that order; None for families that read h alone.
    aux_hidden: torch.Tensor | None = None
    # Sequence parallelism: this rank's rows (hidden / aux_hidden then hold only those); None = the whole sequence
    shard: SequenceShard | None = None


@dataclass
class DepthStats:
    """One depth's numbers for one batch (sums, so they add across micro-batches and ranks).

    count = every target of this depth, scored against base ids (top1 / count is the accuracy). With a
    draft vocabulary, `oov` of them lie outside the map: they are misses (no draft can propose them) and
    carry no loss, so loss_sum / (count - oov) is the mean loss over the in-map targets."""

    loss_sum: float = 0.0
    count: int = 0
    top1: int = 0
    topk: int = 0
    oov: int = 0

    def add(self, other: DepthStats) -> None:
        self.loss_sum += other.loss_sum
        self.count += other.count
        self.top1 += other.top1
        self.topk += other.topk
        self.oov += other.oov

    @property
    def loss_count(self) -> int:
        """Targets that carry a loss (inside the draft vocabulary)."""
        return self.count - self.oov


@dataclass
class DraftLossOutput:
    loss: torch.Tensor  # scalar to backward()
    per_depth: list[DepthStats] = field(default_factory=list)  # index 0 = depth 1


def add_depth_loss(total: torch.Tensor, weight: float, loss_sum: torch.Tensor, stats, per_depth: list,
                   oov: int = 0, group_count: int | None = None) -> torch.Tensor:
    """One depth's share of a weighted multi-depth loss: total + weight * mean loss of this depth; appends its
    DepthStats (from a losses.fused_linear_ce.LossStats) to per_depth. A depth without targets in this
    batch adds 0 * loss_sum, which keeps its parameters in the graph (DeepSpeed expects every grad).
    oov: targets outside the draft vocabulary (ignored by the loss, so not in stats.count): they are added
    to the scored count as misses. group_count (sequence parallelism): the targets of this depth over the whole
    sequence (SequenceShard.total), which the mean divides by; per_depth keeps this rank's own numbers."""
    count = int(stats.count)
    div = count if group_count is None else int(group_count)
    total = total + (weight * loss_sum / div if div else 0.0 * loss_sum)
    per_depth.append(DepthStats(float(loss_sum.detach()), count + oov, int(stats.top1), int(stats.topk), oov))
    return total


def estimated_acceptance_length(top1_acc: list[float], prefix: bool = False) -> float:
    """Teacher-forced estimate 1 + sum_k prod_{j<=k} a_j: depth k is accepted only if depths 1..k all
    are. It assumes the depths' errors are independent, so it is a guide, not a measurement (the
    decoder in eval/ measures the real thing).

    prefix=True: a_k is already "depths 1..k all right" (the CTC drafter reports prefix accuracy of its
    collapsed greedy draft), so the estimate is exactly 1 + sum_k a_k, no independence assumption."""
    if prefix:
        return 1.0 + sum(top1_acc)
    total, run = 1.0, 1.0
    for a in top1_acc:
        run *= a
        total += run
    return total


class DraftModel(nn.Module):
    """Interface of a draft family (see models/families/medusa/model.py for the reference implementation)."""

    facts: FamilyFacts  # what other layers need to know about the family (models/family.py)
    family: str = "?"  # = facts.name, set for every subclass that declares facts
    # True when DepthStats.top1 of depth k counts "depths 1..k all right" (CTC's collapsed draft), not
    # depth k alone: the acceptance estimate then sums them instead of multiplying.
    prefix_accuracy: bool = False
    # True when `loss` takes a DraftBatch with a SequenceShard (train.sequence_parallel > 1): its loss over this rank's
    # rows, divided by the group's target counts, so the group's gradients add up to the whole sequence's.
    sequence_parallel: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "facts" in cls.__dict__:
            cls.family = cls.facts.name

    @classmethod
    def check_config(cls, cfg, fail: Callable[[str, object, str], None]) -> None:  # noqa: B027 - optional hook
        """The training-config rules only this family has (cfg: train.config.TrainConfig); call
        fail(key, value, fix) for a bad value. Shared rules live in train/config.py."""

    @classmethod
    def run_title(cls, draft_cfg) -> str:
        """The name of a run of this family in messages, from its draft config (a variant's: "Hydra++")."""
        return cls.facts.title

    @classmethod
    def options(cls, section):
        """This family's own options in a training-config section: `cls.options(cfg.draft)` is draft.<name>
        (an instance of facts.draft_options), `cls.options(cfg.loss)` is loss.<name> (facts.loss_options)."""
        return getattr(section, cls.facts.name)

    def loss(self, batch: DraftBatch, base: BaseView, loss_cfg) -> DraftLossOutput:
        raise NotImplementedError

    def export_config(self) -> dict:
        raise NotImplementedError
