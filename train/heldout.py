"""Held-out per-depth accuracy of a draft (the demo's table), next to a trivial predictor."""

from __future__ import annotations

from collections import Counter

import torch

from data.dataset import collate
from data.targets import offset_labels
from models.base import draft_inputs
from models.draft import DepthStats, DraftBatch, estimated_acceptance_length


@torch.no_grad()
def evaluate_heldout(draft, base_model, view, val_ds, pad_id, cfg, device, dtype, max_rows: int | None = None) -> dict:
    """Teacher-forced per-depth loss / top-1 / top-5 over up to cfg.train.val_batches micro-batches (or max_rows).

    The trivial predictor always answers the most frequent target token of depth k in this very set
    (an upper bound for any constant guess), so "above trivial" is a fair bar.
    """
    was_training = draft.training
    draft.eval()
    K = cfg.draft.num_heads
    totals = [DepthStats() for _ in range(K)]
    freq = [Counter() for _ in range(K)]
    mb = cfg.train.micro_batch_size
    n_rows = min(len(val_ds), cfg.train.val_batches * mb if max_rows is None else max_rows)
    for start in range(0, n_rows, mb):
        batch = collate([val_ds[i] for i in range(start, min(start + mb, n_rows))], pad_id)
        ids, attn, mask = (batch[k].to(device) for k in ("input_ids", "attention_mask", "loss_mask"))
        hidden, aux = draft_inputs(base_model, ids, attn, getattr(draft, "aux_layers", None))
        aux = aux.to(dtype) if aux is not None else None
        out = draft.loss(DraftBatch(hidden.to(dtype), ids, mask, aux), view, cfg.loss)
        for k in range(K):
            totals[k].add(out.per_depth[k])
            labels = offset_labels(ids, mask, 2 + k)
            freq[k].update(labels[labels != -100].tolist())
    draft.train(was_training)
    depths = []
    for k, s in enumerate(totals, start=1):
        n = max(s.count, 1)
        trivial = freq[k - 1].most_common(1)[0][1] / n if freq[k - 1] else 0.0
        # top1/top5 against base ids (out-of-map targets are misses); loss over the in-map targets.
        depths.append({"depth": k, "tokens": s.count, "loss": s.loss_sum / max(s.loss_count, 1), "top1": s.top1 / n,
                       "top5": s.topk / n, "trivial_top1": trivial, "oov": s.oov})
    top1 = [d["top1"] for d in depths]
    summary = {f"top1/head{d['depth']}": d["top1"] for d in depths}
    summary.update({f"top5/head{d['depth']}": d["top5"] for d in depths})
    summary["est_accept_len"] = estimated_acceptance_length(top1, getattr(draft, "prefix_accuracy", False))
    return {"conversations": n_rows, "depths": depths, "summary": summary}


def with_onpolicy(result: dict, onpolicy: dict) -> dict:
    """`result` (the split's held-out rows, ShareGPT's answers) with the on-policy set's numbers beside it: under
    "onpolicy", as top1_onpolicy/head<k> in the summary, and as the acceptance estimate (the base's own text is
    what the draft meets when decoding); the ShareGPT estimate stays as est_accept_len_sharegpt."""
    summary = dict(result["summary"])
    summary["est_accept_len_sharegpt"] = summary["est_accept_len"]
    summary["est_accept_len"] = onpolicy["summary"]["est_accept_len"]
    summary.update({f"top1_onpolicy/head{d['depth']}": d["top1"] for d in onpolicy["depths"]})
    return {**result, "summary": summary, "onpolicy": onpolicy}


def format_heldout_table(result: dict) -> str:
    text = _table(result, "held-out accuracy on the data's own answers")
    if "onpolicy" in result:
        text += "\n" + _table(result["onpolicy"], "held-out accuracy on the base's own answers (on-policy; the "
                               "estimate that counts)")
    return text


def _table(result: dict, title: str) -> str:
    lines = [f"{title} ({result['conversations']} conversations, teacher forced)",
             f"{'head':>4} {'predicts':>9} {'tokens':>7} {'loss':>7} {'top-1':>7} {'top-5':>7} {'trivial':>8}"]
    for d in result["depths"]:
        lines.append(f"{d['depth']:>4} {'x_t+' + str(d['depth'] + 1):>9} {d['tokens']:>7} {d['loss']:>7.3f} "
                     f"{d['top1']:>7.3f} {d['top5']:>7.3f} {d['trivial_top1']:>8.3f}")
    summary = result["summary"]  # with an on-policy set beside it, this set's own estimate is the _sharegpt one
    estimate = summary.get("est_accept_len_sharegpt", summary["est_accept_len"])
    lines.append(f"teacher-forced acceptance-length estimate: {estimate:.2f}")
    return "\n".join(lines)
