"""Held-out per-depth accuracy of a draft (the demo's table), next to a trivial predictor."""

from __future__ import annotations

from collections import Counter

import torch

from data.dataset import collate
from data.targets import offset_labels
from models.base import draft_inputs
from models.draft import DepthStats, DraftBatch, estimated_acceptance_length


@torch.no_grad()
def evaluate_heldout(draft, base_model, view, val_ds, pad_id, cfg, device, dtype) -> dict:
    """Teacher-forced per-depth loss / top-1 / top-5 over up to cfg.train.val_batches micro-batches.

    The trivial predictor always answers the most frequent target token of depth k in this very set
    (an upper bound for any constant guess), so "above trivial" is a fair bar.
    """
    was_training = draft.training
    draft.eval()
    K = cfg.draft.num_heads
    totals = [DepthStats() for _ in range(K)]
    freq = [Counter() for _ in range(K)]
    mb = cfg.train.micro_batch_size
    n_rows = min(len(val_ds), cfg.train.val_batches * mb)
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


def format_heldout_table(result: dict) -> str:
    lines = [f"held-out accuracy ({result['conversations']} conversations, teacher forced)",
             f"{'head':>4} {'predicts':>9} {'tokens':>7} {'loss':>7} {'top-1':>7} {'top-5':>7} {'trivial':>8}"]
    for d in result["depths"]:
        lines.append(f"{d['depth']:>4} {'x_t+' + str(d['depth'] + 1):>9} {d['tokens']:>7} {d['loss']:>7.3f} "
                     f"{d['top1']:>7.3f} {d['top5']:>7.3f} {d['trivial_top1']:>8.3f}")
    lines.append(f"teacher-forced acceptance-length estimate: {result['summary']['est_accept_len']:.2f}")
    return "\n".join(lines)
