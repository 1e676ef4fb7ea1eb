"""ReDrafter at inference: beam search over the recurrent head, then a dynamic tree (the ReDrafter paper).

Each step: W beams of length L (root + L-1 drafts) from `eval.engine.beam_search.beam_search` on h_t and the
root; beams share prefixes, so `eval.engine.tree.tree_from_paths` (the paper's tensor prefix matching) packs them
into one tree: a node per distinct prefix, parent links, ancestor mask and positions (depth). The verifier
then treats it like any other tree.

Acceptance: greedy is lossless through the common verifier. For rejection sampling the beam children are
deterministic picks (no randomness, made before verification), so the tree is passed with
draft_probs=None and `eval.engine.acceptance.rejection_tree` treats each child as a point mass: accept child x
with prob r(x), else zero r(x) and renormalise. That rule is exact for any fixed set of distinct children
(docs/families/redrafter.md), so sampling stays lossless. The drafter's own log-probabilities are kept per beam
(`last_beams`) for analysis; they are not needed for acceptance.

Compression (the paper's Figure 5b): every step adds the tree's node count to `total_tokens_packed` and
W'·(L-1)+1 (the beams' tokens without prefix sharing, root once) to `total_tokens_unpacked`.
"""

from __future__ import annotations

from dataclasses import dataclass

from eval.engine.beam_search import BeamResult, beam_search
from eval.engine.drafters.drafter import DecodeState, Drafter
from eval.engine.tree import Tree, chain_tree, tree_from_paths


class ReDrafterDrafter(Drafter):
    name = "redrafter"

    def __init__(self, draft, beam_width: int, beam_length: int):
        """draft: models.families.redrafter.model.ReDrafterDraft; beam_length counts the root (L-1 drafts per beam)."""
        if beam_width < 1 or beam_length < 1:
            raise ValueError(f"beam_width={beam_width} and beam_length={beam_length} must be >= 1 "
                             "(beam_length counts the root, so 1 means no drafts)")
        self.draft = draft.eval()
        self.beam_width, self.beam_length = int(beam_width), int(beam_length)
        self.max_nodes = 1 + self.beam_width * (self.beam_length - 1)
        self.total_tokens_packed = 0
        self.total_tokens_unpacked = 0
        self.steps = 0
        self.last_beams: BeamResult | None = None

    @property
    def compression_ratio(self) -> float:
        """Unpacked / packed tokens over all steps so far (>= 1; nan before the first step)."""
        return self.total_tokens_unpacked / self.total_tokens_packed if self.total_tokens_packed else float("nan")

    def propose(self, state: DecodeState) -> Tree:
        if self.beam_length == 1:
            tree = chain_tree(state.root)
            unpacked = 1
        else:
            res = beam_search(self.draft, state.last_hidden, state.root, self.beam_width, self.beam_length)
            self.last_beams = res
            tree = tree_from_paths(state.root, res.beams[:, 1:])
            unpacked = 1 + res.beams.shape[0] * (self.beam_length - 1)
        self.total_tokens_packed += tree.num_nodes
        self.total_tokens_unpacked += unpacked
        self.steps += 1
        return tree


# ---- family declaration (eval/engine/drafters/registry.py) ----------------------------------------------------

@dataclass(frozen=True)
class Options:
    """Beam shape; None = the export's defaults (W=4, L=5). The tree is built per step from the beams, so the eval
    config's `tree` / `tree_choices` do not apply."""

    beam_width: int | None = None  # W beams
    beam_length: int | None = None  # L tokens per beam, the root counted (L-1 drafts)


def build(draft, export_cfg: dict, eval_cfg, options: Options):
    width = options.beam_width if options.beam_width is not None else draft.beam_width
    length = options.beam_length if options.beam_length is not None else draft.beam_length
    drafter = ReDrafterDrafter(draft, width, length)
    return drafter, {"beam_width": width, "beam_length": length, "max_nodes": drafter.max_nodes}


def chain(depth: int) -> dict:
    """One beam of depth + 1 tokens (root counted): the chain of top-1 drafts engines run."""
    return {"extra": {"beam_width": 1, "beam_length": depth + 1}}


def num_speculative_tokens(info: dict, drafter) -> int:
    if info.get("beam_width") != 1:
        raise ValueError("a chain is one beam: give this row `eval: {extra: {beam_width: 1, beam_length: L}}`")
    return int(info["beam_length"]) - 1


def shape(info: dict) -> str:
    return f"{info.get('beam_width', '?')} beams × {info.get('beam_length', '?')}"


TUNE_BEAMS = (2, 4, 8)  # beam widths `specdraft tune` sweeps besides the one-beam chains


def tune_shapes(draft) -> list[tuple[str, dict]]:
    """2 / 4 / 8 beams of the trained length (the chains, one beam of each length, are swept already)."""
    length = int(draft.beam_length)
    return [(f"{w} beams x {length}", {"extra": {"beam_width": w, "beam_length": length}}) for w in TUNE_BEAMS]
