"""Sequence parallelism (`train.sequence_parallel` = N > 1) through DeepSpeed's Ulysses pieces.

The world's ranks form groups of N consecutive ranks (DeepSpeed's `parallel_state_sp`, which `deepspeed.initialize`
also gets as its `mpu`, so it averages gradients over the data-parallel groups only and sizes the batch by them).
The N ranks of a group read the same micro-batches; rank r of the group holds rows [r·n, (r+1)·n) of every sequence,
the sequence right-padded to N·n tokens (padding has no loss and, being last, is seen by no causal row):

- the base's forward when training online: each rank runs the base on its n tokens at their true positions, and
  every attention layer trades rows for heads and back (`UlyssesSPAttentionHF`, swapped in for the base's `sdpa`
  only while that forward runs); with the hidden-state cache each rank slices its rows from the cached ones;
- the draft's attention over the sequence: the draft computes q / k / v of its rows and calls `SequenceShard.attend`,
  which runs its own attention function on the whole sequence and a slice of the heads inside
  `deepspeed.sequence.layer.DistributedAttention` (the all-to-all and its backward are DeepSpeed's): EAGLE-3's
  training-time test, Hydra++'s prefix layer, the CTC drafter's attention module, the block drafts' (DFlash, DSpark,
  Domino) blocks against the context;
- the loss: each rank scores only its rows (the fused chunked CE: no [T, V] logits anywhere) and divides by the
  group's target counts (`SequenceShard.total`), so the group's gradients add up to the whole sequence's.

The draft also reads h a few positions past its rows (its teacher at t+1+j): `halo` rows, from the next ranks'
first rows (an all-gather of those rows, no gradient: h is the frozen base's).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn import functional as F

from models.base import last_hidden_and_aux, last_hidden_and_logits
from models.draft import SequenceShard


def _whole_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, local) -> torch.Tensor:
    """DistributedAttention's local attention: q / k / v [B, N·n, H/N, hd] -> local on [B, H/N, N·n, hd], back."""
    return local(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def rank_rows(length: int, size: int, rank: int) -> tuple[int, int, int]:
    """(padded length N·n, start, stop) of rank `rank`'s rows of a sequence of `length` tokens over `size` ranks."""
    n = -(-length // size)
    return n * size, rank * n, (rank + 1) * n


def rank_window(length: int, size: int, rank: int, halo: int) -> tuple[int, int, int]:
    """What that rank reads of cached rows whose longest has `length` tokens: (start, stop of h = its rows and the
    halo past them, stop of aux = its rows), for HiddenCache.window; collate_cached pads them to the widths
    (stop_h - start, stop_aux - start)."""
    _, start, stop = rank_rows(length, size, rank)
    return start, stop + halo, stop


@dataclass
class ShardedBatch:
    """One micro-batch on one rank of a group: input_ids / attention_mask / loss_mask whole [B, N·n] (padded),
    hidden [B, n + halo, d] and aux [B, n, k·d] (or None) of this rank's rows, and the shard the draft's loss takes."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
    aux: torch.Tensor | None
    shard: SequenceShard


class SequenceParallel:
    """This rank's sequence-parallel group: sets DeepSpeed's groups up (collective: every rank calls it once)."""

    def __init__(self, size: int, rank: int, world_size: int):
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
        from deepspeed.sequence.layer import DistributedAttention

        if size < 2 or world_size % size:
            raise ValueError(f"train.sequence_parallel={size} must divide the number of ranks ({world_size}); "
                             f"launch a multiple of {size} ranks (deepspeed --num_gpus {size} ...)")
        if mpu._SEQUENCE_PARALLEL_GROUP is None:  # one set-up per process (a second train() call reuses it)
            mpu.initialize_sequence_parallel(size)
        elif mpu.get_sequence_parallel_world_size() != size:
            raise ValueError(f"this process already has sequence-parallel groups of "
                             f"{mpu.get_sequence_parallel_world_size()} ranks, not {size}")
        self.mpu = mpu  # what deepspeed.initialize takes as `mpu`
        self.size, self.group = size, mpu.get_sequence_parallel_group()
        self.rank = mpu.get_sequence_parallel_rank()
        self.dp_rank, self.dp_size = rank // size, world_size // size  # the data order is per group
        # batch-first [B, S, H, hd]: scatter the heads (2), gather the sequence (1); and back for the output
        self._attention = DistributedAttention(_whole_sequence, self.group, scatter_idx=2, gather_idx=1)

    # -- what the draft's loss calls (models.draft.SequenceShard) -------------------------------------------------

    def attend(self, local, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q / k / v [B, H, n, hd] of this rank's rows -> local's output on them [B, H, n, hd], computed on the whole
        sequence and H/N heads of every rank (DeepSpeed's all-to-all before and after)."""
        if q.shape[1] % self.size or k.shape[1] != q.shape[1]:
            raise ValueError(f"sequence parallelism splits the attention's heads over {self.size} ranks: q has "
                             f"{q.shape[1]} heads, k {k.shape[1]} (expand GQA keys first); use a train."
                             "sequence_parallel that divides the head count")
        out = self._attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None, local)
        return out.transpose(1, 2)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """t of every rank of the group (same shape on each) -> [N, ...] in rank order (no gradient)."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.detach().contiguous(), group=self.group)
        return torch.stack(parts)

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the group (a copy, no gradient)."""
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    # -- the batch ------------------------------------------------------------------------------------------------

    def rows(self, length: int) -> tuple[int, int, int]:
        """(padded length N·n, start, stop) of this rank's rows of a sequence of `length` tokens."""
        return rank_rows(length, self.size, self.rank)

    def window(self, length: int, halo: int) -> tuple[int, int, int]:
        return rank_window(length, self.size, self.rank, halo)

    def _pad(self, t: torch.Tensor, length: int, value: int = 0) -> torch.Tensor:
        """[B, T, ...] -> [B, length, ...] right-padded with `value`."""
        extra = length - t.shape[1]
        if extra <= 0:
            return t
        if t.dim() == 2:
            return F.pad(t, (0, extra), value=value)
        return F.pad(t, (0, 0, 0, extra), value=value)

    def split(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor, pad_id: int,
              halo: int, hidden: torch.Tensor | None = None, aux: torch.Tensor | None = None, base=None,
              aux_layers: list[int] | None = None, dtype: torch.dtype | None = None,
              windowed: bool = False) -> ShardedBatch:
        """This rank's share of a micro-batch. Either hidden [B, T, d] (+ aux) whole, as the hidden-state cache gives
        them (sliced here) or, windowed=True, as `window` says this rank reads them from the cache; or `base` (the
        frozen model): its forward runs sequence-parallel on this rank's tokens (`base_forward`) and the halo rows
        come from the next ranks."""
        length, start, stop = self.rows(input_ids.shape[1])
        ids = self._pad(input_ids, length, pad_id)
        attn, mask = self._pad(attention_mask, length), self._pad(loss_mask, length)
        if hidden is not None and windowed:  # read as this rank's window already: its n rows + halo, n rows of aux
            if hidden.shape[1] != stop - start + halo or (aux is not None and aux.shape[1] != stop - start):
                raise ValueError(f"a windowed batch holds hidden [B, {hidden.shape[1]}, d], aux "
                                 f"{None if aux is None else aux.shape[1]} rows; this rank's window is "
                                 f"{stop - start} rows + {halo} (train/sequence_parallel.py: window)")
        elif hidden is not None:
            hidden = self._pad(hidden, length + halo)[:, start:stop + halo]
            aux = self._pad(aux, length)[:, start:stop] if aux is not None else None
        else:
            hidden, aux = self.base_forward(base, ids, attn, aux_layers)
            hidden = self._with_halo(hidden, halo)
            if dtype is not None:
                hidden = hidden.to(dtype)
                aux = aux.to(dtype) if aux is not None else None
        shard = SequenceShard(start=start, stop=stop, halo=halo, attend=self.attend, total=self.total,
                              gather=self.gather)
        return ShardedBatch(ids, attn, mask, hidden, aux, shard)

    @torch.no_grad()
    def _with_halo(self, hidden: torch.Tensor, halo: int) -> torch.Tensor:
        """[B, n, d] of this rank's rows -> [B, n + halo, d]: the next ranks' first rows after them (zeros past the
        sequence's end). An all-gather of every rank's first min(halo, n) rows."""
        if halo == 0:
            return hidden
        head = hidden[:, :halo].contiguous()
        heads = [torch.empty_like(head) for _ in range(self.size)]
        dist.all_gather(heads, head, group=self.group)
        after = torch.cat([hidden, *heads[self.rank + 1:]], dim=1)[:, :hidden.shape[1] + halo]
        return self._pad(after, hidden.shape[1] + halo)

    @torch.no_grad()
    def base_forward(self, model, ids: torch.Tensor, attn: torch.Tensor, aux_layers: list[int] | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The frozen base on this rank's tokens of ids [B, N·n]: (h [B, n, d], aux [B, n, k·d] or None), equal to
        the whole sequence's rows [start, stop). Every attention layer runs DeepSpeed's UlyssesSPAttentionHF around
        the base's own attention function (causal; right padding follows the real tokens, so no mask is needed)."""
        _, start, stop = self.rows(ids.shape[1])
        pos = torch.arange(start, stop, device=ids.device)[None].expand(ids.shape[0], -1)
        with self._ulysses(model, ids.shape[0]):
            if aux_layers:
                return last_hidden_and_aux(model, ids[:, start:stop], attn[:, start:stop], aux_layers,
                                           position_ids=pos)
            return last_hidden_and_logits(model, ids[:, start:stop], attn[:, start:stop], position_ids=pos)[0], None

    @contextlib.contextmanager
    def _ulysses(self, model, batch_size: int):
        """While inside: the base's attention implementation (transformers' ALL_ATTENTION_FUNCTIONS entry) is
        DeepSpeed's UlyssesSPAttentionHF around it; restored on exit, so every other forward (held-out scoring,
        decoding) runs the plain one."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        config = model.config.get_text_config()
        name = model.config._attn_implementation
        if name in ("eager", "paged|eager"):
            raise ValueError("sequence parallelism needs the base loaded with sdpa or flash attention, not eager")
        core = ALL_ATTENTION_FUNCTIONS[name]
        heads = int(config.num_attention_heads)
        uattn = UlyssesSPAttentionHF(
            attn=core, batch_size=batch_size, attn_head_count=heads,
            attn_head_size=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            kv_head_count=int(config.num_key_value_heads), num_hidden_layers=int(config.num_hidden_layers),
            process_group=self.group, seq_length_is_variable=True)

        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            # the mask transformers built is the shard's; the whole sequence after the all-to-all is causal
            return uattn(module, query, key, value, None, *args, **kwargs)

        ALL_ATTENTION_FUNCTIONS[name] = attention
        try:
            yield
        finally:
            ALL_ATTENTION_FUNCTIONS[name] = core
