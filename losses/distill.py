"""Chunked fused ``Linear → distillation divergence`` to a frozen teacher, with closed-form gradients.

What EAGLE-3 can train each TTT step on (``loss.eagle3.divergence``, docs/families/eagle3.md#training-levers): a
weighted sum of per-row terms between the draft's distribution ``q = softmax(z)``, ``z = hidden @ weightᵀ``, and
the frozen teacher's ``p = softmax(t)``, ``t = teacher_hidden @ teacher_weightᵀ`` (both over the same N columns,
the draft vocabulary), on the rows whose label is not -100::

    ce         −log q_y                              hard CE to the data token y (the label)
    kl         −Σ_v p_v log q_v                      soft CE = KL(p‖q) + H(p): forward KL up to the teacher's
                                                     entropy, a constant for the draft (same gradient, q − p)
    rkl        Σ_v q_v (log q_v − log p_v)           reverse KL, KL(q‖p): mode seeking
    tv         ½ Σ_v |p_v − q_v|                     total variation = 1 − α, α = Σ_v min(p_v, q_v), the
                                                     probability that speculative sampling accepts the draft's token
    lk_alpha   −log max(α, 1e-8)                     LK^α of the LK losses (below): the TV direction, scaled by 1/α
    lk_lambda  λ·(−Σ p log q) + (1 − λ)·TV,          LK^λ: KL's gradient while the draft is far (α small), TV's
               λ = exp(−η·sg[α]) per row             as it nears the teacher; sg = no gradient through λ

LK losses: Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for Speculative Decoding",
arXiv:2602.23881 (https://arxiv.org/abs/2602.23881); η = 3 is the paper's best hybrid setting. λ per row is
speculators' ``lk_hybrid_loss``; SpecForge and TorchSpec take one λ per TTT step from the batch's mean α, which
needs every row's α before any row's gradient (a second pass over the chunks). The paper rescales p by the base's
mass on the draft vocabulary before α (§4.4); here p is the base restricted to the draft vocabulary and
renormalised, like the soft CE's, since the rescaling needs the base's logits over its whole vocabulary.

Gradients w.r.t. the logits, per row (``s = ½·sign(q − p)``, the subgradient of TV that ``abs`` takes)::

    ce  q − e_y        kl  q − p        rkl  q ⊙ (f − Σ q f), f = log q − log p
    tv  q ⊙ (s − Σ s q)                 lk_alpha  tv's / α (0 where α < 1e-8, as clamp does)
    lk_lambda  λ·(q − p) + (1 − λ)·tv's

The fast path works like ``losses/fused_linear_ce.py``: each chunk of ``chunk_size`` rows becomes logits, loss and
dLoss/dlogits in one go, contracted at once into ``grad_hidden`` (``g @ W``) and ``grad_weight`` (``gᵀ @ x``); the
logits die with the chunk (never all ``[N, N_vocab]`` at once), and backward only scales the stash. Peak extra
memory ≈ 7 × chunk_size × N_vocab floats (student and teacher logits, log-probabilities, probabilities, the
gradient buffer, TV's signs). ``linear_distill_reference`` is the slow twin: plain autograd over full logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from losses.chunk_loop import ChunkedLinearLoss
from losses.chunk_loop import compute_dtype as _compute_dtype
from losses.chunk_loop import matmul_dtype as _matmul_dtype
from losses.fused_linear_ce import LossStats
from losses.weighted_ce import IGNORE_INDEX

TERMS = ("ce", "kl", "rkl", "tv", "lk_alpha", "lk_lambda")  # the names a divergence spec may use
LK_EPS = 1e-8  # floor of α under the log of lk_alpha (TorchSpec's; below it the row gives no gradient)


def parse_divergence(spec: str) -> dict[str, float]:
    """A divergence spec -> {term: weight}. ``"tv"`` -> ``{"tv": 1.0}``; a weighted sum
    ``"0.1*ce + 0.9*tv"`` -> ``{"ce": 0.1, "tv": 0.9}`` (DSpark's mixture). Weights are finite and > 0, each term at
    most once. Raises ValueError with a one-line reason."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"give a term ({', '.join(TERMS)}) or a weighted sum such as 0.1*ce+0.9*tv, not {spec!r}")
    out: dict[str, float] = {}
    for part in spec.replace(" ", "").split("+"):
        weight_text, _, name = part.rpartition("*")
        if name not in TERMS:
            raise ValueError(f"unknown term {name!r} in {spec!r}: use {', '.join(TERMS)}, alone or as a weighted sum "
                             "such as 0.1*ce+0.9*tv")
        try:
            weight = float(weight_text) if weight_text else 1.0
        except ValueError:
            raise ValueError(f"the weight {weight_text!r} of {name} in {spec!r} is no number; write w*term, e.g. "
                             "0.1*ce+0.9*tv") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"the weight of {name} in {spec!r} is {weight}: weights are finite and > 0 (leave a term "
                             "out to drop it)")
        if name in out:
            raise ValueError(f"{name} appears twice in {spec!r}: give each term once")
        out[name] = weight
    return out


# ---------------------------------------------------------------------------------------------------
# Fast path
# ---------------------------------------------------------------------------------------------------


def fused_linear_distill(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    weights: dict[str, float],
    lk_eta: float = 3.0,
    chunk_size: int = 1024,
    topk: int = 5,
) -> tuple[torch.Tensor, LossStats]:
    """Σ over valid rows of Σ_term weights[term] · term(row), chunked over rows.

    Args:
        hidden: ``[N, d]`` student features (usually requires grad).
        weight: ``[V, d]`` the student's LM head (V = the draft vocabulary); ``grad_weight`` only if it requires grad.
        labels: ``[N]`` int64, the data token per row (``ce``'s target and the accuracy counters), -100 = ignore.
        teacher_hidden: ``[N, d_t]`` frozen teacher features; teacher_weight ``[V, d_t]`` its head (never get grads).
        weights: {term: weight}, terms from TERMS, weights >= 0 (``parse_divergence`` builds it).
        lk_eta: η of lk_lambda.
        chunk_size: rows per chunk.
        topk: k of the top-k accuracy counter.

    Returns:
        ``(loss_sum, stats)`` like ``fused_linear_cross_entropy``: a 0-dim fp32 sum over valid rows (fp64 for fp64
        inputs), differentiable w.r.t. ``hidden`` and ``weight``; the counters are LossStats.
    """
    _validate(hidden, weight, labels, teacher_hidden, teacher_weight, weights, chunk_size, topk)
    grad_on = torch.is_grad_enabled()
    weights, eta = dict(weights), float(lk_eta)

    def chunk_fn(x, w, targets, valid, tx, tw, k):
        return _chunk_forward_backward(x, w, targets, valid, tx, tw, weights, eta, k)

    loss_sum, count, top1, topk_hits = ChunkedLinearLoss.apply(
        hidden, weight, labels, teacher_hidden.detach(), teacher_weight.detach(), chunk_fn, int(chunk_size),
        int(topk), grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    return loss_sum, LossStats(count, top1, topk_hits)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_v a[n, v]·b[n, v] for [c, V] inputs -> [c], as a batched dot product (no [c, V] temporary)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _chunk_forward_backward(x, w, targets, valid, tx, tw, weights: dict[str, float], eta: float, k: int):
    """One chunk of c rows: x [c, d], w [V, d], targets / valid [c], tx [c, d_t], tw [V, d_t] ->
    (loss sum, top-1 hits, top-k hits, g = dLoss/dlogits [c, V] in the compute dtype)."""
    cdtype = _compute_dtype(x)
    z = (x @ w.T).to(cdtype)  # [c, V] student logits
    z_target = z.gather(1, targets[:, None]).squeeze(1)  # [c]
    hits = (z.topk(k, dim=-1).indices == targets[:, None]) & valid[:, None]  # [c, k], best first
    top1, topk_hits = hits[:, 0].sum(), hits.any(dim=-1).sum()
    lse = torch.logsumexp(z, dim=-1)  # [c]
    log_q = z.sub_(lse[:, None])  # [c, V] in z's buffer
    q = log_q.exp()  # [c, V]
    log_p = (tx @ tw.T).to(cdtype)  # [c, V] teacher logits -> log-probabilities in place
    log_p.sub_(torch.logsumexp(log_p, dim=-1, keepdim=True))
    p = log_p.exp()  # [c, V]

    row = torch.zeros_like(lse)  # [c] the weighted per-row loss
    g = torch.zeros_like(q)  # [c, V] dLoss/dz
    if "ce" in weights:
        wt = weights["ce"]
        row.add_(lse - z_target, alpha=wt)  # −log q_y (z_target is the raw logit, read before the in-place sub)
        g.add_(q, alpha=wt).scatter_add_(1, targets[:, None], g.new_full((g.shape[0], 1), -wt))
    soft_ce = None
    if "kl" in weights or "lk_lambda" in weights:
        soft_ce = -_rowdot(p, log_q)  # [c] −Σ p log q
    if "kl" in weights:
        row.add_(soft_ce, alpha=weights["kl"])
        g.add_(q, alpha=weights["kl"]).sub_(p, alpha=weights["kl"])
    if "rkl" in weights:
        f = log_q - log_p  # [c, V]
        r = _rowdot(q, f)  # [c] Σ q (log q − log p)
        row.add_(r, alpha=weights["rkl"])
        g.addcmul_(q, f.sub_(r[:, None]), value=weights["rkl"])  # q ⊙ (f − R)
        del f
    if {"tv", "lk_alpha", "lk_lambda"} & weights.keys():
        s = q - p  # [c, V] -> ½·sign(q − p) in place
        tv = s.abs().sum(dim=-1).mul_(0.5)  # [c]
        s.sign_().mul_(0.5)
        g_tv = q * (s - _rowdot(s, q)[:, None])  # [c, V] dTV/dz
        del s
        alpha = torch.minimum(p, q).sum(dim=-1)  # [c] acceptance probability
        if "tv" in weights:
            row.add_(tv, alpha=weights["tv"])
            g.add_(g_tv, alpha=weights["tv"])
        if "lk_alpha" in weights:
            a = alpha.clamp_min(LK_EPS)
            row.add_(-a.log(), alpha=weights["lk_alpha"])
            scale = torch.where(alpha >= LK_EPS, weights["lk_alpha"] / a, 0.0)  # [c] d(−log α)/dTV = 1/α
            g.addcmul_(g_tv, scale[:, None])
        if "lk_lambda" in weights:
            lam = torch.exp(-eta * alpha)  # [c] λ, a constant of the row (no gradient through α here)
            wt = weights["lk_lambda"]
            row.add_(lam * soft_ce + (1 - lam) * tv, alpha=wt)
            g.addcmul_(q.sub(p), (wt * lam)[:, None]).addcmul_(g_tv, (wt * (1 - lam))[:, None])
    g.masked_fill_(~valid[:, None], 0.0)
    return row.masked_fill(~valid, 0.0).sum(), top1, topk_hits, g


# ---------------------------------------------------------------------------------------------------
# Slow reference twin
# ---------------------------------------------------------------------------------------------------


def linear_distill_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    weights: dict[str, float],
    lk_eta: float = 3.0,
    chunk_size: int = 1024,
    topk: int = 5,
) -> tuple[torch.Tensor, LossStats]:
    """Same contract as :func:`fused_linear_distill`, with every ``[N, V]`` tensor materialised and plain autograd
    (each term written as its formula; ``chunk_size`` is only validated, so the two are drop-in swappable)."""
    _validate(hidden, weight, labels, teacher_hidden, teacher_weight, weights, chunk_size, topk)
    cdtype, mdtype = _compute_dtype(hidden), _matmul_dtype(hidden)
    z = F.linear(hidden.to(mdtype), weight.to(mdtype)).to(cdtype)  # [N, V]
    t = F.linear(teacher_hidden.detach().to(mdtype), teacher_weight.detach().to(mdtype)).to(cdtype)  # [N, V]
    valid = labels != IGNORE_INDEX
    log_q, log_p = torch.log_softmax(z, dim=-1), torch.log_softmax(t, dim=-1)
    q, p = log_q.exp(), log_p.exp()

    def term(name: str) -> torch.Tensor:  # [N]
        if name == "ce":
            return F.cross_entropy(z, labels.masked_fill(~valid, 0), reduction="none")
        if name == "kl":
            return -(p * log_q).sum(-1)
        if name == "rkl":
            return (q * (log_q - log_p)).sum(-1)
        if name == "tv":
            return 0.5 * (p - q).abs().sum(-1)
        alpha = torch.minimum(p, q).sum(-1)
        if name == "lk_alpha":
            return -alpha.clamp_min(LK_EPS).log()
        lam = torch.exp(-lk_eta * alpha.detach())
        return lam * term("kl") + (1 - lam) * term("tv")

    row = sum(wt * term(name) for name, wt in sorted(weights.items()))
    loss_sum = torch.where(valid, row, row.new_zeros(())).sum()  # where: a masked row's value cannot leak NaN
    with torch.no_grad():
        k = min(topk, weight.shape[0])
        hits = (z.topk(k, dim=-1).indices == labels[:, None]) & valid[:, None]  # [N, k]
        stats = LossStats(valid.sum(), hits[:, 0].sum(), hits.any(dim=-1).sum())
    return loss_sum, stats


def _validate(hidden, weight, labels, teacher_hidden, teacher_weight, weights, chunk_size, topk) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, d] and weight [V, d] with the same d, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1] or labels.dtype != torch.long:
        raise ValueError(f"labels must be int64 of shape [N]={tuple(hidden.shape[:1])}, got {labels.dtype} "
                         f"{tuple(labels.shape)}")
    if (teacher_hidden.dim() != 2 or teacher_hidden.shape[0] != hidden.shape[0] or teacher_weight.dim() != 2
            or teacher_weight.shape != (weight.shape[0], teacher_hidden.shape[1])):
        raise ValueError(f"teacher_hidden must be [N={hidden.shape[0]}, d_t] and teacher_weight [V={weight.shape[0]}, "
                         f"d_t], got {tuple(teacher_hidden.shape)} and {tuple(teacher_weight.shape)}")
    if not weights or any(name not in TERMS or not wt >= 0 for name, wt in weights.items()):
        raise ValueError(f"weights must map terms of {TERMS} to weights >= 0, got {weights!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}; e.g. 1024")
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
