"""Draft vocabulary: a draft predicts over N of the base's V tokens (docs/concepts.md#draft-vocabulary).

A base's LM head dominates a draft head's FLOPs (SmolLM2: 49,152 rows x 576). A draft vocabulary keeps the
N most frequent assistant target tokens of the training data; the draft's LM head then has N rows and its
losses, top-k and teacher distributions live over those N ids. The verifier never sees draft ids: drafting
maps them back to base ids first, so the base still decides and losslessness is untouched.

Two index tensors, the same convention as EAGLE-3 / speculators (which export d2t as offsets, see
models/export/speculators.py):
    d2t [N] int64  draft id -> base id, most frequent first (ties by smaller base id)
    t2d [V] int64  base id -> draft id, -1 for base ids outside the map

Every family reads the map from BaseView.draft_vocab (None = the full vocabulary) and stores it as a
persistent buffer, so it travels in model.safetensors and comes back with the export.
"""

from __future__ import annotations

import dataclasses

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


class DraftVocabMixin:
    """What every family with a draft vocabulary shares (mix into an nn.Module before DraftModel).

    Buffers:
        d2t            [N] int64, persistent (travels in model.safetensors), or None = full vocabulary
        t2d            [V] int64, non-persistent (derived from d2t)
        vocab_rows     [N, d] the frozen base LM-head rows W[d2t] ([V, d] = W itself for the full
                       vocabulary), non-persistent (a buffer so it follows .to()): the shared LM head of
                       share_lm_head drafts and the teacher weight of soft losses (softmax over these
                       logits = the base distribution restricted to the map and renormalised)
    A load_state_dict post-hook rebuilds t2d and vocab_rows from the loaded d2t, so a draft built with a
    placeholder map (from_export_config before load_state_dict) is exact after loading.
    """

    def _init_vocab(self, base, d2t: torch.Tensor | None = None) -> int:
        """Register the buffers from `d2t` (default base.draft_vocab); returns the LM-head rows (N or V)."""
        d2t = base.draft_vocab if d2t is None else d2t
        self.vocab_size = base.vocab_size
        self._base_lm_head = base.lm_head_weight  # plain attribute: never registered, never exported
        if d2t is not None:
            check_fits(d2t, base.vocab_size)
            d2t = d2t.to(device=base.lm_head_weight.device, dtype=torch.long).clone()
        self.register_buffer("d2t", d2t, persistent=True)
        self.register_buffer("t2d", None, persistent=False)
        self.register_buffer("vocab_rows", None, persistent=False)
        self._refresh_vocab()
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh_vocab())
        return self.draft_vocab_size or base.vocab_size

    def _refresh_vocab(self) -> None:
        if self.d2t is None:
            self.t2d, self.vocab_rows = None, self._base_lm_head
            return
        check_fits(self.d2t, self.vocab_size, f"{type(self).__name__}.d2t")
        self.t2d = inverse_map(self.d2t, self.vocab_size)
        full = self._base_lm_head
        self.vocab_rows = restrict_rows(full, self.d2t.to(full.device)).to(self.d2t.device)

    @property
    def draft_vocab_size(self) -> int:
        """N, or 0 for the full vocabulary (the export_config key `draft_vocab_size`)."""
        return 0 if self.d2t is None else int(self.d2t.numel())

    def base_rows(self) -> torch.Tensor:
        """[N or V, d] frozen base LM-head rows over the draft vocabulary."""
        return self.vocab_rows

    def draft_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Base-id labels (IGNORE_INDEX = none) -> (draft-id labels, number of targets outside the map)."""
        mapped, outside = to_draft_labels(labels, self.t2d)
        return mapped, int(outside.sum())

    def to_base(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return to_base_ids(draft_ids, None if self.d2t is None else self.d2t.to(draft_ids.device))


def placeholder_map(cfg: dict, base) -> torch.Tensor | None:
    """For from_export_config: the map a draft is built with before load_state_dict overwrites it.
    base.draft_vocab when the loader already read it (train/export.load_draft does), else arange(N) of
    the export's `draft_vocab_size` (N = 0 or absent: the full vocabulary)."""
    n = int(cfg.get("draft_vocab_size", 0) or 0)
    if n == 0:
        return None
    if base.draft_vocab is not None:
        if base.draft_vocab.numel() != n:
            raise ValueError(f"the export says draft_vocab_size={n} but its d2t has {base.draft_vocab.numel()} "
                             "entries; the export is inconsistent (re-export the run)")
        return base.draft_vocab
    if n > base.vocab_size:
        raise ValueError(f"the export's draft_vocab_size={n} exceeds the base's {base.vocab_size} tokens; load "
                         "the base this draft was trained on")
    return torch.arange(n, dtype=torch.long)


def export_base(cfg: dict, base, name: str):
    """For from_export_config of a draft that reads the base's hidden states: the base view it is built on, after
    checking the export was trained on a base of this size (d, V), with its placeholder draft-vocabulary map."""
    if (cfg.get("hidden_size"), cfg.get("vocab_size")) != (base.hidden_size, base.vocab_size):
        raise ValueError(f"the {name} export has d={cfg.get('hidden_size')}, V={cfg.get('vocab_size')} but the "
                         f"base has d={base.hidden_size}, V={base.vocab_size}; load the base it was trained on")
    return dataclasses.replace(base, draft_vocab=placeholder_map(cfg, base))
