"""EAGLE-3's decode-time rows: step 0 over newly committed base positions (`commit_rows`), P-EAGLE's one-forward
slots (`parallel_rows`) and tree nodes at depth >= 2 (`draft_rows`), each over the per-layer key cache
(layers.Eagle3Cache, [num_layers, H_kv, capacity, hd]). A mixin of Eagle3Draft (model.py), which holds the weights
and the training-time test; these methods only read them (layers, fuse, embed_tokens, rope, run_layers, groups)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from models.components import expand_kv
from models.families.eagle3.layers import Eagle3Cache


class Eagle3DecodeRows:
    """The draft's inference side: what the decoder (drafter.py, lockstep.py) calls between base steps."""

    def new_cache(self, capacity: int, device, dtype) -> Eagle3Cache:
        """An empty cache for every layer's keys: [num_layers, H_kv, capacity, hd]."""
        attn = self.layers[0].self_attn
        shape = (self.num_layers, attn.num_kv_heads, max(1, int(capacity)), attn.head_dim)
        zeros = torch.zeros(shape, device=device, dtype=dtype)
        return Eagle3Cache(zeros, zeros.clone())

    def commit_rows(self, cache: Eagle3Cache, aux: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Step 0 over n newly committed base positions (appended to `cache`, every layer): aux [n, k·d],
        next_tokens [n] (the token after each position; the last one is the root) -> outputs [n, d].
        Row i sits at position cache.length + i and sees every cached row and the new rows <= i."""
        n = int(aux.shape[0])
        past = cache.length
        g = self.fuse(aux)[None]  # [1, n, d]
        x, residual = self.layers[0].pre(self.embed_tokens(next_tokens.to(g.device))[None].to(g.dtype), g)
        cos, sin = self.rope(torch.arange(past, past + n, device=g.device)[None], x.dtype)
        mask = torch.ones(n, past + n, dtype=torch.bool, device=g.device)
        mask[:, past:] = torch.tril(mask[:, past:])

        def attend(i, q, k, v):
            cache.write(i, k, v, past)
            keys = expand_kv(cache.keys[i:i + 1, :, :past + n], self.groups)
            vals = expand_kv(cache.values[i:i + 1, :, :past + n], self.groups)
            return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)

        out = self.run_layers(x, residual, cos, sin, attend)[0]
        cache.length = past + n
        return out

    def parallel_rows(self, cache: Eagle3Cache, aux: torch.Tensor, next_tokens: torch.Tensor, slots: int
                      ) -> torch.Tensor:
        """P-EAGLE's one forward (vLLM's parallel drafting): the n newly committed rows of `commit_rows` (appended to
        `cache`) and `slots` mask slots after them, at positions cache.length + n .. + slots - 1 (the root row's
        position + 1 ..), all causal: a slot sees every committed row, the slots before it and itself. The slots'
        keys are not kept. aux [n, k·d], next_tokens [n] -> outputs [n + slots, d]: row n-1 drafts depth 1, row
        n-1+k depth k+1."""
        n = int(aux.shape[0])
        past = cache.length
        g = self.fuse(aux)[None]  # [1, n, d]
        x, residual = self.layers[0].pre(self.embed_tokens(next_tokens.to(g.device))[None].to(g.dtype), g)
        if slots:
            mx, mres = self.mask_inputs(slots, x.dtype)
            x, residual = torch.cat([x, mx], 1), torch.cat([residual, mres], 1)
        m = n + slots
        cos, sin = self.rope(torch.arange(past, past + m, device=g.device)[None], x.dtype)
        mask = torch.ones(m, past + m, dtype=torch.bool, device=g.device)
        mask[:, past:] = torch.tril(mask[:, past:])

        def attend(i, q, k, v):
            cache.write(i, k[:, :, :n], v[:, :, :n], past)
            keys = expand_kv(torch.cat([cache.keys[i:i + 1, :, :past + n], k[:, :, n:]], 2), self.groups)
            vals = expand_kv(torch.cat([cache.values[i:i + 1, :, :past + n], v[:, :, n:]], 2), self.groups)
            return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)

        out = self.run_layers(x, residual, cos, sin, attend)[0]
        cache.length = past + n
        return out

    def draft_rows(self, cache: Eagle3Cache, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                   tree_k: torch.Tensor | None, tree_v: torch.Tensor | None, visible: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Depth >= 2 rows (tree nodes), nothing committed: hidden [m, d] (each parent's output), tokens [m]
        (each node's own token, base ids), positions [m]; tree_k / tree_v [L, H_kv, M, hd] = the keys of
        nodes drafted earlier in this step, row l those of layer l (or None), visible [m, M] bool = which of them
        are each row's ancestors. Each row sees the whole cache, its ancestors and itself.
        Returns (outputs [m, d], tree_k, tree_v with these rows appended)."""
        m = int(hidden.shape[0])
        x, residual = self.layers[0].pre(self.embed_tokens(tokens.to(hidden.device))[None].to(hidden.dtype),
                                         hidden[None])
        cos, sin = self.rope(positions.to(hidden.device)[None], x.dtype)
        past, big_m = cache.length, m + (0 if tree_k is None else int(tree_k.shape[2]))
        mask = torch.zeros(m, past + big_m, dtype=torch.bool, device=hidden.device)
        mask[:, :past] = True
        if visible is not None and visible.shape[1]:
            mask[:, past:past + visible.shape[1]] = visible
        mask[torch.arange(m), past + big_m - m + torch.arange(m)] = True  # itself
        grown_k, grown_v = [], []

        def attend(i, q, k, v):
            tk = k if tree_k is None else torch.cat([tree_k[i:i + 1], k], dim=2)
            tv = v if tree_v is None else torch.cat([tree_v[i:i + 1], v], dim=2)
            grown_k.append(tk), grown_v.append(tv)
            keys = expand_kv(torch.cat([cache.keys[i:i + 1, :, :past], tk], 2), self.groups)
            vals = expand_kv(torch.cat([cache.values[i:i + 1, :, :past], tv], 2), self.groups)
            return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)

        out = self.run_layers(x, residual, cos, sin, attend)[0]
        if len(grown_k) == 1:
            return out, grown_k[0], grown_v[0]
        return out, torch.cat(grown_k, 0), torch.cat(grown_v, 0)
