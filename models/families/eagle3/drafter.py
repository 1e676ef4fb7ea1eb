"""EAGLE-3 at inference: a chain (what vLLM runs) or a dynamic tree (EAGLE-2's expansion) of drafts, each
node produced by the draft's one decoder layer from its parent's output state and its own token.

Own KV cache (model.py: Eagle3Cache): one "step 0" row per committed base position p, computed from the
base's aux states at p and the token after p (model.py). Each propose() first commits the rows
since the last call (state.new_aux, state.new_ids[1:] + the root), which re-derives them from the base's
own features, as vLLM does after every verification; the last row's output o_root predicts depth 1.
Nodes drafted during one propose() keep their K/V in a scratch buffer that dies with the call.

chain (length K): d_1 = argmax lm_head(norm(o_root)); d_k = argmax of the layer run on (e(d_{k-1}),
    o_{k-1}) at position L+k-1, which sees the cache and its own ancestors: K-1 layer calls of one row.
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

    def __init__(self, draft, mode: str = "tree", chain_length: int = 4, tree_topk: int = 4, tree_depth: int = 4,
                 tree_nodes: int = 16):
        """draft: models.families.eagle3.model.Eagle3Draft. tree_nodes counts the root."""
        if mode not in MODES:
            raise ValueError(f"eagle3 mode={mode!r}: use one of {MODES} (eval extra.eagle3_mode)")
        if chain_length < 0 or tree_topk < 1 or tree_depth < 1 or tree_nodes < 1:
            raise ValueError(f"eagle3: chain_length={chain_length} must be >= 0, tree_topk={tree_topk}, "
                             f"tree_depth={tree_depth} and tree_nodes={tree_nodes} >= 1")
        self.parallel = bool(getattr(draft, "parallel_drafting", False))
        if self.parallel and mode != "chain":
            raise ValueError(f"eagle3 mode={mode!r}: a P-EAGLE draft (parallel_drafting) drafts a chain of tokens "
                             "from one forward; use extra.eagle3_mode=chain (extra.chain_length=K)")
        self.draft = draft.eval()
        self.aux_layers = list(draft.aux_layers)  # the decoder has the backend capture these layers
        self.mode, self.chain_length = mode, int(chain_length)
        self.tree_topk, self.tree_depth, self.tree_nodes = int(tree_topk), int(tree_depth), int(tree_nodes)
        self.max_nodes = 1 + self.chain_length if mode == "chain" else self.tree_nodes
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

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Tree:
        if self.parallel:
            return self._parallel_chain(state)
        o_root = self._commit(state)  # always: the cache must see every committed position
        if self.mode == "chain":
            return self._chain(state.root, o_root)
        return self._tree(state.root, o_root)

    def _chain(self, root: int, o_root: torch.Tensor) -> Tree:
        if self.chain_length == 0:
            return chain_tree(root)
        pos0 = self._cache.length - 1  # the root row's position
        drafts, out, tk, tv = [], o_root, None, None
        for k in range(1, self.chain_length + 1):
            tok = self._top(out, 1)[1][:, 0]  # [1] base id of d_k
            drafts.append(int(tok))
            if k == self.chain_length:
                break
            visible = torch.ones(1, k - 1, dtype=torch.bool, device=self._device)  # d_1 .. d_{k-1} rows
            out, tk, tv = self.draft.draft_rows(self._cache, out, tok, torch.tensor([pos0 + k]), tk, tv, visible)
        return chain_tree(root, drafts)

    def _parallel_chain(self, state: DecodeState) -> Tree:
        """P-EAGLE: the committed rows and chain_length - 1 mask slots in one layer call; one argmax per row from the
        root's on (the root row drafts d_1, mask slot k drafts d_{k+1})."""
        aux, nxt = self._new_rows(state)
        n = int(aux.shape[0])
        out = self.draft.parallel_rows(self._cache, aux, nxt, max(0, self.chain_length - 1))
        if self.chain_length == 0:
            return chain_tree(state.root)
        drafts = self._top(out[n - 1:], 1)[1][:, 0]  # [K] base ids
        return chain_tree(state.root, drafts.tolist())

    def _tree(self, root: int, o_root: torch.Tensor) -> Tree:
        pos0 = self._cache.length - 1
        k = self.tree_topk
        # Node tables (index 0 = root): token, parent, depth, cumulative log-prob, scratch-KV row (-1 = none).
        tokens, parents, depths, scores, kv_row = [int(root)], [-1], [0], [0.0], [-1]
        vals, toks = self._top(o_root, k)
        level = []
        for v, t in zip(vals[0].tolist(), toks[0].tolist()):
            level.append(len(tokens))
            tokens.append(t), parents.append(0), depths.append(1), scores.append(v), kv_row.append(-1)
        out_of = {0: o_root[0]}  # node -> its layer output (expanded nodes only)
        tk = tv = None
        n_kv = 0
        for depth in range(2, self.tree_depth + 1):
            expand = sorted(level, key=lambda i: -scores[i])[:k]  # best nodes of the newest level
            hidden = torch.stack([out_of[parents[i]] for i in expand])  # [m, d]: each parent's output
            tok = torch.tensor([tokens[i] for i in expand], device=self._device)
            pos = torch.tensor([pos0 + depth - 1] * len(expand))
            visible = torch.zeros(len(expand), n_kv, dtype=torch.bool, device=self._device)
            for r, i in enumerate(expand):  # ancestors below the root all sit in the scratch KV
                a = parents[i]
                while a > 0:
                    visible[r, kv_row[a]] = True
                    a = parents[a]
            outs, tk, tv = self.draft.draft_rows(self._cache, hidden, tok, pos, tk, tv, visible)
            for r, i in enumerate(expand):
                kv_row[i] = n_kv + r
                out_of[i] = outs[r]
            n_kv += len(expand)
            vals, toks = self._top(outs, k)
            level = []
            for r, i in enumerate(expand):
                for v, t in zip(vals[r].tolist(), toks[r].tolist()):
                    level.append(len(tokens))
                    tokens.append(t), parents.append(i), depths.append(depth)
                    scores.append(scores[i] + v), kv_row.append(-1)
        # Keep the best nodes (score desc, then shallower, then older), then lay them out topologically.
        ranked = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], depths[i], i))[: self.tree_nodes - 1]
        kept = [0] + sorted(ranked, key=lambda i: (depths[i], i))
        new_index = {old: new for new, old in enumerate(kept)}
        return Tree(torch.tensor([tokens[i] for i in kept]),
                    torch.tensor([-1] + [new_index[parents[i]] for i in kept[1:]]),
                    torch.tensor([depths[i] for i in kept]))


# ---- family declaration (eval/engine/drafters/registry.py) ----------------------------------------------------

@dataclass(frozen=True)
class Options:
    """`tree` (EAGLE-2: expand the tree_topk best nodes per depth, keep the best tree_nodes, root counted) or
    `chain` (chain_length autoregressive top-1 drafts, what vLLM and llama.cpp run; a P-EAGLE draft's chain comes from
    one forward, and its export sets chain mode with its K). The tree is built per step from the draft's scores, so
    the eval config's `tree` / `tree_choices` do not apply."""

    eagle3_mode: str = "tree"  # tree | chain
    chain_length: int = 4  # chain mode: drafted tokens per step
    tree_topk: int = 4  # tree mode: nodes expanded per depth, children per expanded node
    tree_depth: int = 4  # tree mode: draft steps per verification
    tree_nodes: int = 16  # the size tree16 has: what a 2-core CPU verifies for about the price of one token


def build(draft, export_cfg: dict, eval_cfg, options: Options):
    drafter = Eagle3Drafter(draft, mode=options.eagle3_mode, chain_length=options.chain_length,
                            tree_topk=options.tree_topk, tree_depth=options.tree_depth, tree_nodes=options.tree_nodes)
    info = {"eagle3_mode": drafter.mode, "max_nodes": drafter.max_nodes}
    if drafter.parallel:
        info["parallel_drafting"] = True
    info.update({"chain_length": drafter.chain_length} if drafter.mode == "chain" else
                {"tree_topk": drafter.tree_topk, "tree_depth": drafter.tree_depth, "tree_nodes": drafter.tree_nodes})
    return drafter, info


def chain(depth: int) -> dict:
    return {"tree_choices": None, "extra": {"eagle3_mode": "chain", "chain_length": depth}}


def chain_depth(info: dict, drafter) -> int:
    if info.get("eagle3_mode") != "chain":
        raise ValueError("serving engines draft EAGLE-3 as a chain: give this row `eval: {extra: {eagle3_mode: chain, "
                         "chain_length: K}}`")
    return int(info["chain_length"])


def shape(info: dict) -> str:
    if info.get("eagle3_mode") == "chain":
        return ("parallel " if info.get("parallel_drafting") else "") + f"chain of {info.get('chain_length', '?')}"
    return f"dynamic tree, {info.get('max_nodes', '?')} nodes"  # EAGLE-2: top-k expansions, reranked to max_nodes
