"""Domino: DFlash's block-parallel draft plus a causal correction, a GRU over the tokens drafted before each slot
(docs/families/domino.md; SpecForge 0.3's `projector_type: domino`, its training in specforge/core/domino.py).

DFlash fills a block in one non-causal forward, so a slot never sees the tokens drafted before it in its own block.
Domino keeps that forward and corrects each slot's logits with a small recurrent state of the block's earlier
tokens. At base position t (committed x_0..x_t, the base's aux states at 0..t known, the root x_{t+1} chosen), one
forward of the block [x_{t+1}, M, ..., M] (γ = block_size slots at positions t+1 .. t+γ) through DFlash's layers
(models/block_draft.py: BlockDraft; the math: ../dflash/model.py) gives h_0 .. h_{γ-1} (after the final norm).
Every slot drafts, the root's included (SpecForge's `shift_label`): slot k predicts depth k+1. Left to right:

    p_0   = x_{t+1}                                          the root
    g_k   = GRU(e(p_k), g_{k-1})        g_{-1} = 0           [G]  e = the base's frozen embedding; no biases
    c_k   = W_out SiLU(W_in [h_k ; g_k])                     [N]  W_in: [C, d + G], W_out: [N, C] (C = correction_dim)
    z_k   = lm_head(h_k) + c_k          (c_k = 0 for k < prefix_len: those slots are the backbone's alone)
    d_k   = argmax z_k  (its base id)                        the draft at depth k+1; p_{k+1} = d_k

so slot k's logits depend on every token drafted before it (the GRU's state after the root and d_0..d_{k-1}), at
the cost of one GRU step and a [N, C] product per slot, not a forward. SpecForge's names: prefix_gru (nn.GRU,
bias=False), embed_proj = [Linear(d+G, C), SiLU, Linear(C, N)], pure_draft_prefix_len (default 1), emb_dim = C,
gru_hidden_dim = G; SGLang's `domino_greedy_rollout` decodes the same way.

Training (`loss`, BlockDraft's with two hooks): teacher-forced, p_k is the true token x_{t+1+k} and the GRU runs
over the block's true tokens in one call; the row of depth k is [h_k ; SiLU(W_in [h_k ; g_k])] against
[lm_head | W_out], one linear layer, so the chunked fused CE of losses/block.py applies unchanged (the [rows, N]
logits are never held). SpecForge mixes two CEs, (1 - λ)·CE(z) + λ·CE(lm_head(h)), λ decaying from 1 to 0 over
training so the backbone stays a good DFlash while the correction learns; the loss here has no notion of the
training step, so it adds the backbone's CE at a constant weight: CE(z) + loss.domino.base_weight·CE(lm_head(h))
(BlockDraft.more_row_features), the same objective as a constant λ = w / (1 + w) up to a factor.

Initialisation: the GRU and W_in as PyTorch's defaults, W_out = 0 (a fresh Domino drafts like a DFlash whose root
slot drafts too); the mask slots' input is the base's embedding row of mask_token_id, frozen (SpecForge embeds
the mask token with the target's embedding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from models.block_draft import BlockCache, BlockDraft
from models.draft import BaseView
from models.family import FamilyFacts


@dataclass
class DominoOptions:
    """Domino's training options (draft.domino.*)."""

    block_size: int = 8  # slots per block = tokens drafted per forward (the root slot drafts too); draft.num_heads = it
    num_anchors: int = 512  # blocks trained per conversation (anchors sampled among supervised positions)
    mask_token_id: int = -1  # the token id of the mask slots; -1 = the base's pad token, else eos, else 0
    gru_hidden: int = 512  # G: the GRU's state over the block's earlier tokens (SpecForge gru_hidden_dim; 1024 at 8B)
    correction_dim: int = 256  # C: width of the correction W_out SiLU(W_in [h; g]) (SpecForge emb_dim, 256)
    prefix_len: int = 1  # leading drafted slots left uncorrected, the backbone's logits alone (pure_draft_prefix_len)


@dataclass
class DominoLossOptions:
    """Domino's loss options (loss.domino.*)."""

    position_weights: str = "dpace"  # weights of a block's drafted slots: dpace | decay (loss.lambda0 * loss.decay**k)
    dpace_alpha: float = 0.5  # D-PACE smoothing of the slot confidences, in (0, 1]
    base_weight: float = 0.5  # weight of the backbone's own CE (lm_head alone) beside the corrected one; 0 = none


class Correction(nn.Module):
    """prefix_gru (GRU over base embeddings, no biases) and embed_proj ([d + G] -> C -> SiLU -> [N]): SpecForge's
    state-dict names."""

    def __init__(self, hidden_size: int, gru_hidden: int, correction_dim: int, draft_vocab_size: int):
        super().__init__()
        self.prefix_gru = nn.GRU(hidden_size, gru_hidden, num_layers=1, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(nn.Linear(hidden_size + gru_hidden, correction_dim, bias=False), nn.SiLU(),
                                        nn.Linear(correction_dim, draft_vocab_size, bias=False))


class DominoDraft(BlockDraft):
    facts = FamilyFacts("domino", "Domino", ("specdraft",),
                        export_keys=("aux_layers", "block_size", "num_layers", "mask_token_id", "gru_hidden",
                                     "correction_dim", "prefix_len"),
                        export_key_types={"gru_hidden": int, "correction_dim": int, "prefix_len": int},
                        draft_options=DominoOptions, loss_options=DominoLossOptions,
                        summary="DFlash's block of γ slots in one forward, every slot drafting, plus a causal "
                        "correction: a GRU over the tokens drafted before each slot and a low-rank logit delta from "
                        "its state and the slot's hidden (decoded left to right); chain; our decoder only")
    anchor_drafts = True
    own_args = ("gru_hidden", "correction_dim", "prefix_len")

    @classmethod
    def check_config(cls, cfg, fail) -> None:
        super().check_config(cfg, fail)  # BlockDraft's rules; then Domino's own
        o, lo = cls.options(cfg.draft), cls.options(cfg.loss)
        if o.gru_hidden < 1 or o.correction_dim < 1:
            fail("draft.domino.gru_hidden" if o.gru_hidden < 1 else "draft.domino.correction_dim",
                 min(o.gru_hidden, o.correction_dim), "use a width >= 1 (SpecForge: 1024 and 256)")
        if not 0 <= o.prefix_len < o.block_size:
            fail("draft.domino.prefix_len", o.prefix_len, f"use 0..{o.block_size - 1} (SpecForge: 1); a prefix of "
                 "the whole block leaves nothing to correct: that is DFlash")
        if lo.base_weight < 0:
            fail("loss.domino.base_weight", lo.base_weight, "use 0 (the corrected CE alone) or more")

    def __init__(self, base: BaseView, aux_layers: list[int] | None = None, num_layers: int = 5,
                 block_size: int = 8, mask_token_id: int | None = None, num_anchors: int = 512,
                 gru_hidden: int = 512, correction_dim: int = 256, prefix_len: int = 1, share_lm_head: bool = False,
                 init_weights: bool = True):
        super().__init__(base, aux_layers, num_layers, block_size, mask_token_id, num_anchors, learned_mask=False,
                         share_lm_head=share_lm_head, init_weights=init_weights)
        if gru_hidden < 1 or correction_dim < 1 or not 0 <= prefix_len < self.block_size:
            raise ValueError(f"Domino: gru_hidden={gru_hidden} and correction_dim={correction_dim} must be >= 1, "
                             f"prefix_len={prefix_len} in 0..{self.block_size - 1}")
        self.gru_hidden, self.correction_dim, self.prefix_len = int(gru_hidden), int(correction_dim), int(prefix_len)
        self.correction = Correction(self.hidden_size, self.gru_hidden, self.correction_dim, self.lm_head.out_features)
        with torch.no_grad():
            self.correction.embed_proj[2].weight.zero_()

    # -- export (construction from configs: BlockDraft.from_config / from_export_config, by own_args) ------

    def export_config(self) -> dict:
        return {"family": self.family, "aux_layers": list(self.aux_layers), "num_layers": self.num_layers,
                "block_size": self.block_size, "num_heads": self.num_heads, "mask_token_id": self.mask_token_id,
                "num_anchors": self.num_anchors, "gru_hidden": self.gru_hidden,
                "correction_dim": self.correction_dim, "prefix_len": self.prefix_len,
                "draft_vocab_size": self.draft_vocab_size, "share_lm_head": self.share_lm_head,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size}

    # -- the correction ----------------------------------------------------------------------------------

    def gru_states(self, prev: torch.Tensor, state: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [M, K] base ids (the token before each slot, left to right) -> (g [M, K, G]: the state after
        prev[:, :k+1] at k, the last state [1, M, G]); `state` [1, M, G] continues an earlier call (None: zero)."""
        gru = self.correction.prefix_gru
        x = F.embedding(prev.long(), self.embed).to(gru.weight_ih_l0.dtype)  # [M, K, d]
        return gru(x, state)

    def correction_features(self, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """h [..., d] (normed slot outputs), g [..., G] -> SiLU(W_in [h ; g]) [..., C], what W_out maps to logits."""
        proj = self.correction.embed_proj
        return proj[1](proj[0](torch.cat([h, g.to(h.dtype)], dim=-1).to(proj[0].weight.dtype)))

    # -- training hooks (models/block_draft.py: BlockDraft._block_loss) -----------------------------------

    def row_features(self, out: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[h ; SiLU(W_in [h ; g])] against [lm_head | W_out]: logits = lm_head(h) + W_out SiLU(W_in [h ; g]) in one
        linear map; the first prefix_len slots get a zero correction."""
        h = self.head_input(out)  # [B, A, K, d]
        b, a, k, d = h.shape
        g, _ = self.gru_states(prev.reshape(b * a, k))  # [B·A, K, G]: teacher forced, every slot at once
        c = self.correction_features(h, g.view(b, a, k, -1))  # [B, A, K, C]
        keep = (torch.arange(k, device=h.device) >= self.prefix_len)[:, None].to(c.dtype)  # [K, 1]
        feats = torch.cat([h, (c * keep).to(h.dtype)], dim=-1)
        weight = torch.cat([self.lm_head.weight, self.correction.embed_proj[2].weight.to(self.lm_head.weight.dtype)],
                           dim=1)  # [N, d + C]
        return feats.reshape(-1, feats.shape[-1]), weight

    def more_row_features(self, out, prev, loss_cfg):
        """The backbone's own logits lm_head(h), at loss.domino.base_weight (SpecForge's base-anchor CE)."""
        weight = float(self.options(loss_cfg).base_weight)
        if weight == 0:
            return []
        h = self.head_input(out)
        return [(weight, (h.reshape(-1, h.shape[-1]), self.lm_head.weight))]

    # -- inference ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def draft_chain(self, cache: BlockCache, root: int, depth: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block forward, then the slots left to right, each corrected by the GRU's state after the root and
        the drafts before it (greedy, as SGLang's domino_greedy_rollout) -> (drafts [D] base ids, the corrected
        logits [D, N] each draft is the argmax of); D = depth or block_size. A shorter chain runs a block of D
        slots (the slots see each other: a cut full block would draft other tokens). draft_chains with one
        block."""
        roots = torch.tensor([int(root)], dtype=torch.long, device=cache.keys[0].device)
        drafts, logits = self.draft_chains([cache.context()], roots, depth)
        return drafts[0], logits[0]

    @torch.no_grad()
    def draft_chains(self, contexts: list, roots: torch.Tensor, depth: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_chain of B blocks at once (BlockDraft.draft_blocks_outputs' contexts and roots [B]): every GRU step
        and correction runs over the B blocks' rows together. Returns (drafts [B, D] base ids, the corrected logits
        [B, D, N])."""
        h = self.head_input(self.draft_blocks_outputs(contexts, roots, depth))  # [B, D, d]
        base_logits = self.lm_head(h)  # [B, D, N]
        w_out = self.correction.embed_proj[2]
        prev = roots[:, None]  # [B, 1] base ids: the token the GRU reads next
        state, drafts, logits = None, [], []
        for k in range(h.shape[1]):
            g, state = self.gru_states(prev, state)  # g [B, 1, G]: after the root and d_0 .. d_{k-1}
            z = base_logits[:, k]  # [B, N]
            if k >= self.prefix_len:
                z = z + w_out(self.correction_features(h[:, k], g[:, -1])).to(z.dtype)
            d = self.to_base(z.argmax(dim=-1))  # [B] base ids
            drafts.append(d)
            logits.append(z)
            prev = d[:, None]
        return torch.stack(drafts, dim=1), torch.stack(logits, dim=1)
