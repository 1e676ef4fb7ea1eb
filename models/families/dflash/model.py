"""DFlash: a small block-diffusion draft that fills a whole block of γ slots in one forward pass
(docs/families/dflash.md; the layout speculators trains and vLLM serves with method dflash, see
models/export/vllm.py).

At base position t (the base has committed x_0..x_t, its aux states at 0..t are known, and it chose the root
x_{t+1}):

    c_i   = hidden_norm(fc([a_i^(l1); ...; a_i^(lk)]))      i = 0..t: the context features [d] (aux = the base's
                                                            residual stream after layers l1..lk, as EAGLE-3's)
    block = [x_{t+1}, M, M, ..., M]                         γ slots at positions t+1 .. t+γ; M = the mask token
    x     = e(block)                                        frozen base embedding; M's row is `mask_embedding`
    N decoder layers (Qwen3-shaped: per-head q_norm / k_norm), each
        q, k_b, v_b = from input_layernorm(x)               the block's own queries / keys / values
        k_c, v_c    = k_proj / v_proj of c_0..c_t           the context as extra keys / values (no input norm)
        x = x + o_proj(Attn(q; [k_c | k_b], [v_c | v_b]))    every slot sees the whole context and the whole
        x = x + MLP(post_attention_layernorm(x))             block (bidirectional inside the block)
    logits_k = lm_head(norm(x_k))                            slot k = 1..γ-1 drafts x_{t+1+k} (depth k)

so one forward drafts γ-1 tokens, which is what vLLM runs (slot 0's output is not sampled). RoPE: context row i
at position i, slot k at t+1+k (vLLM's and speculators' positions). k_norm applies to context and block keys
alike; values are not normed.

Training (`loss`): anchors t sampled along each conversation among the positions whose depth-1 target is
valid (the offset rule, docs/concepts.md#the-offset-rule), one block per anchor, all blocks of a batch in one
forward. `block_attention` computes only the allowed parts of the block-sparse mask: the context
scores [A·γ, T] (slot of anchor t sees positions <= t) and each block's own [γ, γ]; its slow twin
`block_attention_reference` builds the dense [A·γ, T + A·γ] mask (speculators' flex-attention mask) and goes
through sdpa (parity test in tests/test_dflash.py). Targets of slot k: x_{t+1+k}; teacher: the base's
distribution at t+k over the draft vocabulary; row loss and per-position weights in losses/dflash.py.

Inference (`new_cache`, `commit_context`, `draft_block`): the context K/V of each layer only depend on committed
positions, so they are computed once per committed position and cached (vLLM does the same), and a propose step
runs the γ block slots against the cache.

The machinery (layers, block attention, anchors, the loss, the context cache) is `models.block_draft.BlockDraft`,
shared with DSpark (models/families/dspark/model.py); this file declares the family and its configs.

Initialisation (speculators' recipe): the layers and fc start random (normal, std = the base's
initializer_range), the norms at one, the LM head at the base's rows over the draft vocabulary, the mask
embedding at the base's embedding row of the mask token.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.block_draft import (  # noqa: F401 - the block pieces stay importable under their DFlash names
    MAX_BLOCK_SIZE,
    BlockDraft,
    block_attention,
    block_attention_reference,
)
from models.block_draft import BlockAttention as DFlashAttention  # noqa: F401
from models.block_draft import BlockCache as DFlashCache  # noqa: F401
from models.block_draft import BlockLayer as DFlashLayer  # noqa: F401
from models.components import default_mask_token_id  # noqa: F401
from models.family import FamilyFacts


@dataclass
class DFlashOptions:
    """DFlash's training options (draft.dflash.*)."""

    block_size: int = 16  # slots per block (the root + block_size-1 drafts of one forward); draft.num_heads = it - 1
    num_anchors: int = 512  # blocks trained per conversation (anchors sampled among supervised positions)
    mask_token_id: int = -1  # the token id of the mask slots; -1 = the base's pad token, else eos, else 0
    learned_mask: bool = True  # train the mask slots' embedding (false: the base's row of mask_token_id)


@dataclass
class DFlashLossOptions:
    """DFlash's loss options (loss.dflash.*)."""

    position_weights: str = "dpace"  # weights of the drafted slots of a block: dpace (by the accepted length
    # hanging on each slot) | decay (slot k gets loss.lambda0 * loss.decay**(k-1))
    dpace_alpha: float = 0.5  # D-PACE smoothing of the slot confidences, in (0, 1]


class DFlashDraft(BlockDraft):
    facts = FamilyFacts("dflash", "DFlash", ("specdraft", "vllm", "gguf"), vllm_method="dflash",
                        vllm_schedule=True, llamacpp_spec_type="draft-dflash", llamacpp_whole_block=True,
                        export_keys=("aux_layers", "block_size", "num_layers", "mask_token_id"),
                        draft_options=DFlashOptions, loss_options=DFlashLossOptions,
                        flat_keys=("draft.block_size", "draft.num_anchors", "draft.mask_token_id",
                                   "draft.learned_mask", "loss.position_weights", "loss.dpace_alpha"),
                        summary="block diffusion: fused base layers as context keys / values of a few bidirectional "
                        "decoder layers, which fill a block of γ slots (root + γ-1 mask slots) in one forward; chain "
                        "or static tree")

    config_notes = {"block_size": "the root + the drafts; default 16", "num_layers": " (speculators: 5)",
                    "num_anchors": " (speculators: 512)", "dpace_alpha": " (speculators: 0.5)",
                    "position_weights": " (dpace: speculators' DFlash default; decay: loss.lambda0 * "
                                        "loss.decay^(k-1))"}

    # -- export (construction from configs: BlockDraft.from_config / from_export_config, by own_args) ------

    def export_config(self) -> dict:
        return {"family": self.family, "aux_layers": list(self.aux_layers), "num_layers": self.num_layers,
                "block_size": self.block_size, "num_heads": self.num_heads, "mask_token_id": self.mask_token_id,
                "learned_mask": self.learned_mask, "num_anchors": self.num_anchors,
                "draft_vocab_size": self.draft_vocab_size, "share_lm_head": self.share_lm_head,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size}
