"""The chunk loop both fused LM-head losses share (losses/fused_linear_ce.py, losses/distill.py): per chunk of rows,
logits -> loss and dLoss/dlogits (the loss's own `chunk_fn`), then the logits gradient contracted at once into
grad_hidden (g @ W) and grad_weight (gᵀ @ x), so no [N, V] tensor ever exists; and the backward that only scales
that stash by grad_output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from losses.weighted_ce import IGNORE_INDEX

# chunk_fn(x [c, d], w [V, d], targets [c], valid [c], teacher x [c, d_t] or None, k) ->
#   (loss sum, top-1 hits, top-k hits, g = dLoss/dlogits [c, V] in the compute dtype)
ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """Softmax / loss dtype: fp64 stays fp64 (gradcheck); bf16/fp16/fp32 are computed in fp32."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def matmul_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The LM-head matmuls run in the input's dtype: bf16/fp16 inputs use the fast low-precision units (tensor cores,
    AVX512-BF16), whose matmuls accumulate in fp32 anyway; the [c, V] logits are then upcast so softmax, loss and
    dLoss/dlogits are fp32."""
    return hidden.dtype if hidden.dtype in (torch.bfloat16, torch.float16) else compute_dtype(hidden)


def chunked_forward(ctx, hidden, weight, labels, teacher_hidden, teacher_weight, chunk_size: int, topk: int,
                    need_grad_hidden: bool, need_grad_weight: bool, chunk_fn: ChunkFn):
    """An autograd Function's forward: hidden [N, d], weight [V, d], labels [N] (-100 = ignored), teacher_hidden
    [N, d_t] and teacher_weight [V, d_t] or None. Returns (loss sum, valid rows, top-1 hits, top-k hits) and stashes
    the input gradients on ctx for `scaled_backward`."""
    n = hidden.shape[0]
    cdtype, mdtype = compute_dtype(hidden), matmul_dtype(hidden)
    # Cast the heads once per call, not per chunk ([V, d]; a no-op when already in mdtype).
    w = weight.to(mdtype)
    tw = teacher_weight.to(mdtype) if teacher_weight is not None else None
    valid = labels != IGNORE_INDEX  # [N] bool
    targets = labels.masked_fill(~valid, 0)  # [N] safe gather index; invalid rows are zeroed by chunk_fn
    k = min(topk, w.shape[0])
    loss_sum = torch.zeros((), dtype=cdtype, device=hidden.device)
    top1 = torch.zeros((), dtype=torch.long, device=hidden.device)
    topk_hits = torch.zeros((), dtype=torch.long, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None  # [N, d], input dtype
    grad_w = torch.zeros_like(w, dtype=cdtype) if need_grad_weight else None  # [V, d], accumulated in cdtype
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        x = hidden[start:end].to(mdtype)  # [c, d]
        tx = teacher_hidden[start:end].to(mdtype) if tw is not None else None  # [c, d_t]
        loss, hits1, hitsk, g = chunk_fn(x, w, targets[start:end], valid[start:end], tx, tw, k)
        loss_sum += loss
        top1 += hits1
        topk_hits += hitsk
        if grad_hidden is not None:
            grad_hidden[start:end] = g.to(mdtype) @ w  # [c, V] @ [V, d] -> [c, d], cast to the input dtype
        if grad_w is not None:
            if mdtype == cdtype:
                grad_w.addmm_(g.T, x)  # [V, c] @ [c, d] -> [V, d]
            else:  # low-precision matmul, fp32 accumulation across chunks
                grad_w.add_(g.T.to(mdtype) @ x)
        del g  # free the [c, V] buffer before the next chunk allocates its own
    # save_for_backward (not ctx attributes) so autograd frees the stash right after backward.
    ctx.save_for_backward(grad_hidden, grad_w.to(weight.dtype) if grad_w is not None else None)
    count = valid.sum()
    ctx.mark_non_differentiable(count, top1, topk_hits)
    return loss_sum, count, top1, topk_hits


def scaled_backward(ctx, grad_loss: torch.Tensor, n_inputs: int) -> tuple:
    """The backward of `chunked_forward`: the stash times grad_output, None for the other `n_inputs` - 2 inputs.
    Out of place, so the stash survives a second backward (retain_graph=True, gradcheck); it costs one transient
    [V, d] copy per head (grad_output is never 1 in practice: λ_k / count)."""
    grad_hidden, grad_weight = ctx.saved_tensors
    if grad_hidden is not None:
        grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
    if grad_weight is not None:
        grad_weight = grad_weight * grad_loss.to(grad_weight.dtype)
    return (grad_hidden, grad_weight) + (None,) * (n_inputs - 2)


class ChunkedLinearLoss(torch.autograd.Function):
    """A fused LM-head loss as one autograd Function: forward computes the loss *and* the input gradients chunk by
    chunk (`chunked_forward` with the loss's `chunk_fn`), backward only scales the stash. Inputs: hidden [N, d],
    weight [V, d], labels [N], teacher_hidden [N, d_t] / teacher_weight [V, d_t] or None, chunk_fn, chunk_size,
    topk, need_grad_hidden, need_grad_weight. Returns (loss sum, valid rows, top-1 hits, top-k hits)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, teacher_hidden, teacher_weight, chunk_fn: ChunkFn, chunk_size: int,
                topk: int, need_grad_hidden: bool, need_grad_weight: bool):
        return chunked_forward(ctx, hidden, weight, labels, teacher_hidden, teacher_weight, chunk_size, topk,
                               need_grad_hidden, need_grad_weight, chunk_fn)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_count, _grad_top1, _grad_topk):
        return scaled_backward(ctx, grad_loss, 10)
