"""EAGLE-3: fused low/mid/high base features + one decoder layer (or a few), autoregressive in feature space
(docs/families/eagle3.md; the layout is the one `speculators` trains and vLLM serves, see models/export/speculators.py).

At base position t (the base has committed x_0..x_t and its aux states at t are known):

    g_t   = fc([a_t^(l1); a_t^(l2); a_t^(l3)])      aux = the base's residual stream after layers l1, l2, l3
                                                      (HF `output_hidden_states[l]`), k·d -> d, no bias
    x     = [input_layernorm(e(x_{t+1})); hidden_norm(g_t)]            [2d]  (e = frozen base embedding)
    a     = g_t + o_proj(Attn(q, k, v = W_{q,k,v} x))                 q/k/v projections read 2d
    out_t = a + MLP(post_attention_layernorm(a))                       [d], the layer's "pre-norm" output
    logits = lm_head(norm(out_t))                                      over the draft vocabulary (N rows)

predicts x_{t+2} (depth 1). Depth k+1 feeds the layer its own previous output and the next token:
input (e(token at depth k), out of depth k) at position t+k, attending to every committed position's
depth-1 ("step 0") key and to its own ancestors' keys. This is the training-time test (TTT) unroll:

    step j = 0..T-1, row t: token x_{t+1+j} (data; teacher forcing on tokens, own states, as speculators
    and the EAGLE-3 code), hidden = out of step j-1 (g_t for j = 0), position t+j; attention = step-0
    keys of rows 0..t (causal) + the step-i keys of row t itself for i = 1..j; target x_{t+2+j}, teacher
    = the base's distribution at t+1+j restricted to the draft vocabulary.

`ttt_attention` (models/families/eagle3/ttt.py) computes that mask without materialising it ([T, T+j] scores: the
causal block and j diagonal terms); `ttt_attention_reference` is its slow twin with the dense [T, (j+1)T]
mask (the parity test in tests/test_eagle3.py).

Parallel drafting (P-EAGLE, `draft.eagle3.parallel_drafting: true`; speculators' `peagle`, which vLLM serves as
method eagle3 with `parallel_drafting`): the same layer drafts K = ttt_steps tokens in ONE forward. Depth 1 is
step 0 above; depth k+1 (k = 1..K-1) is a "mask slot" at position t+k whose input is the embedding of
`mask_token_id` (the base's row, frozen) and the learned feature `mask_hidden` [k·d] (before fc, as vLLM stores
it), never the previous draft's token or output. Attention is the TTT mask again: slot k of anchor t sees the
step-0 rows 0..t and its own slots 1..k. Training (`ttt_unroll(..., parallel=True)` + COD sampling in `loss`):
every anchor's depth-0 row, and per depth k a random subset of the anchors, nested in depth k-1's and
max(cod_ratio^k, cod_ratio_min) of them (speculators' `generate_cod_sample_indices`); no sampling in eval mode.

Positions: row t sits at position t (vLLM's convention; speculators trains at t+1: RoPE only sees
differences, so the two agree exactly). Residual: the raw fc output (speculators' default
`norm_before_residual: false`, written explicitly into the speculators export because vLLM's loader
defaults the key to true).

Normalisation variants (`draft.eagle3.*`, speculators' config keys, each read by vLLM 0.32's llama_eagle3.py; all off
by default, and a draft without them has exactly the tensors above):

    fc_norm               g_t = fc([n_1(a^(l1)); n_2(a^(l2)); n_3(a^(l3))]), an RMSNorm per aux layer (EAGLE-3.1)
    norm_before_fc        g_t = fc(n([a^(l1); a^(l2); a^(l3)])), one RMSNorm over k·d (excludes fc_norm)
    norm_output           the draft's output is norm(out_t): depth k+1 reads it and the LM head takes it as is
                          (EAGLE-3.1: keeps the fed-back feature's scale from drifting over the depths)
    norm_before_residual  a = hidden_norm(g_t) + o_proj(...) instead of g_t + o_proj(...)

Deeper drafts (`draft.eagle3.num_layers` = 2..4; vLLM's llama_eagle3.py and speculators run the same): out_t above
is layer 0's output; layers 1.. (layers.py: Eagle3DecoderLayer, `layers.1`, ...) are plain decoder
layers of the base's shape, each on the layer before's d-wide output (x + Attn(input_layernorm(x)), then + MLP), at
the same positions and with the same attention pattern, each over its own keys (the TTT unroll keeps them per layer,
the decode-time Eagle3Cache holds [L, H_kv, capacity, hd]); norm / lm_head (and norm_output) follow the last layer,
whose output is what the next depth reads. norm_before_residual concerns layer 0 only, as in vLLM.

Initialisation (our choice; speculators starts the layer at random): the layer is a copy of the base's
last decoder layer with its q/k/v weights on both input halves and o_proj / down_proj at zero, fc picks
the highest aux layer, norm and lm_head come from the base. A fresh draft therefore predicts
lm_head(norm(a_t^(l3))), roughly the base's own next-token guess, and training grows from there. Layers 1.. copy the
same base layer with o_proj / down_proj at zero: each starts as the identity, so a fresh deeper draft predicts
exactly what a fresh one-layer draft does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from data.targets import offset_labels
from losses.distill import fused_linear_distill, linear_distill_reference, parse_divergence
from losses.fused_linear_ce import fused_linear_cross_entropy, linear_cross_entropy_reference
from losses.ttt import ttt_step_weights, ttt_weighted_loss
from models.components import (
    RMSNorm,
    check_aux_layers,
    default_aux_layers,
    default_mask_token_id,
    expand_kv,
    rope_cos_sin,
)
from models.draft import BaseView, DepthStats, DraftBatch, DraftLossOutput, DraftModel, SequenceShard
from models.families.eagle3.decode_rows import Eagle3DecodeRows
from models.families.eagle3.layers import (
    Eagle3DecoderLayer,
    Eagle3Layer,
    init_deep_layer,
    init_first_layer,
)
from models.families.eagle3.ttt import cod_keep, ttt_attention, ttt_attention_reference
from models.family import FamilyFacts
from models.vocab_map import DraftVocabMixin, export_base, restrict_rows, to_draft_labels

MAX_TTT_STEPS = 7
MAX_LAYERS = 4  # draft.eagle3.num_layers: 1..4 decoder layers


@dataclass
class Eagle3Options:
    """EAGLE-3's training options (draft.eagle3.*)."""

    ttt_steps: int = 3  # training-time-test unroll (1..7); one reported depth per step (draft.num_heads is set to it)
    # Decoder layers (1..4): layer 0 reads [embedding; feature], layers 1.. are plain decoder layers of the base's shape
    # on the layer before's output (vLLM's and speculators' multi-layer EAGLE-3; each starts as the identity). Each
    # layer adds about one layer's cost to every draft step and keeps its own KV cache
    num_layers: int = 1
    # P-EAGLE: draft ttt_steps tokens in one forward, depths 2.. fed the mask token and a learned mask_hidden
    # (exports as speculators' `peagle`, served by vLLM as eagle3 + parallel_drafting); false = plain EAGLE-3
    parallel_drafting: bool = False
    mask_token_id: int = -1  # parallel drafting: the mask slots' token; -1 = the base's pad token, else eos, else 0
    cod_ratio: float = 0.7  # parallel drafting: depth k trains on max(cod_ratio^k, cod_ratio_min) of the anchors
    cod_ratio_min: float = 0.2  # parallel drafting: the floor of that share (1.0 and 1.0: every anchor, every depth)
    # Normalisation variants (speculators' config keys, each served by vLLM 0.32; EAGLE-3.1 = fc_norm + norm_output):
    fc_norm: bool = False  # an RMSNorm per aux layer before fc: fc([norm_1(a1); norm_2(a2); norm_3(a3)]) (EAGLE-3.1)
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states [k·d] before fc (not with fc_norm)
    norm_output: bool = False  # the next depth reads norm(out), the LM head's input, instead of out (EAGLE-3.1)
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(feature) instead of the raw feature
    # Training only: the std of Gaussian noise added to the base's aux hidden states before fc (speculators' noise
    # transform of its `hidden_states`, std 0.05 there); 0 = none. Absolute, in the residual stream's units
    aux_noise_std: float = 0.0


@dataclass
class Eagle3LossOptions:
    """EAGLE-3's loss options (loss.eagle3.*)."""

    # What each TTT step distils from the base (weighted by loss.teacher_weight, the rest hard CE): kl (soft CE, the
    # forward KL up to the base's entropy; the recipe), rkl (reverse KL), tv (total variation), lk_alpha / lk_lambda
    # (the LK losses, arXiv:2602.23881), ce (hard CE), or a weighted sum such as 0.1*ce+0.9*tv (losses/distill.py)
    divergence: str = "kl"
    lk_eta: float = 3.0  # lk_lambda's eta: lambda = exp(-eta * acceptance) weighs KL against TV per row (paper: 3)


NORM_VARIANTS = ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")


class Eagle3Draft(Eagle3DecodeRows, DraftVocabMixin, DraftModel):
    facts = FamilyFacts("eagle3", "EAGLE-3", ("specdraft", "speculators", "vllm", "gguf"), vllm_method="eagle3",
                        vllm_schedule=True, llamacpp_spec_type="draft-eagle3",
                        chain_estimate=True, export_keys=("aux_layers",),
                        draft_options=Eagle3Options, loss_options=Eagle3LossOptions, flat_keys=("draft.ttt_steps",),
                        shared_from={"draft.num_heads": "draft.eagle3.ttt_steps"},
                        summary="fc over low/mid/high base layers + one decoder layer (up to 4: "
                        "`draft.eagle3.num_layers`), training-time test; chain or "
                        "EAGLE-2 tree; what vLLM serves; P-EAGLE option (`draft.eagle3.parallel_drafting`): K drafts "
                        "from one forward",
                        also_files=("losses/ttt.py",))
    sequence_parallel = True  # train.sequence_parallel: the TTT attention over DeepSpeed's Ulysses all-to-all

    @classmethod
    def check_config(cls, cfg, fail) -> None:
        d, ttt_steps = cfg.draft, cls.options(cfg.draft).ttt_steps
        if not 1 <= ttt_steps <= 7:
            fail("draft.eagle3.ttt_steps", ttt_steps, "EAGLE-3 unrolls 1..7 training-time-test steps (default 3)")
        if not 1 <= cls.options(cfg.draft).num_layers <= MAX_LAYERS:
            fail("draft.eagle3.num_layers", cls.options(cfg.draft).num_layers, f"EAGLE-3 drafts with 1..{MAX_LAYERS} "
                 "decoder layers (default 1; vLLM and speculators serve more than one)")
        if d.num_layers != 1:
            fail("draft.num_layers", d.num_layers, "EAGLE-3 takes its decoder layers from draft.eagle3.num_layers "
                 "(1..4); draft.num_layers (ResBlocks, DFlash's layers) does not apply: leave it at 1")
        if any(i < 0 for i in d.aux_layers) or len(set(d.aux_layers)) != len(d.aux_layers):
            fail("draft.aux_layers", d.aux_layers, "give distinct base layer ids >= 0, or [] for [2, L//2, L-3]")
        if cfg.deepspeed.zero_stage == 3:
            fail("deepspeed.zero_stage", 3, "EAGLE-3's loss reads its LM-head weight directly; use stage 0-2")
        o = cls.options(cfg.draft)
        if cfg.train.sequence_parallel > 1 and o.parallel_drafting:
            fail("train.sequence_parallel", cfg.train.sequence_parallel, "P-EAGLE's COD sampling draws anchors over "
                 "the whole sequence; train parallel drafting with train.sequence_parallel=1")
        if o.mask_token_id < -1:
            fail("draft.eagle3.mask_token_id", o.mask_token_id, "use -1 (the base's pad / eos token) or a token id")
        for key in ("cod_ratio", "cod_ratio_min"):
            if not 0.0 < getattr(o, key) <= 1.0:
                fail(f"draft.eagle3.{key}", getattr(o, key), "a share of the anchors in (0, 1] (speculators: 0.7, 0.2)")
        if o.fc_norm and o.norm_before_fc:
            fail("draft.eagle3.norm_before_fc", True, "fc_norm (one norm per aux layer) and norm_before_fc (one norm "
                 "over all of them) exclude each other, as in speculators: set one of them false")
        if not 0.0 <= o.aux_noise_std < float("inf"):
            fail("draft.eagle3.aux_noise_std", o.aux_noise_std, "the noise's std is 0 (none) or more (speculators: "
                 "0.05)")
        lo, terms = cls.options(cfg.loss), {}
        try:
            terms = parse_divergence(lo.divergence)
        except ValueError as err:
            fail("loss.eagle3.divergence", lo.divergence, str(err))
        if lo.divergence != "kl" and cfg.loss.teacher_weight == 0:
            fail("loss.eagle3.divergence", lo.divergence, "the divergence is the loss.teacher_weight share of the "
                 "loss, and loss.teacher_weight=0 trains on hard CE alone: set loss.teacher_weight > 0 (1.0: the "
                 "divergence alone), or leave divergence at kl")
        if not 0.0 <= lo.lk_eta < float("inf"):
            fail("loss.eagle3.lk_eta", lo.lk_eta, "eta is 0 (lk_lambda = KL) or more (the LK paper's best: 3)")
        if lo.lk_eta != Eagle3LossOptions.lk_eta and "lk_lambda" not in terms:
            fail("loss.eagle3.lk_eta", lo.lk_eta, f"only lk_lambda reads eta, and loss.eagle3.divergence="
                 f"{lo.divergence} has none: drop lk_eta, or add lk_lambda to the divergence")

    def __init__(self, base: BaseView, aux_layers: list[int] | None = None, ttt_steps: int = 3,
                 init_from_base: bool = True, share_lm_head: bool = False, parallel_drafting: bool = False,
                 mask_token_id: int | None = None, cod_ratio: float = 0.7, cod_ratio_min: float = 0.2,
                 fc_norm: bool = False, norm_before_fc: bool = False, norm_output: bool = False,
                 norm_before_residual: bool = False, aux_noise_std: float = 0.0, num_layers: int = 1):
        super().__init__()
        if base.model is None:
            raise ValueError("EAGLE-3 builds a decoder layer of the base's architecture, but this BaseView has no "
                             "`.model`; build it with BaseView.from_model(base_model)")
        config = base.model.config
        if not 1 <= ttt_steps <= MAX_TTT_STEPS:
            raise ValueError(f"draft.eagle3.ttt_steps={ttt_steps}: EAGLE-3 unrolls 1..{MAX_TTT_STEPS} steps "
                             "(default 3)")
        if not 1 <= num_layers <= MAX_LAYERS:
            raise ValueError(f"draft.eagle3.num_layers={num_layers}: EAGLE-3 drafts with 1..{MAX_LAYERS} decoder "
                             "layers (default 1)")
        body = getattr(base.model, "model", None)
        n_layers = int(config.num_hidden_layers)
        self.aux_layers = check_aux_layers(aux_layers or default_aux_layers(n_layers), n_layers)
        self.ttt_steps = int(ttt_steps)
        self.num_heads = self.ttt_steps  # one reported depth per TTT step (the loop's per-depth table)
        d = int(config.hidden_size)
        self.hidden_size, self.vocab_size = d, int(base.vocab_size)
        self.eps = float(config.rms_norm_eps)
        self.layer_config = config  # read by the speculators export (transformer_layer_config); not a module
        if not 0.0 <= aux_noise_std < float("inf"):
            raise ValueError(f"draft.eagle3.aux_noise_std={aux_noise_std}: the noise's std is 0 (none) or more")
        self.aux_noise_std = float(aux_noise_std)  # training only (loss); not exported, decoding never adds noise

        n_out = self._init_vocab(base)  # d2t (persistent) / t2d / base rows W[d2t]: models/vocab_map.py

        if fc_norm and norm_before_fc:
            raise ValueError("draft.eagle3.fc_norm and draft.eagle3.norm_before_fc exclude each other: set one false")
        k = len(self.aux_layers)
        # The normalisation variants (NORM_VARIANTS): modules only when on; a plain draft's tensors stay as they were.
        self.norm_output = bool(norm_output)
        self.norm_before_residual = bool(norm_before_residual)
        self.input_norm = RMSNorm(k * d, self.eps) if norm_before_fc else None  # speculators' input_norm [k·d]
        self.fc_norm = nn.ModuleList([RMSNorm(d, self.eps) for _ in range(k)]) if fc_norm else None  # fc_norm.{i} [d]
        self.fc = nn.Linear(k * d, d, bias=False)
        # speculators / vLLM name them layers.0 (the 2d-wide first layer), layers.1, ... (plain decoder layers)
        self.layers = nn.ModuleList([Eagle3Layer(config, norm_before_residual=self.norm_before_residual)] +
                                    [Eagle3DecoderLayer(config) for _ in range(int(num_layers) - 1)])
        self.num_layers = len(self.layers)
        self.norm = RMSNorm(d, self.eps)
        self.lm_head = nn.Linear(d, n_out, bias=False)
        # Frozen base input embedding [V, d]: never trained, never exported (vLLM shares the base's).
        self.register_buffer("embed", base.embed_weight, persistent=False)

        rotary = getattr(body, "rotary_emb", None)
        if rotary is None:
            raise ValueError(f"{type(base.model).__name__} has no `.model.rotary_emb`; EAGLE-3 needs a LLaMA-style "
                             "causal LM (LlamaForCausalLM, Qwen2, Mistral, ...)")
        # RoPE frequencies kept in fp32 outside the buffers (a bf16 cast would shift every angle).
        fresh = type(rotary)(config=config)
        self._inv_freq = fresh.inv_freq.detach().float().cpu().clone()
        self._rope_scale = float(getattr(fresh, "attention_scaling", 1.0))
        attn = self.layers[0].self_attn
        self.groups = attn.num_heads // attn.num_kv_heads

        # P-EAGLE (parallel drafting): the mask slots' token and learned feature. Only then does the draft have a
        # `mask_hidden` tensor, so a plain EAGLE-3 draft's state dict and exports stay as they were.
        self.parallel_drafting = bool(parallel_drafting)
        self.mask_token_id = None
        if self.parallel_drafting:
            mask_id = int(mask_token_id) if mask_token_id is not None and mask_token_id >= 0 else \
                default_mask_token_id(config)
            if not 0 <= mask_id < self.vocab_size:
                raise ValueError(f"draft.eagle3.mask_token_id={mask_id} is outside the base's {self.vocab_size} tokens")
            if not (0.0 < cod_ratio <= 1.0 and 0.0 < cod_ratio_min <= 1.0):
                raise ValueError(f"draft.eagle3.cod_ratio={cod_ratio}, cod_ratio_min={cod_ratio_min}: shares in (0, 1]")
            self.mask_token_id = mask_id
            self.cod_ratio, self.cod_ratio_min = float(cod_ratio), float(cod_ratio_min)
            # [1, 1, k·d] as speculators keeps it (vLLM views it as [1, k·d]); N(0, 1) like speculators' init
            self.mask_hidden = nn.Parameter(torch.randn(1, 1, len(self.aux_layers) * d))

        # share_lm_head: the head keeps the base's rows, frozen (fewer trainable parameters; still a real
        # tensor of the draft because speculators / vLLM load the draft's own lm_head.weight).
        self.share_lm_head = bool(share_lm_head)
        self.lm_head.weight.requires_grad_(not self.share_lm_head)
        with torch.no_grad():
            self.lm_head.weight.copy_(self.base_rows())
            if init_from_base:
                self._init_from_base(body, d)

    def _init_from_base(self, body, d: int) -> None:
        """Layer 0 = the base's last layer (q/k/v on both halves, o_proj / down_proj zero), layers 1.. the same layer
        as the identity (layers.py), fc = the highest aux layer, norm = the base's final norm: a fresh
        draft predicts lm_head(norm(a^(l3)))."""
        src = body.layers[-1].state_dict()
        init_first_layer(self.layers[0], src)
        for deep in self.layers[1:]:
            init_deep_layer(deep, src)
        self.norm.weight.copy_(body.norm.weight)
        self.fc.weight.zero_()
        self.fc.weight[:, -d:].copy_(torch.eye(d))

    # -- construction from configs -----------------------------------------------------------------------

    @classmethod
    def from_config(cls, draft_cfg, base: BaseView) -> Eagle3Draft:
        o = cls.options(draft_cfg)
        return cls(base, list(draft_cfg.aux_layers) or None, o.ttt_steps or 3, share_lm_head=draft_cfg.share_lm_head,
                   parallel_drafting=o.parallel_drafting, mask_token_id=o.mask_token_id, cod_ratio=o.cod_ratio,
                   cod_ratio_min=o.cod_ratio_min, aux_noise_std=o.aux_noise_std, num_layers=o.num_layers,
                   **{key: getattr(o, key) for key in NORM_VARIANTS})

    @staticmethod
    def resolve_aux_layers(draft_cfg, model) -> list[int]:
        """The aux layer ids a config asks for on this base (the loop and the hidden cache need them before
        the draft exists)."""
        n_layers = int(model.config.num_hidden_layers)
        return check_aux_layers(list(draft_cfg.aux_layers) or default_aux_layers(n_layers), n_layers)

    @classmethod
    def from_export_config(cls, cfg: dict, base: BaseView) -> Eagle3Draft:
        # A map of the export's size; load_state_dict overwrites d2t and the mixin's hook rebuilds the rest.
        base = export_base(cfg, base, "EAGLE-3")
        return cls(base, cfg["aux_layers"], cfg.get("ttt_steps", 3), init_from_base=False,
                   share_lm_head=cfg.get("share_lm_head", False),
                   parallel_drafting=cfg.get("parallel_drafting", False), mask_token_id=cfg.get("mask_token_id"),
                   num_layers=int(cfg.get("num_layers", 1)),  # an export without the key has one layer
                   **{key: bool(cfg.get(key, False)) for key in NORM_VARIANTS})

    def norm_variants(self) -> dict[str, bool]:
        """The normalisation variants this draft uses, {key: True} (empty for the plain layout)."""
        on = {"fc_norm": self.fc_norm is not None, "norm_before_fc": self.input_norm is not None,
              "norm_output": self.norm_output, "norm_before_residual": self.norm_before_residual}
        return {key: True for key, value in on.items() if value}

    def export_config(self) -> dict:
        # ttt_steps: the trained depth, declared once (an older export also wrote it as num_heads, not read)
        cfg = {"family": self.family, "aux_layers": list(self.aux_layers), "ttt_steps": self.ttt_steps,
               "draft_vocab_size": self.draft_vocab_size,
               "share_lm_head": self.share_lm_head,
               "hidden_size": self.hidden_size, "vocab_size": self.vocab_size}
        cfg.update(self.norm_variants())  # only the keys that are on: a plain export's config is unchanged
        if self.num_layers != 1:  # likewise: a one-layer export's config is the one it always was
            cfg["num_layers"] = self.num_layers
        if self.parallel_drafting:
            # eagle3_mode / num_speculative_tokens: the drafter's defaults for this export
            # (eval/engine/drafters/options.py): the parallel chain of the K tokens it was trained to draft at once
            cfg.update(parallel_drafting=True, mask_token_id=self.mask_token_id, eagle3_mode="chain",
                       num_speculative_tokens=self.ttt_steps)
        return cfg

    # -- pieces shared by training and inference ---------------------------------------------------------

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B or 1, n] long -> (cos, sin) [B or 1, n, hd] (HF rotate-half layout)."""
        return rope_cos_sin(self._inv_freq, self._rope_scale, positions, dtype)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., k·d] (the base's aux layers side by side, in aux_layers order) -> g [..., d]."""
        if aux.shape[-1] != self.fc.in_features:
            raise ValueError(f"EAGLE-3 expects aux hidden states [..., {self.fc.in_features}] (layers "
                             f"{self.aux_layers} x d={self.hidden_size}), got {tuple(aux.shape)}")
        aux = aux.to(self.fc.weight.dtype)
        if self.input_norm is not None:  # norm_before_fc: one norm over [a1; a2; a3]
            aux = self.input_norm(aux)
        if self.fc_norm is not None:  # fc_norm: [norm_1(a1); norm_2(a2); norm_3(a3)]
            aux = torch.cat([norm(a) for norm, a in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(aux)

    def mask_inputs(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Parallel drafting: the input of n mask slots, (attention input [1, n, 2d], residual [1, n, d]) =
        layer.pre(e(mask_token_id), fc(mask_hidden)); every slot's is the same, only its position differs."""
        g = self.fuse(self.mask_hidden.view(1, 1, -1)).to(dtype)  # [1, 1, d]
        emb = self.embed_tokens(torch.tensor([[self.mask_token_id]], device=g.device)).to(dtype)  # [1, 1, d]
        x, residual = self.layers[0].pre(emb, g)
        return x.expand(1, n, -1), residual.expand(1, n, -1)

    def output(self, layer_out: torch.Tensor) -> torch.Tensor:
        """The layer's pre-norm output [..., d] -> what the draft hands on as its output (the feature the next depth
        reads and head_input takes): itself, or norm(it) with norm_output (vLLM: aux_output = the post-norm state)."""
        return self.norm(layer_out) if self.norm_output else layer_out

    def head_input(self, out: torch.Tensor) -> torch.Tensor:
        """An output of `output` [..., d] -> the LM head's input: norm(out) (already normed with norm_output)."""
        return out if self.norm_output else self.norm(out)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Layer output [..., d] -> logits over the draft vocabulary [..., N] (draft ids)."""
        return self.lm_head(self.head_input(out))

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Every decoder layer over the same rows, then `output`: x [B, n, 2d] / residual [B, n, d] = layer 0's input
        (`Eagle3Layer.pre`), cos / sin [B or 1, n, hd] the rows' RoPE (every layer sits at the same positions);
        attend(i, q, k, v) -> layer i's attention [B, H, n, hd] over its own keys (it stores k / v where the caller
        keeps them). Layer i > 0 reads layer i-1's output. Returns the draft's output [B, n, d]."""
        h = x
        for i, layer in enumerate(self.layers):
            if i:
                x, residual = layer.pre(h)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            h = layer.post(layer.self_attn.out(attend(i, q, k, v)), residual)
        return self.output(h)


    # -- training ----------------------------------------------------------------------------------------

    def ttt_unroll(self, aux: torch.Tensor, ids: torch.Tensor, steps: int, reference: bool = False,
                   parallel: bool | None = None, shard: SequenceShard | None = None) -> list[torch.Tensor]:
        """The TTT unroll. aux [B, T, k·d], ids [B, T] -> `steps` layer outputs [B, S, d], S = T-1.

        Row t of step j: token ids[t+1+j] (0 past the end: such rows have no target), hidden = the row's
        own step j-1 output (g_t at j = 0), position t+j. reference=True uses the dense-mask attention.
        parallel (default: the draft's parallel_drafting): steps j >= 1 are P-EAGLE's mask slots instead, token
        mask_token_id and hidden fc(mask_hidden) for every row, with the same positions and attention.
        shard (sequence parallelism): only rows [shard.start, shard.stop) of the whole ids' rows, aux holding just
        those rows [B, n, k·d]; outputs [B, n, d]. The attention sees every row of the sequence through
        shard.attend (the step's keys are kept head-sharded, whole-sequence, as the local attention got them).
        """
        parallel = self.parallel_drafting if parallel is None else parallel
        layer = self.layers[0]
        b, t = ids.shape
        if shard is None:
            s = t - 1
            hidden = self.fuse(aux[:, :s])  # [B, S, d]
            pos = torch.arange(s, device=ids.device)[None]  # [1, S]
        else:  # this rank's rows: the last row of the sequence (no target, seen by no other row) is drafted too
            s = shard.stop - shard.start
            hidden = self.fuse(aux[:, :s])  # [B, n, d]
            pos = torch.arange(shard.start, shard.stop, device=ids.device)[None]  # [1, n]
        keys, values, outs = [[] for _ in self.layers], [[] for _ in self.layers], []  # per layer, per step
        attention = ttt_attention_reference if reference else ttt_attention

        def attend(i, q, k, v):  # layer i: this step's keys beside its earlier steps'
            if shard is not None:
                return shard.attend(lambda qh, kh, vh: whole(i, qh, kh, vh), q, expand_kv(k, self.groups),
                                    expand_kv(v, self.groups))
            keys[i].append(expand_kv(k, self.groups))
            values[i].append(expand_kv(v, self.groups))
            return attention(q, keys[i], values[i])

        def whole(i, q, k, v):  # sequence parallelism: every row, this rank's heads
            keys[i].append(k)
            values[i].append(v)
            return attention(q, keys[i], values[i])

        for j in range(steps):
            if parallel and j > 0:
                x, residual = (m.expand(b, s, -1) for m in self.mask_inputs(1, hidden.dtype))
            else:
                if shard is None:
                    tok = F.pad(ids[:, 1 + j:], (0, j))[:, :s]  # [B, S]: x_{t+1+j}
                else:
                    tok = F.pad(ids[:, 1 + j:], (0, 1 + j))[:, shard.start:shard.stop]  # [B, n]: x_{t+1+j}
                x, residual = layer.pre(self.embed_tokens(tok).to(hidden.dtype), hidden)
            cos, sin = self.rope(pos + j, x.dtype)
            hidden = self.run_layers(x, residual, cos, sin, attend)  # [B, S, d]
            outs.append(hidden)
        return outs

    def loss(self, batch: DraftBatch, base: BaseView, loss_cfg) -> DraftLossOutput:
        """Σ_j decay^j · mean loss of TTT step j (depth j+1, target x_{t+2+j}).

        loss.teacher_weight α: (1-α)·hard CE + α·D, D = loss.eagle3.divergence between the draft and the base's
        distribution at t+1+j over the draft vocabulary; D = kl (the default) is the soft CE, computed by the fused CE
        exactly as before the option existed (α = 1, the recipe: pure soft CE, the same gradients as speculators' KL);
        any other D is losses/distill.py's fused loss. Rows whose target lies outside the draft vocabulary have no
        draft id: they are left out of the loss and counted as misses in the per-depth accuracy. Parallel drafting:
        step j is the mask slot at depth j+1, each depth's loss its own mean as above, over the anchors COD sampling
        kept for it while training (every anchor in eval mode, so held-out accuracy and the chain estimate are
        deterministic). In training, draft.eagle3.aux_noise_std > 0 adds N(0, std²) noise to the aux states before
        fc (speculators' noise on its `hidden_states`); the teacher, the base's own distribution, stays clean.
        """
        if batch.aux_hidden is None:
            raise ValueError("EAGLE-3 trains on the base's aux hidden states, but the batch has none; the training "
                             "loop fills DraftBatch.aux_hidden from base layers draft.aux_layers (or the hidden "
                             "cache built with them)")
        ids, hidden, mask, aux = batch.input_ids, batch.hidden, batch.loss_mask, batch.aux_hidden
        if self.training and self.aux_noise_std > 0:
            # [B, T, k·d] + N(0, std²) from torch's global RNG (the loop seeds it per step): on fc's input, where
            # speculators adds it, so fc_norm / norm_before_fc see the noisy states too
            aux = aux + torch.randn_like(aux) * self.aux_noise_std
        shard = batch.shard  # sequence parallelism: this rank's rows (hidden: [start, stop + halo), aux: the rows)
        if shard is not None and shard.halo < self.ttt_steps:
            raise ValueError(f"EAGLE-3's teacher at step j reads h at t+1+j: the shard needs a halo of "
                             f"{self.ttt_steps} rows (draft.eagle3.ttt_steps), got {shard.halo}")
        outs = self.ttt_unroll(aux, ids, self.ttt_steps, reference=not loss_cfg.chunked, shard=shard)
        keep, n0 = None, 0  # parallel drafting in training: COD sampling of the anchors per depth (None: every row)
        alpha = float(loss_cfg.teacher_weight)
        opts = self.options(loss_cfg)
        terms = parse_divergence(opts.divergence)
        # {term: weight} of losses/distill.py ((1-α)·hard CE + α·Σ w·term in one pass), or None: the fused soft CE
        # (hard CE alone at α = 0), which is today's loss whatever the divergence says
        distill = None
        if alpha > 0 and terms != {"kl": 1.0}:
            distill = {name: alpha * w for name, w in terms.items()}
            if alpha < 1:
                distill["ce"] = distill.get("ce", 0.0) + (1.0 - alpha)
        ce = fused_linear_cross_entropy if loss_cfg.chunked else linear_cross_entropy_reference
        divergence = fused_linear_distill if loss_cfg.chunked else linear_distill_reference
        teacher_w = restrict_rows(base.lm_head_weight, self.d2t) if alpha > 0 else None
        weights = ttt_step_weights(self.ttt_steps, loss_cfg.lambda0, loss_cfg.decay)
        s = ids.shape[1] - 1
        sums, counts, per_depth = [], [], []
        for j, out in enumerate(outs):
            if shard is None:
                base_labels = offset_labels(ids, mask, 2 + j)[:, :s]  # [B, S]: x_{t+2+j} or -100
            else:  # this rank's rows; hidden[:, c] is h at shard.start + c, so the teacher's index below holds
                base_labels = offset_labels(ids, mask, 2 + j)[:, shard.start:shard.stop]
            if self.parallel_drafting and self.training:
                keep = cod_keep(base_labels != -100, keep, j, n0, self.cod_ratio, self.cod_ratio_min)
                n0 = int(keep.sum()) if j == 0 else n0
                base_labels = base_labels.masked_fill(~keep, -100)
            labels, outside = to_draft_labels(base_labels, self.t2d)
            rows, cols = (labels != -100).nonzero(as_tuple=True)  # [n]
            head_in = self.head_input(out[rows, cols])  # [n, d]
            if distill is not None:
                loss_sum, stats = divergence(head_in, self.lm_head.weight, labels[rows, cols],
                                             hidden[rows, cols + 1 + j], teacher_w, weights=distill,
                                             lk_eta=opts.lk_eta, chunk_size=loss_cfg.chunk_size)
            else:
                teacher = {}
                if alpha > 0:
                    teacher = {"teacher_hidden": hidden[rows, cols + 1 + j], "teacher_weight": teacher_w,
                               "soft_weight": alpha}
                loss_sum, stats = ce(head_in, self.lm_head.weight, labels[rows, cols],
                                     chunk_size=loss_cfg.chunk_size, **teacher)
            sums.append(loss_sum.float())
            counts.append(stats.count)
            per_depth.append(DepthStats(float(loss_sum.detach()), int(stats.count) + int(outside.sum()),
                                        int(stats.top1), int(stats.topk)))
        counts = torch.stack(counts)
        if shard is not None:  # every rank divides its rows' sums by the whole sequence's counts
            counts = shard.total(counts)
        return DraftLossOutput(ttt_weighted_loss(torch.stack(sums), counts, weights), per_depth)
