"""EAGLE-3 at inference: a chain (what vLLM runs) or a dynamic tree (EAGLE-2's expansion) of drafts, each
node produced by the draft's one decoder layer from its parent's output state and its own token.

Own KV cache (model.py: Eagle3Cache): one "step 0" row per committed base position p, computed from the
base's aux states at p and the token after p (model.py). Each propose() first commits the rows
since the last call (state.new_aux, state.new_ids[1:] + the root), which re-derives them from the base's
own features, as vLLM does after every verification; the last row's output o_root predicts depth 1.
Nodes drafted during one propose() keep their K/V in a scratch buffer that dies with the call.

chain (K = num_speculative_tokens): d_1 = argmax lm_head(norm(o_root)); d_k = argmax of the layer run on
    (e(d_{k-1}), o_{k-1}) at position L+k-1, which sees the cache and its own ancestors: K-1 layer calls of one row.
tree (EAGLE-2): the root's top-k children, then for depth 2..D: take the `topk` nodes of the newest level
    with the best cumulative draft log-probability, run the layer on them (one batched call), give each
    its top-k children; finally keep the best `nodes - 1` of all drafted nodes by cumulative
    log-probability. A child's score never exceeds its parent's, and ties go to the shallower node, so
    the kept set always contains every kept node's ancestors.

parallel chain (a P-EAGLE draft, `draft.parallel_drafting`; vLLM's eagle3 with `parallel_drafting: true`): ONE
    layer call over the newly committed rows and K-1 mask slots after the root (model.py: parallel_rows);
    d_1 = argmax at the root row, d_{k+1} = argmax at mask slot k. The drafts never feed back into the layer, so
    all K come from that one forward, as in vLLM. Such a draft drafts chains only (its depths >= 2 were trained on
    mask slots, not on its own outputs).

Children are deterministic picks (argmax / top-k), so rejection sampling treats them as point masses
(Tree.draft_probs = None), which keeps sampling lossless like the other top-k families.
With a draft vocabulary the layer's logits are over N draft ids; tokens are mapped to base ids (d2t)
before they enter the tree or the embedding, so the verifier never sees a draft id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eval.engine.drafters.drafter import DecodeState, Drafter
from eval.engine.tree import Tree, chain_tree

MODES = ("chain", "tree")


class Eagle3Drafter(Drafter):
    name = "eagle3"

    def __init__(self, draft, mode: str = "tree", num_speculative_tokens: int = 4, tree_topk: int = 4,
                 tree_depth: int = 4, tree_nodes: int = 16):
        """draft: models.families.eagle3.model.Eagle3Draft; num_speculative_tokens: the chain's drafts per step;
        tree_nodes counts the root."""
        if mode not in MODES:
            raise ValueError(f"eagle3 mode={mode!r}: use one of {MODES} (eval extra.eagle3_mode)")
        if num_speculative_tokens < 0 or tree_topk < 1 or tree_depth < 1 or tree_nodes < 1:
            raise ValueError(f"eagle3: num_speculative_tokens={num_speculative_tokens} must be >= 0, "
                             f"tree_topk={tree_topk}, tree_depth={tree_depth} and tree_nodes={tree_nodes} >= 1")
        self.parallel = bool(getattr(draft, "parallel_drafting", False))
        if self.parallel and mode != "chain":
            raise ValueError(f"eagle3 mode={mode!r}: a P-EAGLE draft (parallel_drafting) drafts a chain of tokens "
                             "from one forward; use extra.eagle3_mode=chain (extra.num_speculative_tokens=K)")
        self.draft = draft.eval()
        self.aux_layers = list(draft.aux_layers)  # the decoder has the backend capture these layers
        self.mode, self.num_speculative_tokens = mode, int(num_speculative_tokens)
        self.tree_topk, self.tree_depth, self.tree_nodes = int(tree_topk), int(tree_depth), int(tree_nodes)
        self.max_nodes = 1 + self.num_speculative_tokens if mode == "chain" else self.tree_nodes
        param = next(draft.parameters())
        self._device, self._dtype = param.device, param.dtype
        self._cache = None

    def reset(self) -> None:
        self._cache = None

    def _new_rows(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [n, k*d], next tokens [n]) of the positions committed since the last call (the root last)."""
        if state.new_aux is None:
            raise ValueError("the EAGLE-3 drafter needs the base's aux hidden states (DecodeState.new_aux); run it "
                             "through eval.engine.decoder.speculative_generate, which asks the backend for them")
        aux = state.new_aux.to(self._device, self._dtype)  # [n, k*d]
        nxt = torch.cat([state.new_ids[1:].to(self._device), torch.tensor([int(state.root)], device=self._device)])
        if self._cache is None:
            self._cache = self.draft.new_cache(max(256, 2 * aux.shape[0]), self._device, self._dtype)
        return aux, nxt

    def _commit(self, state: DecodeState) -> torch.Tensor:
        """Append the newly committed positions to the draft's cache; return o_root [1, d]."""
        aux, nxt = self._new_rows(state)
        return self.draft.commit_rows(self._cache, aux, nxt)[-1:]

    def _top(self, out: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer outputs [m, d] -> (top-k log-probs [m, k], base ids [m, k]) over the draft vocabulary."""
        logp = torch.log_softmax(self.draft.logits(out).float(), dim=-1)
        vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return vals, self.draft.to_base(idx)

    def _rows(self):
        """draft_rows on this prompt's cache, as the walkers below call it: (hidden [m, d], tokens [m], positions
        [m], spans [(0, m)], visible [[m, M]]) -> outputs [m, d]; the step's scratch K/V [L, H_kv, M, hd] lives in
        the closure and dies with the call to propose."""
        scratch = [None, None]

        def rows(hidden, tokens, positions, spans, visible):
            out, scratch[0], scratch[1] = self.draft.draft_rows(self._cache, hidden, tokens, positions, *scratch,
                                                                visible[0])
            return out

        return rows

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Tree:
        if self.parallel:
            return self._parallel_chain(state)
        o_root = self._commit(state)  # always: the cache must see every committed position
        top = lambda out, k, spans: self._top(out, k)  # noqa: E731
        pos0 = [self._cache.length - 1]  # the root row's position
        if self.mode == "chain":
            return chain_tree(state.root, chain_drafts(o_root, pos0, self.num_speculative_tokens, top, self._rows(),
                                                       self._device)[0])
        tokens, parents, depths = tree_drafts([int(state.root)], o_root, pos0, self, top, self._rows(),
                                              self._device)[0]
        return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))

    def _parallel_chain(self, state: DecodeState) -> Tree:
        """P-EAGLE: the committed rows and num_speculative_tokens - 1 mask slots in one layer call; one argmax per row
        from the root's on (the root row drafts d_1, mask slot k drafts d_{k+1})."""
        aux, nxt = self._new_rows(state)
        n = int(aux.shape[0])
        out = self.draft.parallel_rows(self._cache, aux, nxt, max(0, self.num_speculative_tokens - 1))
        if self.num_speculative_tokens == 0:
            return chain_tree(state.root)
        drafts = self._top(out[n - 1:], 1)[1][:, 0]  # [K] base ids
        return chain_tree(state.root, drafts.tolist())


# ---- the drafting walks, once for one prompt (propose) and for B prompts at a time (lockstep.py) ---------------
# Each walks B prompts' drafts together through two row primitives, so the field's batched path (models/families/
# eagle3/lockstep.py) drafts by this same code with its batched primitives and propose with the draft's own:
#   top(out [R, d], k, spans) -> (top-k log-probs [R, k], base ids [R, k]); prompt i owns rows spans[i]
#   rows(hidden [R, d], tokens [R], positions [R], spans, visible) -> layer outputs [R, d]: each row fed its
#       parent's output and its own token, seeing its prompt's cache, its ancestors among the nodes its prompt
#       drafted earlier this step (visible[i] [m_i, M_i] bool) and itself
# close(i, ordered, scores, cut), where given, is told each cut that decides which nodes prompt i's tree holds.


def chain_drafts(o_root: torch.Tensor, pos0: list[int], length: int, top, rows, device) -> list[list[int]]:
    """Chain of `length` per prompt: d_1 = argmax at o_root [B, d]; d_k = argmax of the layer run on (e(d_{k-1}),
    o_{k-1}) at position pos0[i] + k - 1 (pos0: each root row's position), seeing d_1 .. d_{k-2}. Returns the
    drafts (base ids) per prompt."""
    b = int(o_root.shape[0])
    drafts: list[list[int]] = [[] for _ in range(b)]
    out, spans = o_root, [(i, i + 1) for i in range(b)]
    for k in range(1, length + 1):
        tok = top(out, 1, spans)[1][:, 0]  # [B] base ids of d_k
        for i, t in enumerate(tok.tolist()):
            drafts[i].append(t)
        if k == length:
            break
        # d_1 .. d_{k-1}: one mask a prompt (a list repeated with * would alias one tensor across them)
        visible = [torch.ones(1, k - 1, dtype=torch.bool, device=device) for _ in range(b)]
        out = rows(out, tok, torch.tensor([p + k for p in pos0]), spans, visible)
    return drafts


def tree_drafts(roots: list[int], o_root: torch.Tensor, pos0: list[int], shape, top, rows, device,
                close=None) -> list[tuple[list[int], list[int], list[int]]]:
    """EAGLE-2's tree per prompt (shape: tree_topk, tree_depth, tree_nodes): the root's top-k children, then per
    depth 2..D the topk nodes of the newest level with the best cumulative log-prob (stable sort: ties keep level
    order) run through the layer, all prompts' rows in one call, each given its top-k children; at the end the best
    tree_nodes - 1 nodes by (score desc, depth, index), laid out depth by depth. Python floats carry the scores, so
    ties resolve alike on every path. Returns per prompt (tokens, parents, depths), node 0 the root."""
    k, b = shape.tree_topk, len(roots)
    # Per prompt node tables (index 0 = root): token, parent, depth, cumulative log-prob, scratch-KV row (-1: none).
    tables = [([int(r)], [-1], [0], [0.0], [-1]) for r in roots]
    vals, toks = top(o_root, k, [(i, i + 1) for i in range(b)])  # [B, k]
    levels = [_children(t, [0], [v], [tk], 1) for t, v, tk in zip(tables, vals.tolist(), toks.tolist())]
    out_of = [{0: o_root[i]} for i in range(b)]  # per prompt: node -> its layer output [d] (expanded nodes)
    n_kv = [0] * b
    for depth in range(2, shape.tree_depth + 1):
        expands, hidden, tok, pos, spans, visible, r = [], [], [], [], [], [], 0
        for i, (tokens, parents, _, scores, kv_row) in enumerate(tables):
            ordered = sorted(levels[i], key=lambda j: -scores[j])
            expand = ordered[:k]  # best nodes of the newest level
            if close is not None:
                close(i, ordered, scores, k)
            expands.append(expand)
            hidden += [out_of[i][parents[j]] for j in expand]
            tok += [tokens[j] for j in expand]
            pos += [pos0[i] + depth - 1] * len(expand)
            vis = torch.zeros(len(expand), n_kv[i], dtype=torch.bool, device=device)
            for row, j in enumerate(expand):  # ancestors below the root all sit in the scratch KV
                a = parents[j]
                while a > 0:
                    vis[row, kv_row[a]] = True
                    a = parents[a]
            visible.append(vis)
            spans.append((r, r + len(expand)))
            r += len(expand)
        outs = rows(torch.stack(hidden), torch.tensor(tok, device=device), torch.tensor(pos), spans, visible)
        vals, toks = top(outs, k, spans)  # [R, k]: one LM head over every prompt's expanded nodes
        vals, toks = vals.tolist(), toks.tolist()
        for i, (table, expand, (lo, hi)) in enumerate(zip(tables, expands, spans)):
            for row, j in enumerate(expand):
                table[4][j] = n_kv[i] + row
                out_of[i][j] = outs[lo + row]
            n_kv[i] += len(expand)
            levels[i] = _children(table, expand, vals[lo:hi], toks[lo:hi], depth)
    trees = []
    for i, (tokens, parents, depths, scores, _) in enumerate(tables):
        # Keep the best nodes (score desc, then shallower, then older), then lay them out topologically.
        order = sorted(range(1, len(tokens)), key=lambda j: (-scores[j], depths[j], j))
        if close is not None:
            close(i, order, scores, shape.tree_nodes - 1)
        kept = [0] + sorted(order[: shape.tree_nodes - 1], key=lambda j: (depths[j], j))
        new_index = {old: new for new, old in enumerate(kept)}
        trees.append(([tokens[j] for j in kept], [-1] + [new_index[parents[j]] for j in kept[1:]],
                      [depths[j] for j in kept]))
    return trees


def _children(table, expand: list[int], vals: list[list[float]], toks: list[list[int]], depth: int) -> list[int]:
    """Add each expanded node's top-k children (vals / toks: one list of k a node) to the node tables; returns the
    new level's node indices."""
    tokens, parents, depths, scores, kv_row = table
    level = []
    for j, vr, tr in zip(expand, vals, toks):
        for v, t in zip(vr, tr):
            level.append(len(tokens))
            tokens.append(t), parents.append(j), depths.append(depth)
            scores.append(scores[j] + v), kv_row.append(-1)
    return level


# ---- family declaration (eval/engine/drafters/registry.py) ----------------------------------------------------

@dataclass(frozen=True)
class Options:
    """`tree` (EAGLE-2: expand the tree_topk best nodes per depth, keep the best tree_nodes, root counted) or
    `chain` (num_speculative_tokens autoregressive top-1 drafts, what vLLM and llama.cpp run; a P-EAGLE draft's chain
    comes from one forward, and its export sets chain mode with its K). The tree is built per step from the draft's
    scores, so the eval config's `tree` / `tree_choices` do not apply."""

    eagle3_mode: str = "tree"  # tree | chain
    num_speculative_tokens: int = 4  # chain mode: drafted tokens per step (vLLM's name); 4, EAGLE-3's usual chain
    tree_topk: int = 4  # tree mode: nodes expanded per depth, children per expanded node
    tree_depth: int = 4  # tree mode: draft steps per verification
    tree_nodes: int = 16  # the size tree16 has: what a 2-core CPU verifies for about the price of one token


def build(draft, export_cfg: dict, eval_cfg, options: Options):
    drafter = Eagle3Drafter(draft, mode=options.eagle3_mode, num_speculative_tokens=options.num_speculative_tokens,
                            tree_topk=options.tree_topk, tree_depth=options.tree_depth, tree_nodes=options.tree_nodes)
    info = {"eagle3_mode": drafter.mode, "max_nodes": drafter.max_nodes}
    if drafter.parallel:
        info["parallel_drafting"] = True
    info.update({"num_speculative_tokens": drafter.num_speculative_tokens} if drafter.mode == "chain" else
                {"tree_topk": drafter.tree_topk, "tree_depth": drafter.tree_depth, "tree_nodes": drafter.tree_nodes})
    return drafter, info


def chain(depth: int) -> dict:
    return {"tree_choices": None, "extra": {"eagle3_mode": "chain", "num_speculative_tokens": depth}}


def num_speculative_tokens(info: dict, drafter) -> int:
    if info.get("eagle3_mode") != "chain":
        raise ValueError("serving engines draft EAGLE-3 as a chain: give this row `eval: {extra: {eagle3_mode: chain, "
                         "num_speculative_tokens: K}}`")
    return int(info["num_speculative_tokens"])


def shape(info: dict) -> str:
    if info.get("eagle3_mode") == "chain":
        parallel = "parallel " if info.get("parallel_drafting") else ""
        return f"{parallel}chain of {info.get('num_speculative_tokens', '?')}"
    return f"dynamic tree, {info.get('max_nodes', '?')} nodes"  # EAGLE-2: top-k expansions, reranked to max_nodes
