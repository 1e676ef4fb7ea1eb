"""Losslessness verdicts: exact, and tie-aware for low-precision bases (docs/concepts.md#losslessness-and-ties).

Greedy speculative decoding is lossless in exact arithmetic: it emits exactly plain greedy decoding's
tokens. In bf16 a verification forward over N tree tokens and a one-token decode forward round their
matmuls differently (different kernels, blockings and accumulation orders), so where the base's top-2
logits are closer than that rounding difference the two runs can pick different argmaxes, and from there
on the outputs drift apart. That is the base's precision, not the algorithm.

The tie-aware check, per prompt whose speculative tokens differ from plain decoding:
  i    = first position where they differ
  gap  = top1 - top2 logit of the base at position i in the PLAIN run (recorded per step, cheaply)
  tie  iff the speculative token at i is the plain run's runner-up (rank 2) and gap <= tolerance, or another
       of the plain run's near ties (several tokens can tie exactly in bf16) within tolerance of its top-1:
       a rounding flip swaps tokens that were (nearly) level; a token further down is a real error whatever
       the gap
  tolerance = the rounding difference MEASURED on this base + dtype + device (`measure_tolerance`):
       for a few prompts, the top-ranked logits of one-token forwards vs multi-token (chain) forwards on
       the same positions, at every verify width the decoder can use (`verify_widths`: the powers of two up
       to the drafter's largest tree, the buckets a static / compiled backend pads trees to); a top-2 gap can
       shrink by at most twice the largest such logit difference. One width is not enough: on CUDA a width-1
       and a width-16 forward can round bit for bit alike (the same GEMM kernel serves both) while the
       width-4 verify of a 3-node tree does not, and a tolerance of 0 then calls every tie a mismatch.
In fp32 the tolerance is 0: the verdict is the exact one (tree and one-token forwards agree to ~1e-6,
far below any gap that is not an exact tie).

The tolerance is a sample (a few prompts, a few widths): measured at 0.0 on three prompts, a one-step bf16 flip on a
fourth became a "bug"; measured at 1.25 on others, it was wide enough to hide a real one. So in bf16 / fp16 the
tolerance is only a diagnostic, and the JUDGE is an exact re-decode (`rejudge`): every prompt whose output differs
from plain decoding is decoded again, speculative and plain, in fp32 on the same device with the same draft, tree
and length. Identical in fp32 -> NUMERIC (the low-precision rounding flipped a near tie, not a drafter/verifier bug);
different in fp32 -> judged exactly there (an exact fp32 tie, or a real MISMATCH). Where no fp32 twin could be
built, the tolerance verdict stands and the report says it was not re-decoded.

`lossless` (exact) stays the report contract key; the verdict counts live in report["extra"].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eval.engine.tree import chain_tree

IDENTICAL, TIE, MISMATCH, NUMERIC = "identical", "tie", "mismatch", "numeric"


@dataclass
class Divergence:
    """How one prompt's speculative output relates to plain greedy decoding."""

    kind: str  # identical | tie | mismatch | numeric (differs in bf16/fp16, identical when re-decoded in fp32)
    position: int | None = None  # first differing new-token index (None when identical)
    gap: float | None = None  # plain run's top1 - top2 logit there (None: not recorded)
    spec_token: int | None = None
    plain_token: int | None = None
    plain_runner_up: int | None = None
    spec_gap: float | None = None  # plain run's top1 - the speculative token's logit, when it was a near tie
    tolerance_kind: str | None = None  # what the measured tolerance alone said (a diagnostic once re-decoded)
    fp32: dict | None = None  # the fp32 re-decode: {"kind": identical|tie|mismatch, "position": ...}

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, len(shorter) when one is a strict prefix, None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def classify(spec: Sequence[int], plain: Sequence[int], plain_gaps: Sequence[float] | None,
             plain_runner_up: Sequence[int] | None, tolerance: float,
             plain_near_ties: Sequence[Sequence] | None = None) -> Divergence:
    """One prompt's verdict. plain_gaps[i] / plain_runner_up[i]: the plain run's top1 - top2 logit gap and
    rank-2 token at new-token index i (the logits that chose plain[i]); plain_near_ties[i]: [[token, top1 - its
    logit], ...] of the other tokens close to the top there (eval/engine/top2.py). Missing data is a mismatch: a
    verdict of "tie" needs evidence."""
    i = first_difference(spec, plain)
    if i is None:
        return Divergence(IDENTICAL)
    d = Divergence(MISMATCH, position=i, spec_token=spec[i] if i < len(spec) else None,
                   plain_token=plain[i] if i < len(plain) else None)
    if plain_gaps is None or plain_runner_up is None or i >= len(plain_gaps) or i >= len(spec):
        return d  # one output simply stopped earlier (or nothing recorded): not explained by a tie
    d.gap, d.plain_runner_up = float(plain_gaps[i]), int(plain_runner_up[i])
    tol = tolerance or 0.0
    if d.gap <= tol and d.spec_token == d.plain_runner_up:
        d.kind = TIE
    elif plain_near_ties is not None and i < len(plain_near_ties):
        near = {int(t): float(g) for t, g in plain_near_ties[i]}
        if d.spec_token in near:
            d.spec_gap = near[d.spec_token]
            if d.spec_gap <= tol:
                d.kind = TIE
    return d


def rejudge(d: Divergence, spec32: Sequence[int], plain32: Sequence[int], gaps32: Sequence[float] | None,
            runner_up32: Sequence[int] | None, near_ties32: Sequence[Sequence] | None = None) -> Divergence:
    """The verdict of a prompt that differed in low precision (`d`, from `classify` with the measured tolerance),
    judged by its fp32 re-decode: spec32 / plain32 are the speculative and plain outputs decoded again in fp32 with
    the same draft, tree and length, gaps32 / runner_up32 / near_ties32 the fp32 plain run's records. Identical in
    fp32 -> NUMERIC (keeping the low-precision position and gap, for the report); otherwise the exact fp32 verdict
    (tolerance 0): TIE only at an exact fp32 tie, else MISMATCH at the fp32 position."""
    if d.kind == IDENTICAL:
        return d
    exact = classify(spec32, plain32, gaps32, runner_up32, 0.0, near_ties32)
    out = Divergence(**{**d.__dict__, "tolerance_kind": d.kind, "fp32": {
        k: v for k, v in {"kind": exact.kind, "position": exact.position, "gap": exact.gap}.items() if v is not None}})
    out.kind = NUMERIC if exact.kind == IDENTICAL else exact.kind
    if exact.kind != IDENTICAL:  # the fp32 difference is the one that tells
        out.position, out.gap, out.spec_token, out.plain_token = (exact.position, exact.gap, exact.spec_token,
                                                                  exact.plain_token)
        out.plain_runner_up, out.spec_gap = exact.plain_runner_up, exact.spec_gap
    return out


def verdict(divergences: Sequence[Divergence], tolerance: float | None) -> dict:
    """Counts and the booleans for the report's extra (None fields when nothing was checked).
    lossless_up_to_ties: no real mismatch (ties and numeric flips allowed); lossless_redecoded: how many
    differing prompts the fp32 re-decode judged (the rest were judged by the tolerance alone)."""
    n = {k: sum(d.kind == k for d in divergences) for k in (IDENTICAL, TIE, MISMATCH, NUMERIC)}
    checked = len(divergences)
    differing = checked - n[IDENTICAL]
    return {"lossless_up_to_ties": (n[MISMATCH] == 0) if checked else None,
            "lossless_identical": n[IDENTICAL], "lossless_ties": n[TIE], "lossless_mismatches": n[MISMATCH],
            "lossless_numeric": n[NUMERIC], "lossless_differing": differing,
            "lossless_redecoded": sum(d.fp32 is not None for d in divergences),
            "tie_tolerance": tolerance}


def verify_widths(max_nodes: int) -> list[int]:
    """The verify widths to measure for a drafter whose trees have at most `max_nodes` nodes: 2, 4, ... up to
    the power of two >= max_nodes (a static backend pads an N-node tree to that bucket; an eager one runs N
    exactly, and these sample the range)."""
    top = 1 << max(1, int(max_nodes) - 1).bit_length()
    return [1 << k for k in range(1, top.bit_length())]


@torch.no_grad()
def measure_tolerance(backend, prompts: Sequence, *, new_tokens: int = 32, widths: Sequence[int] = (16,),
                      top: int = 8) -> dict:
    """Measure the rounding difference between one-token and multi-token forwards on `backend`.

    Per prompt (token ids [T]): greedy-decode max(new_tokens, max(widths)) tokens one per forward, keeping each
    row of logits; then, per width w, re-prefill and feed the same tokens as chains of w nodes (the shape of a
    tree verification: one forward over many tokens, K/V of the chain computed in that forward) and compare
    the logits at the same positions. Per position, the difference that matters is on the tokens that could
    win: the `top` best of the one-token run. A top-2 gap can shrink by at most twice the largest such
    difference, so tolerance = 2 x max |logit_multi - logit_one| over those tokens, all positions and widths.
    Returns {"tolerance", "max_abs_logit_diff", "max_gap_change", "positions", "prompts", "widths",
    "by_width": {w: max |diff|}}.
    """
    widths = sorted({int(w) for w in widths})
    if not widths or widths[0] < 2:
        raise ValueError(f"measure_tolerance: widths {widths} must be >= 2 (width 1 is the reference itself)")
    n_tok = max(new_tokens, widths[-1])
    by_width = {w: 0.0 for w in widths}
    max_gap_change, positions = 0.0, 0
    dev = backend.device
    for ids in prompts:
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        room = ids.numel() + n_tok + widths[-1] + 1
        backend.reset(room)
        logits, _ = backend.prefill(ids.to(dev))
        seq = [int(logits[-1].argmax())]
        one = []  # [n_tok] rows [V]: logits after seq[j] (they predict seq[j+1])
        for _ in range(n_tok):
            t = chain_tree(seq[-1])
            row, _ = backend.forward_tree(t.tokens.to(dev), t.depths.to(dev), t.mask.to(dev))
            backend.commit(torch.zeros(1, dtype=torch.long, device=dev))
            one.append(row[0].float().cpu())
            seq.append(int(row[0].argmax()))
        for w in widths:
            backend.reset(room)
            backend.prefill(ids.to(dev))
            multi = []
            for s in range(0, n_tok, w):
                toks = seq[s:min(s + w, n_tok)]
                t = chain_tree(toks[0], toks[1:])
                rows, _ = backend.forward_tree(t.tokens.to(dev), t.depths.to(dev), t.mask.to(dev))
                backend.commit(torch.arange(len(toks), device=dev))
                multi.extend(rows.float().cpu())
            for a, b in zip(one, multi):
                idx = torch.topk(a, top).indices
                by_width[w] = max(by_width[w], float((b[idx] - a[idx]).abs().max()))
                gap_a, gap_b = float(a[idx[0]] - a[idx[1]]), float(b[idx[0]] - b[idx[1]])
                max_gap_change = max(max_gap_change, abs(gap_a - gap_b))
                positions += 1
    max_diff = max(by_width.values())
    return {"tolerance": 2 * max_diff, "max_abs_logit_diff": max_diff, "max_gap_change": max_gap_change,
            "positions": positions, "prompts": len(prompts), "widths": widths,
            "by_width": {str(w): d for w, d in by_width.items()}}


def is_exact_dtype(dtype: torch.dtype) -> bool:
    """fp32/fp64: tree and one-token forwards agree to rounding far below any real gap; the verdict is exact."""
    return dtype in (torch.float32, torch.float64)


def format_verdict(report: dict) -> str:
    """The verdict in words, e.g. 'lossless up to rounding: 7/8 prompts identical to plain greedy decoding, 1
    differs only by bf16 rounding (re-decoded in fp32: identical to plain decoding); 0 real mismatches'."""
    extra = report.get("extra") or {}
    n = report.get("num_prompts")
    checked = extra.get("lossless_checked", n)
    if report.get("lossless") is None or not checked:
        return "lossless: not checked (sampling, or no plain-decoding reference in this run)"
    same = extra.get("lossless_identical")
    if same is None:  # a report from before the tie-aware check
        k = round((report.get("lossless_fraction") or 0) * checked)
        word = "yes" if report["lossless"] else "NO"
        return f"lossless {word}: {k}/{checked} prompts identical to plain greedy decoding"
    ties, bad, tol = extra.get("lossless_ties", 0), extra.get("lossless_mismatches", 0), extra.get("tie_tolerance")
    numeric = extra.get("lossless_numeric", 0)
    differing = extra.get("lossless_differing", checked - same)
    redecoded = extra.get("lossless_redecoded", 0)
    dtype = extra.get("dtype", "")
    head = ("lossless (exact)" if report["lossless"] else
            "NOT lossless" if not extra.get("lossless_up_to_ties") else
            "lossless up to rounding" if numeric else "lossless up to ties")
    text = f"{head}: {same}/{checked} prompts identical to plain greedy decoding"
    if numeric:
        text += (f", {numeric} differ{'s' if numeric == 1 else ''} only by {dtype} rounding (re-decoded in fp32: "
                 "identical to plain decoding; numeric, not a drafter/verifier bug)")
    if ties and tol and redecoded < differing:  # low precision, judged by the measured tolerance alone
        text += (f", {ties} differ only where the base's top-2 logits tie within {dtype} rounding "
                 f"(gap <= {tol:.3g}, measured; not re-decoded in fp32)")
    elif ties:  # an exact tie (gap 0): in an fp32 run, or in the fp32 re-decode
        text += f", {ties} differ only at an exact tie of the base's top-2 logits"
    text += f"; {bad} real mismatch{'es' if bad != 1 else ''}"
    not_redecoded = isinstance(extra.get("fp32_redecode"), str)  # low precision, and the re-decode did not run
    if bad and redecoded:
        text += " (different in the fp32 re-decode too: a drafter/verifier bug, see samples.jsonl 'divergence')"
    elif bad and not not_redecoded and dtype in ("float32", "float64"):
        text += " (a difference at a clear top-1 in an exact dtype: a drafter/verifier bug, see samples.jsonl " \
                "'divergence')"
    elif bad:
        text += (f" (judged by the measured {dtype} tolerance only, {tol or 0:.3g}: not re-decoded in fp32, so "
                 "possibly rounding; see samples.jsonl 'divergence')")
    return text


__all__ = ["IDENTICAL", "TIE", "MISMATCH", "NUMERIC", "Divergence", "first_difference", "classify", "rejudge",
           "verdict", "verify_widths", "measure_tolerance", "is_exact_dtype", "format_verdict"]
