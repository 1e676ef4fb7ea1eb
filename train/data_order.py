"""Deterministic data order: which rows each rank reads at each micro-step.

The order is a pure function of (seed, epoch, step), so resuming at optimizer step s reads exactly the
rows an uninterrupted run would have read, with nothing to save but the step number.
"""

from __future__ import annotations

import torch


class DataOrder:
    def __init__(self, num_rows: int, global_batch: int, micro_batch: int, rank: int, world_size: int, seed: int):
        if num_rows < global_batch:
            raise ValueError(
                f"the training set has {num_rows} conversations, fewer than train.global_batch_size="
                f"{global_batch}; read more data (data.max_records) or lower the batch size")
        self.num_rows, self.global_batch, self.micro_batch = num_rows, global_batch, micro_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.steps_per_epoch = num_rows // global_batch  # the ragged tail of an epoch is dropped
        self._perm_epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_rows, generator=g), epoch
        return self._perm

    def micro_batches(self, step: int) -> list[list[int]]:
        """Row indices of this rank's micro-batches for optimizer step `step` (0-based, over all epochs).

        The global batch is split rank-major: rank r takes rows [r*per_rank, (r+1)*per_rank) of it, so a
        1-rank run with the same global batch sees the same rows in the same step.
        """
        epoch, within = divmod(step, self.steps_per_epoch)
        perm = self._permutation(epoch)
        rows = perm[within * self.global_batch:(within + 1) * self.global_batch].tolist()
        per_rank = self.global_batch // self.world_size
        mine = rows[self.rank * per_rank:(self.rank + 1) * per_rank]
        return [mine[i:i + self.micro_batch] for i in range(0, len(mine), self.micro_batch)]
