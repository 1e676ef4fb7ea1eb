"""CTC drafter at inference (the CTC drafter paper §3.3, docs/families/ctc.md).

Per decode step (t = last committed token, root = x_{t+1} chosen by the base):
    z_t      = the draft's attention module over the committed hidden states (its own KV cache:
               each propose() appends state.new_hidden, the rows committed since the last call)
    frames   = M distributions over V+1 classes (class V = blank; N+1 with a draft vocabulary of N tokens,
               whose collapsed draft ids are mapped to base ids before the tree is built) read from z_t
    raw      = P fixed-length candidates [P, M]: rank choices over the frames (a static set, or the P
               most probable frame sequences under the frames' own probabilities, "joint")
    collapse = the CTC transform B per candidate: merge adjacent repeats, drop blanks -> ragged paths
    tree     = tree_from_paths(root, paths): shared prefixes merged; a kept token's depth is its index
               AFTER collapse + 1, so its position id is cache_len + depth with no RoPE gap, and removed
               frames never enter the tree (never verified, attended to or cached).

The collapse runs over the M frames only: the root is not part of the frame sequence, so a first
collapsed token equal to the root is KEPT (a real repeat like "\\n" "\\n"). That matches training, where
the CTC alignment covers the frames and the labels start at x_{t+2} (the root is never a label), and
merging it away would make legitimate repeats of the root impossible to draft.

Drafts are deterministic picks, so greedy acceptance is lossless through the common verifier and
rejection sampling treats each child as a point mass (no draft_probs).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eval.engine.drafters.drafter import DecodeState, Drafter
from eval.engine.tree import Tree, tree_from_paths
from losses.ctc import collapse_reference

PAD = -1
SEARCHES = ("static", "joint")


# ---------------------------------------------------------------------------------------------------
# The CTC transform, vectorized, and its reference twin
# ---------------------------------------------------------------------------------------------------


def ctc_collapse(raw: torch.Tensor, blank: int, pad: int = PAD) -> torch.Tensor:
    """raw [P, M] long frame sequences -> [P, M] long collapsed tokens, left-aligned, padded with `pad`.

    A frame is kept iff it is not the blank and differs from the previous FRAME (not the previous kept
    token: "a _ a" keeps both a's). The first frame has no predecessor (the root is not a frame).
    Kept tokens are compacted by their running count, so column j holds the token at depth j+1.
    """
    if raw.ndim != 2:
        raise ValueError(f"raw candidates must be [P, M], got shape {tuple(raw.shape)}")
    if pad >= 0:
        raise ValueError(f"pad must be negative so it never equals a token id, got {pad}")
    p, m = raw.shape
    prev = torch.cat([torch.full((p, 1), pad, dtype=raw.dtype, device=raw.device), raw[:, :-1]], dim=1)
    keep = (raw != blank) & (raw != prev)  # [P, M]
    col = keep.long().cumsum(1) - 1  # [P, M]: depth - 1 of each kept frame
    out = torch.full_like(raw, pad)
    rows = torch.arange(p, device=raw.device)[:, None].expand(p, m)
    out[rows[keep], col[keep]] = raw[keep]
    return out


def ctc_collapse_reference(raw: torch.Tensor, blank: int, pad: int = PAD) -> torch.Tensor:
    """Slow twin of `ctc_collapse`: one Python collapse per row (losses.ctc.collapse_reference)."""
    out = torch.full_like(raw, pad)
    for i, row in enumerate(raw.tolist()):
        kept = collapse_reference(row, blank)
        out[i, : len(kept)] = torch.tensor(kept, dtype=raw.dtype)
    return out


# ---------------------------------------------------------------------------------------------------
# Raw candidates: which rank per frame
# ---------------------------------------------------------------------------------------------------


def default_raw_choices(num_frames: int, num_paths: int = 24, topk: int = 4) -> tuple[tuple[int, ...], ...]:
    """A static set of `num_paths` rank tuples over the M frames (each of length M, ranks < topk).

    Data-free prior: a tuple's cost is the sum of its ranks (every rank step down the top-k about halves
    the probability), so the greedy tuple (all 0) comes first, then one rank-1 frame, then rank sum 2,
    ...; within a cost, deviations at EARLIER frames first, because an early frame decides the first
    collapsed tokens, which every longer acceptance needs. 24 paths x M=6 frames bound a tree at 145
    nodes; after collapse and prefix merging it is usually far smaller (~30-60), a size a 2-core CPU
    verifies at close to the cost of one token.
    """
    if num_frames < 1 or num_paths < 1 or topk < 1:
        raise ValueError(f"need num_frames, num_paths, topk >= 1, got {num_frames}, {num_paths}, {topk}")
    total = topk**num_frames
    if total <= 200_000:
        pool = itertools.product(range(topk), repeat=num_frames)
    else:  # never enumerate a huge grid: tuples with rank sum <= 3 hold every useful small set
        pool = (c for c in itertools.product(range(min(topk, 4)), repeat=num_frames) if sum(c) <= 3)
    ranked = sorted(pool, key=lambda c: (sum(c), tuple(-r for r in c)))
    return tuple(ranked[:num_paths])


def check_raw_choices(choices: Sequence[Sequence[int]], num_frames: int) -> torch.Tensor:
    """Validate rank tuples and return them as [P, M] long."""
    rows = [tuple(int(r) for r in c) for c in choices]
    if not rows:
        raise ValueError("the CTC drafter needs at least one raw candidate (extra.ctc_paths)")
    bad = [c for c in rows if len(c) != num_frames or min(c) < 0]
    if bad:
        raise ValueError(f"each CTC raw candidate is one rank >= 0 per frame ({num_frames} frames); bad: {bad[:3]}")
    if len(set(rows)) != len(rows):
        raise ValueError("CTC raw candidates contain duplicates; list each rank tuple once")
    return torch.tensor(rows, dtype=torch.long)


def joint_top_paths(log_probs: torch.Tensor, num_paths: int, topk: int) -> torch.Tensor:
    """The `num_paths` most probable frame sequences with each frame in its top-k, most probable first.

    log_probs [M, C] -> raw [P, M] long (P = min(num_paths, topk^M)). Frames are independent, so a beam
    of width P over frames is exact: any sequence in the global top P has its first m frames in the
    top P of the m-frame prefixes. Ties keep the lower rank tuple first.
    """
    k = min(topk, log_probs.shape[1])
    top = log_probs.topk(k, dim=-1)  # values/indices [M, k], best first
    scores, seqs = top.values[0], top.indices[0][:, None]  # [k], [k, 1]
    for m in range(1, log_probs.shape[0]):
        cand = (scores[:, None] + top.values[m][None, :]).reshape(-1)  # [B*k], row-major = (beam, rank)
        best = cand.topk(min(num_paths, cand.numel()), sorted=True)
        beam, rank = best.indices // k, best.indices % k
        scores = best.values
        seqs = torch.cat([seqs[beam], top.indices[m][rank][:, None]], dim=1)
    return seqs[:num_paths]


def joint_top_paths_reference(log_probs: torch.Tensor, num_paths: int, topk: int) -> torch.Tensor:
    """Slow twin: score every one of the topk^M rank tuples, sort."""
    k = min(topk, log_probs.shape[1])
    top = log_probs.topk(k, dim=-1)
    m = log_probs.shape[0]
    scored = []
    for ranks in itertools.product(range(k), repeat=m):
        score = sum(float(top.values[j, r]) for j, r in enumerate(ranks))
        scored.append((-score, ranks))
    scored.sort()
    rows = [[int(top.indices[j, r]) for j, r in enumerate(ranks)] for _, ranks in scored[:num_paths]]
    return torch.tensor(rows, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------------


class CTCDrafter(Drafter):
    name = "ctc"

    def __init__(self, draft, choices: Sequence[Sequence[int]] | None = None, *, search: str = "static",
                 num_paths: int = 24, topk: int = 4, max_len: int = 4096):
        """draft: models.families.ctc.model.CTCDraft (attention module with new_cache/step, frame_logits, num_frames,
        blank). search="static": `choices` rank tuples (default `default_raw_choices`); "joint": the
        num_paths most probable frame sequences within each frame's top-k, recomputed every step.
        max_len: room of the attention module's KV cache (committed tokens per sequence)."""
        if search not in SEARCHES:
            raise ValueError(f"CTC search must be one of {SEARCHES}, got {search!r}")
        self.draft = draft.eval()
        self.search, self.max_len = search, int(max_len)
        m = draft.num_frames
        if search == "static":
            self.choices = check_raw_choices(choices or default_raw_choices(m, num_paths, topk), m)  # [P, M]
            self.topk = int(self.choices.max()) + 1
            self.num_paths = self.choices.shape[0]
        else:
            if num_paths < 1 or topk < 1:
                raise ValueError(f"joint search needs num_paths, topk >= 1, got {num_paths}, {topk}")
            self.choices, self.topk, self.num_paths = None, int(topk), int(num_paths)
        self.max_nodes = 1 + self.num_paths * m  # collapse only removes frames; merging only removes nodes
        param = next(draft.parameters())
        self._device, self._dtype = param.device, param.dtype
        self._frame_idx = torch.arange(m, device=self._device)[None, :]  # [1, M]
        self._choices_on = self.choices.to(self._device) if self.choices is not None else None  # [P, M]
        self._cache = None

    def reset(self) -> None:
        self._cache = None  # a new sequence: the attention module's KV cache starts empty

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Tree:
        if self._cache is None:
            self._cache = self.draft.attn.new_cache(self.max_len, self._device, self._dtype)
        new = state.new_hidden.to(device=self._device, dtype=self._dtype)  # [n, d] committed since last call
        z = self.draft.attn.step(self._cache, new)[-1:]  # [1, d]: z_t of the last committed token
        log_probs = torch.log_softmax(self.draft.frame_logits(z)[0].float(), dim=-1)  # [M, V+1]
        if self.search == "static":
            top = log_probs.topk(self.topk, dim=-1).indices  # [M, k]
            raw = top[self._frame_idx, self._choices_on]  # [P, M]: frame m takes rank choices[p, m]
        else:
            raw = joint_top_paths(log_probs, self.num_paths, self.topk)
        paths = ctc_collapse(raw.cpu(), self.draft.blank)  # [P, M] draft ids, PAD after the collapsed end
        d2t = getattr(self.draft, "d2t", None)
        if d2t is not None:  # draft vocabulary: kept draft ids -> base ids (the verifier sees base ids only)
            paths = torch.where(paths >= 0, d2t.cpu()[paths.clamp(min=0)], paths)
        return tree_from_paths(state.root, paths)


# ---- family declaration (eval/engine/drafters/registry.py) ----------------------------------------------------

@dataclass(frozen=True)
class Options:
    """Raw candidates: `static` rank paths over the frames (ctc_paths, else ctc_num_paths of the top-ctc_topk per
    frame) or the `joint` best paths; the tree is built per step from the collapsed candidates, so the eval
    config's `tree` / `tree_choices` do not apply."""

    ctc_search: str = "static"  # static | joint
    ctc_paths: list | None = None  # explicit rank tuples over the frames, e.g. [[0, 0, 0, 0, 0, 0], [1, 0, ...]]
    ctc_num_paths: int = 24  # raw candidates per step before collapsing
    ctc_topk: int = 4  # ranks considered per frame


def build(draft, export_cfg: dict, eval_cfg, options: Options):
    paths = options.ctc_paths
    drafter = CTCDrafter(draft, [tuple(c) for c in paths] if paths else None, search=options.ctc_search,
                         num_paths=options.ctc_num_paths, topk=options.ctc_topk)
    return drafter, {"ctc_search": options.ctc_search, "ctc_num_paths": drafter.num_paths, "ctc_topk": drafter.topk,
                     "max_nodes": drafter.max_nodes}


def chain(depth: int) -> dict:
    raise ValueError("the CTC drafter has no fixed-depth chain (a collapsed candidate is as long as its distinct "
                     "frames), so no serving engine drafts it")


def num_speculative_tokens(info: dict, drafter) -> int:
    return chain(0)


def shape(info: dict) -> str:
    return f"{info.get('ctc_num_paths', '?')} CTC paths"


TUNE_PATHS = (4, 8, 16, 24)  # raw candidate counts `specdraft tune` sweeps (it has no chain to sweep)


def tune_shapes(draft) -> list[tuple[str, dict]]:
    return [(f"{n} CTC paths", {"extra": {"ctc_num_paths": n}}) for n in TUNE_PATHS]
