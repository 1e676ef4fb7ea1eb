"""Draft vocabulary: a draft predicts over N of the base's V tokens (DESIGN.md §5, "Draft vocabulary").

A base's LM head dominates a draft head's FLOPs (SmolLM2: 49,152 rows x 576). A draft vocabulary keeps the
N most frequent assistant target tokens of the training data; the draft's LM head then has N rows and its
losses, top-k and teacher distributions live over those N ids. The verifier never sees draft ids: drafting
maps them back to base ids first, so the base still decides and losslessness is untouched.

Two index tensors, the same convention as EAGLE-3 / speculators (which export d2t as offsets, see
train/export_speculators.py):
    d2t [N] int64  draft id -> base id, most frequent first (ties by smaller base id)
    t2d [V] int64  base id -> draft id, -1 for base ids outside the map

Every family reads the map from BaseView.draft_vocab (None = the full vocabulary) and stores it as a
persistent buffer, so it travels in model.safetensors and comes back with the export.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def inverse_map(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """d2t [N] -> t2d [V] int64 (-1 outside the map). Raises if d2t does not fit a V-token base."""
    check_fits(d2t, vocab_size)
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    t2d[d2t] = torch.arange(d2t.numel(), device=d2t.device)
    return t2d


def check_fits(d2t: torch.Tensor, vocab_size: int, where: str = "draft vocabulary") -> None:
    """A map must be 1-D, unique and inside [0, V): a map built for another tokenizer is a clear error."""
    if d2t.dim() != 1 or d2t.numel() == 0:
        raise ValueError(f"{where}: d2t must be a non-empty 1-D tensor of base ids, got shape {tuple(d2t.shape)}")
    lo, hi = int(d2t.min()), int(d2t.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{where}: maps to base ids in [{lo}, {hi}] but the base has {vocab_size} tokens; "
                         "the map was built for another base/tokenizer: rebuild it (draft.vocab_size) or load the "
                         "base this draft was trained on")
    if torch.unique(d2t).numel() != d2t.numel():
        raise ValueError(f"{where}: d2t repeats base ids; a draft vocabulary must list each base id once")


def restrict_rows(weight: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """[V, d] LM-head (or embedding) weight -> [N, d] rows of the map (the weight itself when d2t is None)."""
    return weight if d2t is None else weight.index_select(0, d2t)


def to_draft_labels(labels: torch.Tensor, t2d: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Base-id labels [...] (IGNORE_INDEX = no target) -> (draft-id labels [...], outside [...] bool).

    Targets outside the map become IGNORE_INDEX: no draft can ever propose them, so training on them only
    pulls probability mass nowhere. `outside` marks them so the caller counts them as misses in top-1/top-k
    (accuracy stays scored against base ids) and reports how many there were.
    """
    if t2d is None:
        return labels, torch.zeros_like(labels, dtype=torch.bool)
    valid = labels != IGNORE_INDEX
    mapped = torch.where(valid, t2d[labels.clamp(min=0)], torch.full_like(labels, -1))
    outside = valid & (mapped < 0)
    return torch.where(valid & ~outside, mapped, torch.full_like(labels, IGNORE_INDEX)), outside


def to_base_ids(draft_ids: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """Draft ids (any shape) -> base ids, the only ids the verifier sees."""
    return draft_ids if d2t is None else d2t[draft_ids]


def restrict_logits(logits: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """[..., V] base logits -> [..., N] over the map; a softmax over them is the base's distribution
    restricted to the draft vocabulary and renormalised (the teacher of soft losses)."""
    return logits if d2t is None else logits.index_select(-1, d2t)
