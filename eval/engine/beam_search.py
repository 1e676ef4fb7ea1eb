"""ReDrafter's beam search over its recurrent draft head (the ReDrafter paper §2 "Beam search").

Beam shape W x L, where L counts the root: every beam is [root, d_1, ..., d_{L-1}]. Step 1 expands only
the root (s_1 = RNN(0, e(root))), giving min(W, V) beams from its top tokens; each later step feeds every
beam's last token to the RNN, scores all W x V one-token extensions by cumulative drafter log-probability
and keeps the best W. Candidates are distinct sequences by construction (distinct parents or distinct
last tokens), so beams never repeat.

Note: beam search is not exhaustive. Its beams equal the W most likely length-L sequences only when every
prefix of those is kept on the way (always true when W >= V**(L-2)); the tests check both that case
against brute force and the general case against a slow per-beam twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BeamResult:
    beams: torch.Tensor  # [W', L] long: column 0 = root, then the drafts; best beam first (W' <= W)
    scores: torch.Tensor  # [W'] fp32: cumulative drafter log-probability of each beam's drafts
    token_logprobs: torch.Tensor  # [W', L-1] fp32: log q(d_j | h_t, beam prefix) of each chosen draft


@torch.inference_mode()
def beam_search(draft, hidden: torch.Tensor, root: int, width: int, length: int) -> BeamResult:
    """Batched beam search. draft: models.families.redrafter.model.ReDrafterDraft; hidden [d] = h_t (the base state
    that chose `root`). Returns the beams sorted by score, best first."""
    if width < 1 or length < 1:
        raise ValueError(f"beam width={width} and length={length} must be >= 1 (length counts the root)")
    dev = draft.embed.device
    h = hidden.reshape(1, -1).to(device=dev, dtype=draft.param_dtype)  # [1, d]
    beams = torch.tensor([[int(root)]], dtype=torch.long, device=dev)  # [n, j] with n live beams
    scores = torch.zeros(1, dtype=torch.float32, device=dev)  # [n]
    token_lp = torch.zeros(1, 0, dtype=torch.float32, device=dev)  # [n, j-1]
    state = torch.zeros(1, draft.hidden_size, dtype=draft.param_dtype, device=dev)  # s_0 = 0, [n, d]
    for _ in range(length - 1):
        n = beams.shape[0]
        state = draft.rnn_step(state, draft.embed_tokens(beams[:, -1]))  # [n, d]
        logp = draft.logits(h.expand(n, -1), state).float().log_softmax(dim=-1)  # [n, V]
        vocab = logp.shape[1]
        cand = (scores[:, None] + logp).reshape(-1)  # [n*V]: beam-major, so index // V = parent beam
        top, idx = cand.topk(min(width, cand.numel()))  # sorted, best first
        parent, tok = idx // vocab, idx % vocab  # tok: draft ids (= base ids without a draft vocabulary)
        beams = torch.cat([beams[parent], draft.to_base(tok)[:, None]], dim=1)  # beams hold base ids
        token_lp = torch.cat([token_lp[parent], logp[parent, tok][:, None]], dim=1)
        state, scores = state[parent], top
    return BeamResult(beams.cpu(), scores.cpu(), token_lp.cpu())


@torch.inference_mode()
def beam_search_reference(draft, hidden: torch.Tensor, root: int, width: int, length: int) -> BeamResult:
    """Slow twin: every beam re-runs the RNN from s_0 along its own tokens, one beam at a time, and the
    kept candidates come from a Python sort of all (beam, token) extensions."""
    h = hidden.reshape(1, -1).to(device=draft.embed.device, dtype=draft.param_dtype)
    live: list[tuple[list[int], float, list[float]]] = [([int(root)], 0.0, [])]  # (tokens, score, token lps)
    for _ in range(length - 1):
        cands = []
        for toks, score, lps in live:
            s = torch.zeros(1, draft.hidden_size, dtype=draft.param_dtype, device=h.device)
            for tok in toks:  # s_j from the beam's own tokens
                s = draft.rnn_step(s, draft.embed_tokens(torch.tensor([tok], device=h.device)))
            logp = draft.logits(h, s).float().log_softmax(dim=-1)[0].tolist()
            base_ids = draft.to_base(torch.arange(len(logp))).tolist()  # draft id v -> base id
            cands.extend((toks + [base_ids[v]], score + lp, lps + [lp]) for v, lp in enumerate(logp))
        cands.sort(key=lambda c: -c[1])  # stable: ties keep (beam, token) order
        live = cands[:width]
    return BeamResult(torch.tensor([c[0] for c in live], dtype=torch.long),
                      torch.tensor([c[1] for c in live], dtype=torch.float32),
                      torch.tensor([c[2] for c in live], dtype=torch.float32).reshape(len(live), length - 1))
