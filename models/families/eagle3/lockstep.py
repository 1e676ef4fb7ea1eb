"""Lockstep simulation of an EAGLE-3 draft on the stored answers: the field benchmark's fast path
(eval/field/simulation.py; docs/howto/evaluate.md, "The field benchmark").

Why: the per-prompt simulation (field.simulate: the unchanged decoder loop against a ReplayBackend) pays the draft's
cost one prompt at a time, and for EAGLE-3 that cost is batch-1 matrix-vector products (fc, q/k/v/o, the MLP and
above all the 16,384-row LM head), bound by memory bandwidth: the weights are read once per row. Every prompt's next
step is independent of every other prompt's, so here B prompts advance together: per lockstep step every
weight-heavy op of the draft runs ONCE over the rows of all active prompts (a matrix product that reads the weights
once for all of them), and only attention stays per prompt (each prompt has its own draft KV cache, of its own
length). A prompt that ends hands its slot to the next one, so the batch stays full.

What it reproduces, per prompt and step (field.simulate's GenerationResult, i.e. eval/engine/decoder.py's
speculative_generate with models/families/eagle3/drafter.py's Eagle3Drafter.propose against the ReplayBackend):
  commit   the rows committed since the last step (after the prompt: all of its positions; after a step: the root
           and the accepted drafts), each with its aux states and the token after it, appended to the prompt's
           draft cache (Eagle3Draft.commit_rows); the last row's output o_root predicts depth 1
  draft    chain and tree: the drafter's own walks (drafter.py: chain_drafts, tree_drafts, which propose runs on
           one prompt), here on rows batched over the slots; P-EAGLE: the committed rows and K-1 mask slots in one
           layer call (Eagle3Drafter._parallel_chain)
  verify   the ReplayBackend's lookup + greedy_accept: a node is on the stored path iff its token and all its
           ancestors' equal the stored ones at their positions; the deepest such node (the smallest index among
           equals) ends the accepted path, the bonus is the stored token after it
  book     speculative_generate's: accepted_lengths before end-of-turn / length truncation, accept / proposed
           counts per depth, tree_nodes (root counted), tokens cut after end-of-turn or at max_new_tokens
The walks are the drafter's, so the tree's scores (Python floats) and sort keys, and its ties, are too.

Not bitwise by construction: a row of a batched matrix product and the same row's matrix-vector product may differ
in the last bits (MKL's kernels sum in different orders), so a near-exact tie between two draft tokens can flip (on
the shipped draft: one depth-3 draft of 2,536 chain steps, at a log-prob gap of 1.4e-6). So every comparison whose
outcome decides the drafted tree is guarded: a slot meets a near tie when two log-probs (or tree scores) that decide
it lie within TIE_EPS (the argmax's top two, a top-k's boundary, the expansion's and the final ranking's cut: the
comparisons that decide which nodes a tree holds; an order among kept nodes only lays it out), and run_lockstep then
hands that prompt to the exact path (`redo`: one prompt at a time through the decoder
loop) from the start. The agreement with the exact path stays a measured property (tests/test_field_lockstep.py on
the tiny base, tests/test_field_real.py on the shipped draft, and every batched run's own sample).

Shapes: d = hidden size, k·d = the aux layers side by side, H / H_kv / hd = query heads / key-value heads / head
size, N = draft vocabulary, R = rows of all active prompts in one op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from eval.engine.backends.replay import ReplayError
from models.families.eagle3.drafter import chain_drafts, tree_drafts
from models.families.eagle3.layers import Eagle3Cache

# Two log-probs (or cumulative tree scores) closer than this are a near tie: the batched path's last bits could order
# them otherwise than the one-row path, so the prompt is redone on the exact path. 70x the largest flip seen.
TIE_EPS = 1e-4


@dataclass
class Slot:
    """One prompt in flight: its stored sequence, its draft cache, its decode bookkeeping.

    The draft cache holds step-0 rows of positions [0, cache.length); positions [cache.length, length) are committed
    by the base but not yet by the draft (the next step commits them); root = seq[length] is the base's next token.
    """

    ref: object  # field_refs.RefPrompt
    n: int  # max_new_tokens: the answer's decoded length (or less)
    seq: list[int]  # prompt + stored answer (+ its tail), python ints: the lookups are per token
    seq_t: torch.Tensor  # [S] long, the same on the draft's device (next tokens of committed rows)
    aux: torch.Tensor  # [S, k·d] the base's aux states at every position, in the draft's dtype
    differs: list[int]
    eos: frozenset
    cache: Eagle3Cache | None = None
    length: int = 0  # committed positions (the ReplayBackend's cache_len)
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


@dataclass
class Proposal:
    """One slot's drafted tree, laid out like eval.engine.tree.Tree: node 0 the root, parents before children."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]


class LockstepEagle3:
    """Advances a list of Slots by one decode step each, every weight-heavy op batched over all of them."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.draft = drafter.draft
        self.layer = self.draft.layers[0]  # layer 0's pre() builds every path's input; run_layers runs them all
        self.groups = self.draft.groups
        self.device, self.dtype = drafter._device, drafter._dtype

    # -- slots -----------------------------------------------------------------------------------------------

    def start(self, ref, n: int, aux: torch.Tensor, differs: list[int], eos: Iterable[int]) -> Slot:
        """A slot right after the prefill: the prompt's T positions committed by the base (not yet by the draft),
        root = the first answer token, counted as a new token (speculative_generate's prefill)."""
        seq = list(ref.prompt) + list(ref.answer)
        if aux is None or aux.shape[0] != len(seq):
            raise ReplayError(f"{ref.id}: the field cache holds {None if aux is None else aux.shape[0]} aux rows "
                              f"for {len(seq)} tokens")
        s = Slot(ref, n, seq, torch.tensor(seq, dtype=torch.long, device=self.device),
                 aux.to(self.device, self.dtype), differs, frozenset(eos), length=len(ref.prompt))
        s.tokens = [s.root]
        s.stopped = s.root in s.eos or n <= 1
        # The drafter's cache, sized as Eagle3Drafter._new_rows sizes it (it grows by doubling).
        s.cache = self.draft.new_cache(max(256, 2 * s.length), self.device, self.dtype)
        return s

    def step(self, slots: list[Slot]) -> None:
        """One decode step of every slot (none may be stopped): commit, draft, look up, book."""
        d = self.drafter
        if d.parallel:
            proposals = self._parallel_chain(slots)
        else:
            o_root = self._commit(slots)  # [B, d]
            proposals = self._chain(slots, o_root) if d.mode == "chain" else self._tree(slots, o_root)
        for s, p in zip(slots, proposals):
            self._verify_and_book(s, p)

    # -- the draft's layer, batched over rows; attention per slot -----------------------------------------------

    def _new_rows(self, slots: list[Slot]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """The rows each slot commits this step, stacked: (aux [R, k·d], next tokens [R], positions [R], per slot
        its (first, last + 1) row in R). Row p of a slot: aux[p], the token after p (seq[p + 1]), position p."""
        aux, nxt, pos, spans, r = [], [], [], [], 0
        for s in slots:
            a, b = s.cache.length, s.length
            aux.append(s.aux[a:b])
            nxt.append(s.seq_t[a + 1:b + 1])
            pos.append(torch.arange(a, b))
            spans.append((r, r + b - a))
            r += b - a
        return torch.cat(aux), torch.cat(nxt), torch.cat(pos), spans

    def _layers(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Every decoder layer over R rows (Eagle3Draft.run_layers: q/k/v, o_proj and the MLP batched over all slots):
        x [1, R, 2d], residual [1, R, d] (layer 0's input), positions [R] (RoPE at each row's position);
        attend(i, q, k, v) -> layer i's attention [1, H, R, hd], slot by slot. Returns the draft's outputs [R, d]."""
        cos, sin = self.draft.rope(positions.to(self.device)[None], x.dtype)
        return self.draft.run_layers(x, residual, cos, sin, attend)[0]

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [1, H, m, hd] over keys / values [1, H_kv, L, hd] (views into a slot's cache buffer), mask [m, L] bool.
        enable_gqa instead of expand_kv's copies: bitwise the same result (measured on this CPU), without copying
        the whole cache per call."""
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.groups > 1)

    def _commit_attend(self, s: Slot, i: int, q, k, v, lo: int, hi: int) -> torch.Tensor:
        """Layer i: one slot's step-0 rows q/k/v[:, :, lo:hi] written after its cache's committed rows (as
        Eagle3Draft.commit_rows; the caller moves the length once every layer has written), then causal attention
        over cache + new rows -> [1, H, m, hd]. P-EAGLE's mask slots, the last rows of the span, are written the same
        way: past the length the caller leaves them, seen (causally) but not kept."""
        m, past = hi - lo, s.cache.length
        s.cache.write(i, k[:, :, lo:hi], v[:, :, lo:hi], past)
        mask = torch.ones(m, past + m, dtype=torch.bool, device=self.device)
        mask[:, past:] = torch.tril(mask[:, past:])
        return self._attend(q[:, :, lo:hi], s.cache.keys[i:i + 1, :, :past + m], s.cache.values[i:i + 1, :, :past + m],
                            mask)

    def _commit_layers(self, slots: list[Slot], x, residual, pos, spans, extra: int = 0) -> torch.Tensor:
        """The rows of every slot's span through every layer, each slot's attention over its own cache; then each
        cache keeps its span's rows but the last `extra` (P-EAGLE's mask slots). Returns the outputs [R, d]."""
        def attend(i, q, k, v):
            return torch.cat([self._commit_attend(s, i, q, k, v, a, b) for s, (a, b) in zip(slots, spans)], dim=2)

        out = self._layers(x, residual, pos, attend)
        for s, (a, b) in zip(slots, spans):
            s.cache.length += b - a - extra
        return out

    def _commit(self, slots: list[Slot]) -> torch.Tensor:
        """Eagle3Drafter._commit for every slot: the new rows through the layers, appended to each cache.
        Returns o_root [B, d], the output of each slot's last (root) row."""
        aux, nxt, pos, spans = self._new_rows(slots)
        g = self.draft.fuse(aux)[None]  # [1, R, d]: fc over every slot's new rows at once
        x, residual = self.layer.pre(self.draft.embed_tokens(nxt)[None].to(g.dtype), g)  # [1, R, 2d], [1, R, d]
        out = self._commit_layers(slots, x, residual, pos, spans)  # [R, d]
        return out[torch.tensor([b - 1 for _, b in spans], device=out.device)]

    def _draft_rows(self, slots: list[Slot], hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                    spans: list[tuple[int, int]], drafted: list[int], visible: list[torch.Tensor | None]
                    ) -> torch.Tensor:
        """Eagle3Draft.draft_rows for every slot at once: hidden [R, d] (each row's parent output), tokens [R] (base
        ids), positions [R]; slot i owns rows spans[i]; drafted[i] nodes of this step already have their K/V in its
        scratch rows (past the cache's length; updated here), visible[i] [m_i, drafted[i]] its rows' ancestors
        among them. Each row sees the slot's whole cache, its ancestors and itself. Returns outputs [R, d]."""
        x, residual = self.layer.pre(self.draft.embed_tokens(tokens)[None].to(hidden.dtype), hidden[None])
        masks = []
        for i, (s, (lo, hi)) in enumerate(zip(slots, spans)):
            m, past, big_m = hi - lo, s.cache.length, drafted[i] + hi - lo
            mask = torch.zeros(m, past + big_m, dtype=torch.bool, device=self.device)
            mask[:, :past] = True
            vis = visible[i]
            if vis is not None and vis.shape[1]:
                mask[:, past:past + vis.shape[1]] = vis
            mask[torch.arange(m), past + big_m - m + torch.arange(m)] = True  # itself
            masks.append(mask)

        def attend(layer, q, k, v):  # each slot: its scratch rows of this layer after the committed ones
            outs = []
            for i, (s, (lo, hi)) in enumerate(zip(slots, spans)):
                end = s.cache.length + drafted[i] + hi - lo
                s.cache.write(layer, k[:, :, lo:hi], v[:, :, lo:hi], s.cache.length + drafted[i])
                outs.append(self._attend(q[:, :, lo:hi], s.cache.keys[layer:layer + 1, :, :end],
                                         s.cache.values[layer:layer + 1, :, :end], masks[i]))
            return torch.cat(outs, dim=2)

        out = self._layers(x, residual, positions, attend)
        for i, (lo, hi) in enumerate(spans):
            drafted[i] += hi - lo
        return out

    def _top(self, out: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
        """Eagle3Drafter._top over all rows at once: outputs [R, d] -> (top-k log-probs [R, k], base ids [R, k],
        per row whether its k-th and (k+1)-th log-probs lie within TIE_EPS: which k it keeps could then differ from
        the one-row product's; their order inside the k only orders the tree's nodes, never which nodes it holds).
        The LM head is the one big product: N x d read once for all R rows."""
        logp = torch.log_softmax(self.draft.logits(out).float(), dim=-1)
        vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)  # as the drafter asks (topk orders exact ties by k)
        wide = logp.topk(min(k + 1, logp.shape[-1]), dim=-1).values  # k + 1: the boundary's neighbour too
        near = ((wide[:, k - 1] - wide[:, k]) < TIE_EPS).tolist() if wide.shape[1] > k else [False] * wide.shape[0]
        return vals, self.draft.to_base(idx), near

    # -- the three drafting shapes ----------------------------------------------------------------------------

    def _topper(self, slots: list[Slot]):
        """The walkers' `top` (models/families/eagle3/drafter.py): _top over every slot's rows, each slot flagged
        where one of its rows met a near tie."""
        def top(out, k, spans):
            vals, idx, near = self._top(out, k)
            for s, (lo, hi) in zip(slots, spans):
                s.near_tie |= any(near[lo:hi])
            return vals, idx

        return top

    def _rower(self, slots: list[Slot]):
        """The walkers' `rows`: _draft_rows over every slot's rows, each slot's count of nodes drafted this step (its
        scratch rows past the cache's length) kept here across the walk's calls."""
        drafted = [0] * len(slots)

        def rows(hidden, tokens, positions, spans, visible):
            return self._draft_rows(slots, hidden, tokens, positions, spans, drafted, visible)

        return rows

    def _chain(self, slots: list[Slot], o_root: torch.Tensor) -> list[Proposal]:
        """Eagle3Drafter's chain for every slot, by its own walk (drafter.py: chain_drafts) on the batched rows."""
        pos0 = [s.cache.length - 1 for s in slots]  # each root row's position
        drafts = chain_drafts(o_root, pos0, self.drafter.num_speculative_tokens, self._topper(slots),
                              self._rower(slots), self.device)
        return [Proposal([s.root, *dr], list(range(-1, len(dr))), list(range(len(dr) + 1)))
                for s, dr in zip(slots, drafts)]

    def _tree(self, slots: list[Slot], o_root: torch.Tensor) -> list[Proposal]:
        """Eagle3Drafter's EAGLE-2 tree for every slot, by its own walk (drafter.py: tree_drafts) on the batched
        rows; a cut of the expansion or the final ranking within TIE_EPS flags the slot."""
        def close(i, ordered, scores, cut):
            slots[i].near_tie |= _close_at(ordered, scores, cut)

        pos0 = [s.cache.length - 1 for s in slots]
        return [Proposal(*t) for t in tree_drafts([s.root for s in slots], o_root, pos0, self.drafter,
                                                  self._topper(slots), self._rower(slots), self.device, close)]

    def _parallel_chain(self, slots: list[Slot]) -> list[Proposal]:
        """Eagle3Drafter._parallel_chain (P-EAGLE) for every slot: each slot's new rows and K-1 mask slots in one
        layer call (Eagle3Draft.parallel_rows), batched; drafts = argmax at the root row and at each mask slot."""
        big_k = self.drafter.num_speculative_tokens
        extra = max(0, big_k - 1)
        aux, nxt, pos, spans = self._new_rows(slots)
        g = self.draft.fuse(aux)[None]  # [1, R, d]
        x, residual = self.layer.pre(self.draft.embed_tokens(nxt)[None].to(g.dtype), g)
        if extra:  # interleave: each slot's new rows, then its mask slots at the positions after its root row
            mx, mres = self.draft.mask_inputs(extra, x.dtype)  # [1, extra, 2d], [1, extra, d]
            xs, rs, ps, grown, r = [], [], [], [], 0
            for s, (a, b) in zip(slots, spans):
                xs += [x[:, a:b], mx]
                rs += [residual[:, a:b], mres]
                ps += [pos[a:b], torch.arange(s.length, s.length + extra)]
                grown.append((r, r + b - a + extra))
                r += b - a + extra
            x, residual, pos, spans = torch.cat(xs, 1), torch.cat(rs, 1), torch.cat(ps), grown
        out = self._commit_layers(slots, x, residual, pos, spans, extra)  # [R + B·extra, d]
        if big_k == 0:
            return [Proposal([s.root], [-1], [0]) for s in slots]
        rows = torch.cat([torch.arange(b - extra - 1, b) for _, b in spans])  # [B·K]: root row, then the slots
        _, top, near = self._top(out[rows.to(out.device)], 1)
        toks = top[:, 0].view(len(slots), big_k).tolist()
        for i, s in enumerate(slots):
            s.near_tie |= any(near[i * big_k:(i + 1) * big_k])
        return [Proposal([s.root, *t], list(range(-1, big_k)), list(range(big_k + 1))) for s, t in zip(slots, toks)]

    # -- verification by lookup, and speculative_generate's bookkeeping ----------------------------------------

    def _verify_and_book(self, s: Slot, p: Proposal) -> None:
        """The ReplayBackend + greedy_accept + speculative_generate's step bookkeeping for one slot."""
        base = s.length
        max_depth = max(p.depths)
        if base + max_depth + 1 >= len(s.seq):
            raise ReplayError(f"{s.ref.id}: a tree node at position {base + max_depth} needs the base's token after "
                              f"it, but the stored sequence ends at {len(s.seq)}: the stored tail is shorter than "
                              "this drafter's deepest tree")
        # on[i]: node i and all its ancestors carry the stored tokens (parents come before children)
        on = [True] + [False] * (len(p.tokens) - 1)
        best = 0  # the deepest on-path node, the smallest index among equals (greedy_accept's cand[0])
        for i in range(1, len(p.tokens)):
            if on[p.parents[i]] and p.tokens[i] == s.seq[base + p.depths[i]]:
                on[i] = True
                if p.depths[i] > p.depths[best]:
                    best = i
        n_acc = p.depths[best]
        _grow(s.accept_counts, max_depth)
        _grow(s.proposed_counts, max_depth)
        for j in range(max_depth):
            s.proposed_counts[j] += 1
            s.accept_counts[j] += int(j < n_acc)
        s.accepted_lengths.append(n_acc + 1)
        s.tree_nodes += len(p.tokens)
        # committed = seq[base : base + n_acc + 1] (root + accepted drafts); bonus = seq[base + n_acc + 1]
        for tok in s.seq[base + 1: base + n_acc + 2]:
            s.tokens.append(tok)
            if tok in s.eos:
                s.stopped = True
                break
            if len(s.tokens) >= s.n:
                s.stopped = True
                break
        s.length = base + n_acc + 1


def _close_at(ordered: list[int], scores: list[float], cut: int) -> bool:
    """Whether the last node kept and the first cut of `ordered` (nodes by descending score, `cut` kept) lie within
    TIE_EPS: which nodes are kept could then flip. The order among the kept ones only lays the tree out."""
    return 0 < cut < len(ordered) and scores[ordered[cut - 1]] - scores[ordered[cut]] < TIE_EPS


def _grow(counts: list[int], n: int) -> None:
    counts.extend([0] * (n - len(counts)))


def run_lockstep(drafter, todo: list, load: Callable, n_of: Callable, eos: Iterable[int], done: Callable, *,
                 width: int = 32, redo: Callable | None = None) -> int:
    """Simulate `drafter` (an Eagle3Drafter) on the prompts `todo`, `width` at a time: load(ref) -> (aux [S, k·d],
    differs), n_of(ref) -> its max_new_tokens, done(ref, slot) is called as each prompt ends (in finish order),
    and a finished slot is refilled with the next prompt, so the batch stays full until the queue runs dry. The
    longest answers go first: the batch then drains on short ones at the end (the results do not depend on order).
    redo(ref): a prompt that met a near tie (TIE_EPS) leaves the batch and is handed to it (the caller simulates
    it on the exact path and records it); without redo the batched result stands. Returns the prompts redone."""
    if width < 1:
        raise ValueError(f"lockstep width must be >= 1, got {width}")
    sim = LockstepEagle3(drafter)
    eos = frozenset(eos)
    queue = iter(sorted(todo, key=lambda r: -n_of(r)))
    active: list[Slot] = []
    redone = 0
    with torch.inference_mode():
        while True:
            for ref in queue if len(active) < width else ():
                aux, differs = load(ref)
                slot = sim.start(ref, n_of(ref), aux, differs, eos)
                if slot.stopped:  # the prefill's token ended it: no decode step (speculative_generate's rule)
                    done(ref, slot)
                else:
                    active.append(slot)
                if len(active) >= width:
                    break
            if not active:
                return redone
            sim.step(active)
            for s in active:
                if s.near_tie and redo is not None:
                    redone += 1
                    redo(s.ref)
                elif s.stopped:
                    done(s.ref, s)
            active = [s for s in active if not s.stopped and not (s.near_tie and redo is not None)]
