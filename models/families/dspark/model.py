"""DSpark: DFlash's block-parallel draft plus a low-rank Markov logit bias and a confidence head
(docs/families/dspark.md; the layout speculators trains and vLLM serves with method dspark, see
models/families/dspark/export_speculators.py).

At base position t (committed x_0..x_t, the base's aux states at 0..t known, the root x_{t+1} chosen), one forward
of the block [x_{t+1}, M, ..., M] (γ = block_size slots at positions t+1 .. t+γ) through DFlash's layers
(models/block_draft.py: BlockDraft; the math: ../dflash/model.py) gives h_0 .. h_{γ-1} (after the final norm).
Unlike DFlash, every slot drafts, the root's included (speculators' / vLLM's `sample_from_anchor`): slot k predicts
the token after its own position, depth k+1, so one forward drafts γ tokens. Left to right inside the block:

    p_0   = x_{t+1}                                          the root
    e_k   = W1[p_k]                                          [r]   W1: [V, r] over the base vocabulary
    z_k   = lm_head(h_k) + W2 e_k                            [N]   W2: [N, r] into the draft vocabulary
    d_k   = argmax z_k  (its base id)                        the draft at depth k+1; p_{k+1} = d_k
    c_k   = σ(w_c · [h_k ; e_k] + b_c)                       the confidence head: P(d_k accepted | d_<k were)

so a slot's logits depend on the token drafted just before it (first-order Markov), at the cost of one r-wide
embedding row and one [N, r] product per slot, not a forward. This is vLLM 0.32's `DSparkSpeculator._sample_sequential`
(greedy) and `Qwen3DSparkForCausalLM` (markov_head.markov_w1 / markov_w2, confidence_head.proj). vLLM's adaptive
verification multiplies the c_k (survival to depth k = Π_{j<=k} c_j); our drafter can cut the chain where that
product falls below a threshold (eval extra.confidence_cut).

The mask slots' input is the base's embedding row of mask_token_id, frozen: vLLM's DSpark loader ignores a learned
mask embedding (it "masks via the vocab row"), so DSpark has no learned_mask option.

Training (`loss`, BlockDraft's with two hooks): teacher-forced, p_k is the true token x_{t+1+k}; the row of depth
k is [norm(h_{k-1}) ; W1[x_{t+k}]] against [lm_head | W2], one linear layer, so the chunked fused CE of
losses/block.py applies unchanged (logits never held for all rows). Per-position weights: loss.dspark.position_weights
(dpace | decay). The confidence head adds loss.dspark.confidence_weight · BCE(c_k, top-1 of depth k == target)
(losses/block.py: acceptance_bce). Speculators targets 1 - TV(draft, base) there, the acceptance rate under
sampling; the greedy hit is its temperature-0 counterpart, which is what our and vLLM's greedy chains accept.

Initialisation: W1 ~ N(0, 0.01²) (speculators), W2 = 0 (a fresh DSpark drafts like a DFlash whose root slot drafts
too; speculators starts W2 at nn.Linear's default), the confidence head at 0 (c = 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from losses.block import acceptance_bce
from models.block_draft import BlockCache, BlockDraft
from models.draft import BaseView
from models.family import FamilyFacts


@dataclass
class DSparkOptions:
    """DSpark's training options (draft.dspark.*)."""

    block_size: int = 8  # slots per block = tokens drafted per forward (the root slot drafts too); draft.num_heads = it
    num_anchors: int = 512  # blocks trained per conversation (anchors sampled among supervised positions)
    mask_token_id: int = -1  # the token id of the mask slots; -1 = the base's pad token, else eos, else 0
    markov_rank: int = 256  # r of the Markov logit bias W2 · W1[previous token] (speculators' default 256)


@dataclass
class DSparkLossOptions:
    """DSpark's loss options (loss.dspark.*)."""

    position_weights: str = "dpace"  # weights of a block's drafted slots: dpace | decay (loss.lambda0 * loss.decay**k)
    dpace_alpha: float = 0.5  # D-PACE smoothing of the slot confidences, in (0, 1]
    confidence_weight: float = 1.0  # weight of the confidence head's BCE (speculators' confidence_head_alpha)


class MarkovHead(nn.Module):
    """markov_w1 [V, r] (previous token, base ids) and markov_w2 [N, r] (bias over the draft vocabulary): the
    state-dict names of speculators' and vLLM's DSpark."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """proj: [d + r] -> 1 logit, with bias (vLLM's DSparkConfidenceHead(bias=True), speculators' ConfidenceHead)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


class DSparkDraft(BlockDraft):
    facts = FamilyFacts("dspark", "DSpark", ("specdraft", "vllm"), vllm_method="dspark",
                        export_keys=("aux_layers", "block_size", "num_layers", "mask_token_id", "markov_rank"),
                        draft_options=DSparkOptions, loss_options=DSparkLossOptions,
                        summary="DFlash's block of γ slots in one forward, every slot drafting, plus a low-rank Markov "
                        "logit bias from the token drafted before each slot (decoded left to right) and a "
                        "per-position confidence head; chain")
    anchor_drafts = True
    own_args = ("markov_rank",)

    @classmethod
    def check_config(cls, cfg, fail) -> None:
        super().check_config(cfg, fail)  # BlockDraft's rules; then DSpark's own
        o, lo = cls.options(cfg.draft), cls.options(cfg.loss)
        if o.markov_rank < 1:
            fail("draft.dspark.markov_rank", o.markov_rank, "use a rank >= 1 (speculators: 256); without the Markov "
                 "head the family is DFlash")
        if lo.confidence_weight < 0:
            fail("loss.dspark.confidence_weight", lo.confidence_weight, "use 0 (confidence head untrained) or more")

    def __init__(self, base: BaseView, aux_layers: list[int] | None = None, num_layers: int = 5,
                 block_size: int = 8, mask_token_id: int | None = None, num_anchors: int = 512,
                 markov_rank: int = 256, share_lm_head: bool = False, init_weights: bool = True):
        super().__init__(base, aux_layers, num_layers, block_size, mask_token_id, num_anchors, learned_mask=False,
                         share_lm_head=share_lm_head, init_weights=init_weights)
        if markov_rank < 1:
            raise ValueError(f"DSpark: markov_rank={markov_rank} must be >= 1")
        self.markov_rank = int(markov_rank)
        self.markov_head = MarkovHead(self.vocab_size, self.lm_head.out_features, self.markov_rank)
        self.confidence_head = ConfidenceHead(self.hidden_size + self.markov_rank)
        with torch.no_grad():
            nn.init.normal_(self.markov_head.markov_w1.weight, std=0.01)
            self.markov_head.markov_w2.weight.zero_()
            self.confidence_head.proj.weight.zero_()
            self.confidence_head.proj.bias.zero_()

    # -- export (construction from configs: BlockDraft.from_config / from_export_config, by own_args) ------

    def export_config(self) -> dict:
        return {"family": self.family, "aux_layers": list(self.aux_layers), "num_layers": self.num_layers,
                "block_size": self.block_size, "num_heads": self.num_heads, "mask_token_id": self.mask_token_id,
                "num_anchors": self.num_anchors, "markov_rank": self.markov_rank,
                "draft_vocab_size": self.draft_vocab_size, "share_lm_head": self.share_lm_head,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size}

    # -- the two heads -----------------------------------------------------------------------------------

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [...] base ids (the token before each slot) -> W1[prev] [..., r]."""
        return self.markov_head.markov_w1(prev.long()).to(self.lm_head.weight.dtype)

    def confidence_logits(self, head_in: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """head_in [..., d] (norm of the layer output), emb [..., r] -> the acceptance logit [...]."""
        x = torch.cat([head_in, emb.to(head_in.dtype)], dim=-1)
        return self.confidence_head.proj(x.to(self.confidence_head.proj.weight.dtype)).squeeze(-1)

    # -- training hooks (models/block_draft.py: BlockDraft._block_loss) -----------------------------------

    def row_features(self, out: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[norm(h) ; W1[prev]] against [lm_head | W2]: logits = lm_head(norm(h)) + W2 W1[prev], in one linear map."""
        h = self.head_input(out)  # [B, A, K, d]
        feats = torch.cat([h, self.markov_embed(prev).to(h.dtype)], dim=-1)
        weight = torch.cat([self.lm_head.weight, self.markov_head.markov_w2.weight.to(self.lm_head.weight.dtype)],
                           dim=1)  # [N, d + r]
        return feats.reshape(-1, feats.shape[-1]), weight

    def extra_block_loss(self, out, prev, hits, valid, loss_cfg) -> torch.Tensor | None:
        weight = float(self.options(loss_cfg).confidence_weight)
        if weight == 0:
            return None
        logits = self.confidence_logits(self.head_input(out), self.markov_embed(prev))  # [B, A, K]
        return weight * acceptance_bce(logits.reshape(hits.shape), hits, valid)

    # -- inference ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def draft_chain(self, cache: BlockCache, root: int, depth: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block forward, then the slots left to right with the Markov bias of the token before each (greedy,
        as vLLM's DSparkSpeculator) -> (drafts [D] base ids, confidences [D] in (0, 1)); D = depth or block_size.
        A shorter chain runs a block of D slots: vLLM's DSpark queries num_speculative_tokens slots (the root and
        D-1 mask slots), and the slots see each other, so a cut full block would draft other tokens. draft_chains
        with one block."""
        roots = torch.tensor([int(root)], dtype=torch.long, device=cache.keys[0].device)
        drafts, conf, _ = self.draft_chains([cache.context()], roots, depth)
        return drafts[0], conf[0]

    @torch.no_grad()
    def draft_chains(self, contexts: list, roots: torch.Tensor, depth: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """draft_chain of B blocks at once (BlockDraft.draft_blocks_outputs' contexts and roots [B]): every step of
        the left-to-right walk runs over the B blocks' rows together. Returns (drafts [B, D] base ids, confidences
        [B, D], the biased logits [B, D, N] each draft is the argmax of)."""
        h = self.head_input(self.draft_blocks_outputs(contexts, roots, depth))  # [B, D, d]
        base_logits = self.lm_head(h)  # [B, D, N]
        w2 = self.markov_head.markov_w2
        prev = roots  # [B] base ids: the token before slot k
        drafts, embs, logits = [], [], []
        for k in range(h.shape[1]):
            emb = self.markov_embed(prev)  # [B, r]
            z = base_logits[:, k] + w2(emb.to(w2.weight.dtype))  # [B, N]
            prev = self.to_base(z.argmax(dim=-1))  # [B] base ids
            drafts.append(prev)
            embs.append(emb)
            logits.append(z)
        conf = torch.sigmoid(self.confidence_logits(h, torch.stack(embs, dim=1)).float())  # [B, D]
        return torch.stack(drafts, dim=1), conf, torch.stack(logits, dim=1)
