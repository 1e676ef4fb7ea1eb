"""Static trees for the families whose heads give a top-k per depth (Medusa, Hydra): which tree a run uses, the
chain serving engines draft (each depth's top-1), and what their batched field paths share (run_static_lockstep;
the block families' batched paths run on it too: eval/engine/drafters/block_lockstep.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from eval.engine.tree import STATIC_TREES, StaticTree, chain_choices

# The static tree each tree-based family uses when neither the eval config nor the export names one.
# tree16: on a 2-core CPU a bf16 base verifies up to ~16 tree tokens for about the price of one (oneDNN's small-N
# GEMMs are memory-bound), while 64 nodes cost ~2x; on a GPU medusa63 is the usual choice (docs/lab/benchmarks.md).
DEFAULT_TREE = "tree16"


def resolve_tree(export_cfg: dict, eval_cfg) -> tuple[str, StaticTree]:
    """Explicit choices > eval config's tree name > the export's stored tree > the default."""
    if eval_cfg.tree_choices:
        return "custom", StaticTree([tuple(c) for c in eval_cfg.tree_choices])
    if eval_cfg.tree != "auto":
        return eval_cfg.tree, StaticTree(STATIC_TREES[eval_cfg.tree])
    stored = export_cfg.get("tree")
    if isinstance(stored, list):
        return "export", StaticTree([tuple(c) for c in stored])
    name = stored if isinstance(stored, str) else DEFAULT_TREE
    return name, StaticTree(STATIC_TREES[name])


def build_static_tree_drafter(drafter_cls, draft, export_cfg: dict, eval_cfg):
    """The tree from resolve_tree (the tree search stores its pick as the export's `tree`), checked against the
    number of heads; returns (drafter, report info)."""
    tree_name, tree = resolve_tree(export_cfg, eval_cfg)
    if tree.depth > draft.num_heads and tree_name == DEFAULT_TREE and eval_cfg.tree == "auto":
        # Nobody asked for this tree: a draft with fewer heads (the demo's one-head Hydra) gets the default
        # tree's first num_heads levels instead of an error.
        tree = StaticTree([c for c in tree.choices if len(c) <= draft.num_heads])
        tree_name = f"{tree_name}[:{draft.num_heads}]"
    if tree.depth > draft.num_heads:
        raise ValueError(f"tree {tree_name!r} is {tree.depth} deep but the draft has {draft.num_heads} heads; "
                         f"pick a shallower tree (tree=...)")
    return drafter_cls(draft, tree), {"tree": tree_name, "tree_nodes": tree.num_nodes}


def static_tree_builder(drafter_cls):
    """The `build` of a static-tree family's declaration (its options are the eval config's tree keys)."""
    def build(draft, export_cfg: dict, eval_cfg, options):
        return build_static_tree_drafter(drafter_cls, draft, export_cfg, eval_cfg)
    return build


def static_chain(depth: int) -> dict:
    """Eval overrides that make a static-tree family draft the chain of each depth's top-1 (what engines run)."""
    return {"tree": "auto", "tree_choices": chain_choices(depth)}


def static_num_speculative_tokens(info: dict, drafter) -> int:
    choices = [tuple(c) for c in drafter.tree.choices]
    if not choices or choices != [(0,) * j for j in range(1, len(choices) + 1)]:
        raise ValueError("serving engines draft a chain of each head's top-1: give this row `eval: {tree: chain4}` "
                         "(or tree_choices [[0], [0, 0], ...])")
    return len(choices)


# The static trees `specdraft tune` sweeps besides the chains (chain4 is a chain, already swept).
TUNE_TREES = ("wide2", "tree16", "medusa63")


def static_tune_shapes(draft) -> list[tuple[str, dict]]:
    """(label, eval knobs) of each tuned static tree; one deeper than the draft's heads is left out when built."""
    return [(f"{name} ({len(STATIC_TREES[name])} nodes)", {"tree": name, "tree_choices": None}) for name in TUNE_TREES]


def heads_max_speculative_tokens(draft) -> int:
    """A static-tree draft with K heads drafts at most K tokens per step (one per head)."""
    return int(draft.num_heads)


def static_shape(info: dict) -> str:
    """The draft shape in a table cell, from the report info of a static-tree row."""
    if info.get("tree_search_nodes"):
        return f"searched, {info['tree_search_nodes']} nodes"
    if info.get("tree") == "export":  # the tree stored in the export (`specdraft tree-search` writes it), root included
        return f"export's tree, {info.get('tree_nodes', '?')} nodes"
    return f"{info.get('tree', '?')}, {info.get('tree_nodes', '?')} nodes"


# ---- the field benchmark's batched path for a static-tree family (its models/families/<name>/lockstep.py) ---------
#
# What the families share: the slots (one prompt in flight each), the verification by lookup and
# speculative_generate's bookkeeping, the near-tie test, the queue. What each family adds: its drafting step over
# the rows of every active slot, by its drafter's own code (`draft(slots) -> ([B, N] base ids, [B] near ties)`:
# models/families/hydra/lockstep.py, models/families/medusa/lockstep.py; the block families' through
# eval/engine/drafters/block_lockstep.py).

# Two logits of a row whose order decides a tree node closer than this are a near tie: a batched product's last bits
# could order them otherwise than the per-prompt one, so the prompt is redone on the exact path (the same margin as
# EAGLE-3's lockstep: models/families/eagle3/lockstep.py).
TIE_EPS = 1e-4


@dataclass
class StaticSlot:
    """One prompt in flight: its stored sequence, the base's rows the draft reads, its decode bookkeeping.

    Positions [0, length) are committed by the base; [seen, length) are the rows committed since the drafter last
    drafted (the decoder's DecodeState.new_hidden: the whole prompt after the prefill, then root + accepted drafts);
    root = seq[length] is the base's next token."""

    ref: object  # field_refs.RefPrompt
    n: int  # max_new_tokens: the answer's decoded length (or less)
    seq: list[int]  # prompt + stored answer (+ its tail)
    states: torch.Tensor  # [S, .] the base's rows the draft reads at every position: final hidden states [S, d]
    # (Hydra, Medusa) or aux layers [S, k*d] (the block families, which free them once read: block_lockstep.py)
    differs: list[int]
    eos: frozenset
    length: int = 0  # committed positions (the ReplayBackend's cache_len)
    seen: int = 0  # positions already handed to the drafter
    context: object = None  # the family's own per-prompt draft state (Hydra++: the prefix layer's KV cache)
    tokens: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    accept_counts: list[int] = field(default_factory=list)
    proposed_counts: list[int] = field(default_factory=list)
    tree_nodes: int = 0
    stopped: bool = False
    near_tie: bool = False  # a decision of this prompt's drafts met a near tie (TIE_EPS): redo it exactly

    @property
    def root(self) -> int:
        return self.seq[self.length]

    def new_rows(self) -> torch.Tensor:
        """The rows committed since the last draft ([n, d], n >= 1), now handed to the drafter."""
        rows = self.states[self.seen:self.length]
        self.seen = self.length
        return rows


def start_slot(ref, n: int, states: torch.Tensor, differs: list[int], eos: Iterable[int]) -> StaticSlot:
    """A slot right after the prefill: the prompt's positions committed, root = the first answer token, counted as a
    new token (speculative_generate's prefill); stopped at once if that token ends it."""
    from eval.engine.backends.replay import ReplayError

    seq = list(ref.prompt) + list(ref.answer)
    if states is None or states.shape[0] != len(seq):
        raise ReplayError(f"{ref.id}: the field cache holds {None if states is None else states.shape[0]} hidden rows "
                          f"for {len(seq)} tokens")
    s = StaticSlot(ref, n, seq, states, differs, frozenset(eos), length=len(ref.prompt))
    s.tokens = [s.root]
    s.stopped = s.root in s.eos or n <= 1
    return s


def verify_and_book(s: StaticSlot, tokens: list[int], tree: StaticTree) -> None:
    """The ReplayBackend's lookup + greedy_accept + speculative_generate's step bookkeeping for one slot's drafted
    tree (tokens in `tree`'s node order, node 0 the root): a node is on the stored path iff its token and all its
    ancestors' equal the stored ones at their positions; the deepest such node (the smallest index among equals)
    ends the accepted path, the bonus is the stored token after it."""
    from eval.engine.backends.replay import ReplayError

    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    base, max_depth = s.length, tree.depth
    if base + max_depth + 1 >= len(s.seq):
        raise ReplayError(f"{s.ref.id}: a tree node at position {base + max_depth} needs the base's token after it, "
                          f"but the stored sequence ends at {len(s.seq)}: the stored tail is shorter than this "
                          "drafter's deepest tree")
    on = [True] + [False] * (len(tokens) - 1)  # parents come before children
    best = 0
    for i in range(1, len(tokens)):
        if on[parents[i]] and tokens[i] == s.seq[base + depths[i]]:
            on[i] = True
            if depths[i] > depths[best]:
                best = i
    n_acc = depths[best]
    for counts in (s.accept_counts, s.proposed_counts):
        counts.extend([0] * (max_depth - len(counts)))
    for j in range(max_depth):
        s.proposed_counts[j] += 1
        s.accept_counts[j] += int(j < n_acc)
    s.accepted_lengths.append(n_acc + 1)
    s.tree_nodes += len(tokens)
    for tok in s.seq[base + 1: base + n_acc + 2]:  # the accepted drafts, then the bonus
        s.tokens.append(tok)
        if tok in s.eos or len(s.tokens) >= s.n:
            s.stopped = True
            break
    s.length = base + n_acc + 1


def near_ties(logits: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Per row of logits [R, V]: whether two of its top widths[r] + 1 logits lie within TIE_EPS of their neighbour
    (widths [R] long, the ranks a static tree takes from that row). A static tree's node is the rank-r pick of its
    row, so the order among the ranks it takes and the boundary after the last one all decide tokens; a row the
    tree takes no rank from (width 0) has none. Returns [R] bool."""
    k = min(int(widths.max()) + 1, logits.shape[-1]) if widths.numel() else 0
    if k < 2:
        return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    top = logits.float().topk(k, dim=-1).values  # [R, k]
    close = (top[:, :-1] - top[:, 1:]) < TIE_EPS  # [R, k - 1]: rank j against rank j + 1
    used = torch.arange(k - 1, device=logits.device)[None] < widths.to(logits.device)[:, None]
    return (close & used).any(dim=-1)


def depth_widths(tree: StaticTree) -> torch.Tensor:
    """[depth] long: per depth k, the ranks its nodes take from their rows (max rank + 1)."""
    out = torch.zeros(tree.depth, dtype=torch.long)
    for c in tree.choices:
        out[len(c) - 1] = max(int(out[len(c) - 1]), c[-1] + 1)
    return out


def run_static_lockstep(drafter, draft: Callable, todo: list, load: Callable, n_of: Callable, eos: Iterable[int],
                        done: Callable, *, width: int = 32, redo: Callable | None = None,
                        tree_of: Callable | None = None) -> int:
    """A static-tree family's run_lockstep (eval/engine/drafters/registry.py): simulate `drafter` on the prompts
    `todo`, `width` at a time. draft(slots) -> (tokens [B, N] base ids in drafter.tree's node order, or one list
    of base ids per slot, near [B] bool): the family's drafting step over every active slot (each reads its new
    rows: StaticSlot.new_rows). tree_of(tokens) -> the StaticTree a slot's drafted tokens lie in (default:
    drafter.tree, every slot's; the chain families whose chain length varies per step name their own). load(ref)
    -> (the base's rows the draft reads [S, .], differs), n_of(ref) -> its max_new_tokens, done(ref, slot) as each
    prompt ends (in finish order); a finished slot is refilled with the next prompt. The longest answers go first
    (the results do not depend on order). redo(ref): a prompt that met a near tie leaves the batch and is handed
    to it (the caller simulates it on the exact path); without redo the batched result stands. Returns the
    prompts redone."""
    if width < 1:
        raise ValueError(f"lockstep width must be >= 1, got {width}")
    eos = frozenset(eos)
    queue = iter(sorted(todo, key=lambda r: -n_of(r)))
    active: list[StaticSlot] = []
    redone = 0
    with torch.inference_mode():
        while True:
            for ref in queue if len(active) < width else ():
                states, differs = load(ref)
                slot = start_slot(ref, n_of(ref), states, differs, eos)
                if slot.stopped:  # the prefill's token ended it: no decode step (speculative_generate's rule)
                    done(ref, slot)
                else:
                    active.append(slot)
                if len(active) >= width:
                    break
            if not active:
                return redone
            tokens, near = draft(active)
            rows = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
            for s, toks, tie in zip(active, rows, near):
                s.near_tie |= bool(tie)
                verify_and_book(s, toks, drafter.tree if tree_of is None else tree_of(toks))
            for s in active:
                if s.near_tie and redo is not None:
                    redone += 1
                    redo(s.ref)
                elif s.stopped:
                    done(s.ref, s)
            active = [s for s in active if not s.stopped and not (s.near_tie and redo is not None)]


def static_lockstep(draft_step: Callable, tree_of: Callable | None = None) -> Callable:
    """The `run_lockstep` a static-tree family declares in its `lockstep` role module: run_static_lockstep with the
    family's drafting step, draft_step(drafter, slots) -> (tokens [B, N] base ids or a list per slot, near [B]
    bool), and its tree_of (run_static_lockstep's; default drafter.tree)."""
    def run_lockstep(drafter, todo: list, load: Callable, n_of: Callable, eos: Iterable[int], done: Callable, *,
                     width: int = 32, redo: Callable | None = None) -> int:
        return run_static_lockstep(drafter, lambda slots: draft_step(drafter, slots), todo, load, n_of, eos, done,
                                   width=width, redo=redo, tree_of=tree_of)

    run_lockstep.__doc__ = run_static_lockstep.__doc__
    return run_lockstep
