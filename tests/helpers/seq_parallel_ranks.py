"""One rank of the sequence-parallelism parity check (tests/test_sequence_parallel.py starts N of them, gloo).

Every rank builds the same tiny base and drafts (EAGLE-3, Hydra++ with its prefix-attention layer, the CTC drafter
with its attention module, DFlash, DSpark, Domino; fp32 or fp64, one thread) and the same batch (two conversations of
different lengths, right-padded, a length N does not divide). For each draft it computes the whole sequence's loss
and gradients on its own, as one rank would, then the sequence-parallel loss of its rows through
train/sequence_parallel.py, twice: with hidden states given whole (the hidden-state cache's path: each rank slices
its rows) and with the base's forward itself run sequence-parallel (online training). The group's gradients are
summed (what DeepSpeed's gradient all-reduce adds up within a group) and compared with the whole sequence's. Rank 0
writes the numbers.

    python tests/helpers/seq_parallel_ranks.py OUT.json [--families eagle3,hydra,...] [--steps 3] [--layers 1]
        [--heads 4,2] [--dtype float32|float64]     (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set)
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from models.base import draft_inputs
from models.draft import BaseView, DraftBatch
from models.families.eagle3.model import Eagle3Draft
from models.families.hydra.model import HydraDraft
from models.registry import DRAFT_MODELS
from models.tiny import diverse_tiny_llama, tiny_llama
from train.distributed import init_distributed
from train.sequence_parallel import SequenceParallel


def _loss_cfg(chunked: bool, family: str) -> SimpleNamespace:
    """The loss section: shared keys, and the family's own options at their defaults."""
    own = DRAFT_MODELS[family].facts.loss_options
    return SimpleNamespace(chunked=chunked, chunk_size=8, teacher_weight=0.5, lambda0=1.0, decay=0.8,
                           **({family: own()} if own is not None else {}))


def _grads(draft) -> dict[str, torch.Tensor]:
    out = {name: p.grad.detach().clone() for name, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad(set_to_none=True)
    return out


def _tiny_base(heads: int, kv_heads: int, dtype: torch.dtype):
    """The tiny test base (diverse_tiny_llama's weights), with other head counts when asked (16 dims a head)."""
    if (heads, kv_heads) == (4, 2):
        return diverse_tiny_llama(seed=0).to(dtype).eval()
    base = tiny_llama(0, hidden_size=16 * heads, num_heads=heads, num_kv_heads=kv_heads)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in base.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return base.to(dtype).eval()


def _draft(family: str, view: BaseView, steps: int, layers: int, dtype: torch.dtype):
    torch.manual_seed(0)
    if family == "eagle3":  # --steps TTT steps, --layers decoder layers
        draft = Eagle3Draft(view, aux_layers=[0, 1], ttt_steps=steps, num_layers=layers)
    elif family == "hydra":  # Hydra++: --steps heads of --layers blocks, the prefix-attention layer
        draft = HydraDraft(steps, layers, view, prefix_layer=True)
    elif family == "ctc":  # --steps labels over --steps + 2 frames, --layers blocks, the attention module
        draft = DRAFT_MODELS[family](steps + 2, steps, layers, view)
    else:  # a block draft of --layers layers, blocks of --steps + 1 slots, 5 of the 2 x 8 valid anchors sampled
        draft = DRAFT_MODELS[family](view, aux_layers=[0, 1], num_layers=layers, block_size=steps + 1, num_anchors=5)
    draft = draft.to(dtype)
    with torch.no_grad():  # a trained-looking draft: o_proj / down_proj start at zero, which would hide attention
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return draft.train()


def _compare(family: str, draft, view, base, sp, steps: int, dtype: torch.dtype) -> dict:
    """The whole sequence's loss and gradients against the group's, for both loss paths and both sources of h."""
    aux_layers = list(getattr(draft, "aux_layers", None) or [])
    g = torch.Generator().manual_seed(1)
    lengths, width, pad_id = [13, 9], 13, 0
    ids = torch.full((2, width), pad_id, dtype=torch.long)
    attn = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(1, view.vocab_size, (n,), generator=g)
        attn[b, :n] = 1
        mask[b, 2:n] = 1  # the first tokens play the prompt
    hidden, aux = draft_inputs(base, ids, attn, aux_layers)

    result = {}
    halo = steps + 1
    for chunked in (True, False):
        cfg = _loss_cfg(chunked, family)
        torch.manual_seed(7)  # the blocks a block draft samples: alike on every rank and in every pass
        ref = draft.loss(DraftBatch(hidden, ids, mask, aux), view, cfg)
        ref.loss.backward()
        ref_grads = _grads(draft)
        for mode in ("cached", "online"):
            if mode == "cached":
                part = sp.split(ids, attn, mask, pad_id, halo, hidden=hidden, aux=aux)
            else:
                part = sp.split(ids, attn, mask, pad_id, halo, base=base, aux_layers=aux_layers,
                                dtype=dtype)
            torch.manual_seed(7)
            out = draft.loss(DraftBatch(part.hidden, part.input_ids, part.loss_mask, part.aux, part.shard), view,
                             cfg)
            out.loss.backward()
            grads = _grads(draft)
            # the group's shares add up to the whole sequence's loss (a share may be fp32 zeros in an fp64 run)
            loss = sp.total(out.loss.detach().double())
            diff = 0.0
            for name, want in ref_grads.items():
                got = grads[name].clone()
                dist.all_reduce(got, group=sp.group)
                diff = max(diff, float((got - want).abs().max()))
            counts = sp.total(torch.tensor([s.count for s in out.per_depth])).tolist()
            key = f"{mode}_{'chunked' if chunked else 'reference'}"
            result[key] = {"loss": float(loss), "ref_loss": float(ref.loss.detach()), "max_grad_diff": diff,
                           "max_grad": max(float(t.abs().max()) for t in ref_grads.values()),
                           "counts": counts, "ref_counts": [s.count for s in ref.per_depth]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--families", default="eagle3,hydra,ctc,dflash,dspark,domino")
    parser.add_argument("--heads", default="4,2", help="the tiny base's attention heads and KV heads")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    info = init_distributed()
    sp = SequenceParallel(info.world_size, info.rank, info.world_size)
    heads, kv_heads = (int(x) for x in args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    base = _tiny_base(heads, kv_heads, dtype)
    view = BaseView.from_model(base)
    result = {"world_size": info.world_size}
    for family in args.families.split(","):
        draft = _draft(family, view, args.steps, args.layers, dtype)
        result[family] = _compare(family, draft, view, base, sp, args.steps, dtype)
    if info.is_main:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
