"""The block-parallel draft DFlash, DSpark and Domino extend: one forward fills a block of mask slots against the
context keys / values of the base's aux states (the math is written out in models/families/dflash/model.py's
docstring).

    block_attention (+ reference),  the layers it is made of (models/block_layers.py, importable from here too): the
    BlockAttention, BlockLayer,     slots' attention over the context and the block, a decoder layer whose keys /
    BlockCache                      values come from the context and the slots, the context cache of decoding
    BlockDraft                      the draft: anchors, the block loss and its hooks, the rules its families share
                                    (`check_config`), export and load; at inference B blocks each against its own
                                    context in one forward (`draft_blocks_outputs`: one block for a drafter's
                                    propose, every active prompt's for the field benchmark's batched path)

The parameter names are state-dict keys of exports on disk: renaming one would break loading them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from data.targets import offset_labels
from losses.block import block_position_weights, block_weighted_loss, linear_row_losses, linear_row_losses_reference
from models.block_layers import (  # noqa: F401 - importable from here as before
    BlockAttention,
    BlockCache,
    BlockLayer,
    block_attention,
    block_attention_reference,
)
from models.components import (
    RMSNorm,
    check_aux_layers,
    default_aux_layers,
    default_mask_token_id,
    expand_kv,
    rope_cos_sin,
)
from models.draft import BaseView, DepthStats, DraftBatch, DraftLossOutput, DraftModel
from models.vocab_map import DraftVocabMixin, export_base, restrict_rows, to_draft_labels

MAX_BLOCK_SIZE = 64  # slots per block, the root included



class BlockDraft(DraftVocabMixin, DraftModel):
    """The block-parallel draft DFlash and DSpark share (models/families/dflash/model.py: the math): fc over the
    base's aux layers -> the context keys / values of N Qwen3-shaped layers, which fill a block [root, M, ..., M]
    in one forward. A subclass declares its facts, its configs and, where it differs, `anchor_drafts` (slot 0,
    the root, drafts depth 1 too: DSpark), `row_features` / `more_row_features` / `extra_block_loss` (more terms
    in the loss) and what it does with `draft_block_outputs`."""

    anchor_drafts = False  # True: slots 0..G-1 draft depths 1..G (each slot predicts the next position's token)
    sequence_parallel = True  # train.sequence_parallel: each rank's blocks against the whole context (Ulysses)
    # What a family's config messages add, by rule: its default block ("default 8"), and where it cites its
    # reference implementation's value (DFlash: speculators').
    config_notes: dict[str, str] = {}
    # The subclass's own constructor arguments after the shared ones, by name: read from its draft options by
    # from_config and from the export's config.json (absent: the options' default) by from_export_config.
    own_args: tuple[str, ...] = ("learned_mask",)

    @classmethod
    def from_config(cls, draft_cfg, base: BaseView) -> BlockDraft:
        o = cls.options(draft_cfg)
        return cls(base, list(draft_cfg.aux_layers) or None, draft_cfg.num_layers, o.block_size, o.mask_token_id,
                   o.num_anchors, share_lm_head=draft_cfg.share_lm_head, **{a: getattr(o, a) for a in cls.own_args})

    @classmethod
    def from_export_config(cls, cfg: dict, base: BaseView) -> BlockDraft:
        base, defaults = export_base(cfg, base, cls.facts.title), cls.facts.draft_options()
        return cls(base, cfg["aux_layers"], cfg["num_layers"], cfg["block_size"], cfg["mask_token_id"],
                   cfg.get("num_anchors", 512), share_lm_head=cfg.get("share_lm_head", False), init_weights=False,
                   **{a: cfg.get(a, getattr(defaults, a)) for a in cls.own_args})

    @classmethod
    def check_config(cls, cfg, fail) -> None:
        """The training-config rules every block family has (draft.<name>.block_size / num_anchors / mask_token_id,
        one reported depth per drafted slot, the loss's position weights, ZeRO <= 2); a family that has more calls
        this first (super().check_config) and adds its own."""
        d, o, lo = cfg.draft, cls.options(cfg.draft), cls.options(cfg.loss)
        name, title, note = cls.facts.name, cls.facts.title, cls.config_notes.get
        if not 2 <= o.block_size <= MAX_BLOCK_SIZE:
            fail(f"draft.{name}.block_size", o.block_size, f"{title} blocks hold 2..{MAX_BLOCK_SIZE} slots "
                 f"({note('block_size', 'default 8')})")
        # one reported depth per drafted slot: G with the root drafting too (anchor_drafts), else G - 1
        heads, minus = (o.block_size, "") if cls.anchor_drafts else (o.block_size - 1, " - 1")
        if d.num_heads != heads:
            per_slot = "per slot (the root's drafts too)" if cls.anchor_drafts else "per drafted slot"
            fail("draft.num_heads", d.num_heads, f"{title} reports one depth {per_slot}: set draft.num_heads={heads} "
                 f"(= draft.{name}.block_size{minus}), as configs/{name}.yaml does")
        if d.num_layers < 1:
            fail("draft.num_layers", d.num_layers, f"{title} needs at least one decoder layer{note('num_layers', '')}")
        if o.num_anchors < 1:
            fail(f"draft.{name}.num_anchors", o.num_anchors,
                 f"train at least one block per conversation{note('num_anchors', '')}")
        if o.mask_token_id < -1:
            fail(f"draft.{name}.mask_token_id", o.mask_token_id, "use -1 (the base's pad / eos token) or a token id")
        if any(i < 0 for i in d.aux_layers) or len(set(d.aux_layers)) != len(d.aux_layers):
            fail("draft.aux_layers", d.aux_layers, "give distinct base layer ids >= 0, or [] for [2, L//2, L-3]")
        if lo.position_weights not in ("dpace", "decay"):
            fail(f"loss.{name}.position_weights", lo.position_weights,
                 f"use dpace or decay{note('position_weights', '')}")
        if not 0.0 < lo.dpace_alpha <= 1.0:
            fail(f"loss.{name}.dpace_alpha", lo.dpace_alpha,
                 f"use a smoothing constant in (0, 1]{note('dpace_alpha', '')}")
        if cfg.deepspeed.zero_stage == 3:
            fail("deepspeed.zero_stage", 3, f"{title}'s loss reads its LM-head weight directly; use stage 0-2")

    def __init__(self, base: BaseView, aux_layers: list[int] | None = None, num_layers: int = 5,
                 block_size: int = 16, mask_token_id: int | None = None, num_anchors: int = 512,
                 learned_mask: bool = True, share_lm_head: bool = False, init_weights: bool = True):
        super().__init__()
        if base.model is None:
            raise ValueError(f"{self.facts.title} builds decoder layers of the base's shape, but this BaseView has no "
                             "`.model`; build it with BaseView.from_model(base_model)")
        config = base.model.config
        if not 2 <= block_size <= MAX_BLOCK_SIZE or num_layers < 1 or num_anchors < 1:
            raise ValueError(f"{self.facts.title}: block_size={block_size} must be in 2..{MAX_BLOCK_SIZE}, "
                             f"num_layers={num_layers} and num_anchors={num_anchors} >= 1")
        n_layers = int(config.num_hidden_layers)
        self.aux_layers = check_aux_layers(aux_layers or default_aux_layers(n_layers), n_layers)
        self.block_size, self.num_layers, self.num_anchors = int(block_size), int(num_layers), int(num_anchors)
        # Drafted slots: 1..G-1 (slot 0 holds the root), or 0..G-1 when slot 0 drafts too (anchor_drafts).
        self.first_slot = 0 if self.anchor_drafts else 1
        self.num_heads = self.block_size - self.first_slot  # one reported depth per drafted slot
        d = int(config.hidden_size)
        self.hidden_size, self.vocab_size = d, int(base.vocab_size)
        self.eps = float(config.rms_norm_eps)
        self.layer_config = config  # read by the vLLM export (transformer_layer_config); not a module
        mask_id = default_mask_token_id(config) if mask_token_id is None or mask_token_id < 0 else int(mask_token_id)
        if not 0 <= mask_id < self.vocab_size:
            raise ValueError(f"draft.mask_token_id={mask_id} is outside the base's {self.vocab_size} tokens")
        self.mask_token_id = mask_id

        n_out = self._init_vocab(base)  # d2t (persistent) / t2d / base rows W[d2t]: models/vocab_map.py

        self.fc = nn.Linear(len(self.aux_layers) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, self.eps)
        self.layers = nn.ModuleList([BlockLayer(config) for _ in range(self.num_layers)])
        self.norm = RMSNorm(d, self.eps)
        self.lm_head = nn.Linear(d, n_out, bias=False)
        # Frozen base input embedding [V, d]: never trained, never exported (vLLM shares the base's).
        self.register_buffer("embed", base.embed_weight, persistent=False)
        # The mask slots' input [d]: learned (exported as vLLM's mask_embedding.pt) or the base's row, frozen.
        self.learned_mask = bool(learned_mask)
        self.mask_embedding = nn.Parameter(base.embed_weight[mask_id].detach().clone().float(),
                                           requires_grad=self.learned_mask)

        body = getattr(base.model, "model", None)
        rotary = getattr(body, "rotary_emb", None)
        if rotary is None:
            raise ValueError(f"{type(base.model).__name__} has no `.model.rotary_emb`; {self.facts.title} needs a "
                             "LLaMA-style causal LM (LlamaForCausalLM, Qwen2/3, Mistral, ...)")
        fresh = type(rotary)(config=config)  # RoPE frequencies in fp32 outside the buffers (as EAGLE-3)
        # Bases with per-layer-type RoPE (Gemma 3: sliding / full): the draft's layers are full attention.
        prefix = "" if hasattr(fresh, "inv_freq") else "full_attention_"
        self._inv_freq = getattr(fresh, f"{prefix}inv_freq").detach().float().cpu().clone()
        self._rope_scale = float(getattr(fresh, f"{prefix}attention_scaling", 1.0))
        attn = self.layers[0].self_attn
        self.groups = attn.num_heads // attn.num_kv_heads

        self.share_lm_head = bool(share_lm_head)
        self.lm_head.weight.requires_grad_(not self.share_lm_head)
        with torch.no_grad():
            self.lm_head.weight.copy_(self.base_rows())
            if init_weights:
                std = float(getattr(config, "initializer_range", 0.02))
                for module in [self.fc, *self.layers]:
                    for name, p in module.named_parameters():
                        if name.endswith("norm.weight"):
                            p.fill_(1.0)
                        elif name.endswith("bias"):
                            p.zero_()
                        else:
                            p.normal_(0.0, std)

    # -- construction -------------------------------------------------------------------------------------

    @staticmethod
    def resolve_aux_layers(draft_cfg, model) -> list[int]:
        """The aux layer ids a config asks for on this base (the loop and the hidden cache need them first)."""
        n_layers = int(model.config.num_hidden_layers)
        return check_aux_layers(list(draft_cfg.aux_layers) or default_aux_layers(n_layers), n_layers)

    # -- pieces shared by training and inference ---------------------------------------------------------

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..] long -> (cos, sin) [.., hd] (HF rotate-half layout, fp32 angles)."""
        return rope_cos_sin(self._inv_freq, self._rope_scale, positions, dtype)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [.., k·d] (the base's aux layers side by side, in aux_layers order) -> hidden_norm(fc(aux)) [.., d]."""
        if aux.shape[-1] != self.fc.in_features:
            raise ValueError(f"{self.facts.title} expects aux hidden states [..., {self.fc.in_features}] (layers "
                             f"{self.aux_layers} x d={self.hidden_size}), got {tuple(aux.shape)}")
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """ctx [B, T, d] (context features), positions [B or 1, T] -> per layer (k, v) [B, H_kv, T, hd]."""
        cos, sin = self.rope(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def embed_block(self, tokens: torch.Tensor) -> torch.Tensor:
        """Block tokens [...] (base ids; mask slots hold mask_token_id) -> [..., d]. Every slot whose id is the mask
        token gets the mask embedding, exactly as vLLM embeds them (so a root equal to it would be masked too)."""
        emb = F.embedding(tokens, self.embed).to(self.fc.weight.dtype)
        is_mask = (tokens == self.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embedding.to(emb.dtype), emb)

    def run_blocks(self, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, positions: torch.Tensor,
                   anchors: torch.Tensor, reference: bool = False, shard=None) -> torch.Tensor:
        """The N layers over A blocks. ctx_kv: per layer (k, v) [B, H_kv, T, hd]; x [B, A, G, d] block inputs;
        positions [B, A, G] long; anchors [B, A] (block a sees context positions <= anchors[b, a]).
        Returns the last layer's output [B, A, G, d] (before the final norm). shard (sequence parallelism): ctx_kv
        holds this rank's context rows and the blocks are this rank's; the attention sees the whole context
        (`_sharded_block_attention`)."""
        attend = block_attention_reference if reference else block_attention
        cos, sin = self.rope(positions, x.dtype)
        anchors = anchors.to(x.device)
        for layer, (kc, vc) in zip(self.layers, ctx_kv):
            kc, vc = expand_kv(kc, self.groups), expand_kv(vc, self.groups)

            def mix(q, kb, vb, kc=kc, vc=vc):
                if shard is not None:
                    return self._sharded_block_attention(attend, q, kc, vc, kb, vb, anchors, shard)
                # Training: the [A·G, T + G] scores of every layer would be kept for backward (GBs at 512 anchors
                # of 16 slots over 512 tokens); recomputing them in backward keeps one layer's at a time.
                if torch.is_grad_enabled() and q.requires_grad:
                    return checkpoint(attend, q, kc, vc, kb, vb, anchors, use_reentrant=False)
                return attend(q, kc, vc, kb, vb, anchors)

            x = self.block_layer(layer, x, cos, sin, mix)
        return x

    def run_blocks_each(self, contexts: list[list[tuple[torch.Tensor, torch.Tensor]]], x: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
        """The N layers over B blocks of which each sees a context of its own (inference): contexts[b] per layer
        (k, v) [1, H_kv, L_b, hd], the rows block b sees (all of them: its anchor is L_b - 1); x [B, 1, G, d];
        positions [B, 1, G] long. The weight-heavy ops run once over all B·G rows; the attention runs per block,
        against its own context, exactly as a block drafted alone attends (no padding to the longest context).
        Returns the last layer's output [B, 1, G, d] (before the final norm)."""
        if len(contexts) != x.shape[0]:
            raise ValueError(f"{x.shape[0]} blocks but {len(contexts)} contexts")
        cos, sin = self.rope(positions, x.dtype)
        anchors = torch.tensor([[c[0][0].shape[2] - 1] for c in contexts], dtype=torch.long, device=x.device)
        for i, layer in enumerate(self.layers):
            def mix(q, kb, vb, i=i):  # q, kb, vb [B, H, 1, G, hd] -> [B, H, 1, G, hd]
                return torch.cat([block_attention(q[b:b + 1], expand_kv(c[i][0], self.groups),
                                                  expand_kv(c[i][1], self.groups), kb[b:b + 1], vb[b:b + 1],
                                                  anchors[b:b + 1]) for b, c in enumerate(contexts)])

            x = self.block_layer(layer, x, cos, sin, mix)
        return x

    def block_layer(self, layer: BlockLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    mix) -> torch.Tensor:
        """One decoder layer over blocks x [B, A, G, d] (cos / sin of their positions): the slots' queries and
        keys / values, mix(q, kb, vb) -> [B, H, A, G, hd] their attention over the context and the block (q and the
        GQA-expanded kb / vb [B, H, A, G, hd]; how the context is laid out is the caller's), o_proj, the MLP."""
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q(h, cos, sin)  # [B, H, A, G, hd]
        kb, vb = attn.kv(h, cos, sin)  # [B, H_kv, A, G, hd]
        x = x + attn.out(mix(q, expand_kv(kb, self.groups), expand_kv(vb, self.groups)))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    @staticmethod
    def _sharded_block_attention(attend, q, kc, vc, kb, vb, anchors, shard) -> torch.Tensor:
        """Sequence parallelism: `attend` of this rank's A blocks (q / kb / vb [B, H, A, G, hd]) against the whole
        context, of which this rank holds rows [start, stop) (kc / vc [B, H, n, hd]). Each rank lays out one
        sequence of n + A·G rows (its context rows, then its blocks' slots; q is zero on the context rows) and
        shard.attend trades rows for heads: every rank then holds, for H/N heads, every rank's context rows (the whole
        context, in order) and blocks, attends them with every rank's anchors, and trades back. A is the same on every
        rank (the loss pads it). Returns [B, H, A, G, hd]."""
        b, h, a, g, hd = q.shape
        n = kc.shape[2]
        seg = n + a * g
        every = shard.gather(anchors)  # [N, B, A]
        size = every.shape[0]
        every = every.permute(1, 0, 2).reshape(b, size * a)  # [B, N·A]: the blocks in rank order

        def whole(qw, kw, vw):  # [B, H/N, N·seg, hd]
            hh = qw.shape[1]
            qw, kw, vw = (t.reshape(b, hh, size, seg, hd) for t in (qw, kw, vw))

            def ctx(t):
                return t[:, :, :, :n].reshape(b, hh, size * n, hd)

            def blocks(t):
                return t[:, :, :, n:].reshape(b, hh, size * a, g, hd)

            args = (blocks(qw), ctx(kw), ctx(vw), blocks(kw), blocks(vw), every)
            o = checkpoint(attend, *args, use_reentrant=False) if torch.is_grad_enabled() and qw.requires_grad \
                else attend(*args)
            o = torch.cat([o.new_zeros(b, hh, size, n, hd), o.reshape(b, hh, size, a * g, hd)], dim=3)
            return o.reshape(b, hh, size * seg, hd)

        qs = torch.cat([q.new_zeros(b, h, n, hd), q.reshape(b, h, a * g, hd)], dim=2)
        ks = torch.cat([kc, kb.reshape(b, h, a * g, hd)], dim=2)
        vs = torch.cat([vc, vb.reshape(b, h, a * g, hd)], dim=2)
        return shard.attend(whole, qs, ks, vs)[:, :, n:].reshape(b, h, a, g, hd)

    def row_features(self, out: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The LM-head rows of the loss as (features [B·A·K, d'], weight [N, d']): logits = features @ weightᵀ.
        out [B, A, K, d] the drafted slots' layer outputs, prev [B, A, K] the token before each (base ids).
        Here norm(out) and the LM head; DSpark appends its Markov embedding and projection."""
        return self.head_input(out).reshape(-1, out.shape[-1]), self.lm_head.weight

    def more_row_features(self, out: torch.Tensor, prev: torch.Tensor, loss_cfg
                          ) -> list[tuple[float, tuple[torch.Tensor, torch.Tensor]]]:
        """Further heads scored on the same rows as `row_features`: (scale, (features, weight)) pairs, each row loss
        computed against the same labels and teacher, weighted by the same position weights and added to the loss
        times scale (a family whose drafts add a correction to the block's logits can keep the uncorrected logits
        trained too). The per-depth statistics stay `row_features`'s. Default none."""
        return []

    def extra_block_loss(self, out: torch.Tensor, prev: torch.Tensor, hits: torch.Tensor, valid: torch.Tensor,
                         loss_cfg) -> torch.Tensor | None:
        """A further loss term of one set of blocks (None: none). hits / valid [B·A, K] bool: top-1 equals the
        target / the row has a target (out-of-vocabulary targets included, as misses)."""
        return None

    def head_input(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Layer output [..., d] -> logits over the draft vocabulary [..., N] (draft ids)."""
        return self.lm_head(self.head_input(out))

    # -- training ----------------------------------------------------------------------------------------

    def sample_anchors(self, valid: torch.Tensor, generator: torch.Generator | None = None, all_anchors: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """valid [B, T] bool (positions t whose depth-1 target exists) -> (anchors [B, A] long, ok [B, A] bool).

        Up to num_anchors per row, drawn uniformly without replacement (speculators' `select_anchors`), sorted;
        all_anchors=True takes every valid position. Rows with fewer pad with anchor 0, ok False."""
        rows = []
        for b in range(valid.shape[0]):
            idx = valid[b].nonzero().flatten()
            if not all_anchors and idx.numel() > self.num_anchors:
                perm = torch.randperm(idx.numel(), generator=generator, device="cpu")[:self.num_anchors]
                idx = idx[perm.to(idx.device)].sort().values
            rows.append(idx)
        a = max(1, max(r.numel() for r in rows))
        anchors = torch.zeros(valid.shape[0], a, dtype=torch.long, device=valid.device)
        ok = torch.zeros(valid.shape[0], a, dtype=torch.bool, device=valid.device)
        for b, r in enumerate(rows):
            anchors[b, :r.numel()] = r
            ok[b, :r.numel()] = True
        return anchors, ok

    def block_outputs(self, aux: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor, reference: bool = False,
                      shard=None) -> torch.Tensor:
        """Teacher-forced blocks: aux [B, T, k·d], ids [B, T], anchors [B, A] (each < T-1) -> outputs [B, A, G, d].
        Block a: slot 0 = ids[anchor + 1], slots 1.. = the mask, at positions anchor+1 .. anchor+G, seeing the
        context rows 0..anchor. shard (sequence parallelism): aux holds rows [shard.start, shard.stop) only, the
        anchors are this rank's (padded to the group's count)."""
        b, t = ids.shape
        g = self.block_size
        if shard is None:
            ctx = self.context(aux)  # [B, T, d]
            ctx_kv = self.context_kv(ctx, torch.arange(t, device=ids.device)[None])
        else:
            ctx = self.context(aux[:, :shard.stop - shard.start])  # [B, n, d]
            ctx_kv = self.context_kv(ctx, torch.arange(shard.start, shard.stop, device=ids.device)[None])
        tokens = torch.full((b, anchors.shape[1], g), self.mask_token_id, dtype=torch.long, device=ids.device)
        tokens[:, :, 0] = ids.gather(1, (anchors + 1).clamp(max=t - 1))
        positions = anchors[:, :, None] + 1 + torch.arange(g, device=ids.device)  # [B, A, G]
        if shard is None:
            return self.run_blocks(ctx_kv, self.embed_block(tokens), positions, anchors, reference)
        return self.run_blocks(ctx_kv, self.embed_block(tokens), positions, anchors, reference, shard=shard)

    def loss(self, batch: DraftBatch, base: BaseView, loss_cfg) -> DraftLossOutput:
        """Σ w·ℓ / n over the drafted slots of the sampled blocks (losses/block.py), plus `extra_block_loss`.

        Depth k (slot k, or slot k-1 with anchor_drafts) of the block at anchor t targets x_{t+1+k}
        (offset_labels(ids, mask, 1 + k)); teacher = the base's distribution at t+k over the draft vocabulary; row
        loss (1-α)·hard CE + α·soft CE (α = loss.teacher_weight); weights loss.<family>.position_weights
        (dpace | decay).
        Targets outside the draft vocabulary carry no loss and count as misses. In eval mode every valid anchor is
        scored (a fixed, complete set for the held-out table), num_anchors blocks at a time.
        """
        if batch.aux_hidden is None:
            raise ValueError(f"{self.facts.title} trains on the base's aux hidden states, but the batch has none; "
                             "the training loop fills DraftBatch.aux_hidden from base layers draft.aux_layers (or the "
                             "hidden cache)")
        ids, mask = batch.input_ids, batch.loss_mask
        k_max = self.num_heads
        labels = torch.stack([offset_labels(ids, mask, 1 + k) for k in range(1, k_max + 1)], dim=-1)  # [B, T, K]
        valid_anchor = labels[..., 0] != -100  # [B, T]
        anchors, ok = self.sample_anchors(valid_anchor, all_anchors=not self.training)
        if batch.shard is not None:  # sequence parallelism: the group drew the same anchors; this rank's, at once
            return self._shard_loss(batch, base, loss_cfg, labels, anchors, ok)
        chunks = [slice(0, anchors.shape[1])] if self.training else \
            [slice(s, s + self.num_anchors) for s in range(0, anchors.shape[1], self.num_anchors)]
        total, n_rows = None, 0
        stats = [DepthStats() for _ in range(k_max)]
        for sl in chunks:
            part, count = self._block_loss(batch, base, loss_cfg, labels, anchors[:, sl], ok[:, sl], stats)
            total = part * count if total is None else total + part * count
            n_rows += count
        return DraftLossOutput(total / max(n_rows, 1), stats)

    def _shard_loss(self, batch, base, loss_cfg, labels, anchors, ok) -> DraftLossOutput:
        """Sequence parallelism: the loss of the sampled blocks whose anchor is among this rank's rows (every rank of
        the group drew the same anchors, the loop seeds it so), each term divided by the group's count."""
        shard = batch.shard
        if shard.halo < self.num_heads:
            raise ValueError(f"{self.facts.title}'s teacher of slot k reads h at anchor + k: the shard needs a halo of "
                             f"{self.num_heads} rows, got {shard.halo}")
        mine = ok & (anchors >= shard.start) & (anchors < shard.stop)  # [B, A]
        a = max(1, int(shard.gather(mine.sum(1).max().reshape(1)).max()))  # the group's widest row of blocks
        own = torch.full((anchors.shape[0], a), shard.start, dtype=torch.long, device=anchors.device)
        own_ok = torch.zeros(anchors.shape[0], a, dtype=torch.bool, device=anchors.device)
        for b in range(anchors.shape[0]):
            picked = anchors[b][mine[b]]
            own[b, :picked.numel()] = picked
            own_ok[b, :picked.numel()] = True
        stats = [DepthStats() for _ in range(self.num_heads)]
        loss, _ = self._block_loss(batch, base, loss_cfg, labels, own, own_ok, stats)
        return DraftLossOutput(loss, stats)

    def _block_loss(self, batch, base, loss_cfg, labels, anchors, ok, stats) -> tuple[torch.Tensor, int]:
        """Loss (mean over valid rows, weighted) of one set of blocks and its number of valid rows; adds the
        per-depth statistics to `stats`. Under sequence parallelism (batch.shard) each term's mean is over the whole
        group's valid rows."""
        ids, hidden = batch.input_ids, batch.hidden
        b, t = ids.shape
        k_max = self.num_heads
        shard = batch.shard
        if shard is None:
            out = self.block_outputs(batch.aux_hidden, ids, anchors,
                                     reference=not loss_cfg.chunked)[:, :, self.first_slot:]
        else:
            out = self.block_outputs(batch.aux_hidden, ids, anchors, reference=not loss_cfg.chunked,
                                     shard=shard)[:, :, self.first_slot:]
        rows_lab = labels.gather(1, anchors[:, :, None].expand(-1, -1, k_max))  # [B, A, K] base ids
        rows_lab = rows_lab.masked_fill(~ok[:, :, None], -100)
        draft_lab, outside = to_draft_labels(rows_lab, self.t2d)
        valid = draft_lab != -100  # [B, A, K]
        alpha = float(loss_cfg.teacher_weight)
        teacher = {}
        if alpha > 0:
            # Slot k's teacher: the base's h at t+k (its next-token distribution is over x_{t+1+k}).
            pos = (anchors[:, :, None] + torch.arange(1, k_max + 1, device=ids.device)).clamp(max=t - 1)
            if shard is not None:  # hidden holds rows [start, stop + halo): the same rows, local indices
                pos = (pos - shard.start).clamp(min=0, max=hidden.shape[1] - 1)
            th = hidden.gather(1, pos.reshape(b, -1, 1).expand(-1, -1, hidden.shape[-1]))  # [B, A·K, d]
            teacher = {"teacher_hidden": th.reshape(-1, hidden.shape[-1]),
                       "teacher_weight": restrict_rows(base.lm_head_weight, self.d2t), "soft_weight": alpha}
        rows_fn = linear_row_losses if loss_cfg.chunked else linear_row_losses_reference
        # The token just before each drafted depth k: x_{t+k} (the root for k = 1), teacher-forced.
        prev = ids.gather(1, (anchors[:, :, None] + torch.arange(1, k_max + 1, device=ids.device)).clamp(max=t - 1)
                          .reshape(b, -1)).view(b, -1, k_max)  # [B, A, K] base ids
        flat, head_weight = self.row_features(out, prev)  # [B·A·K, d'], [N, d']
        rows, top1, topk = rows_fn(flat, head_weight, draft_lab.reshape(-1), chunk_size=loss_cfg.chunk_size,
                                   **teacher)
        rows2, valid2 = rows.view(-1, k_max), valid.view(-1, k_max)  # [B·A, K]
        own = self.options(loss_cfg)  # loss.<family>: position_weights, dpace_alpha
        weights = block_position_weights(rows2, valid2, own.position_weights, lambda0=loss_cfg.lambda0,
                                         decay=loss_cfg.decay, alpha=own.dpace_alpha)
        share = 1.0  # sequence parallelism: this rank's valid rows / the group's (each term is a mean over them)
        if shard is not None:
            share = int(valid2.sum()) / max(1, int(shard.total(valid2.sum().reshape(1)).item()))
        loss = block_weighted_loss(rows2, weights, valid2) * share if shard is not None else \
            block_weighted_loss(rows2, weights, valid2)
        for scale, (more_flat, more_weight) in self.more_row_features(out, prev, loss_cfg):
            more, _, _ = rows_fn(more_flat, more_weight, draft_lab.reshape(-1), chunk_size=loss_cfg.chunk_size,
                                 **teacher)
            if shard is not None:
                loss = loss + scale * share * block_weighted_loss(more.view(-1, k_max), weights, valid2)
            else:
                loss = loss + scale * block_weighted_loss(more.view(-1, k_max), weights, valid2)
        top1, topk = top1.view(-1, k_max), topk.view(-1, k_max)
        oov = outside.view(-1, k_max)
        extra = self.extra_block_loss(out, prev, top1, valid2 | oov, loss_cfg)
        if extra is not None and shard is not None:  # a mean over the rows with a target, outside the map included
            scored = (valid2 | oov).sum()
            extra = extra * (int(scored) / max(1, int(shard.total(scored.reshape(1)).item())))
        if extra is not None:
            loss = loss + extra
        for k in range(k_max):
            n_oov = int(oov[:, k].sum())
            stats[k].add(DepthStats(float(rows2[:, k].detach().sum()), int(valid2[:, k].sum()) + n_oov,
                                    int(top1[:, k].sum()), int(topk[:, k].sum()), n_oov))
        return loss, int(valid2.sum())

    # -- inference ---------------------------------------------------------------------------------------

    def new_cache(self, capacity: int, device, dtype) -> BlockCache:
        attn = self.layers[0].self_attn
        shape = (1, attn.num_kv_heads, max(1, int(capacity)), attn.head_dim)
        return BlockCache([torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers],
                          [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers])

    def commit_context(self, cache: BlockCache, aux: torch.Tensor) -> None:
        """Append n newly committed base positions: aux [n, k·d]; row i sits at position cache.length + i."""
        ctx = self.context(aux)[None]  # [1, n, d]
        pos = torch.arange(cache.length, cache.length + ctx.shape[1], device=ctx.device)[None]
        cache.append(self.context_kv(ctx, pos))

    def draft_block_outputs(self, cache: BlockCache, root: int, slots: int | None = None) -> torch.Tensor:
        """One forward of the block [root, M, ..., M] at positions L .. L+G-1 (L = cache.length), seeing every
        cached position -> the layer outputs [K, d] of the drafted slots (before the final norm; row k-1 drafts
        depth k). slots: a shorter block of that many slots (G = slots), as vLLM queries when it is asked for
        fewer tokens than the block drafts (DSpark: num_speculative_tokens slots). draft_blocks_outputs with one
        block."""
        roots = torch.tensor([int(root)], dtype=torch.long, device=cache.keys[0].device)
        return self.draft_blocks_outputs([cache.context()], roots, slots)[0]

    def draft_blocks_outputs(self, contexts: list[list[tuple[torch.Tensor, torch.Tensor]]], roots: torch.Tensor,
                             slots: int | None = None) -> torch.Tensor:
        """B blocks in one forward: block b = [roots[b], M, ..., M] at positions L_b .. L_b+G-1 against its own
        context (contexts[b]: per layer (k, v) [1, H_kv, L_b, hd], e.g. BlockCache.context) -> the drafted slots'
        layer outputs [B, K, d] (before the final norm; row k-1 drafts depth k). roots [B] long base ids; slots:
        as draft_block_outputs. What the drafters draft with (one block) and the field benchmark's batched path
        (many: eval/engine/drafters/block_lockstep.py)."""
        device = roots.device
        g = self.block_size if slots is None else int(slots)
        b = roots.shape[0]
        tokens = torch.full((b, 1, g), self.mask_token_id, dtype=torch.long, device=device)
        tokens[:, 0, 0] = roots
        lengths = torch.tensor([c[0][0].shape[2] for c in contexts], dtype=torch.long, device=device)  # [B]
        positions = lengths[:, None, None] + torch.arange(g, device=device)  # [B, 1, G]
        out = self.run_blocks_each(contexts, self.embed_block(tokens), positions)
        return out[:, 0, self.first_slot:]

    def draft_block(self, cache: BlockCache, root: int) -> torch.Tensor:
        """Logits [K, N] of the drafted slots of one block (draft ids; row k-1 = depth k), without any bias a
        subclass adds per drafted token (DSpark's Markov head)."""
        roots = torch.tensor([int(root)], dtype=torch.long, device=cache.keys[0].device)
        return self.draft_blocks([cache.context()], roots)[0]

    def draft_blocks(self, contexts: list[list[tuple[torch.Tensor, torch.Tensor]]], roots: torch.Tensor
                     ) -> torch.Tensor:
        """Logits [B, K, N] of B blocks (draft_blocks_outputs' arguments), as draft_block's of each."""
        return self.logits(self.draft_blocks_outputs(contexts, roots))
